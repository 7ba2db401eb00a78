"""Skeleton of thought (Ning et al. 2024): the model writes a skeleton of its answer, a
few words per point, then every point it wrote is expanded in parallel.

The skeleton is one generation after ``"\\nSkeleton:\\n"``, written under a grammar that
admits a numbered list (``"1. <point>\\n2. <point>\\n"``…, ``min_points`` to ``points``
points of at most ``point_chars`` characters each), so that even a small model writes one
that parses; the model decides how many points (it ends the list with its end-of-sequence
token). The points are the list's complete lines.
Each is then expanded on a ``fork`` of the skeleton's context, after ``"\\nExpand point
<i>:"``, greedily for up to ``point_tokens`` tokens. The answer lists each point with its
expansion.

KV cache: the expansions share every full page of the prompt and the skeleton by reference
(only the partial last page is copied per fork), instead of each re-reading them; they
decode concurrently on their own queues, so their forwards run in one batch per token.

Args (one JSON object)::

    {"prompt": "question" or [ids]} or {"prompt_tokens": [ids]}, "model": null,
    "points": 5, "min_points": 1, "point_chars": 60, "point_tokens": 32, "trace": false

Result (JSON)::

    {"text": "1. <point>: <expansion>\\n2. ...", "skeleton": ["<point>", ...],
     "points": ["<expansion>", ...], "skeleton_tokens": [ids of the list],
     "point_tokens": [[ids], ...], "contexts": {"skeleton": [ids before the list],
     "points": [[ids before expansion i]]} (with trace)}
"""

from __future__ import annotations

import asyncio
import json
import re

from pastry.sdk import Context, EosTokens, MaxTokens, Sampler
from pastry.sdk.args import options, prompt_tokens
from pastry.sdk.grammar import Constraint, generate

DEFAULTS = {
    "model": None,
    "points": 5,
    "min_points": 1,
    "point_chars": 60,
    "point_tokens": 32,
    "trace": False,
}
SKELETON = "\nSkeleton:\n"
EXPAND = "\nExpand point {}:"
LINE = re.compile(r"(\d+)\. ([^\n]+)\n")


def skeleton_regex(points: int, chars: int, least: int = 1) -> str:
    """A numbered list of ``least`` to ``points`` points, each a line of 1 to ``chars``
    characters (the first not a space): ``1. a\\n``, ``1. a\\n2. b\\n``…"""
    out = ""
    for i in range(points, 0, -1):
        item = f"{i}\\. [^\\n ][^\\n]{{0,{chars - 1}}}\\n"
        if not out:
            out = item
        elif i >= least:  # the points after this one may be left out
            out = f"{item}({out})?"
        else:
            out = item + out
    return out


def parse_skeleton(text: str) -> list[str]:
    """The points of a skeleton the grammar admitted: its complete lines, in order."""
    heads = []
    for m in LINE.finditer(text):
        if int(m.group(1)) != len(heads) + 1:
            break
        heads.append(m.group(2).strip())
    return heads


def _check(opts: dict) -> None:
    for key in ("points", "min_points", "point_chars", "point_tokens"):
        if opts[key] < 1:
            raise ValueError(f"{key} must be at least 1, got {opts[key]}")
    if opts["points"] > 20:
        raise ValueError(f"points must be at most 20, got {opts['points']}")
    if opts["min_points"] > opts["points"]:
        raise ValueError(f"min_points ({opts['min_points']}) exceeds points ({opts['points']})")


async def main(args: list[str]) -> str:
    opts = options(args, DEFAULTS)
    _check(opts)
    ctx = Context(opts["model"])
    api = ctx.api
    q = api.create_queue(ctx.model)  # for tokenizing; outlives the contexts
    eos = set(ctx.eos_ids)

    ctx.fill_tokens(prompt_tokens(ctx, opts))
    ctx.fill(SKELETON, add_special_tokens=False)
    before = list(ctx.tokens)
    grammar = {"regex": skeleton_regex(opts["points"], opts["point_chars"], opts["min_points"])}
    with Constraint(ctx, grammar) as c:  # a line takes at most a token per character
        written = await generate(ctx, c, opts["points"] * (opts["point_chars"] + 4))
    heads = parse_skeleton(api.detokenize(q, written.tokens))
    if len(heads) < opts["min_points"]:  # the tokens ran out (characters of several tokens)
        raise ValueError(f"the skeleton ended after {len(heads)} complete points: {heads}")

    async def expand(c: Context, i: int) -> tuple[list[int], list[int]]:
        """(the expansion of point ``i``, the context before it)."""
        c.fill(EXPAND.format(i), add_special_tokens=False)
        context = list(c.tokens)
        await c.generate(Sampler(), MaxTokens(opts["point_tokens"]) | EosTokens(eos))
        return [t for t in c.tokens[len(context) :] if t not in eos], context

    forks = await asyncio.gather(*(ctx.fork() for _ in range(len(heads) - 1)))
    branches = [*forks, ctx]
    points = await asyncio.gather(*(expand(c, i) for i, c in enumerate(branches, start=1)))
    await asyncio.gather(*(c.release() for c in branches))
    bodies = [api.detokenize(q, t) for t, _ in points]
    result = {
        "text": "\n".join(
            f"{i}. {h}:{b}" for i, (h, b) in enumerate(zip(heads, bodies, strict=True), start=1)
        ),
        "skeleton": heads,
        "points": bodies,
        "skeleton_tokens": written.tokens,
        "point_tokens": [t for t, _ in points],
    }
    if opts["trace"]:
        result["contexts"] = {"skeleton": before, "points": [c for _, c in points]}
    return json.dumps(result)
