"""One generation with SGLang's sampling parameters, on a :class:`pastry.sdk.Context`.

Shared by the prompt states of :mod:`pastry.lang` (``gen``) and the native HTTP API
(``POST /generate``). Sampling runs on the device (only the token id comes back) unless a
parameter needs the distribution on the host: ``return_logprob`` (the chosen token's
log-probability and alternatives), ``min_new_tokens`` (end tokens are excluded before it).
``regex`` / ``json_schema`` decode through :mod:`pastry.sdk.grammar` (llguidance).

Parameters this server cannot honour yet raise :class:`Unsupported` naming them — never
silently ignored.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pastry.lang.expr import SamplingParams
from pastry.sdk import EosTokens, MaxTokens, StopCondition, StopStrings
from pastry.sdk.context import Context
from pastry.sdk.sampling import Sampler

# Parameters with the value that leaves them off, which this server does not implement.
NOT_YET = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0}
HOST_K = 256  # alternatives read per step when sampling on the host


class Unsupported(ValueError):
    """A sampling parameter this server does not implement; ``param`` names it."""

    def __init__(self, param: str, why: str) -> None:
        super().__init__(f"{param!r} is not supported: {why}")
        self.param = param


@dataclass
class Generation:
    text: str
    tokens: list[int]  # every generated token (a matched stop token included)
    finish_reason: dict[str, Any]
    logprobs: list[tuple[float, int]] | None = None  # (logprob, token) per generated token
    top_logprobs: list[list[tuple[float, int]]] | None = None
    meta: dict[str, Any] = field(default_factory=dict)


def check(params: SamplingParams) -> None:
    """Raise ``ValueError`` (or :class:`Unsupported`) naming the first bad parameter."""
    for name, off in NOT_YET.items():
        if getattr(params, name) != off:
            raise Unsupported(name, "penalties are not implemented by this server yet")
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
        ("top_logprobs_num", isinstance(p.top_logprobs_num, int) and p.top_logprobs_num >= 0,
         "an integer >= 0"),
    ]  # fmt: skip
    for name, ok, what in rules:
        if not ok:
            raise ValueError(f"{name!r} must be {what}, got {getattr(p, name)!r}")
    if p.regex is not None and p.json_schema is not None:
        raise ValueError("give at most one of 'regex' and 'json_schema'")
    if p.regex is not None or p.json_schema is not None:
        which = "regex" if p.regex is not None else "json_schema"
        for name, off in (("top_p", 1.0), ("top_k", -1), ("min_p", 0.0), ("min_new_tokens", 0)):
            if getattr(p, name) != off and not (name == "top_k" and p.top_k == 0):
                raise Unsupported(name, f"it cannot be combined with {which!r} here")
        if p.return_logprob:
            raise Unsupported("return_logprob", f"it cannot be combined with {which!r} here")


def _num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


async def generate(
    ctx: Context, params: SamplingParams, on_text: Callable[[str], None] | None = None
) -> Generation:
    """Generate once on ``ctx`` (which has a pending token); the tokens stay in ``ctx``.
    ``on_text`` receives the text as it grows (pieces that can no longer change)."""
    check(params)
    if params.max_new_tokens == 0:
        return Generation(
            "", [], {"type": "length", "length": 0}, [] if params.return_logprob else None
        )
    if params.regex is not None or params.json_schema is not None:
        return await _constrained(ctx, params)
    start = len(ctx.tokens)
    ends = set(params.stop_token_ids) | (set() if params.ignore_eos else set(ctx.eos_ids))
    stops = [s for s in params.stops if s]
    cond: StopCondition = MaxTokens(params.max_new_tokens) | EosTokens(sorted(ends))
    if stops:
        cond = cond | StopStrings(stops)
    if params.min_new_tokens:
        cond = _AtLeast(params.min_new_tokens, cond)
    stream = None
    if on_text is not None:
        stream = _Stream(on_text, lambda t: ctx.api.detokenize(ctx.queue, t), ends, stops)
        cond = stream | cond  # first, so that it sees every step
    host = params.return_logprob or params.min_new_tokens > 0
    sampler: Any = (
        _HostSampler(params, ends)
        if host
        else Sampler(
            temperature=params.temperature,
            top_k=max(params.top_k, 0),
            top_p=params.top_p,
            min_p=params.min_p,
            seed=params.seed,
        )
    )
    await ctx.generate(sampler, cond)
    out = ctx.tokens[start:]
    body = out
    reason: dict[str, Any] = {"type": "length", "length": params.max_new_tokens}
    if out and out[-1] in ends:
        body = out[:-1]
        reason = {"type": "stop", "matched": out[-1]}
    text = ctx.api.detokenize(ctx.queue, body)
    cut = min((text.find(s) for s in stops if s in text), default=-1)
    if cut >= 0:
        matched = min((s for s in stops if s in text), key=text.find)
        text, reason = text[:cut], {"type": "stop", "matched": matched}
    if stream is not None:
        stream.flush(text)
    gen = Generation(text, out, reason)
    if host:
        gen.logprobs = sampler.chosen
        gen.top_logprobs = sampler.top
    return gen


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
                from dataclasses import replace

                p = replace(p, seed=(p.seed + i * 0x9E3779B9) % (1 << 62))
            runs.append(generate(b, p, on_text[i] if on_text else None))
        return list(await asyncio.gather(*runs))
    finally:
        await asyncio.gather(*(b.release() for b in branches[1:]))


async def _constrained(ctx: Context, params: SamplingParams) -> Generation:
    try:
        from pastry.sdk import grammar
    except ImportError as e:  # the sandbox's runtime has no llguidance
        which = "regex" if params.regex is not None else "json_schema"
        raise Unsupported(
            which,
            f"grammar-constrained generation needs llguidance, which this runtime lacks ({e}); "
            "run the program trusted (a built-in, or `pastry serve --trusted-uploads`)",
        ) from None
    spec = {"regex": params.regex} if params.regex is not None else {
        "json_schema": params.json_schema}  # fmt: skip
    constraint = grammar.Constraint(ctx, spec)
    got = await grammar.generate(
        ctx, constraint, params.max_new_tokens, params.temperature, params.seed
    )
    text = ctx.api.detokenize(ctx.queue, got.tokens)
    if got.complete:
        reason: dict[str, Any] = {"type": "stop", "matched": ctx.eos_ids[0]}
    else:
        reason = {"type": "length", "length": params.max_new_tokens}
    stops = [s for s in params.stops if s]
    cut = min((text.find(s) for s in stops if s in text), default=-1)
    if cut >= 0:
        matched = min((s for s in stops if s in text), key=text.find)
        text, reason = text[:cut], {"type": "stop", "matched": matched}
    return Generation(text, list(got.tokens), reason)


class _AtLeast(StopCondition):
    """``inner``, but never before ``n`` tokens."""

    def __init__(self, n: int, inner: StopCondition) -> None:
        self.n, self.inner = n, inner
        self.tail_tokens = inner.tail_tokens

    def should_stop(self, tokens, text) -> bool:
        return len(tokens) >= self.n and self.inner.should_stop(tokens, text)

    def trim(self, text: str) -> str:
        return self.inner.trim(text)


class _HostSampler:
    """Samples from the top-``HOST_K`` distribution on the host, recording the chosen
    token's log-probability and the alternatives; excludes end tokens before
    ``min_new_tokens``. Greedy at temperature 0; otherwise temperature, top-k, top-p and
    min-p over those ``HOST_K`` tokens (the tail beyond them is not sampled)."""

    on_device = False

    def __init__(self, p: SamplingParams, ends: set[int]) -> None:
        self.p, self.ends = p, ends
        self.rng = random.Random(p.seed)
        self.chosen: list[tuple[float, int]] = []
        self.top: list[list[tuple[float, int]]] = []

    def params(self, step: int) -> dict:  # not used: this sampler is on the host
        raise AssertionError("host sampler")

    def choose(self, ids: list[int], probs: list[float]) -> int:
        p = self.p
        cands = list(zip(ids, probs, strict=True))
        if len(self.chosen) < p.min_new_tokens:
            cands = [c for c in cands if c[0] not in self.ends] or cands
        if p.temperature == 0:
            tok, prob = cands[0]
        else:
            if p.top_k > 0:
                cands = cands[: p.top_k]
            if p.min_p > 0:
                cands = [c for c in cands if c[1] >= p.min_p * cands[0][1]]
            weights = [math.exp(math.log(max(q, 1e-45)) / p.temperature) for _, q in cands]
            if p.top_p < 1:
                total, acc, keep = sum(weights), 0.0, 0
                for w in weights:
                    keep += 1
                    acc += w
                    if acc >= p.top_p * total:
                        break
                cands, weights = cands[:keep], weights[:keep]
            tok, prob = self.rng.choices(cands, weights)[0]
        lp = math.log(prob) if prob > 0 else -math.inf
        self.chosen.append((lp, tok))
        n = p.top_logprobs_num
        self.top.append(
            [
                (math.log(q) if q > 0 else -math.inf, i)
                for i, q in zip(ids[:n], probs[:n], strict=False)
            ]
        )
        return tok


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
