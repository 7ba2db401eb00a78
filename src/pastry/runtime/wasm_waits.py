"""The blocking imports of a component guest: what suspends its fiber, and what answers it.

A blocking import (``wait``, ``wait-take``, the launcher's ``load-inferlet`` /
``start-inferlet``, and the ``SUSPENDING`` imports of the request table) is an async host
function: :func:`block` answers it now, or leaves the guest's ``wait_out`` set and hooks
the futures it waits on to its ``wake`` callback (:class:`~pastry.runtime.wasm_run.Runner`
then polls the guest again, and Wasmtime calls the continuation, :func:`unblock`, which
writes the answer once it can be given). Both run on the guest's fiber under the host lock
(:mod:`pastry.runtime.wasm_callbacks`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from wasmtime.component import Variant

from pastry.api import ApiError
from pastry.runtime.wasm_host import Guest, Kill, call_host, error_text
from pastry.runtime.wasm_imports import outcome

BLOCKING = ("wait", "wait-take")
# The launcher's blocking imports, in the order the runtime calls them (Guest.stage).
LAUNCH_STAGES = {"load-inferlet": 0, "start-inferlet": 1}
STARTED = 2  # the stage once start-inferlet is answered: main() runs


@dataclass
class Sig:
    """One import's compiled value conversions (built at its first call)."""

    name: str
    handler: Callable | None  # HOST entry (None: a blocking import)
    api: bool  # an inferlet API import (it needs a bound session)
    params: list[Callable]
    result: Callable | None  # write(ok, value, val); None: the import returns nothing
    fallible: bool  # returns result<_, string>: errors go to the guest as err


def block(g: Guest, sig: Sig, results, *args) -> bool:
    """A blocking import was called: answer now (False) or suspend the fiber until
    :func:`unblock` can (True)."""
    if sig.handler is not None:
        return _suspend(g, sig, results, args)
    if sig.name in LAUNCH_STAGES:
        stage = LAUNCH_STAGES[sig.name]
        if g.stage != stage:
            raise Kill(f"launcher.{sig.name} out of order: only the runtime calls it, once")
        g.stage = stage + 1
        g.wait_out = (results, sig)
        g.parked = _complete_wait(g)
        return g.parked
    g.wait_out = (results, sig)
    if sig.name == "wait":
        pids, timeout_ns = args
        for pid in pids:
            if pid not in g.pending:
                g.wait_out = None
                raise ApiError(f"pending call {pid} does not exist in this inferlet")
        g.waiting = list(pids)
    else:  # wait-take: every pending call of the instance
        (timeout_ns,) = args
        g.waiting = list(g.pending)
    g.wait_done = timeout_ns == 0 or (not g.waiting and timeout_ns is None)
    if not _complete_wait(g):
        return False
    if g.session is None:  # loaded ahead on the pool's thread: no timers there
        g.wait_out = None
        raise Kill("the inferlet's module waits while it loads: it is loaded at launch")
    if not g.waiting and timeout_ns is not None and g.wall_end:
        loop = asyncio.get_running_loop()
        if loop.time() + timeout_ns / 1e9 > g.wall_end:
            g.wait_out = None
            raise Kill(
                f"sleeping {timeout_ns / 1e9:g} s would go past the wall-clock limit of "
                f"{g.limits.wall_seconds:g} s (SandboxLimits.wall_seconds)"
            )
    for pid in g.waiting:
        if pid not in g.hooked:
            g.hooked.add(pid)
            g.pending[pid].add_done_callback(g.wake)
    if timeout_ns is not None:
        g.timer = asyncio.get_running_loop().call_later(timeout_ns / 1e9, g.wake, None)
    return True


def _suspend(g: Guest, sig: Sig, results, args: tuple) -> bool:
    """A ``SUSPENDING`` import: its handler's value or error is the answer now (False),
    or it returned a future, which the fiber waits for (True)."""
    assert sig.fallible, f"{sig.name}: a suspending import returns result<_, string>"
    try:
        if g.stage < STARTED:
            raise ApiError(
                f"{sig.name}: the inferlet API is available from main(), not while the "
                "inferlet's module loads"
            )
        out = call_host(sig.handler, g, *args)
    except Kill:
        raise
    except Exception as e:
        sig.result(False, error_text(e, sig.name), results[0])
        return False
    if not isinstance(out, asyncio.Future):
        sig.result(True, out, results[0])
        return False
    g.host_call = out
    g.wait_out = (results, sig)
    out.add_done_callback(g.wake)
    return True


def unblock(g: Guest) -> bool:
    """The continuation of a suspended blocking import: False while it must wait."""
    return not _complete_wait(g)


def _complete_wait(g: Guest) -> bool:
    """Write the blocked import's result if it can be answered now; True if it must
    wait instead."""
    results, sig = g.wait_out
    ok = True
    if sig.handler is not None:  # a SUSPENDING import
        fut = g.host_call
        if not fut.done():
            return True
        g.host_call = None
        if fut.cancelled():
            ok, value = False, f"{sig.name} was cancelled"
        elif fut.exception() is not None:
            ok, value = False, error_text(fut.exception(), sig.name)
        else:
            value = fut.result()
    elif sig.name == "load-inferlet":
        if g.code is None:
            return True
        value = (g.code.name, g.code.code)
    elif sig.name == "start-inferlet":
        if g.args is None:
            return True
        value = g.args
    else:
        pending = g.pending
        ready = [p for p in g.waiting if p in pending and pending[p].done()]
        if not ready and not g.wait_done:
            return True
        if sig.name == "wait":
            value = ready
        else:
            value = []
            for pid in ready:
                ok, v = outcome(g, pid, pending[pid])
                value.append((pid, Variant("ok" if ok else "err", v)))
    g.waiting = g.wait_out = None
    g.wait_done = g.parked = False
    if g.timer is not None:
        g.timer.cancel()
        g.timer = None
    sig.result(ok, value, results[0])
    return False
