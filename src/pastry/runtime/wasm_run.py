"""Running component and core-module guests on the event loop: sections, wake-ups, ends.

A :class:`Runner` (one per :class:`~pastry.runtime.wasm.WasmSandbox`) drives every bound
guest: a launch binds a guest to its session (:meth:`Runner.bind`) and readies it
(:meth:`Runner.ready`); ready guests are polled in *sections* (:meth:`Runner._section`):
the guests one engine batch or one burst of launches readies, in parallel on
:class:`~pastry.runtime.wasm_pollers.GuestPollers`' threads (Wasmtime runs guest code
without the GIL; each host call takes the host lock while the loop's thread waits), at
most :data:`SECTION_SECONDS` of new polls per section. A guest runs until it blocks in a
blocking import (:mod:`pastry.runtime.wasm_waits`), finishes, or yields at an epoch tick;
a future it waits on readies it again (``Guest.wake``). :meth:`Runner.end` drops a guest
at once (its Store's memory goes back to the system then, not at a garbage collection).
"""

from __future__ import annotations

import asyncio
import contextvars
import ctypes
import functools
import logging
import time

import wasmtime
from wasmtime.component import Component, Linker, Variant

from pastry.control.session import Session
from pastry.runtime import wasm_codec, wasm_core
from pastry.runtime import wasmtime_raw as raw
from pastry.runtime.wasm_host import Guest, SandboxError, SandboxLimits
from pastry.runtime.wasm_pollers import GuestPollers
from pastry.runtime.wasm_waits import STARTED

log = logging.getLogger(__name__)

# A guest runs 1-2 epoch ticks per poll before it yields (so one that has just been
# resumed is not sent to the back of the queue at the very next tick).
SLICE_TICKS = 2
# A polling section takes no new guest after this long: the loop's other callbacks (the
# scheduler, deliveries, I/O) wait at most about this much (plus one guest's slice).
SECTION_SECONDS = 0.005


