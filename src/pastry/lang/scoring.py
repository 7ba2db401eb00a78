"""Log-probabilities of given tokens: what ``select`` ranks choices by and what the native
API returns as prompt log-probabilities. Everything that reads a token's probability
goes through :func:`score`, so that it can move to on-device log-probabilities in one place.

:func:`score` appends tokens to a context and forwards them, with every token pending
before them, in *one* forward call whose outputs are read at each position: the
top-``k`` distribution, and the full distribution only for a position whose token is not
among the top ``k`` (exact, and cheap for the likely tokens a scored text is made of).

``select`` scores each choice on a fork of the prompt's context, so the prompt's K/V is
computed once and shared by every choice (:func:`choice_logprobs`). Which tokens score a
choice follows SGLang: the tokens of ``prompt + choice``, tokenized as one text, from the
prompt's last token on — a choice may merge with the prompt's last token (``" A"``), so
that token is scored too.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from dataclasses import dataclass

from pastry.sdk.context import Context
from pastry.sdk.steps import _forward_pending, truncate

TOP_K = 64  # alternatives read at every position before falling back to the full row


@dataclass(frozen=True)
class Scored:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token, logprob) alternatives, most likely first


def _log(p: float) -> float:
    return math.log(p) if p > 0 else -math.inf


async def score(ctx: Context, tokens: Sequence[int], top_n: int = 0) -> list[Scored]:
    """Append ``tokens`` to ``ctx`` and forward them with the tokens pending before them (at
    least one); each appended token's log-probability given every token before it, with the
    ``top_n`` most likely tokens at its position. Outputs are read only from the last
    pending token on (the ones before are forwarded first, without). Afterwards nothing is
    pending."""
    if not ctx.pending:
        raise ValueError("score needs a pending token before the scored ones: fill it first")
    if not tokens:
        return []
    await ctx.flush()  # the context before the last pending token: no outputs read there
    before = len(ctx.pending)
    ctx.fill_tokens(tokens)
    n_out = len(ctx.pending)
    k = max(TOP_K, top_n)
    futs = _forward_pending(ctx, n_out, k)
    slots = ctx._embed_slots(n_out * 2)[n_out:]  # where _forward_pending put the outputs
    dists = (await asyncio.gather(*futs))[2:]
    # the output at pending position i predicts pending token i + 1
    wanted = [(before - 1 + j, t) for j, t in enumerate(tokens)]
    rows = ctx.api.get_vocab_size(ctx.queue)
    missing = [i for i, t in wanted if t not in dists[i][0]]
    if missing:
        full = await asyncio.gather(
            *(ctx.api.get_next_dist(ctx.queue, slots[i], rows) for i in missing)
        )
        dists = list(dists)
        for i, d in zip(missing, full, strict=True):
            dists[i] = d
    out = []
    for i, t in wanted:
        ids, probs = dists[i]
        lp = _log(probs[ids.index(t)])
        top = tuple((a, _log(p)) for a, p in zip(ids[:top_n], probs[:top_n], strict=False))
        out.append(Scored(t, lp, top))
    return out


def scored_span(prompt_len: int) -> int:
    """Index of the first token that scores a choice (SGLang: the prompt's last token, or
    the second token when the prompt has one)."""
    return max(prompt_len - 1, 1)


async def choice_logprobs(
    ctx: Context, prompt: Sequence[int], continued: Sequence[Sequence[int]]
) -> list[list[Scored]]:
    """For each ``continued[i]`` (the tokens of prompt text + choice i), the scored tokens
    from :func:`scored_span` on, each computed on a fork of ``ctx``; ``ctx`` holds exactly
    ``prompt`` (its K/V up to the last token is computed once, before the forks)."""
    assert list(ctx.tokens) == list(prompt)
    await ctx.flush()
    first = scored_span(len(prompt))

    async def one(tokens: Sequence[int]) -> list[Scored]:
        if len(tokens) <= first:
            raise ValueError("a choice must add at least one token to the prompt")
        common = 0
        for a, b in zip(prompt, tokens, strict=False):
            if a != b:
                break
            common += 1
        cut = min(common, first - 1)
        fork = await ctx.fork()
        try:
            await truncate(fork, cut)
            fork.fill_tokens(tokens[cut:first])
            return await score(fork, tokens[first:])
        finally:
            await fork.release()

    return list(await asyncio.gather(*(one(t) for t in continued)))


async def unconditional_logprobs(ctx: Context, tokens: Sequence[int]) -> list[Scored]:
    """``tokens`` scored on their own (a fresh context on ``ctx``'s model); the first has
    no context and counts log-probability 0."""
    fresh = Context(ctx.model)
    try:
        fresh.fill_tokens(tokens[:1])
        rest = await score(fresh, tokens[1:])
    finally:
        await fresh.release()
    return [Scored(tokens[0], 0.0), *rest]
