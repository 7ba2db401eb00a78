"""Output validation by probability (Kuchnik et al. 2023, ReLM): score given candidates.

Instead of generating, ask how likely the model finds each of several candidate outputs
after the prompt: ``log p(c | prompt) = sum_i log p(c[i] | prompt, c[:i])``. This checks
what a model would say (e.g. which answer of a multiple-choice question, which completion
of a fact, whether a memorised string is reproduced) without sampling at all.

The prompt is forwarded once; each candidate is a fork sharing its KV pages, and scores
all its tokens in *one* forward (the last prompt token and the candidate's tokens but its
last, reading the distribution after each). The forks are on their own queues, so all
candidates' forwards run in one batch. A token's probability is read from the full
next-token distribution (``get_next_dist`` with ``k`` = vocabulary size), so it is exact.

Args (one JSON object)::

    {"prompt": "text" or [ids]} or {"prompt_tokens": [ids]}, "model": null (the first),
    "candidates": ["text", ...] (each tokenized on its own and appended to the prompt's
    tokens) or "candidate_tokens": [[ids], ...]

Result (JSON)::

    {"ranking": [candidate indices, most likely first],
     "scores": [{"tokens": [ids], "logprob": total, "token_logprobs": [per token]}, ...]
               (in candidate order)}
"""

from __future__ import annotations

import asyncio
import json
import math

from pastry.sdk import Context
from pastry.sdk.args import options, prompt_tokens
from pastry.sdk.steps import dists_after

DEFAULTS = {"model": None, "candidates": None, "candidate_tokens": None}


async def score(ctx: Context, candidate: list[int], vocab: int) -> dict:
    """Log-probabilities of ``candidate``'s tokens after ``ctx`` (which it extends)."""
    dists = await dists_after(ctx, candidate[:-1], vocab)  # dists[i]: after c[:i]
    token_logprobs = []
    for tok, (ids, probs) in zip(candidate, dists, strict=True):
        p = dict(zip(ids, probs, strict=True)).get(tok)
        if not p:  # only if the model's vocabulary is padded past the tokenizer's
            raise ValueError(f"token {tok} has no probability among the top {vocab}")
        token_logprobs.append(math.log(p))
    return {
        "tokens": candidate,
        "logprob": sum(token_logprobs),
        "token_logprobs": token_logprobs,
    }


async def main(args: list[str]) -> str:
    opts = options(args, DEFAULTS)
    async with Context(opts["model"]) as ctx:
        a, q = ctx.api, ctx.queue
        ctx.fill_tokens(prompt_tokens(ctx, opts))
        if opts["candidate_tokens"] is not None:
            candidates = [[int(t) for t in c] for c in opts["candidate_tokens"]]
        elif opts["candidates"] is not None:
            candidates = [a.tokenize(q, c) for c in opts["candidates"]]
        else:
            raise ValueError('give "candidates" (texts) or "candidate_tokens" (token id lists)')
        if not candidates or not all(candidates):
            raise ValueError("give at least one candidate, each at least one token long")
        vocab = len(a.get_vocabs(q))
        await ctx.flush()  # the prompt's K/V, once; forks made after it share its pages
        forks = await asyncio.gather(*(ctx.fork() for _ in candidates))
        scores = await asyncio.gather(
            *(score(f, c, vocab) for f, c in zip(forks, candidates, strict=True))
        )
        await asyncio.gather(*(f.release() for f in forks))
    ranking = sorted(range(len(scores)), key=lambda i: -scores[i]["logprob"])
    return json.dumps({"ranking": ranking, "scores": scores})