class Runner:
    """The bound guests of one sandbox and the loop sections that poll them."""

    def __init__(self, pollers: GuestPollers) -> None:
        self.pollers = pollers
        self.pool = None  # the sandbox's GuestPool (set once made: it ends guests here)
        self.guests: dict[int, Guest] = {}  # store context address -> guest
        self.bound: dict[int, Guest] = {}  # instance id -> its running guest
        self._runq: dict[asyncio.AbstractEventLoop, list[Guest]] = {}  # loop -> next section

    def add(self, g: Guest) -> None:
        """Register a guest with a fresh Store (its host calls find it by its context)."""
        g.ctx = raw.context(g.store)
        g.ctx_addr = ctypes.cast(g.ctx, ctypes.c_void_p).value
        self.guests[g.ctx_addr] = g

    def bind(self, g: Guest, session: Session, limits: SandboxLimits) -> None:
        """Give ``g`` to a launch: its session, limits (memory, wall clock) and result."""
        loop = asyncio.get_running_loop()
        limits.apply(session)
        if limits.memory_bytes != g.limits.memory_bytes:
            g.store.set_limits(memory_size=limits.memory_bytes)
        g.id, g.session, g.limits = session.instance, session, limits
        self.bound[g.id] = g
        g.result = loop.create_future()
        g.wake = functools.partial(self._wake, g)
        if g.code is None:  # not the Python runtime: nothing to load, its run is main
            g.stage = STARTED
        if limits.wall_seconds is not None:
            g.wall_end = loop.time() + limits.wall_seconds
            g.deadline = loop.call_at(g.wall_end, self._expire, g)

    def _wake(self, g: Guest, _fut=None) -> None:
        """A future the guest waits on completed (or its timeout passed). The calls of one
        engine batch complete together: the first callback readies the guest, which takes
        them all; the others find nothing new and do not resume it."""
        if g.finished or g.wait_out is None:
            return
        if _fut is None:
            g.wait_done = True
        elif g.waiting is not None:
            pending = g.pending
            if not any(p in pending and pending[p].done() for p in g.waiting):
                return
        self.ready(g)

    def ready(self, g: Guest) -> None:
        """Poll ``g`` in the loop's next section (:meth:`_section`), which runs after the
        callbacks queued so far: the guests that one engine batch (or one burst of
        launches) readies are polled together."""
        if g.scheduled or g.finished:
            return
        g.scheduled = True
        loop = asyncio.get_running_loop()
        batch = self._runq.get(loop)
        if batch is None:
            batch = self._runq[loop] = []
            # (a context of its own: sections run in no inferlet's context, and one Context
            # object cannot be entered by two loops' threads at once)
            loop.call_soon(self._section, loop, context=contextvars.Context())
        batch.append(g)

    def _section(self, loop: asyncio.AbstractEventLoop) -> None:
        """Poll the ready guests once each, for at most :data:`SECTION_SECONDS`: in
        parallel (:class:`GuestPollers`), core-module guests first on this thread (their
        host calls do not take the host lock); then act on what each poll left (ended, over
        its CPU budget, yielded). Those not polled in time lead the next section, after the
        loop's other callbacks (deliveries, the scheduler, I/O)."""
        batch = self._runq.pop(loop, [])
        run = []
        for g in batch:
            g.scheduled = False
            if not g.finished and not g.polling:
                g.polling = True  # from now on _end defers (kill_reason) until it is polled
                run.append(g)
        core = [g for g in run if g.core]
        python = [g for g in run if not g.core] if core else run
        if any(g.slices == 0 for g in python):  # launches: the pool waits for a lull
            self.pool.hold()
        for g in core:
            self._poll_once(g)
        seconds = SECTION_SECONDS
        if python and _shareable(loop):
            rest = self.pollers.run(python, self._poll_once, seconds)
        else:
            rest = GuestPollers.serial(python, self._poll_once, seconds)
        for g in rest:  # not polled: first in the next section
            g.polling = False
            if g.kill_reason is not None:
                self._fail(g, g.kill_reason)
            else:
                self.ready(g)
        if rest:
            skipped = set(map(id, rest))
            run = [g for g in run if id(g) not in skipped]
        for g in run:
            self._after_poll(g)

    def _poll_once(self, g: Guest) -> None:
        """Run ``g`` (``polling`` set) until it blocks, yields at an epoch tick, or ends;
        on any thread (its host calls take the host lock)."""
        raw.set_deadline(g.ctx, SLICE_TICKS)
        t0 = time.thread_time_ns()
        try:
            g.returned = bool(raw.poll(g.future))
        finally:
            g.polling = False
            g.cpu_ns += time.thread_time_ns() - t0
            g.slices += 1

    def _after_poll(self, g: Guest) -> None:
        if g.finished:  # ended meanwhile (by what an earlier guest's outcome did)
            return
        if g.returned:
            self._complete(g)
        elif g.kill_reason is not None:
            self._fail(g, g.kill_reason)
        elif g.cpu_ns > g.limits.cpu_seconds * 1e9:
            self._fail(g, f"CPU budget of {g.limits.cpu_seconds:g} s exceeded")
        elif g.wait_out is None:
            self.ready(g)  # yielded at an epoch tick: let the others run, then go on

    def outcome(self, g: Guest) -> str:
        """The finished call future's outcome (dropping it): the result, or raises."""
        _params, result, err, _func = g.keep[:4]  # (the future is deleted by _free)
        if g.kill_reason is not None:
            raise SandboxError(g.kill_reason)
        if err:
            trap = raw.error(err)
            log.debug("inferlet %d trapped: %s", g.id, trap)
            raise SandboxError(f"the inferlet trapped: {trap_text(trap)}")
        out = g.result_ty(result)
        raw.ffi.wasmtime_component_val_delete(ctypes.byref(result))  # read: ours to free
        tag, payload = (out.tag, out.payload) if isinstance(out, Variant) else ("ok", out)
        if tag != "ok":
            raise SandboxError(payload)
        return payload

    def _complete(self, g: Guest) -> None:
        try:
            result = wasm_core.outcome(g) if g.core else self.outcome(g)
        except SandboxError as e:
            return self._fail(g, str(e))
        self._finish(g, result)

    def _expire(self, g: Guest) -> None:
        g.deadline = None
        if not g.finished:
            self._fail(
                g,
                f"wall-clock limit of {g.limits.wall_seconds:g} s exceeded "
                "(SandboxLimits.wall_seconds)",
            )

    def _fail(self, g: Guest, message: str) -> None:
        self._finish(g, SandboxError(message))

    def _finish(self, g: Guest, outcome) -> None:
        if g.result is not None and not g.result.done():
            if isinstance(outcome, BaseException):
                g.result.set_exception(outcome)
            else:
                g.result.set_result(outcome)
        self.end(g)

    def end(self, g: Guest) -> None:
        """Drop the guest now: its fiber, pending calls, timers and Store (its memory goes
        back to the system here, not at a garbage collection). Idempotent; deferred while
        the guest is being polled."""
        if g.finished:
            return
        if g.polling:
            g.kill_reason = g.kill_reason or "terminated"
            return
        g.finished = True
        for handle in (g.timer, g.deadline):
            if handle is not None:
                handle.cancel()
        g.timer = g.deadline = None
        for fut in g.pending.values():
            if g.wake is not None:
                fut.remove_done_callback(g.wake)
            if not fut.done():
                fut.cancel()
        g.pending.clear()
        g.hooked.clear()
        if g.host_call is not None:
            if g.wake is not None:
                g.host_call.remove_done_callback(g.wake)
            g.host_call.cancel()
            g.host_call = None
        self.guests.pop(g.ctx_addr, None)
        if self.bound.get(g.id) is g:
            del self.bound[g.id]
        if g.result is not None and not g.result.done():
            g.result.set_exception(SandboxError(g.kill_reason or "terminated"))
        future, g.future = g.future, None
        keep, store = g.keep, g.store
        g.keep = []
        g.wait_out = None
        g.wake = None  # no cycle keeps the guest (and its Store) alive
        g.code = g.args = None
        self.pool.retire(functools.partial(_free, future, keep, store, not g.core))


