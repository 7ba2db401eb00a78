"""Run-ahead for a stop condition of the program's own (``Context.generate``).

The control layer's loop stops at what it can check itself (the length, stop tokens, stop
strings: :func:`pastry.sdk.stop.loop_fields`); the program hears the tokens as they come
(merged when it reads slower than the loop samples) and checks its own condition on each,
as the per-step loop would after every step. When the condition holds at a token the loop
is told to stop, and the tokens it sampled past that one leave the context again, with
the pages it allocated for them: the context is what the steps would have left.
"""

from __future__ import annotations

from typing import Any

from pastry.api import Sampling
from pastry.sdk.stop import LoopFields, StopCondition


async def until_own_stop(
    ctx: Any, sampling: Sampling | None, stop: StopCondition, fields: LoopFields, out: list[int]
) -> None:
    """Generate on ``ctx`` (a :class:`~pastry.sdk.Context` with one pending token) until
    ``stop`` holds, ``out`` being the tokens generated so far (extended in place)."""
    max_tokens, stop_ids, strings = fields
    a, q, n = ctx.api, ctx.queue, stop.tail_tokens
    pages, heard, done = len(ctx.pages), 0, False

    def hear(tokens: list[int], logprobs: tuple) -> bool:
        nonlocal heard, done
        for t in tokens:
            if done:
                break
            out.append(t)
            heard += 1
            done = stop.should_stop(out, a.detokenize(q, out[-n:]) if n else "")
        return done

    tail = out[-n:] if n else []
    tokens, _, _ = await ctx.run_ahead(
        max_tokens - len(out), sampling, stop_ids, strings, recent=tail, every=1, hear=hear
    )
    extra = len(tokens) - heard
    if extra:  # sampled past the stop: as the steps would have left it, last token pending
        del ctx.tokens[-extra:]
        ctx.pending = [ctx.tokens[-1]]
        ctx.kv_len -= extra
        keep = max(pages, -(-ctx.kv_len // ctx.page_size))
        spare, ctx.pages = ctx.pages[keep:], ctx.pages[:keep]
        if spare:
            await a.dealloc_kvpages(q, spare)
