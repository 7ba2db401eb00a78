"""A request's :class:`~pastry.api.Sampling`, checked once and turned into engine fields.

:func:`sample_spec` is the boundary where a sampling record enters the control layer: it
checks every field (:meth:`pastry.api.Sampling.check`, errors naming the field and what it
takes), resolves the grammar constraint of ``constraint`` and builds what the engine's
``Sample`` / ``NextDist`` calls take (:mod:`pastry.wire.calls`): the scalar parameters,
and the logit processing as int64 / float32 / int32 arrays. Ops keep the resulting
:class:`SampleSpec` and build their calls from it per batch; ``None`` (no sampling record)
is greedy with no processing, the fast path that builds nothing.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pastry.api import ApiError, Sampling
from pastry.control.constraints import HostConstraint
from pastry.wire.calls import Sampled, ids


class SampleSpec:
    """The engine form of a checked sampling record: ``params`` (temperature, top_k,
    top_p, min_p, seed; None: the defaults), ``proc`` (the logit processing fields that are
    set, by name), the constraint's ``grammar`` and whether ``logprobs`` were asked."""

    __slots__ = ("grammar", "logprobs", "params", "proc")

    def __init__(self, params: tuple | None, proc: dict, grammar, logprobs: bool) -> None:
        self.params, self.proc, self.grammar, self.logprobs = params, proc, grammar, logprobs

    def finish(self, r: Any) -> Any:
        """The caller's value from the engine's result: the grammar advances with the token;
        with logprobs, a ``(token, logprob, top_ids, top_logprobs)`` tuple."""
        grammar = self.grammar
        if grammar is not None:
            grammar.busy = False
            grammar.advance(r if type(r) is int else r.token)
        if self.logprobs:
            return _sampled(r)
        return r


def _sampled(r: Sampled) -> tuple[int, float, list[int], list[float]]:
    return r.token, r.logprob, r.top_ids.tolist(), r.top_logprobs.tolist()


def sample_spec(
    sampling: Sampling | None,
    vocab_size: int,
    constraints: dict[int, HostConstraint],
    *,
    distribution: bool = False,
) -> SampleSpec | None:
    """Check ``sampling`` against a model of ``vocab_size`` output rows and build its engine
    form (None for None). ``constraints``: the instance's grammar constraints by handle;
    ``distribution``: for ``get_next_dist`` (logit processing only)."""
    if sampling is None:
        return None
    sampling.check(vocab_size, distribution=distribution)
    proc: dict[str, Any] = {}
    if sampling.processes:
        _processing(sampling, proc, vocab_size)
    logprobs = sampling.logprobs is not None
    if logprobs:
        proc["logprobs"] = int(sampling.logprobs)
    grammar = None
    if sampling.constraint is not None:
        grammar = _grammar(sampling.constraint, constraints, vocab_size)
        words = grammar.mask()
        proc["mask"] = words & proc["mask"] if "mask" in proc else words
    s = sampling
    params = (float(s.temperature), int(s.top_k), float(s.top_p), float(s.min_p), s.seed)
    if params == _DEFAULT_PARAMS and s.seed is None:
        params = None
    if params is None and not proc and grammar is None:
        return None
    return SampleSpec(params, proc, grammar, logprobs)


_DEFAULT_PARAMS = (0.0, 0, 1.0, 0.0, None)


def _processing(s: Sampling, proc: dict, vocab: int) -> None:
    if s.mask is not None:
        want = 4 * ((vocab + 31) // 32)  # llguidance may hand over a word more: moot bits
        proc["mask"] = np.frombuffer(bytes(s.mask[:want]), dtype="<i4").astype(np.int32)
    if s.logit_bias:
        proc["bias_ids"] = ids([int(t) for t, _ in s.logit_bias])
        proc["bias_values"] = np.array([float(b) for _, b in s.logit_bias], dtype=np.float32)
    if s.penalty_tokens:
        proc["penalty_tokens"] = ids(list(s.penalty_tokens))
    if s.penalty_prompt:
        proc["penalty_prompt"] = ids(list(s.penalty_prompt))
    for name, off in (
        ("repetition_penalty", 1.0),
        ("frequency_penalty", 0.0),
        ("presence_penalty", 0.0),
    ):
        value = getattr(s, name)
        if value != off:
            proc[name] = float(value)


def _grammar(c: int, constraints: dict[int, HostConstraint], vocab: int) -> HostConstraint:
    grammar = constraints.get(c)
    if grammar is None:
        raise ApiError(
            f"constraint {c} does not exist in this inferlet (create one with "
            "create_constraint; a freed one is gone)"
        )
    if grammar.rows != vocab:
        raise ApiError(f"constraint {c} was made for another model")
    if grammar.busy:
        raise ApiError(
            f"constraint {c} is already used by a sample in flight; await it first (the "
            "grammar advances with its token)"
        )
    return grammar


class Release:
    """A done-callback that frees a grammar for its next sample, whatever the outcome of
    the one in flight (a call object, not a closure: it is a value like the op)."""

    __slots__ = ("grammar",)

    def __init__(self, grammar: HostConstraint) -> None:
        self.grammar = grammar

    def __call__(self, _fut: object) -> None:
        self.grammar.busy = False
