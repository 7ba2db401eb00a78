"""One generation with SGLang's sampling parameters, on a :class:`pastry.sdk.Context`.

Shared by the prompt states of :mod:`pastry.lang` (``gen``) and the native HTTP API
(``POST /generate``). The first token is sampled with the prompt's forward and the rest
runs ahead in the control layer (:meth:`Context.run_ahead`) where no token is decided
here (see :func:`generate`); every step, run ahead or one ``sample`` call, has everything
that shapes the distribution done on the device: temperature, top-k / top-p / min-p, the penalties
(SGLang's: repetition over prompt and output, frequency and presence over the output),
``min_new_tokens`` (end tokens get a -inf bias before it), ``regex`` / ``json_schema`` (a
grammar constraint the host holds and advances, :mod:`pastry.sdk.grammar`; tokens it
forces are appended without a step unless log-probabilities are asked for) and
``return_logprob`` (the device returns the chosen token's log-probability and the top
ones: the model's raw distribution, before processing). Stop strings and stop tokens are
checked here, after ``min_new_tokens``.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from pastry.api import Sampling
from pastry.lang.expr import SamplingParams
from pastry.sdk import StopCondition, StopStrings
from pastry.sdk.context import Context
from pastry.sdk.steps import sample_next

MAX_LOGPROBS = 20  # the most top log-probabilities ``sample`` returns (the API's limit)


@dataclass
class Generation:
    text: str
    tokens: list[int]  # every generated token (a matched stop token included)
    finish_reason: dict[str, Any]
    logprobs: list[tuple[float, int]] | None = None  # (logprob, token) per generated token
    top_logprobs: list[list[tuple[float, int]]] | None = None
    meta: dict[str, Any] = field(default_factory=dict)


def check(params: SamplingParams) -> None:
    """Raise ``ValueError`` naming the first bad parameter."""
    p = params
    rules = [
        ("max_new_tokens", isinstance(p.max_new_tokens, int) and p.max_new_tokens >= 0,
         "an integer >= 0"),
        ("min_new_tokens", isinstance(p.min_new_tokens, int) and p.min_new_tokens >= 0,
         "an integer >= 0"),
        ("n", isinstance(p.n, int) and p.n >= 1, "an integer >= 1"),
        ("temperature", _num(p.temperature) and 0 <= p.temperature < math.inf,
         "a number >= 0"),
        ("top_p", _num(p.top_p) and 0 < p.top_p <= 1, "a number in (0, 1]"),
        ("top_k", isinstance(p.top_k, int) and (p.top_k == -1 or p.top_k >= 0),
         "-1 (off) or an integer >= 0"),
        ("min_p", _num(p.min_p) and 0 <= p.min_p <= 1, "a number in [0, 1]"),
        ("repetition_penalty", _num(p.repetition_penalty)
         and 0 < p.repetition_penalty < math.inf, "a number > 0 (1: off)"),
        ("frequency_penalty", _num(p.frequency_penalty) and abs(p.frequency_penalty) <= 2,
         "a number from -2 to 2 (0: off)"),
        ("presence_penalty", _num(p.presence_penalty) and abs(p.presence_penalty) <= 2,
         "a number from -2 to 2 (0: off)"),
        ("top_logprobs_num", isinstance(p.top_logprobs_num, int)
         and 0 <= p.top_logprobs_num <= MAX_LOGPROBS, f"an integer from 0 to {MAX_LOGPROBS}"),
        ("seed", p.seed is None or (isinstance(p.seed, int) and not isinstance(p.seed, bool)),
         "an integer"),
        ("logit_bias", all(t >= 0 and not math.isnan(b) and b != math.inf
                           for t, b in p.logit_bias), "{token id: bias} (bias < +inf)"),
    ]  # fmt: skip
    for name, ok, what in rules:
        if not ok:
            raise ValueError(f"{name!r} must be {what}, got {getattr(p, name)!r}")
    if p.regex is not None and p.json_schema is not None:
        raise ValueError("give at most one of 'regex' and 'json_schema'")


def _num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


async def generate(
    ctx: Context,
    params: SamplingParams,
    on_text: Callable[[str], None] | None = None,
    run_ahead: bool = True,
) -> Generation:
    """Generate once on ``ctx`` (which has a pending token); the tokens stay in ``ctx`` (a
    final end token is not added). ``on_text`` receives the text as it grows (pieces that
    can no longer change). After the first token (sampled with the prompt's forward) the
    rest runs ahead in the control layer (one ``generate`` request, heard only to stream),
    except where tokens are decided here: a grammar's forced tokens appended without a
    step, an adapter (the fused step has none), or ``run_ahead`` False (one ``sample`` per
    token: the reference it is tested against)."""
    check(params)
    p = params
    if p.max_new_tokens == 0:
        return Generation("", [], {"type": "length", "length": 0}, [] if p.return_logprob else None)
    constraint = None
    if p.regex is not None or p.json_schema is not None:
        from pastry.sdk.grammar import Constraint

        spec = {"regex": p.regex} if p.regex is not None else {"json_schema": p.json_schema}
        constraint = Constraint(ctx, spec)
    try:
        return await _decode(ctx, p, on_text, constraint, run_ahead)
    finally:
        if constraint is not None:
            constraint.free()


async def _decode(ctx: Context, p: SamplingParams, on_text, constraint, ahead: bool) -> Generation:
    a, q = ctx.api, ctx.queue
    prompt = list(ctx.tokens)
    eos = set(ctx.eos_ids)
    ends = set(p.stop_token_ids) | (set() if p.ignore_eos else eos)
    stops = [s for s in p.stops if s]
    stop = StopStrings(stops) if stops else None
    detokenize = lambda t: a.detokenize(q, t)  # noqa: E731
    stream = None if on_text is None else _Stream(on_text, detokenize, ends, stops)
    bias = list(p.logit_bias)
    banned = bias + [(t, -math.inf) for t in sorted(ends)]
    penalties = _penalties(p, prompt)
    fast_forward = not p.return_logprob  # a forced token has no log-probability
    ahead = ahead and ctx.adapter is None and (constraint is None or not fast_forward)
    out: list[int] = []
    chosen, tops = [], []  # type: ignore[var-annotated]  # (logprob, token), top (lp, id)
    reason: dict[str, Any] = {"type": "length", "length": p.max_new_tokens}
    steps = 0
    while len(out) < p.max_new_tokens:
        if constraint is not None:
            _, done, forced = constraint.state()
            if done:  # the grammar admits nothing more: the output ends as at an end token
                reason = {"type": "stop", "matched": ctx.eos_ids[0]}
                break
            if forced and fast_forward:
                forced = forced[: p.max_new_tokens - len(out)]
                constraint.consume(forced)
                ctx.fill_tokens(forced)
                out += forced
                if _stopped(out, p, stop, stream, a, q):
                    reason = {"type": "stop", "matched": _matched(a, q, out, stops)}
                    break
                continue
        bias_now = banned if len(out) < p.min_new_tokens and ends else bias
        got = await sample_next(ctx, **_sample_args(p, steps, out, bias_now, penalties, constraint))
        steps += 1
        if constraint is not None:
            constraint.sampled()
        if p.return_logprob:
            tok, lp, ids, lps = got
            chosen.append((lp, tok))
            tops.append(list(zip(lps, ids, strict=True)))
        else:
            tok = got
        out.append(tok)
        if tok in ends or (constraint is not None and tok in eos):
            reason = {"type": "stop", "matched": tok}
            break
        ctx.fill_tokens([tok])
        if _stopped(out, p, stop, stream, a, q):
            reason = {"type": "stop", "matched": _matched(a, q, out, stops)}
            break
        if ahead and len(out) < p.max_new_tokens:
            loop = _Ahead(ctx, p, out, ends | (eos if constraint is not None else set()))
            kw = _sample_args(p, steps, list(out), bias, penalties, constraint)
            return await loop.finish(kw, stop, stream, (chosen, tops), reason)
    return _generation(a, q, out, reason, stream, (chosen, tops) if p.return_logprob else None)


class _Ahead:
    """The rest of a generation as one loop in the control layer (``Context.run_ahead``):
    the same sampling per token as the steps above (seed, penalty history, ``ends``
    banned before ``min_new_tokens``), heard only to stream the text."""

    def __init__(self, ctx: Context, p: SamplingParams, out: list[int], ends: set[int]):
        self.ctx, self.p, self.out, self.ends = ctx, p, out, ends

    async def finish(self, kw: dict[str, Any], stop, stream, logprobs, length) -> Generation:
        """Generate on from ``out`` with the sampling of the next step (``kw``)."""
        reason = await self.run(kw, stop, stream, logprobs) or length
        a, q, p = self.ctx.api, self.ctx.queue, self.p
        return _generation(a, q, self.out, reason, stream, logprobs if p.return_logprob else None)

    async def run(self, kw: dict[str, Any], stop, stream, logprobs) -> dict[str, Any] | None:
        """Generate on from ``out`` with the sampling of the next step (``kw``); the finish
        reason (None: the length)."""
        ctx, p, out = self.ctx, self.p, self.out
        n = len(out)
        sampling = Sampling(**{k: v for k, v in kw.items() if v is not None})
        chosen, tops = logprobs

        def hear(tokens: list[int], lps: tuple[list, list, list]) -> bool:
            out.extend(tokens)
            if p.return_logprob:
                chosen.extend(zip(lps[0], tokens, strict=True))
                tops.extend(list(zip(v, i, strict=True)) for i, v in zip(*lps[1:], strict=True))
            if stream is not None and out[-1] not in self.ends:
                stream.should_stop(out, "")
            return False

        _, finish, _ = await ctx.run_ahead(
            p.max_new_tokens - n, sampling, sorted(self.ends), stop.strings if stop else [],
            max(0, p.min_new_tokens - n), out[-stop.tail_tokens :] if stop else [],
            every=1 if stream is not None else 0, hear=hear,
        )  # fmt: skip
        if finish == "grammar":  # it admits nothing more: the output ends as at an end token
            return {"type": "stop", "matched": ctx.eos_ids[0]}
        if finish != "stop":
            return None
        if out[-1] in self.ends:  # an end token: not part of the context (as a step leaves it)
            ctx.tokens.pop()
            ctx.pending = []
            return {"type": "stop", "matched": out[-1]}
        a, q = ctx.api, ctx.queue
        return {"type": "stop", "matched": _matched(a, q, out, stop.strings)}


def _penalties(p: SamplingParams, prompt: list[int]) -> dict[str, Any]:
    """The penalty arguments of every step (none when no penalty is asked for)."""
    if p.repetition_penalty == 1.0 and p.frequency_penalty == 0.0 and p.presence_penalty == 0.0:
        return {}
    return dict(
        penalty_prompt=prompt if p.repetition_penalty != 1.0 else None,
        repetition_penalty=p.repetition_penalty,
        frequency_penalty=p.frequency_penalty,
        presence_penalty=p.presence_penalty,
    )


def _sample_args(
    p: SamplingParams, steps: int, out: list[int], bias: list, penalties: dict, constraint
) -> dict[str, Any]:
    """The sampling arguments of the next step (``bias``: the logit bias now)."""
    kw: dict[str, Any] = dict(
        temperature=p.temperature,
        top_k=max(p.top_k, 0),
        top_p=p.top_p,
        min_p=p.min_p,
        seed=None if p.seed is None else p.seed + steps,
    )
    if bias:
        kw["logit_bias"] = bias
    if penalties:
        kw.update(penalties, penalty_tokens=out)
    if p.return_logprob:
        kw["logprobs"] = p.top_logprobs_num
    if constraint is not None:
        kw["constraint"] = constraint.handle
    return kw


def _generation(a, q, out: list[int], reason: dict[str, Any], stream, logprobs) -> Generation:
    """The output's text (without a matched end token or stop string) and the rest
    (``logprobs``: the chosen tokens' and the top ones, when asked for)."""
    matched = reason.get("matched")
    ended = isinstance(matched, int) and bool(out) and out[-1] == matched
    text = a.detokenize(q, out[:-1] if ended else out)
    if isinstance(matched, str):
        text = text[: text.find(matched)]
    if stream is not None:
        stream.flush(text)
    gen = Generation(text, out, reason)
    if logprobs is not None:
        gen.logprobs, gen.top_logprobs = logprobs
    return gen


def _stopped(out: list[int], p: SamplingParams, stop, stream, a, q) -> bool:
    """Pass the new text on (streaming) and say whether a stop string ended the output."""
    tail = a.detokenize(q, out[-stop.tail_tokens :]) if stop is not None else ""
    if stream is not None:
        stream.should_stop(out, tail)
    return stop is not None and len(out) >= p.min_new_tokens and stop.should_stop(out, tail)


def _matched(a, q, out: list[int], stops: list[str]) -> str:
    text = a.detokenize(q, out)
    return min((s for s in stops if s in text), key=text.find)


async def generate_n(
    ctx: Context, params: SamplingParams, on_text: Sequence[Callable[[str], None]] | None = None
) -> list[Generation]:
    """``params.n`` generations from ``ctx``: the first on ``ctx`` itself, the others on
    forks of it (sharing its pages), all at once so that their steps batch together."""
    branches = [ctx] + [await ctx.fork() for _ in range(params.n - 1)]
    try:
        runs = []
        for i, b in enumerate(branches):
            p = params
            if p.seed is not None and i:
                p = replace(p, seed=(p.seed + i * 0x9E3779B9) % (1 << 62))
            runs.append(generate(b, p, on_text[i] if on_text else None))
        return list(await asyncio.gather(*runs))
    finally:
        await asyncio.gather(*(b.release() for b in branches[1:]))


class _Stream(StopCondition):
    """Passes the generated text on as it grows; never stops generation itself.

    Each step decodes only the newest tokens after the previous step's (for context) and
    passes on the text that can no longer change: not a trailing incomplete UTF-8
    character, not an end token, not the last ``len(longest stop) - 1`` characters (a
    stop string may still cover them) nor a stop string itself.
    """

    def __init__(self, send, detokenize, ends: set[int], stops: list[str]) -> None:
        self.send, self.detokenize = send, detokenize
        self.ends, self.stops = ends, stops
        self.hold = max(map(len, stops), default=1) - 1
        self.text = ""
        self.prefix = self.read = 0
        self.sent = 0
        self.stopped = False

    def should_stop(self, tokens: list[int], text: str) -> bool:
        if tokens[-1] in self.ends or self.stopped:
            return False
        before = self.detokenize(tokens[self.prefix : self.read])
        after = self.detokenize(tokens[self.prefix :])
        if after.endswith("\ufffd") or not after.startswith(before):
            return False
        self.text += after[len(before) :]
        self.prefix, self.read = self.read, len(tokens)
        if any(s in self.text for s in self.stops):
            self.stopped = True  # the final text (cut before the stop) is flushed at the end
            return False
        self.flush(self.text[: max(0, len(self.text) - self.hold)])
        return False

    def flush(self, text: str) -> None:
        if len(text) > self.sent:
            self.send(text[self.sent :])
            self.sent = len(text)
