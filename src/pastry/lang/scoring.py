"""Log-probabilities of given tokens: what ``select`` ranks choices by and what the native
API returns as prompt log-probabilities. Everything that reads a token's probability
goes through :func:`score`.

:func:`score` appends tokens to a context and forwards them with the API's prompt
log-probabilities (``forward(..., logprob_targets=...)``): the engine computes each
token's log-probability under the model (and the top alternatives when asked) on the
device, and only those numbers come back — one forward call, whatever the vocabulary.
Tokens pending before the scored ones are forwarded in a call of their own without outputs,
issued together with it (the two usually share an engine batch), so the output head runs
only where a log-probability is wanted.

``select`` scores each choice on a fork of the prompt's context, so the prompt's K/V is
computed once and shared by every choice (:func:`choice_logprobs`). Which tokens score a
choice follows SGLang: the tokens of ``prompt + choice``, tokenized as one text, from the
prompt's last token on — a choice may merge with the prompt's last token (``" A"``), so
that token is scored too.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass

from pastry.sdk.context import Context
from pastry.sdk.steps import truncate


@dataclass(frozen=True)
class Scored:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token, logprob) alternatives, most likely first


def _forward(ctx: Context, tokens: list[int], slots: list[int], **kw) -> list[Awaitable]:
    """Issue embed + forward of ``tokens`` after the context's K/V, storing theirs, with
    ``slots`` as input embeddings and no output embedding; the tokens count as forwarded."""
    a, q, ps = ctx.api, ctx.queue, ctx.page_size
    n, start = len(tokens), ctx.kv_len
    need = -(-(start + n) // ps) - len(ctx.pages)
    if need > 0:
        ctx.alloc_pages(need)
    ctx_pages = ctx.pages[: -(-start // ps)]
    last = start - (len(ctx_pages) - 1) * ps if ctx_pages else 0
    out_pages = ctx.pages[start // ps : -(-(start + n) // ps)]
    ctx.kv_len += n
    return [
        a.embed_txt(q, list(tokens), list(range(start, start + n)), slots),
        a.forward(q, ctx_pages, last, slots, out_pages, start % ps, [], None, **kw),
    ]


async def score(ctx: Context, tokens: Sequence[int], top_n: int = 0) -> list[Scored]:
    """Append ``tokens`` to ``ctx`` and score them: each one's log-probability given every
    token before it, with the ``top_n`` (at most 20) most likely tokens at its place. At
    least one token must be pending before them. Afterwards, like after ``flush``, every
    token but the last is in the KV cache and the last is pending (generation can go on
    from it)."""
    ctx.check_live()
    if not ctx.pending:
        raise ValueError("score needs a pending token before the scored ones: fill it first")
    tokens = list(tokens)
    if not tokens:
        return []
    head = ctx.pending[:-1]
    ctx.pending = ctx.pending[-1:]
    ctx.fill_tokens(tokens)
    seq = ctx.pending
    slots = ctx.embed_slots(len(head) + len(seq) - 1)
    futs: list[Awaitable] = []
    if head:
        futs += _forward(ctx, head, slots[: len(head)])
    futs += _forward(ctx, seq[:-1], slots[len(head) :], logprob_targets=seq[1:], logprob_top=top_n)
    ctx.pending = seq[-1:]
    lps, ids, tops = (await asyncio.gather(*futs))[-1]
    return [
        Scored(t, lp, tuple(zip(i[:top_n], v[:top_n], strict=True)))
        for t, lp, i, v in zip(tokens, lps, ids, tops, strict=True)
    ]


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
    """``tokens`` scored on their own (a fresh context on ``ctx``'s model and adapter); the
    first has no context and counts log-probability 0."""
    fresh = Context(ctx.model, adapter=ctx.adapter)
    try:
        fresh.fill_tokens(tokens[:1])
        rest = await score(fresh, tokens[1:])
    finally:
        await fresh.release()
    return [Scored(tokens[0], 0.0), *rest]
