"""The host side of a component guest's ``api`` imports, derived from the request table.

Every request kind of :data:`pastry.api.SPECS` is the WIT import of the same name
(``wit/pastry.wit`` is generated from the same table): its handler here builds the request
record from the lifted arguments (:mod:`pastry.runtime.wasm_codec` gives Python values; a
``sampling`` record arrives as a tuple of its fields) and answers it with the instance's
session (``session.call``), exactly as a trusted inferlet's call is answered. A queued
request's future is tracked as a ``pending`` handle, whose outcome ``take`` returns as the
``value`` case the table names for that request.

:data:`OVERRIDES` are the sandbox's own policies on a few imports (message sizes, long
texts tokenized off the event loop), wrapped around the derived handler. The blocking
imports (``wait``, ``wait-take``; the launcher's) are the callbacks' own
(:mod:`pastry.runtime.wasm`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import numpy as np
from wasmtime.component import Variant

from pastry import api
from pastry.api import SPECS, ApiError, Sampling, Spec
from pastry.runtime.wasm_host import Guest, check_message, error_text, send

TOKENIZE_ON_LOOP_CHARS = 4096  # a guest's shorter texts are tokenized in the call

_NONE = Variant("none")


# ---------------------------------------------------------------------------- arguments


def _sampling(fields: tuple | None) -> Sampling | None:
    """The record of a WIT ``option<sampling>`` (its fields as lifted, in order)."""
    if fields is None:
        return None
    s = Sampling(*fields)
    if s.mask is not None:  # WIT words -> the API's bytes
        s.mask = np.asarray(s.mask, dtype="<u4").tobytes()
    return s


def _lifter(tree: Any) -> Callable[[Any], Any] | None:
    """The field value of a lifted WIT value of ``tree`` (None: the value itself)."""
    if tree == ("option", ("record", "sampling")):
        return _sampling
    return None


# ---------------------------------------------------------------------------- answers


def value_of(spec: Spec) -> Callable[[Any], Variant]:
    """The ``value`` case of a queued request's result (the table's ``queued`` cases)."""
    cases = spec.queued
    if cases == ("none",):
        return lambda r: _NONE
    if cases == ("token", "sampled"):
        return lambda r: Variant("token", r) if type(r) is int else Variant("sampled", tuple(r))
    if cases == ("none", "logprobs"):
        return lambda r: _NONE if r is None else Variant("logprobs", tuple(r))
    (case,) = cases
    if api.VALUES[case][0] in ("u32", "string"):
        return lambda r: Variant(case, r)
    return lambda r: Variant(case, tuple(r))


def _answer(spec: Spec) -> Callable[[Any], Any] | None:
    """The WIT form of an immediate result (None: the result itself)."""
    if spec.now_tree == "bitmask":
        return lambda b: np.frombuffer(b, dtype="<u4").tolist()
    return None


def handler(spec: Spec) -> Callable:
    """``handler(guest, *lifted_args)``: the answer of the import of ``spec``."""
    cls, lifts, answer = spec.cls, [_lifter(p.tree) for p in spec.params], _answer(spec)
    value = value_of(spec) if spec.queued else None
    convert = any(f is not None for f in lifts)

    def record(args: tuple) -> Any:
        if convert:
            args = tuple(a if f is None else f(a) for f, a in zip(lifts, args, strict=True))
        return cls(*args)

    if spec.queued and spec.now is not None:  # prefill: (handles now, pending)

        def both(g: Guest, *args):
            now, fut = g.session.call(record(args))
            return now, g.track(fut, value)

        return both
    if spec.queued:
        return lambda g, *args: g.track(g.session.call(record(args)), value)
    if answer is not None:
        return lambda g, *args: answer(g.session.call(record(args)))
    return lambda g, *args: g.session.call(record(args))


# ---------------------------------------------------------------------------- the pending table


def outcome(g: Guest, pid: int, fut: asyncio.Future) -> tuple[bool, Any]:
    """(ok, value case or error message) of a completed call; its handle is freed."""
    g.pending.pop(pid, None)
    g.hooked.discard(pid)
    value = g.values.pop(pid, None)
    if fut.cancelled():
        return False, f"pending call {pid} was cancelled"
    e = fut.exception()
    if e is not None:
        return False, error_text(e, "the call")
    return True, value(fut.result()) if value is not None else _NONE


def take(g: Guest, pid: int) -> Variant:
    fut = g.pending.get(pid)
    if fut is None:
        raise ApiError(f"pending call {pid} does not exist in this inferlet")
    if not fut.done():
        raise ApiError(f"pending call {pid} has not completed (wait for it first)")
    ok, value = outcome(g, pid, fut)
    if not ok:
        raise ApiError(value)
    return value


# ---------------------------------------------------------------------------- the sandbox's policies


def _messages(h: Callable, *positions: int) -> Callable:
    """``h`` after checking the size of the string arguments at ``positions``."""

    def checked(g: Guest, *args):
        check_message(g, *(args[i] for i in positions))
        return h(g, *args)

    return checked


def _tokenize(g: Guest, q: int, text: str, special: bool = False):
    """A short text is tokenized in the call; a long one in the model's tokenizing thread
    while the guest's fiber waits (``SUSPENDING``): an inferlet that tokenizes megabytes
    stalls only itself, not the event loop."""
    if len(text) < TOKENIZE_ON_LOOP_CHARS:
        return g.session.call(api.Tokenize(q, text, special))
    return asyncio.ensure_future(g.session.tokenize_async(q, text, special))


DERIVED: dict[str, Callable] = {spec.wit: handler(spec) for spec in SPECS.values()}
OVERRIDES: dict[str, Callable] = {
    "send": send,
    "broadcast": _messages(DERIVED["broadcast"], 0, 1),
    "store-set": _messages(DERIVED["store-set"], 0, 1),
    "tokenize": _tokenize,
}
# name -> handler(guest, *args) returning the import's result (errors: ApiError).
HOST: dict[str, Callable] = {"take": take, **DERIVED, **OVERRIDES}
# HOST imports whose handler may return an asyncio.Future instead of the value: defined as
# async host functions, the guest's fiber suspended until the future completes.
SUSPENDING = frozenset({"tokenize"})
