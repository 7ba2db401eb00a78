"""Skeleton of thought (Ning et al. 2024): write a skeleton of the answer, a few words per
point, then expand all points in parallel.

The skeleton is one sequential generation: after ``"\\nSkeleton:"``, each point
``"\\n<i>."`` is generated greedily for up to ``skeleton_tokens`` tokens. Each point is then
expanded on a ``fork`` of the skeleton's context, after ``"\\nExpand point <i>:"``, greedily
for up to ``point_tokens`` tokens. The answer lists each point with its expansion.

KV cache: the expansions share every full page of the prompt and the skeleton by reference
(only the partial last page is copied per fork), instead of each re-reading them; they
decode concurrently on their own queues, so their forwards run in one batch per token.

Args (one JSON object)::

    {"prompt": "question" or [ids]} or {"prompt_tokens": [ids]}, "model": null,
    "points": 3, "skeleton_tokens": 5, "point_tokens": 12, "trace": false

Result (JSON)::

    {"text": "1. <point>: <expansion>\\n2. ...", "skeleton": ["..."], "points": ["..."],
     "skeleton_tokens": [[ids], ...], "point_tokens": [[ids], ...],
     "contexts": {"skeleton": [[ids before point i]], "points": [[ids before expansion
     i]]} (with trace)}
"""

from __future__ import annotations

import asyncio
import json

from pastry.sdk import Context, EosTokens, MaxTokens, Sampler
from pastry.sdk.args import options, prompt_tokens

DEFAULTS = {
    "model": None,
    "points": 3,
    "skeleton_tokens": 5,
    "point_tokens": 12,
    "trace": False,
}
SKELETON = "\nSkeleton:"
POINT = "\n{}."
EXPAND = "\nExpand point {}:"


async def main(args: list[str]) -> str:
    opts = options(args, DEFAULTS)
    for key in ("points", "skeleton_tokens", "point_tokens"):
        if opts[key] < 1:
            raise ValueError(f"{key} must be at least 1, got {opts[key]}")
    ctx = Context(opts["model"])
    api = ctx.api
    q = api.create_queue(ctx.model)  # for tokenizing; outlives the contexts
    eos = set(ctx.eos_ids)

    async def generate(c: Context, marker: str, n: int) -> tuple[list[int], list[int]]:
        """(the tokens generated after ``marker``, the context before them)."""
        c.fill(marker)
        context = list(c.tokens)
        await c.generate(Sampler(), MaxTokens(n) | EosTokens(eos))
        return [t for t in c.tokens[len(context) :] if t not in eos], context

    ctx.fill_tokens(prompt_tokens(ctx, opts))
    ctx.fill(SKELETON)
    skeleton = []
    for i in range(1, opts["points"] + 1):
        skeleton.append(await generate(ctx, POINT.format(i), opts["skeleton_tokens"]))
    forks = await asyncio.gather(*(ctx.fork() for _ in range(opts["points"] - 1)))
    branches = [*forks, ctx]
    points = await asyncio.gather(
        *(
            generate(c, EXPAND.format(i), opts["point_tokens"])
            for i, c in enumerate(branches, start=1)
        )
    )
    await asyncio.gather(*(c.release() for c in branches))
    heads = [api.detokenize(q, t) for t, _ in skeleton]
    bodies = [api.detokenize(q, t) for t, _ in points]
    result = {
        "text": "\n".join(
            f"{i}.{h}:{b}" for i, (h, b) in enumerate(zip(heads, bodies, strict=True), start=1)
        ),
        "skeleton": heads,
        "points": bodies,
        "skeleton_tokens": [t for t, _ in skeleton],
        "point_tokens": [t for t, _ in points],
    }
    if opts["trace"]:
        result["contexts"] = {
            "skeleton": [c for _, c in skeleton],
            "points": [c for _, c in points],
        }
    return json.dumps(result)
