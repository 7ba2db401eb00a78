"""How a token is chosen: the one :class:`Sampling` record of every call that samples.

``sample``, ``step`` and ``get_next_dist`` take ``sampling`` (``None``: greedy, no logit
processing: the fast path) or the record's fields as keywords
(``sample(q, e, temperature=0.7, seed=1)``). A new option is a new field here, its check
in :meth:`Sampling.check`, and its implementation on the engine
(:mod:`pastry.engine.logits`); the WIT record, the guest binding and the host's dispatch
follow from the field (``docs/api.md``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from pastry.api.errors import ApiError
from pastry.api.table import record
from pastry.api.types import I64, Bitmask, Count, Float32, Handle, Token

MAX_LOGPROBS = 20  # the most top log-probabilities a call may ask for (OpenAI's limit)


@record("sampling")
@dataclass(slots=True, eq=True)
class Sampling:
    """Sampling and logit processing (vLLM's semantics), applied on the device.

    Logit processing first, in this order: ``mask``, the allowed tokens as a packed bitmask
    (bit ``t % 32`` of little-endian 32-bit word ``t // 32``: what llguidance's
    ``compute_bitmask()`` returns; at least ``(vocab_size + 31) // 32`` words, bits past the
    vocabulary ignored); ``logit_bias``, ``(token, bias)`` pairs added to the logits;
    penalties over a token history: a token in ``penalty_tokens`` (the generated ones) or
    ``penalty_prompt`` has its logit divided by ``repetition_penalty`` if positive,
    multiplied if negative; then ``frequency_penalty`` times its count in
    ``penalty_tokens`` and ``presence_penalty`` once if it occurs there are subtracted.
    Then ``temperature`` (0: greedy) and the top-k / top-p / min-p filters (0 / 1.0 / 0.0
    disable them); with a ``seed`` the draw is a pure function of (seed, logits).

    ``logprobs``: None returns the token id; ``n`` (0 to 20) returns ``(token, logprob,
    top_ids, top_logprobs)`` under the model's raw distribution (before any processing).

    ``constraint`` (a handle of ``create_constraint``): only the tokens its grammar allows
    next can be sampled (its mask, taken when the call is made, is combined with ``mask``),
    and the grammar advances with the sampled token when the call completes. One call at
    a time per constraint.

    ``get_next_dist`` applies the logit processing only (the distribution is the softmax
    of the processed logits); the other fields are refused there.
    """

    temperature: float = 0.0
    top_k: Count = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: I64 | None = None
    mask: Bitmask | None = None
    logit_bias: Sequence[tuple[Token, Float32]] = ()
    penalty_tokens: Sequence[Token] = ()
    penalty_prompt: Sequence[Token] = ()
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logprobs: Count | None = None
    constraint: Handle | None = None

    @property
    def processes(self) -> bool:
        """Whether it changes the logits (mask, bias or a penalty)."""
        return (
            self.mask is not None
            or bool(self.logit_bias)
            or bool(self.penalty_tokens)
            or bool(self.penalty_prompt)
            or self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )

    def check(self, vocab_size: int, *, distribution: bool = False) -> None:
        """Raise :class:`ApiError` naming the first bad field and what it takes.
        ``distribution``: for ``get_next_dist``, which takes the logit processing only."""
        if distribution:
            for name in _SAMPLING_ONLY:
                if getattr(self, name) != _DEFAULTS[name]:
                    raise ApiError(
                        f"get_next_dist applies the logit processing only: {name} is for "
                        "sample and step (leave it unset)"
                    )
        _number(self.temperature, "temperature", lo=0.0)
        _integer(self.top_k, "top_k", 0, 2**31 - 1)
        _number(self.top_p, "top_p", lo=0.0, hi=1.0, lo_open=True)
        _number(self.min_p, "min_p", lo=0.0, hi=1.0)
        if self.seed is not None:
            _integer(self.seed, "seed", -(2**63), 2**63 - 1)
        if self.mask is not None:
            want = 4 * ((vocab_size + 31) // 32)
            mask = self.mask
            if not isinstance(mask, bytes | bytearray | memoryview):
                raise ApiError(f"mask must be bytes (a packed bitmask), got {type(mask).__name__}")
            if len(mask) < want or len(mask) % 4:
                raise ApiError(
                    f"mask must be at least {want} bytes of whole 32-bit words (one bit per "
                    f"token of the {vocab_size} output rows), got {len(mask)}"
                )
        if self.logit_bias:
            try:
                pairs = [(t, float(b)) for t, b in self.logit_bias]
            except (TypeError, ValueError):
                raise ApiError("logit_bias must be a list of (token id, bias) pairs") from None
            _tokens([t for t, _ in pairs], "logit_bias token", vocab_size)
            if any(math.isnan(b) or b == math.inf for _, b in pairs):
                raise ApiError("logit_bias values must be numbers, not NaN or +inf")
        _tokens(self.penalty_tokens, "penalty_tokens", vocab_size)
        _tokens(self.penalty_prompt, "penalty_prompt", vocab_size)
        _number(self.repetition_penalty, "repetition_penalty", lo=0.0, lo_open=True)
        _number(self.frequency_penalty, "frequency_penalty")
        _number(self.presence_penalty, "presence_penalty")
        if self.logprobs is not None:
            _integer(self.logprobs, "logprobs", 0, MAX_LOGPROBS)
        if self.constraint is not None:
            _integer(self.constraint, "constraint", 0, 2**32 - 1)


_DEFAULTS = {f.name: f.default for f in fields(Sampling)}
_SAMPLING_ONLY = ("temperature", "top_k", "top_p", "min_p", "seed", "logprobs", "constraint")
FIELDS: tuple[str, ...] = tuple(_DEFAULTS)


def sampling_of(sampling: Sampling | None, options: Mapping[str, Any]) -> Sampling | None:
    """The record a call asks for: ``sampling``, or one made of keyword ``options`` (its
    fields); ``None`` when neither says anything (greedy, no processing)."""
    if not options:
        if sampling is None or type(sampling) is Sampling:
            return sampling
        raise ApiError(f"sampling must be a Sampling record or None, got {sampling!r}")
    if sampling is not None:
        raise ApiError("pass either sampling=Sampling(...) or its fields as keywords, not both")
    try:
        return Sampling(**options)
    except TypeError:
        bad = sorted(set(options) - set(FIELDS))
        raise ApiError(
            f"unknown sampling option {', '.join(bad)} (the fields of Sampling: "
            f"{', '.join(FIELDS)})"
        ) from None


def _number(v: object, name: str, lo=None, hi=None, lo_open=False) -> None:
    ok = isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    if ok and lo is not None:
        ok = v > lo if lo_open else v >= lo
    if ok and hi is not None:
        ok = v <= hi
    if not ok:
        where = ""
        if lo is not None or hi is not None:
            a = "-inf" if lo is None else f"{lo:g}"
            b = "inf" if hi is None else f"{hi:g}"
            where = f" in {'(' if lo_open or lo is None else '['}{a}, {b}{']' if hi is not None else ')'}"
        raise ApiError(f"{name} must be a finite number{where}, got {v!r}")


def _integer(v: object, name: str, lo: int, hi: int) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise ApiError(f"{name} must be an integer from {lo} to {hi}, got {v!r}")


def _tokens(values: Sequence[Any] | None, name: str, vocab_size: int) -> None:
    for t in values or ():  # (None: none, as an unset list)
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
            raise ApiError(
                f"{name} has token id {t!r}, outside the vocabulary (0 to {vocab_size - 1})"
            )