def start_call(
    g: Guest, linker: Linker, component: Component, export: str, values: tuple, lifts: dict
) -> None:
    """Instantiate ``component`` in ``g``'s store and start ``export(*values)`` as
    ``g``'s call future (not polled yet; ``lifts`` caches each export's result lifter)."""
    store = g.store
    instance = instantiate(linker, store, component)
    func = instance.get_func(store, export)
    if func is None:
        raise SandboxError(f"the component does not export `{export}`")
    fty = func.type(store)
    params = (raw.Val * len(values))()
    for i, ((_, t), v) in enumerate(zip(fty.params, values, strict=True)):
        t.convert_to_c(store, v, ctypes.pointer(params[i]))
    result = raw.Val()
    err = raw.ErrorPtr()
    key = (id(component), export)
    g.result_ty = lifts.get(key)
    if g.result_ty is None:
        g.result_ty = lifts[key] = wasm_codec.lifter(fty.result)
    g.keep = [params, result, err, func]
    g.future = raw.ffi.wasmtime_component_func_call_async(
        ctypes.byref(raw.func_ptr(func)), g.ctx, params, len(values), ctypes.byref(result), 1,
        ctypes.byref(err),
    )  # fmt: skip


def instantiate(linker: Linker, store: wasmtime.Store, component: Component):
    """A new instance of ``component`` in ``store`` (instantiation yields only at epochs)."""
    inst = raw.ffi.wasmtime_component_instance_t()
    err = raw.ErrorPtr()
    fut = raw.ffi.wasmtime_component_linker_instantiate_async(
        linker.ptr(), raw.context(store), component.ptr(), ctypes.byref(inst),
        ctypes.byref(err),
    )  # fmt: skip
    try:
        while not raw.poll(fut):
            pass  # epoch yields only
    finally:
        raw.ffi.wasmtime_call_future_delete(fut)
    if err:
        raise SandboxError(f"instantiation failed: {raw.error(err)}")
    return raw.component_instance(inst)


def _free(future, keep: list, store: wasmtime.Store, component: bool) -> None:
    """Delete an ended guest's call future (its fiber), call arguments and Store: its
    memory goes back to the system now (any thread; nothing else refers to them)."""
    if future is not None:
        raw.ffi.wasmtime_call_future_delete(future)
    if keep and component:  # the call's arguments are ours to free
        for v in keep[0]:
            raw.ffi.wasmtime_component_val_delete(ctypes.byref(v))
    store.close()


def trap_text(trap: wasmtime.WasmtimeError) -> str:
    """A trap's cause without Wasmtime's wasm backtrace (kept in the debug log)."""
    text = str(trap)
    if "Caused by:" in text:
        cause = text.split("Caused by:", 1)[1].strip().splitlines()
        return " ".join(line.strip().lstrip("0123456789: ").strip() or line for line in cause)
    return text.splitlines()[0] if text else "unknown trap"


def _shareable(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether helper threads may run host calls for ``loop`` while its thread waits:
    asyncio's own loops, outside debug mode (whose thread checks would refuse them)."""
    return isinstance(loop, asyncio.BaseEventLoop) and not loop.get_debug()
