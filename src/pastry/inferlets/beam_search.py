"""Beam search (Freitag and Al-Onaizan 2017): keep the ``width`` most likely continuations.

Every step, each live beam reads its next-token distribution (``get_next_dist``; the beams
are on their own queues, so their forwards run in one batch) and proposes its ``expand``
most likely tokens; of all proposals, scored by the sum of token log-probabilities, the
best ``width`` become the next beams. A beam that ends in an end-of-sequence token is
finished: it keeps competing with its score but is not extended.

Beams are forked contexts: a beam chosen for several continuations is ``fork``ed, so they
share its full KV pages by reference (only the partial last page is copied), and its last
continuation takes over the beam's own context. Beams not chosen are released.

With ``expand = m`` and ``width >= m ** (max_tokens - 1)`` no prefix is ever dropped, so the
search is exhaustive over the sequences that pick one of the ``m`` most likely tokens at
every step; ``width = expand = 1`` is greedy decoding.

Args (one JSON object)::

    {"prompt": "text" or [ids]} or {"prompt_tokens": [ids]}, "model": null (the first),
    "width": 3, "expand": width (tokens proposed per beam), "max_tokens": 16,
    "stop_at_eos": true

Result (JSON)::

    {"beams": [{"tokens": [generated ids], "text": "...", "logprob": sum of log-probs},
               ... best first, up to width]}
"""

from __future__ import annotations

import asyncio
import json
import math
from typing import NamedTuple

from pastry.sdk import Context
from pastry.sdk.args import options, prompt_tokens
from pastry.sdk.steps import next_dist

DEFAULTS = {"model": None, "width": 3, "expand": None, "max_tokens": 16, "stop_at_eos": True}


class Beam(NamedTuple):
    tokens: list[int]  # generated so far
    logprob: float
    ctx: Context | None  # None once finished


async def main(args: list[str]) -> str:
    opts = options(args, DEFAULTS)
    width = opts["width"]
    expand = opts["expand"] or width
    if width < 1 or expand < 1:
        raise ValueError(f"width and expand must be at least 1, got {width} and {expand}")
    root = Context(opts["model"])
    api = root.api
    q = api.create_queue(root.model)  # outlives the beams' contexts (released below)
    root.fill_tokens(prompt_tokens(root, opts))
    eos = set(root.eos_ids) if opts["stop_at_eos"] else set()
    beams = [Beam([], 0.0, root)]
    for _ in range(opts["max_tokens"]):
        live = [b for b in beams if b.ctx is not None]
        if not live:
            break
        dists = await asyncio.gather(*(next_dist(b.ctx, expand) for b in live))
        # (score, parent, token); a finished beam competes as itself (token None).
        proposals = [(b.logprob, b, None) for b in beams if b.ctx is None]
        for b, (ids, probs) in zip(live, dists, strict=True):
            proposals += [
                (b.logprob + math.log(p), b, t) for t, p in zip(ids, probs, strict=True) if p > 0
            ]
        proposals.sort(key=lambda c: -c[0])
        beams = await _branch(proposals[:width], live, eos)
    ranked = sorted(beams, key=lambda b: -b.logprob)
    for b in ranked:
        if b.ctx is not None:
            await b.ctx.release()
    return json.dumps(
        {
            "beams": [
                {
                    "tokens": b.tokens,
                    "text": api.detokenize(q, b.tokens),
                    "logprob": b.logprob,
                }
                for b in ranked
            ]
        }
    )


async def _branch(chosen: list[tuple], live: list[Beam], eos: set[int]) -> list[Beam]:
    """The next beams: each chosen (score, parent, token) continues its parent's context,
    forked when the parent continues more than once. Parents not chosen are released."""
    growing = [(s, b, t) for s, b, t in chosen if t is not None and t not in eos]
    uses = {id(b): sum(1 for _, p, _ in growing if p is b) for b in live}
    parents = [b for b in live if uses[id(b)]]
    # Fork first (a fork copies the parent's pending tokens), then extend.
    forked = await asyncio.gather(
        *(asyncio.gather(*(b.ctx.fork() for _ in range(uses[id(b)] - 1))) for b in parents)
    )
    # The last continuation of a parent takes over the parent's own context.
    contexts = {id(b): [*kids, b.ctx] for b, kids in zip(parents, forked, strict=True)}
    await asyncio.gather(*(b.ctx.release() for b in live if not uses[id(b)]))
    out = []
    for score, parent, tok in chosen:
        if tok is None:
            out.append(parent)  # finished before
        elif tok in eos:
            out.append(Beam([*parent.tokens, tok], score, None))
        else:
            ctx = contexts[id(parent)].pop()
            ctx.fill_tokens([tok])
            out.append(Beam([*parent.tokens, tok], score, ctx))
    return out
