"""Steps on a :class:`Context` beyond ``generate``: outputs at several positions, and rollback.

``Context.generate`` forwards the pending tokens and keeps only the one token it samples.
Techniques that score or verify several tokens in one forward (speculative and Jacobi
decoding, output validation) or that need the distribution itself (beam search,
watermarking) need three more operations, built here on the context's pages:

- :func:`next_dist` forwards the pending tokens and returns the next-token distribution;
  the caller picks a token and appends it with ``fill_tokens``.
- :func:`greedy_after` / :func:`dists_after` append a run of tokens and forward it together
  with the pending ones in *one* forward call, reading the model's output after each of
  them: the greedy token (argmax, on the device) or the top-k distribution.
- :func:`truncate` drops tokens from the end, e.g. rejected draft tokens. Their K/V stay in
  the slots after the new end but are never read: a forward attends to the context only up
  to ``kv_len`` (the last page up to ``in_kv_last_len``), and the next forward writes its
  own tokens' K/V from slot ``kv_len`` on, over them. Pages shared with a fork or through
  the prefix cache (``Context.frozen``) are never written: a shared page that would be is
  replaced by a private copy.
- :func:`own_page` makes one page of the context its own to write in place (before
  ``mask_kvpage`` hides some of its slots): a page a fork or the prefix cache may share is
  replaced by a private copy first, the same way.

Each function issues its embed, forward and output calls together and awaits them once, so
they run in one engine batch (and batch with other queues' calls).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Sequence

from pastry.api import ApiError, sampling_of
from pastry.sdk.context import Context
from pastry.sdk.pages import page_refs, unshare

Dist = tuple[list[int], list[float]]  # token ids by decreasing probability, probabilities


async def next_dist(ctx: Context, k: int = 256) -> Dist:
    """Forward the pending tokens; the top-``k`` distribution of the token after them.

    Afterwards nothing is pending: append the chosen token with ``ctx.fill_tokens``.
    """
    *_, dist = await asyncio.gather(*_forward_pending(ctx, 1, k))
    return dist


async def continue_greedy(
    ctx: Context, first: int, n: int, eos: set[int]
) -> tuple[list[int], float]:
    """Append ``first`` and continue greedily up to ``n`` tokens in all (stopping before an
    end-of-sequence token); the tokens and the log-probability of those after ``first``."""
    tokens, logprob = [first], 0.0
    ctx.fill_tokens([first])
    while len(tokens) < n:
        ids, probs = await next_dist(ctx, 1)
        if ids[0] in eos:
            break
        tokens.append(ids[0])
        logprob += math.log(probs[0])
        ctx.fill_tokens(ids[:1])
    return tokens, logprob


async def greedy_after(ctx: Context, tokens: Sequence[int]) -> list[int]:
    """Append ``tokens`` and forward them with the pending tokens in one forward call.

    Returns ``len(tokens) + 1`` greedy (argmax) tokens: element ``i`` is the model's choice
    after the last pending token (``i = 0``) or after ``tokens[i - 1]``. Every appended
    token's K/V is stored; drop the ones you do not keep with :func:`truncate`.
    """
    ctx.fill_tokens(tokens)
    results = await asyncio.gather(*_forward_pending(ctx, len(tokens) + 1, None))
    return results[-(len(tokens) + 1) :]


async def dists_after(ctx: Context, tokens: Sequence[int], k: int = 256) -> list[Dist]:
    """Like :func:`greedy_after`, but the top-``k`` distribution after each token."""
    ctx.fill_tokens(tokens)
    results = await asyncio.gather(*_forward_pending(ctx, len(tokens) + 1, k))
    return results[-(len(tokens) + 1) :]


async def truncate(ctx: Context, length: int, spare: bool = True) -> None:
    """Keep only the first ``length`` tokens of ``ctx`` (see the module docstring for what
    happens to the K/V of the dropped ones). Spare pages are kept for the tokens to come
    (``spare`` False frees them: the context then holds exactly its tokens' pages, as an
    export of it should).

    Kept tokens already forwarded stay in the KV cache, so when ``length`` is at most the
    number forwarded nothing is pending: append a token before ``generate``.
    """
    ctx.check_live()
    if not 0 <= length <= len(ctx.tokens):
        raise ApiError(f"cannot truncate a context of {len(ctx.tokens)} tokens to {length}")
    ctx.drop_images(length)
    a, ps, refs = ctx.api, ctx.page_size, page_refs(ctx.api)
    ctx.tokens = ctx.tokens[:length]
    ctx.kv_len = min(ctx.kv_len, length)
    ctx.pending = ctx.tokens[ctx.kv_len :]
    used = -(-ctx.kv_len // ps)
    # The next forward writes from slot kv_len on: into the last used page if it is partial,
    # then into the spare pages. None of them may be a page a fork still reads.
    spare_pages = ctx.pages[used:]
    shared = {p for i, p in enumerate(spare_pages, used) if _shared(ctx, refs, i)}
    free = unshare(a, sorted(shared))  # pages shared through the prefix cache we stop using
    kept = [p for p in spare_pages if p not in shared]
    if not spare:
        free += kept
        kept = []
    ctx.pages = ctx.pages[:used] + kept
    ctx.frozen = min(ctx.frozen, used)
    ctx.owned = {i for i in ctx.owned if i < ctx.frozen}
    rest = ctx.kv_len % ps
    if rest and _shared(ctx, refs, used - 1):
        old = ctx.pages[used - 1]
        new = a.alloc_kvpages(ctx.queue, 1)[0]
        if refs.get(old, 1) > 1:
            refs[old] -= 1
        else:
            free.append(old)
        ctx.pages[used - 1] = new
        ctx.frozen = used - 1
        ctx.owned.discard(used - 1)
        await a.copy_kvpage(ctx.queue, old, new, 0, 0, rest)
    if free:
        await a.dealloc_kvpages(ctx.queue, free)


def _shared(ctx: Context, refs: dict[int, int], index: int) -> bool:
    """Whether page ``index`` of ``ctx`` may be read by another context (see own_page)."""
    return refs.get(ctx.pages[index], 1) > 1 or (index < ctx.frozen and index not in ctx.owned)


def own_page(ctx: Context, index: int) -> tuple[int, list[Awaitable]]:
    """Page ``index`` of ``ctx``, made the context's own to write in place (``mask_kvpage``
    on it, say): where another context may read it (a fork shares it, or it is below
    ``ctx.frozen`` and the prefix cache may have given it to other inferlets) its
    forwarded slots are copied into a new page, which takes its place in ``ctx.pages``; the
    old one is given back. Returns the page to write and the calls issued for it, to await
    with whatever writes it: they are on the context's queue, so a call issued after them
    sees the copy (calls on one queue take effect in order).

    A page copied once stays the context's own (``ctx.owned``) until a fork shares it.
    """
    ctx.check_live()
    ps, a, refs = ctx.page_size, ctx.api, page_refs(ctx.api)
    used = -(-ctx.kv_len // ps)
    if not 0 <= index < used:
        raise ApiError(f"page {index} holds no forwarded token ({ctx.kv_len} are forwarded)")
    old = ctx.pages[index]
    if not _shared(ctx, refs, index):
        return old, []
    held = refs.get(old, 1) > 1
    new = a.alloc_kvpages(ctx.queue, 1)[0]
    calls = [a.copy_kvpage(ctx.queue, old, new, 0, 0, min(ps, ctx.kv_len - index * ps))]
    ctx.pages[index] = new
    if held:
        refs[old] -= 1
    else:
        calls.append(a.dealloc_kvpages(ctx.queue, [old]))
    ctx.owned.add(index)
    return new, calls


def _forward_pending(ctx: Context, n_out: int, k: int | None) -> list[Awaitable]:
    """Issue the forward of every pending token (through the prefix cache when some of
    them have no output), then one output call for each of the last ``n_out``:
    ``get_next_dist(k)``, or a greedy ``sample`` when ``k`` is None.

    Returns the futures (the forward's, then the outputs'); the tokens count as forwarded.
    """
    ctx.check_live()
    tokens = ctx.pending
    n = len(tokens)
    if n == 0:
        raise ApiError("nothing to forward: fill the context first")
    assert 1 <= n_out <= n, (n_out, n)
    a, q = ctx.api, ctx.queue
    futs, outs = ctx.forward_tokens(tokens, n_out)
    futs += [a.sample(q, e) if k is None else a.get_next_dist(q, e, k) for e in outs]
    ctx.pending = []
    return futs


async def sample_next(ctx: Context, **kw):
    """Forward the pending tokens and sample the next token on the device; ``kw`` is
    ``sampling=Sampling(...)`` or its fields (temperature, seed, mask, logit_bias,
    penalties, logprobs...).
    Resolves to what ``sample`` does (a token id, or a tuple with ``logprobs``). Afterwards
    nothing is pending: append the token with ``ctx.fill_tokens``."""
    ctx.check_live()
    if not ctx.pending:
        raise ApiError("nothing to generate from: fill the context first")
    await ctx.place()  # on a model with several engines, the router places it first
    sampling = sampling_of(kw.pop("sampling", None), kw)
    if len(ctx.pending) == 1:  # a decode step: one fused command
        (token,) = ctx.pending
        ctx.pending = []
        return await ctx.decode_step(token, sampling)
    futs, (emb,) = ctx.forward_tokens(ctx.pending, 1)
    ctx.pending = []
    *_, out = await asyncio.gather(*futs, ctx.api.sample(ctx.queue, emb, sampling))
    return out


async def prompt_logprobs(
    ctx: Context, top: int = 0
) -> tuple[list[float | None], list[list[int]], list[list[float]]]:
    """Forward the tokens of a new context but the last (like ``flush``), scoring them:
    per token, its log-probability given the tokens before it (None for the first, which
    has nothing before it) and the ``top`` most likely tokens at its place with theirs
    (empty for the first). Echoing a prompt with its log-probabilities needs this."""
    ctx.check_live()
    if not ctx.pending or ctx.kv_len:
        raise ApiError("prompt_logprobs scores a filled context before anything is forwarded")
    await ctx.place(whole=True)  # several engines: placed first, computing the whole prompt
    tokens = ctx.pending
    lps: list[float | None] = [None]
    ids: list[list[int]] = [[]]
    tops: list[list[float]] = [[]]
    if len(tokens) > 1:
        a, q, ps = ctx.api, ctx.queue, ctx.page_size
        todo = tokens[:-1]
        n, start = len(todo), ctx.kv_len
        need = -(-(start + n) // ps) - len(ctx.pages)
        if need > 0:
            ctx.alloc_pages(need)
        ins = ctx.embed_slots(n)
        ctx_pages = ctx.pages[: -(-start // ps)]
        last = start - (len(ctx_pages) - 1) * ps if ctx_pages else 0
        out_pages = ctx.pages[start // ps : -(-(start + n) // ps)]
        _, (got, got_ids, got_tops) = await asyncio.gather(
            a.embed_txt(q, list(todo), list(range(start, start + n)), ins),
            a.forward(q, ctx_pages, last, ins, out_pages, start % ps, [], None, tokens[1:], top),
        )
        ctx.kv_len += n
        ctx.pending = tokens[-1:]
        lps += got
        ids += got_ids
        tops += got_tops
    return lps, ids, tops
