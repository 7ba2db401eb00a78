"""Graph of thoughts (Besta et al. 2024), document merging: summarise each part of a
document, then aggregate the summaries pairwise, round by round, into one.

The thought graph has two operations. *Generate*: a summary of each part, greedily after
``"\\nText: <part>\\nSummary:"``. *Aggregate*: a thought with two parents: after
``"\\nSummary 1: <a>\\nSummary 2: <b>\\nCombined:"``, ``candidates`` alternative merges (one
per most likely first token, continued greedily), scored by their mean token
log-probability, of which the best is kept (*KeepBest*). Aggregation pairs the thoughts of a
round in order (an odd one out goes on to the next round) until one remains.

KV cache: every thought's context forks one instructions context (the prompt), whose full
pages all of them share; an aggregation's candidates fork the aggregation's context, so they
also share its pages holding both parents. Thoughts of one round, and the candidates of an
aggregation, decode concurrently on their own queues: their forwards run in one batch per
token.

Args (one JSON object)::

    {"prompt": "instructions" or [ids]} or {"prompt_tokens": [ids]}, "model": null,
    "chunks": ["part" or [ids], ...], "summary_tokens": 8, "merge_tokens": 8,
    "candidates": 2, "trace": false

Result (JSON)::

    {"summary": "...", "tokens": [ids], "nodes": [{"id": i, "op": "generate" |
     "aggregate", "parents": [ids of the parent nodes], "text": "...", "tokens": [ids],
     "score": mean log-probability, "kept": bool, "context": [ids before the thought]
     (with trace)}, ...]}

A generate node's score counts all its tokens; an aggregate candidate's counts the tokens
after its first (which is chosen, not generated).
"""

from __future__ import annotations

import asyncio
import json
import math

from pastry.sdk import Context
from pastry.sdk.args import options, prompt_tokens
from pastry.sdk.steps import continue_greedy, next_dist

DEFAULTS = {
    "model": None,
    "chunks": None,
    "summary_tokens": 8,
    "merge_tokens": 8,
    "candidates": 2,
    "trace": False,
}
TEXT, SUMMARY = "\nText:", "\nSummary:"
PART = "\nSummary {}:"
COMBINED = "\nCombined:"


class Graph:
    def __init__(self, base: Context, opts: dict) -> None:
        self.base = base  # the instructions; every thought's context forks from it
        self.api = base.api
        self.q = self.api.create_queue(base.model)  # for tokenizing
        self.eos = set(base.eos_ids)
        self.opts = opts
        self.nodes: list[dict] = []

    async def generate(self, chunk: list[int]) -> dict:
        async with await self.base.fork() as ctx:
            ctx.fill_tokens(self._text(TEXT) + chunk + self._text(SUMMARY))
            context = list(ctx.tokens)
            ids, probs = await next_dist(ctx, 1 + len(self.eos))
            first, p = next((t, p) for t, p in zip(ids, probs, strict=True) if t not in self.eos)
            tokens, logprob = await continue_greedy(
                ctx, first, self.opts["summary_tokens"], self.eos
            )
        return self._node("generate", [], tokens, (logprob + math.log(p)) / len(tokens), context)

    async def aggregate(self, a: dict, b: dict) -> dict:
        async with await self.base.fork() as ctx:
            ctx.fill_tokens(
                self._text(PART.format(1))
                + a["tokens"]
                + self._text(PART.format(2))
                + b["tokens"]
                + self._text(COMBINED)
            )
            context = list(ctx.tokens)
            ids, _ = await next_dist(ctx, self.opts["candidates"] + len(self.eos))
            firsts = [t for t in ids if t not in self.eos][: self.opts["candidates"]]
            forks = await asyncio.gather(*(ctx.fork() for _ in firsts[1:]))
            n = self.opts["merge_tokens"]
            merged = await asyncio.gather(
                *(
                    continue_greedy(c, t, n, self.eos)
                    for c, t in zip([*forks, ctx], firsts, strict=True)
                )
            )
            await asyncio.gather(*(c.release() for c in forks))
        parents = [a["id"], b["id"]]
        nodes = [
            self._node("aggregate", parents, tokens, lp / max(len(tokens) - 1, 1), context)
            for tokens, lp in merged
        ]
        best = max(nodes, key=lambda n: n["score"])  # KeepBest; the first of equals
        for node in nodes:
            node["kept"] = node is best
        return best

    def _node(self, op: str, parents: list[int], tokens: list[int], score: float, context):
        node = {
            "id": len(self.nodes),
            "op": op,
            "parents": parents,
            "text": self.api.detokenize(self.q, tokens),
            "tokens": tokens,
            "score": score,
            "kept": True,
        }
        if self.opts["trace"]:
            node["context"] = context
        self.nodes.append(node)
        return node

    def _text(self, text: str) -> list[int]:
        return self.api.tokenize(self.q, text)


async def main(args: list[str]) -> str:
    opts = options(args, DEFAULTS)
    for key in ("summary_tokens", "merge_tokens", "candidates"):
        if opts[key] < 1:
            raise ValueError(f"{key} must be at least 1, got {opts[key]}")
    chunks = opts["chunks"]
    if not isinstance(chunks, list) or not chunks:
        raise ValueError('give the document as "chunks": a list of texts or token-id lists')
    base = Context(opts["model"])
    base.fill_tokens(prompt_tokens(base, opts))
    await base.flush(keep_last=False)  # the forks append to it: nothing stays pending
    graph = Graph(base, opts)
    parts = [graph._text(c) if isinstance(c, str) else [int(t) for t in c] for c in chunks]
    if not all(parts):
        raise ValueError("every chunk must be non-empty")
    thoughts = await asyncio.gather(*(graph.generate(p) for p in parts))
    while len(thoughts) > 1:
        pairs = list(zip(thoughts[::2], thoughts[1::2], strict=False))
        merged = await asyncio.gather(*(graph.aggregate(a, b) for a, b in pairs))
        thoughts = [*merged, *thoughts[2 * len(pairs) :]]
    await base.release()
    final = thoughts[0]
    return json.dumps({"summary": final["text"], "tokens": final["tokens"], "nodes": graph.nodes})
