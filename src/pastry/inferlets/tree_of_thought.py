"""Tree of thoughts (Yao et al. 2023), breadth-first: grow ``depth`` thoughts, keeping the
``keep`` best partial solutions at each level.

At each level every kept state proposes ``breadth`` thoughts: its next-token distribution
(``get_next_dist``) names the ``breadth`` most likely first tokens, one per thought, and each
thought continues greedily for up to ``thought_tokens`` tokens (ending early at
end-of-sequence). A state's value is the log-probability of its thoughts under the model
(summed over every token of every thought on its path); the ``keep`` best of all proposed
states survive, the others are released. After the last level the best state may generate
an answer.

The proposals of a state are ``fork``s of its context: they share every full KV page of the
prompt and the thoughts before them by reference (only the partial last page is copied),
and the state's own context becomes its last proposal. All proposals of a level decode
together, each on its own queue, so their forwards run in one batch per token.

Args (one JSON object)::

    {"prompt": "text" or [ids]} or {"prompt_tokens": [ids]}, "model": null (the first),
    "breadth": 3, "keep": 2, "depth": 3, "thought_tokens": 8,
    "separator": "\\n" (text before each thought), "answer_prefix": "\\nAnswer:",
    "answer_tokens": 0 (no answer), "trace": false

Result (JSON)::

    {"best": {"thoughts": ["..."], "tokens": [[ids], ...], "score": log-probability,
              "answer": "..." (with answer_tokens), "answer_tokens": [ids]},
     "levels": [[{"parent": index of the state in the previous level (-1: the prompt),
                  "text": "...", "tokens": [ids], "score": ..., "kept": bool,
                  "context": [ids before the thought] (with trace)}, ...], ...]}

A level's states are listed best first; ``parent`` indexes the previous level's list.
"""

from __future__ import annotations

import asyncio
import json
import math
from typing import NamedTuple

from pastry.sdk import Context, EosTokens, MaxTokens, Sampler
from pastry.sdk.args import options, prompt_tokens
from pastry.sdk.steps import continue_greedy, next_dist

DEFAULTS = {
    "model": None,
    "breadth": 3,
    "keep": 2,
    "depth": 3,
    "thought_tokens": 8,
    "separator": "\n",
    "answer_prefix": "\nAnswer:",
    "answer_tokens": 0,
    "trace": False,
}


class State(NamedTuple):
    ctx: Context
    thoughts: list[list[int]]
    score: float  # summed log-probability of every thought token
    parent: int  # index of the parent state in the previous level (-1: the prompt)
    context: list[int]  # the tokens before the latest thought


async def main(args: list[str]) -> str:
    opts = options(args, DEFAULTS)
    breadth, keep, depth, n = (opts[k] for k in ("breadth", "keep", "depth", "thought_tokens"))
    if min(breadth, keep, depth, n) < 1:
        raise ValueError(
            f"breadth, keep, depth and thought_tokens must be at least 1, got {breadth}, "
            f"{keep}, {depth} and {n}"
        )
    root = Context(opts["model"])
    api = root.api
    q = api.create_queue(root.model)  # for tokenizing; outlives the states' contexts
    root.fill_tokens(prompt_tokens(root, opts))
    sep = api.tokenize(q, opts["separator"]) if opts["separator"] else []
    eos = set(root.eos_ids)
    frontier = [State(root, [], 0.0, -1, [])]
    levels = []
    for _ in range(depth):
        for s in frontier:
            s.ctx.fill_tokens(sep)
        proposed = await asyncio.gather(
            *(_propose(s, i if levels else -1, breadth, n, eos) for i, s in enumerate(frontier))
        )
        states = sorted((s for ss in proposed for s in ss), key=lambda s: -s.score)
        await asyncio.gather(*(s.ctx.release() for s in states[keep:]))
        levels.append(
            [
                {
                    "parent": s.parent,
                    "text": api.detokenize(q, s.thoughts[-1]),
                    "tokens": s.thoughts[-1],
                    "score": s.score,
                    "kept": i < keep,
                    **({"context": s.context} if opts["trace"] else {}),
                }
                for i, s in enumerate(states)
            ]
        )
        frontier = states[:keep]
    best = frontier[0]
    result = {
        "thoughts": [api.detokenize(q, t) for t in best.thoughts],
        "tokens": best.thoughts,
        "score": best.score,
    }
    if opts["answer_tokens"] > 0:
        best.ctx.fill(opts["answer_prefix"])
        start = len(best.ctx.tokens)
        stop = MaxTokens(opts["answer_tokens"]) | EosTokens(eos)
        result["answer"] = await best.ctx.generate(Sampler(), stop)
        result["answer_tokens"] = [t for t in best.ctx.tokens[start:] if t not in eos]
    await asyncio.gather(*(s.ctx.release() for s in frontier))
    return json.dumps({"best": result, "levels": levels})


async def _propose(state: State, index: int, breadth: int, n: int, eos: set[int]) -> list[State]:
    """``breadth`` thoughts after ``state``, one per most likely first token, each on a fork
    of the state's context (the last on the context itself)."""
    ids, probs = await next_dist(state.ctx, breadth + len(eos))
    firsts = [(t, p) for t, p in zip(ids, probs, strict=True) if t not in eos and p > 0]
    firsts = firsts[:breadth]
    context = list(state.ctx.tokens)
    forks = await asyncio.gather(*(state.ctx.fork() for _ in firsts[1:]))
    thoughts = await asyncio.gather(
        *(
            continue_greedy(ctx, t, n, eos)
            for ctx, (t, _) in zip([*forks, state.ctx], firsts, strict=True)
        )
    )
    return [
        State(ctx, [*state.thoughts, tokens], state.score + math.log(p) + lp, index, context)
        for ctx, (_, p), (tokens, lp) in zip([*forks, state.ctx], firsts, thoughts, strict=True)
    ]
