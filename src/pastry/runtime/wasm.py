"""The sandboxed runner: inferlets as WebAssembly components on Wasmtime fibers.

A sandboxed program is Python source like a trusted one (``async def main(args)``), but
the host never executes it, nor even parses it: the generic Python runtime component
("pyrt", :mod:`pastry.runtime.build_pyrt`) compiles it in an instance of its own
(``compile-source``; :func:`sandboxed_program`, or :func:`sandboxed_program_async` off the
event loop), and each launch runs the compiled code in a fresh instance, with
``pastry.sdk`` bound to the component's imports (``wit/pastry.wit``). The host side of
every import is the instance's :class:`~pastry.control.session.Session`, the same object
trusted inferlets call, so sandboxed and trusted inferlets share the batch scheduler and
batch together.

How it is driven (one asyncio loop, no thread per guest; guests are polled on the loop's
thread and a few helpers, :mod:`pastry.runtime.wasm_pollers`):

- One :class:`WasmSandbox` per process: one Engine (epoch interruption; an epoch ticker
  thread), one component Linker, the compiled pyrt component, and a :class:`GuestPool` of
  pre-started instances (made on a background thread, each parked in ``load-inferlet``,
  or loaded with a recently launched program and parked in ``start-inferlet``):
  a launch binds one to its session and resumes it, so N simultaneous launches do not
  queue behind N instantiations.
- :func:`sandboxed_program` returns a :class:`~pastry.runtime.trusted.Program` whose
  ``main`` runs the guest, so :class:`~pastry.runtime.trusted.TrustedRuntime` launches,
  terminates and reports sandboxed instances exactly like trusted ones.
- The guest runs as a Wasmtime *call future* (a fiber). The loop polls it; it runs until
  it blocks in a blocking import (``wait``, ``wait-take``, the launcher's), finishes,
  or yields at an epoch tick. Other imports are synchronous host functions: they convert
  values (:mod:`pastry.runtime.wasm_codec`), call the Session and return (queued calls
  return a ``pending`` handle at once). A blocking import suspends the fiber until one of
  its futures completes (or the host's timer fires: ``time.sleep`` and ``asyncio.sleep``
  in the guest wait here); that future's done-callback readies the guest again.
- Ready guests are polled in *sections* (:meth:`WasmSandbox._section`): the guests one
  engine batch or one burst of launches readies, in parallel on :class:`GuestPollers`'
  threads (Wasmtime runs guest code without the GIL), each host call under
  ``host_lock`` while the loop's thread waits, so host code still runs one call at a
  time, as the loop's own; at most ``SECTION_SECONDS`` of new polls per section.
- WASI's own clock waits are refused (the guest traps): Wasmtime would block the whole
  thread in them, and with it the server.
- Limits per instance (:class:`SandboxLimits`): linear memory (store limits), CPU (thread
  time spent polling the guest, checked after every slice of at most one epoch tick),
  wall-clock lifetime (a host timer), message size, and KV pages and embeddings held (set
  on the instance's resource managers at launch). Over a limit, the instance ends with an
  error naming it; the others go on. When an instance ends, its Store is closed at once
  (its memory is returned then, not at the next garbage collection).
- What component and core-module guests share (the Engine, limits, guest state, checks
  inside host calls) is :mod:`pastry.runtime.wasm_host`; core modules' Linker is
  :mod:`pastry.runtime.wasm_core`.

Pitfalls handled here (see ``docs/sandbox.md``): the ctypes binding of
``wasmtime_context_epoch_deadline_async_yield_and_update`` declares a result the library
does not return (restype fixed to None, or reading it segfaults); a finished call future
is never polled again; every callback catches everything and reports through its error
result; an async callback always fills its continuation; a result value is never left
half-written (:mod:`pastry.runtime.wasm_codec`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import ctypes
import functools
import hashlib
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import wasmtime
from wasmtime import _bindings
from wasmtime import _ffi as ffi
from wasmtime.component import Component, Linker
from wasmtime.component import _types as ctypes_

from pastry.api import ApiError
from pastry.control.session import Session
from pastry.runtime import build_pyrt, wasm_codec, wasm_core
from pastry.runtime.trusted import Program, ProgramError
from pastry.runtime.wasm_host import (
    Guest,
    Kill,
    SandboxError,
    SandboxLimits,
    call_host,
    engine,
    error_text,
)
from pastry.runtime.wasm_imports import HOST, SUSPENDING, outcome
from pastry.runtime.wasm_memory import MemoryMap
from pastry.runtime.wasm_pollers import DEFAULT_THREADS, GuestPollers
from pastry.runtime.wasm_pool import GuestPool

log = logging.getLogger(__name__)

# wasmtime-py 50 declares this as returning wasmtime_error_t*, the library returns void:
# reading the garbage "error" segfaults.
_bindings._wasmtime_context_epoch_deadline_async_yield_and_update.restype = None

API = "pastry:inferlet/api@0.1.0"
LAUNCHER = "pastry:inferlet/launcher@0.1.0"
WASI_CLOCK = "wasi:clocks/monotonic-clock"
POOL_SIZE = 64  # pre-started Python guests kept ready (WasmSandbox(pool_size=...))
# A guest runs 1-2 epoch ticks per poll before it yields (so one that has just been
# resumed is not sent to the back of the queue at the very next tick).
SLICE_TICKS = 2
# A polling section takes no new guest after this long: the loop's other callbacks (the
# scheduler, deliveries, I/O) wait at most about this much (plus one guest's slice).
SECTION_SECONDS = 0.005


# ---------------------------------------------------------------------------- host imports
# The api imports (HOST, derived from the request table) are pastry.runtime.wasm_imports';
# the blocking ones (``wait``, ``wait-take``; the launcher's load/start) are the callbacks'
# own: they suspend the fiber.

BLOCKING = ("wait", "wait-take")
# The launcher's blocking imports, in the order the runtime calls them (Guest.stage).
LAUNCH_STAGES = {"load-inferlet": 0, "start-inferlet": 1}
STARTED = 2  # the stage once start-inferlet is answered: main() runs


def _memory_probe(g: Guest, offset: int, marker: bytes) -> None:
    if g.probe is None:  # the runtime's call, before the inferlet runs; later ones are ignored
        g.probe = (offset, bytes(marker))


LAUNCHER_IMPORTS: dict[str, Callable] = {
    "inferlet-source": lambda g: g.source or "",
    "memory-probe": _memory_probe,
}


# ---------------------------------------------------------------------------- ctypes glue

# The C callback types, with the context and function type as plain addresses (ctypes then
# passes an int instead of building a pointer object on every call); cast to Wasmtime's
# declared types when registered.
_SyncFn = ctypes.CFUNCTYPE(
    ctypes.c_size_t, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_size_t,
    ctypes.POINTER(ffi.wasmtime_component_val_t), ctypes.c_size_t,
    ctypes.POINTER(ffi.wasmtime_component_val_t), ctypes.c_size_t,
)  # fmt: skip
_AsyncFn = ctypes.CFUNCTYPE(
    None, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_size_t,
    ctypes.POINTER(ffi.wasmtime_component_val_t), ctypes.c_size_t,
    ctypes.POINTER(ffi.wasmtime_component_val_t), ctypes.c_size_t,
    ctypes.POINTER(ctypes.POINTER(ffi.wasmtime_error_t)),
    ctypes.POINTER(ffi.wasmtime_async_continuation_t),
)  # fmt: skip


@dataclass
class _Sig:
    """One import's compiled value conversions (built at its first call)."""

    name: str
    handler: Callable | None  # HOST entry (None: a blocking import)
    api: bool  # an inferlet API import (it needs a bound session)
    params: list[Callable]
    result: Callable | None  # write(ok, value, val); None: the import returns nothing
    fallible: bool  # returns result<_, string>: errors go to the guest as err


class _Callbacks:
    """The ctypes callbacks shared by every guest (they outlive them)."""

    def __init__(self, sandbox: WasmSandbox) -> None:
        self.sandbox = sandbox
        self.guests = sandbox._guests
        self.lock = sandbox.host_lock
        self.names: list[tuple[str, dict | None]] = [("", None)]  # index 0: a NULL env
        self.sigs: dict[int, _Sig] = {}
        self.sync = _SyncFn(self._sync_call)
        self.async_ = _AsyncFn(self._async_call)
        self.deny = _SyncFn(self._deny)
        self.done = ffi.wasmtime_func_async_continuation_callback_t(lambda env: True)
        self.resume = ffi.wasmtime_func_async_continuation_callback_t(self._resume)
        self.noop = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(lambda env: None)

    def define(self, inst, name: str, table: dict | None, blocking: bool) -> None:
        """Add import ``name`` (its handler in ``table``) to linker instance ``inst``."""
        self.names.append((name, table))
        b = name.encode()
        add = (
            ffi.wasmtime_component_linker_instance_add_func_async
            if blocking
            else ffi.wasmtime_component_linker_instance_add_func
        )
        cb = ctypes.cast(
            self.async_ if blocking else self.sync,
            ffi.wasmtime_component_func_async_callback_t
            if blocking
            else ffi.wasmtime_component_func_callback_t,
        )
        err = add(inst.ptr(), ctypes.create_string_buffer(b), len(b), cb, len(self.names) - 1,
                  self.noop)  # fmt: skip
        if err:
            raise wasmtime.WasmtimeError._from_ptr(err)

    def _sig(self, idx: int, ty: int) -> _Sig:
        sig = self.sigs.get(idx)
        if sig is None:
            name, table = self.names[idx]
            fty = ctypes_.FuncType._from_ptr(
                ctypes.cast(ty, ctypes.POINTER(ffi.wasmtime_component_func_type_t)), owner=self
            )
            rty = fty.result
            fallible = isinstance(rty, ctypes_.ResultType)
            if rty is None:
                write = None
            elif fallible:
                write = wasm_codec.result_writer(rty)
            else:
                low = wasm_codec.lowerer(rty)

                def write(ok, value, val, low=low):
                    low(value, val)

            sig = self.sigs[idx] = _Sig(
                name,
                None if table is None else table[name],
                table is HOST,
                [wasm_codec.lifter(t) for _, t in fty.params],
                write,
                fallible,
            )
        return sig

    def _fail(self, g: Guest | None, name: str, e: BaseException) -> int:
        """The error pointer a callback returns for ``e`` (the guest traps)."""
        msg = error_text(e, name)
        if g is not None and isinstance(e, Kill):
            g.kill_reason = str(e)
        err = ffi.wasmtime_error_new(msg.encode("utf-8", "replace"))
        return ctypes.cast(err, ctypes.c_void_p).value or 0

    def _sync_call(self, env, context, ty, args, nargs, results, nresults) -> int:
        # Runs on the guest's fiber, on whichever thread polls it. Never raises: a failure
        # becomes a trap.
        with self.lock:
            return self._sync(env, context, ty, args, results)

    def _sync(self, env, context, ty, args, results) -> int:
        g = None
        sig = None
        try:
            sig = self.sigs.get(env) or self._sig(env, ty)
            g = self.guests.get(context)
            if g is None:
                raise RuntimeError(f"host import {sig.name} called by an unknown store")
            pyargs = [lift(args[i]) for i, lift in enumerate(sig.params)]
            try:
                if sig.api and g.stage < STARTED:  # the warm-up's calls; the module's
                    raise ApiError(
                        f"{sig.name}: the inferlet API is available from main(), not while "
                        "the inferlet's module loads"
                    )
                value, ok = call_host(sig.handler, g, *pyargs), True
            except Kill:
                raise
            except Exception as e:
                if not sig.fallible:
                    raise
                value, ok = error_text(e, sig.name), False
            if sig.result is not None:
                sig.result(ok, value, results[0])
            return 0
        except BaseException as e:
            return self._fail(g, sig.name if sig else "a host import", e)

    def _deny(self, env, context, ty, args, nargs, results, nresults) -> int:
        name, _ = self.names[env]
        e = Kill(
            f"the inferlet called WASI's {name}: blocking waits outside time.sleep and "
            "asyncio.sleep are not available in the sandbox (they would stop the server)"
        )
        with self.lock:
            return self._fail(self.guests.get(context), name, e)

    def _async_call(self, env, context, ty, args, nargs, results, nresults, err_ret, cont):
        # Runs on the guest's fiber, on whichever thread polls it. Never raises; always
        # fills the continuation.
        with self.lock:
            self._async(env, context, ty, args, results, err_ret, cont)

    def _async(self, env, context, ty, args, results, err_ret, cont) -> None:
        c = cont.contents
        c.callback = self.done
        c.env = None
        c.finalizer = self.noop
        g = None
        sig = None
        try:
            sig = self.sigs.get(env) or self._sig(env, ty)
            g = self.guests.get(context)
            if g is None:
                raise RuntimeError(f"host import {sig.name} called by an unknown store")
            pyargs = [lift(args[i]) for i, lift in enumerate(sig.params)]
            if self.sandbox._block(g, sig, results, *pyargs):
                c.callback = self.resume
                c.env = context
        except BaseException as e:
            err_ret[0] = ctypes.cast(
                self._fail(g, sig.name if sig else "a host import", e),
                ctypes.POINTER(ffi.wasmtime_error_t),
            )

    def _resume(self, env) -> bool:
        # Polled (on the fiber) each time a guest blocked in an import is polled.
        with self.lock:
            try:
                g = self.guests.get(env or 0)
                if g is None or g.wait_out is None:
                    return True
                return self.sandbox._unblock(g)
            except BaseException:
                log.exception("sandbox: resuming a guest failed")
                return True  # the unwritten result makes the call fail: a trap, not a crash


# ---------------------------------------------------------------------------- the sandbox

Val = ffi.wasmtime_component_val_t
_poll = _bindings._wasmtime_call_future_poll
_set_deadline = _bindings._wasmtime_context_set_epoch_deadline


@dataclass(eq=False)
class Code:
    """A checked and compiled Python inferlet (:meth:`WasmSandbox.compile`): what a launch
    runs, and what the pool loads guests with (by identity)."""

    name: str
    code: bytes  # the marshalled code object, as load-inferlet sends it
    source: str  # for tracebacks
    limits: SandboxLimits


class WasmSandbox:
    """Runs sandboxed inferlets in this process (use :func:`sandbox` for the shared one).

    ``pool_size`` Python guests are kept pre-started (:class:`GuestPool`; default
    :data:`POOL_SIZE`); 0 makes every launch instantiate its own. ``poll_threads`` guests
    run at once (:class:`GuestPollers`: the event loop's thread and ``poll_threads`` - 1
    helpers; default one per core, up to 4); 1 runs every guest on the loop's thread."""

    def __init__(
        self,
        pyrt: Path | None = None,
        pool_size: int | None = None,
        poll_threads: int | None = None,
    ) -> None:
        self.engine = engine()
        # Held by every host call (on whichever thread polls the guest): host code runs
        # one call at a time, as on the event loop's thread (wasm_pollers).
        self.host_lock = threading.RLock()
        self.pollers = GuestPollers(DEFAULT_THREADS if poll_threads is None else poll_threads)
        self._runq: dict[asyncio.AbstractEventLoop, list[Guest]] = {}  # loop -> next section
        path = pyrt or build_pyrt.cached_path()
        if not path.exists():
            raise FileNotFoundError(
                f"the Python runtime component is not built ({path}): run "
                "`python -m pastry.runtime.build_pyrt`"
            )
        t0 = time.perf_counter()
        self.component = Component.deserialize_file(self.engine, str(path))
        self.load_ms = (time.perf_counter() - t0) * 1e3
        self._guests: dict[int, Guest] = {}  # store context address -> guest
        self._cb = _Callbacks(self)
        self.linker = Linker(self.engine)
        self.linker.add_wasip2()
        with self.linker.root() as root:
            with root.add_instance(API) as inst:
                for name in BLOCKING:
                    self._cb.define(inst, name, None, blocking=True)
                for name in HOST:
                    self._cb.define(inst, name, HOST, blocking=name in SUSPENDING)
            with root.add_instance(LAUNCHER) as inst:
                for name in LAUNCH_STAGES:
                    self._cb.define(inst, name, None, blocking=True)
                for name in LAUNCHER_IMPORTS:
                    self._cb.define(inst, name, LAUNCHER_IMPORTS, blocking=False)
        self._deny_wasi_waits()
        self._ids = itertools.count(1)
        self._core: wasm_core.CoreLinker | None = None
        self._components: dict[str, Component] = {}  # sha256 -> compiled inferlet component
        self._lifts: dict[tuple, Callable] = {}  # (component, export) -> its result's lifter
        self._bound: dict[int, Guest] = {}  # instance id -> its running guest
        self._memory = MemoryMap()
        self.pool_limits = SandboxLimits()  # what pooled guests are made under
        size = POOL_SIZE if pool_size is None else pool_size
        self.pool = GuestPool(self._prestart, self._preload, self._end, size)
        self.compiler = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="pastry-wasm-compile"
        )
        self.pool.start()

    def close(self) -> None:
        """Stop the pool's and the pollers' threads and free the pooled guests (running
        instances are not touched)."""
        self.pool.close()
        self.pollers.close()
        self.compiler.shutdown(wait=False, cancel_futures=True)

    def _deny_wasi_waits(self) -> None:
        """Replace WASI's clock subscriptions (what ``poll``, ``sleep`` and ``select``
        wait on) by imports that end the instance: Wasmtime would block this thread in
        them. ``time.sleep`` and ``asyncio.sleep`` in the guest use the host's timer."""
        name = _wasi_instance_name(self.engine, WASI_CLOCK)
        self.linker.allow_shadowing = True
        with self.linker.root() as root, root.add_instance(name) as inst:
            for fn in ("subscribe-duration", "subscribe-instant"):
                self._cb.names.append((fn, None))
                b = fn.encode()
                cb = ctypes.cast(self._cb.deny, ffi.wasmtime_component_func_callback_t)
                err = ffi.wasmtime_component_linker_instance_add_func(
                    inst.ptr(), ctypes.create_string_buffer(b), len(b), cb,
                    len(self._cb.names) - 1, self._cb.noop,
                )  # fmt: skip
                if err:
                    raise wasmtime.WasmtimeError._from_ptr(err)
        self.linker.allow_shadowing = False

    def memory_bytes(self, instance: int) -> int | None:
        """The linear memory size of a running Python guest (see
        :mod:`pastry.runtime.wasm_memory`); None if ``instance`` has none or it cannot be
        found."""
        g = self._bound.get(instance)
        if g is None or g.finished:
            return None
        g.mem_base, size = self._memory.size(g.mem_base, g.probe)
        return size or None

    # ------------------------------------------------------------------ compiling

    def compile(self, name: str, source: str, limits: SandboxLimits = SandboxLimits()) -> Code:
        """Check and compile ``source`` in a fresh guest (``compile-source``): its code, to
        hand to :meth:`launch`. Runs on the calling thread without holding the GIL while
        the guest works, so from a worker thread it does not stop the event loop; limited
        by ``limits`` (memory, ``compile_cpu_seconds``). :class:`ProgramError` if it is
        not a valid inferlet."""
        store = self._store(limits)
        params = (Val * 2)()
        fut = None
        try:
            try:
                instance = self._instantiate(store, self.component)
            except SandboxError as e:
                raise ProgramError(f"{name}: cannot compile: {e}") from None
            func = instance.get_func(store, "compile-source")
            fty = func.type(store)
            for i, ((_, t), v) in enumerate(zip(fty.params, (name, source), strict=True)):
                t.convert_to_c(store, v, ctypes.pointer(params[i]))
            result = Val()
            err = ctypes.POINTER(ffi.wasmtime_error_t)()
            ctx = store._context()
            fut = ffi.wasmtime_component_func_call_async(
                ctypes.byref(func._func), ctx, params, 2, ctypes.byref(result), 1,
                ctypes.byref(err),
            )  # fmt: skip
            t0 = time.thread_time()
            while True:
                _set_deadline(ctx, 1)
                if _poll(fut):
                    break
                if time.thread_time() - t0 > limits.compile_cpu_seconds:
                    raise ProgramError(
                        f"{name}: compiling took more than {limits.compile_cpu_seconds:g} s "
                        "of CPU (SandboxLimits.compile_cpu_seconds)"
                    )
            if err:
                trap = _trap_text(wasmtime.WasmtimeError._from_ptr(err))
                raise ProgramError(f"{name}: cannot compile: {trap}")
            out = fty.result.convert_from_c(result)
            if out.tag != "ok":
                raise ProgramError(out.payload)
            # (the code as load-inferlet sends it: UTF-8 of the latin-1 text)
            return Code(name, out.payload.encode(), source, limits)
        finally:
            if fut is not None:
                ffi.wasmtime_call_future_delete(fut)
            for v in params:
                ffi.wasmtime_component_val_delete(ctypes.byref(v))
            store.close()

    # ------------------------------------------------------------------ running a guest

    async def launch(self, code: Code, args: list[str]) -> str | None:
        """Run ``code`` (:meth:`compile`'s) with ``args`` in a fresh instance bound to the
        calling inferlet's Session (call inside a runner task, e.g.
        :class:`TrustedRuntime`): a pooled guest loaded with it, else a pooled one, else
        one made now."""
        from pastry.sdk import api

        session = api()
        g = None
        if code.limits.memory_bytes >= self.pool_limits.memory_bytes:
            g = self.pool.take(code)
        if g is None:
            g = self._prestart(code.limits)
        if g.code is None:
            g.code, g.source = code, code.source
        g.args = list(args)
        self._bind(g, session, code.limits)
        self._ready(g)  # with the other launches of this loop iteration
        try:
            return await g.result
        finally:
            self._end(g)

    async def run(
        self, name: str, source: str, args: list[str], limits: SandboxLimits = SandboxLimits()
    ) -> str | None:
        """Compile ``source`` (off the event loop) and :meth:`launch` it."""
        loop = asyncio.get_running_loop()
        code = await loop.run_in_executor(self.compiler, self.compile, name, source, limits)
        return await self.launch(code, args)

    def _core_linker(self) -> wasm_core.CoreLinker:
        if self._core is None:
            self._core = wasm_core.CoreLinker(self.engine, self._guests)
        return self._core

    async def run_core(
        self, name: str, wasm: bytes, args: list[str], limits: SandboxLimits = SandboxLimits()
    ) -> str | None:
        """Run a core wasm module's ``run()`` (imports under module ``"pastry"``, see
        :mod:`pastry.runtime.wasm_core`) in a fresh Store bound to the calling inferlet's
        Session."""
        from pastry.sdk import api

        g = self._new_guest(limits, wasi=False)
        try:
            self._bind(g, api(), limits)
            wasm_core.start(self._core_linker(), g, name, wasm, args)
        except BaseException:
            self._end(g)
            raise
        self._ready(g)
        try:
            return await g.result
        finally:
            self._end(g)

    def compile_component(self, wasm: bytes) -> Component:
        """Compile (once per content) a component exporting the ``inferlet`` world's
        ``run`` (e.g. a componentize-qjs JavaScript inferlet, :mod:`pastry.runtime.build_js`)."""
        key = hashlib.sha256(wasm).hexdigest()
        comp = self._components.get(key)
        if comp is None:
            comp = self._components[key] = Component(self.engine, wasm)
        return comp

    async def run_component(
        self, name: str, wasm: bytes, args: list[str], limits: SandboxLimits = SandboxLimits()
    ) -> str | None:
        """Run a component's ``run(args)`` (world ``inferlet`` of ``wit/pastry.wit``) in a
        fresh instance bound to the calling inferlet's Session."""
        from pastry.sdk import api

        comp = self.compile_component(wasm)
        g = self._new_guest(limits, wasi=True)
        try:
            self._bind(g, api(), limits)
            self._call(g, comp, "run", (list(args),))
        except BaseException:
            self._end(g)
            raise
        self._ready(g)
        try:
            return await g.result
        finally:
            self._end(g)

    # ------------------------------------------------------------------ guest lifecycle

    def _store(self, limits: SandboxLimits) -> wasmtime.Store:
        """A Store under ``limits``' memory, with an empty WASI context (no files, env,
        args, sockets or stdio), yielding at every epoch tick."""
        store = wasmtime.Store(self.engine)
        store.set_limits(memory_size=limits.memory_bytes)
        store.set_wasi(wasmtime.WasiConfig())
        ffi.wasmtime_context_epoch_deadline_async_yield_and_update(store._context(), 1)
        return store

    def _new_guest(self, limits: SandboxLimits, wasi: bool) -> Guest:
        """A registered guest with a fresh Store; nothing runs yet, nothing is bound."""
        if wasi:
            store = self._store(limits)
        else:
            store = wasmtime.Store(self.engine)
            store.set_limits(memory_size=limits.memory_bytes)
            ffi.wasmtime_context_epoch_deadline_async_yield_and_update(store._context(), 1)
        g = Guest(0, None, limits, store)
        g.ctx = store._context()
        g.ctx_addr = ctypes.cast(g.ctx, ctypes.c_void_p).value
        self._guests[g.ctx_addr] = g
        return g

    def _prestart(self, limits: SandboxLimits | None = None) -> Guest:
        """A Python guest parked in ``load-inferlet`` (warm, bound to nothing). Safe to
        call on any thread: it touches only its own new Store."""
        g = self._new_guest(limits or self.pool_limits, wasi=True)
        try:
            self._call(g, self.component, "serve", ())
            if not self._run_until_parked(g, 30.0):
                raise SandboxError("the Python runtime did not start within 30 s of CPU")
            g.cpu_ns = 0  # the runtime's start is not the inferlet's
        except BaseException:
            self._end(g)
            raise
        return g

    def _preload(self, g: Guest, code: Code) -> bool:
        """Load ``code`` into pre-started ``g`` (its module runs, unbound) and park it in
        ``start-inferlet``; its CPU counts against the instance's budget. False (``g`` is
        freed) if it ends or runs out of budget instead: that program is then loaded at
        each launch. On the pool's thread."""
        g.code, g.source = code, code.source
        try:
            if self._run_until_parked(g, code.limits.cpu_seconds):
                return True
        except SandboxError:
            pass
        self._end(g)
        return False

    def _run_until_parked(self, g: Guest, cpu_seconds: float) -> bool:
        """Poll ``g`` (not bound, not on the event loop) until it parks in a launcher
        import; False if ``cpu_seconds`` run out first; SandboxError if it ends."""
        g.parked = False
        t0 = time.thread_time_ns()
        try:
            while not g.parked:
                _set_deadline(g.ctx, 1)
                if _poll(g.future):
                    try:
                        out = self._outcome(g)
                    except SandboxError as e:
                        out = str(e)
                    raise SandboxError(f"the Python runtime ended before its launch: {out}")
                if time.thread_time_ns() - t0 > cpu_seconds * 1e9:
                    return False
            return True
        finally:
            g.cpu_ns += time.thread_time_ns() - t0

    def _call(self, g: Guest, component: Component, export: str, values: tuple) -> None:
        """Instantiate ``component`` in ``g``'s store and start ``export(*values)`` as
        ``g``'s call future (not polled yet)."""
        store = g.store
        instance = self._instantiate(store, component)
        func = instance.get_func(store, export)
        if func is None:
            raise SandboxError(f"the component does not export `{export}`")
        fty = func.type(store)
        params = (Val * len(values))()
        for i, ((_, t), v) in enumerate(zip(fty.params, values, strict=True)):
            t.convert_to_c(store, v, ctypes.pointer(params[i]))
        result = Val()
        err = ctypes.POINTER(ffi.wasmtime_error_t)()
        key = (id(component), export)
        g.result_ty = self._lifts.get(key)
        if g.result_ty is None:
            g.result_ty = self._lifts[key] = wasm_codec.lifter(fty.result)
        g.keep = [params, result, err, func]
        g.future = ffi.wasmtime_component_func_call_async(
            ctypes.byref(func._func), g.ctx, params, len(values), ctypes.byref(result), 1,
            ctypes.byref(err),
        )  # fmt: skip

    def _instantiate(self, store: wasmtime.Store, component: Component):
        from wasmtime.component._instance import Instance as CInstance

        raw = ffi.wasmtime_component_instance_t()
        err = ctypes.POINTER(ffi.wasmtime_error_t)()
        fut = ffi.wasmtime_component_linker_instantiate_async(
            self.linker.ptr(), store._context(), component.ptr(), ctypes.byref(raw),
            ctypes.byref(err),
        )  # fmt: skip
        try:
            while not _poll(fut):
                pass  # epoch yields only
        finally:
            ffi.wasmtime_call_future_delete(fut)
        if err:
            raise SandboxError(f"instantiation failed: {wasmtime.WasmtimeError._from_ptr(err)}")
        return CInstance._from_raw(raw)

    def _bind(self, g: Guest, session: Session, limits: SandboxLimits) -> None:
        """Give ``g`` to a launch: its session, limits (memory, wall clock) and result."""
        loop = asyncio.get_running_loop()
        limits.apply(session)
        if limits.memory_bytes != g.limits.memory_bytes:
            g.store.set_limits(memory_size=limits.memory_bytes)
        g.id, g.session, g.limits = session.instance, session, limits
        self._bound[g.id] = g
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
        self._ready(g)

    def _ready(self, g: Guest) -> None:
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
                self._ready(g)
        if rest:
            skipped = set(map(id, rest))
            run = [g for g in run if id(g) not in skipped]
        for g in run:
            self._after_poll(g)

    def _poll_once(self, g: Guest) -> None:
        """Run ``g`` (``polling`` set) until it blocks, yields at an epoch tick, or ends;
        on any thread (its host calls take the host lock)."""
        _set_deadline(g.ctx, SLICE_TICKS)
        t0 = time.thread_time_ns()
        try:
            g.returned = bool(_poll(g.future))
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
            self._ready(g)  # yielded at an epoch tick: let the others run, then go on

    # ------------------------------------------------------------------ blocking imports

    def _block(self, g: Guest, sig: _Sig, results, *args) -> bool:
        """A blocking import was called: answer now (False) or suspend the fiber until
        :meth:`_unblock` can (True)."""
        if sig.handler is not None:
            return self._suspend(g, sig, results, args)
        if sig.name in LAUNCH_STAGES:
            stage = LAUNCH_STAGES[sig.name]
            if g.stage != stage:
                raise Kill(f"launcher.{sig.name} out of order: only the runtime calls it, once")
            g.stage = stage + 1
            g.wait_out = (results, sig)
            g.parked = self._complete_wait(g)
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
        if not self._complete_wait(g):
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

    def _suspend(self, g: Guest, sig: _Sig, results, args: tuple) -> bool:
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

    def _unblock(self, g: Guest) -> bool:
        """The continuation of a suspended blocking import: False while it must wait."""
        return not self._complete_wait(g)

    def _complete_wait(self, g: Guest) -> bool:
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
                    value.append((pid, ctypes_.Variant("ok" if ok else "err", v)))
        g.waiting = g.wait_out = None
        g.wait_done = g.parked = False
        if g.timer is not None:
            g.timer.cancel()
            g.timer = None
        sig.result(ok, value, results[0])
        return False

    # ------------------------------------------------------------------ ending

    def _outcome(self, g: Guest) -> str:
        """The finished call future's outcome (dropping it): the result, or raises."""
        _params, result, err, _func = g.keep[:4]  # (the future is deleted by _free)
        if g.kill_reason is not None:
            raise SandboxError(g.kill_reason)
        if err:
            trap = wasmtime.WasmtimeError._from_ptr(err)
            log.debug("inferlet %d trapped: %s", g.id, trap)
            raise SandboxError(f"the inferlet trapped: {_trap_text(trap)}")
        out = g.result_ty(result)
        ffi.wasmtime_component_val_delete(ctypes.byref(result))  # read: ours to free
        tag, payload = (out.tag, out.payload) if isinstance(out, ctypes_.Variant) else ("ok", out)
        if tag != "ok":
            raise SandboxError(payload)
        return payload

    def _complete(self, g: Guest) -> None:
        try:
            result = wasm_core.outcome(g) if g.core else self._outcome(g)
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
        self._end(g)

    def _end(self, g: Guest) -> None:
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
        self._guests.pop(g.ctx_addr, None)
        if self._bound.get(g.id) is g:
            del self._bound[g.id]
        if g.result is not None and not g.result.done():
            g.result.set_exception(SandboxError(g.kill_reason or "terminated"))
        future, g.future = g.future, None
        keep, store = g.keep, g.store
        g.keep = []
        g.wait_out = None
        g.wake = None  # no cycle keeps the guest (and its Store) alive
        g.code = g.args = None
        self.pool.retire(functools.partial(_free, future, keep, store, not g.core))


def _free(future, keep: list, store: wasmtime.Store, component: bool) -> None:
    """Delete an ended guest's call future (its fiber), call arguments and Store: its
    memory goes back to the system now (any thread; nothing else refers to them)."""
    if future is not None:
        ffi.wasmtime_call_future_delete(future)
    if keep and component:  # the call's arguments are ours to free
        for v in keep[0]:
            ffi.wasmtime_component_val_delete(ctypes.byref(v))
    store.close()


def _trap_text(trap: wasmtime.WasmtimeError) -> str:
    """A trap's cause without Wasmtime's wasm backtrace (kept in the debug log)."""
    text = str(trap)
    if "Caused by:" in text:
        cause = text.split("Caused by:", 1)[1].strip().splitlines()
        return " ".join(line.strip().lstrip("0123456789: ").strip() or line for line in cause)
    return text.splitlines()[0] if text else "unknown trap"


_WASI_NAMES: dict[str, str] = {}


def _wasi_instance_name(eng: wasmtime.Engine, interface: str) -> str:
    """The exact name (with version) under which ``add_wasip2`` defines ``interface``:
    shadowing a function must target that instance (another version would be a new
    instance, hiding WASI's)."""
    name = _WASI_NAMES.get(interface)
    if name is None:
        probe = Linker(eng)
        probe.add_wasip2()
        cb = ffi.wasmtime_component_func_callback_t(lambda *a: 0)
        fin = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(lambda env: None)
        with probe.root() as root:
            for minor in range(64):
                candidate = f"{interface}@0.2.{minor}"
                with root.add_instance(candidate) as inst:
                    err = ffi.wasmtime_component_linker_instance_add_func(
                        inst.ptr(), ctypes.create_string_buffer(b"now"), 3, cb, None, fin
                    )
                if err:  # "defined twice": WASI's own instance
                    wasmtime.WasmtimeError._from_ptr(err)  # frees it
                    name = candidate
                    break
        if name is None:
            raise SandboxError(
                f"cannot find WASI's {interface} in Wasmtime's linker (wasmtime "
                "changed?): refusing to run guests whose sleeps would block the server"
            )
        _WASI_NAMES[interface] = name
    return name


def _shareable(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether helper threads may run host calls for ``loop`` while its thread waits:
    asyncio's own loops, outside debug mode (whose thread checks would refuse them)."""
    return isinstance(loop, asyncio.BaseEventLoop) and not loop.get_debug()


_shared: WasmSandbox | None = None
_shared_lock = threading.Lock()


def sandbox() -> WasmSandbox:
    """The process's sandbox (created on first use; needs the built pyrt)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = WasmSandbox()
        return _shared


def sandboxed_program(
    name: str, source: str, limits: SandboxLimits = SandboxLimits(), box: WasmSandbox | None = None
) -> Program:
    """A :class:`Program` whose instances run ``source`` in the sandbox. The source is
    checked and compiled now, inside a guest (:meth:`WasmSandbox.compile`; nothing of it
    runs): :class:`ProgramError` if it is not a valid inferlet. Blocks the calling thread
    meanwhile, not the GIL: call it from a worker thread, or use
    :func:`sandboxed_program_async`, to keep an event loop going."""
    box = box or sandbox()
    code = box.compile(name, source, limits)
    digest = hashlib.sha256(source.encode()).hexdigest()

    async def main(args: list[str]) -> str | None:
        return await box.launch(code, args)

    return Program(name, digest, main, memory=box.memory_bytes)


async def sandboxed_program_async(
    name: str, source: str, limits: SandboxLimits = SandboxLimits(), box: WasmSandbox | None = None
) -> Program:
    """:func:`sandboxed_program` on the sandbox's compile thread: the event loop goes on
    while the guest compiles (a pathological source costs that thread its CPU budget)."""
    loop = asyncio.get_running_loop()
    box = box or await loop.run_in_executor(None, sandbox)
    return await loop.run_in_executor(box.compiler, sandboxed_program, name, source, limits, box)


def deferred_sandboxed_program(
    name: str, source: str, limits: SandboxLimits = SandboxLimits(), box: WasmSandbox | None = None
) -> Program:
    """:func:`sandboxed_program` for a source that was checked before (an upload stored by
    an earlier server run), returned at once: it is compiled on the sandbox's compile
    thread when it is first launched (one compile, which launches meanwhile wait for; a
    failed one is tried again at the next launch). Nothing runs on the event loop: not
    the compile, not the sandbox's start. A source that no longer compiles fails the
    instances launched with it, with the compile's error."""
    if box is None and _shared is None and not build_pyrt.cached_path().exists():
        raise FileNotFoundError(
            f"the Python runtime component is not built ({build_pyrt.cached_path()}): run "
            "`python -m pastry.runtime.build_pyrt`"
        )
    digest = hashlib.sha256(source.encode()).hexdigest()
    lock = threading.Lock()
    compiled: concurrent.futures.Future | None = None
    started: WasmSandbox | None = box

    async def main(args: list[str]) -> str | None:
        nonlocal compiled, started
        loop = asyncio.get_running_loop()
        b = started = started or await loop.run_in_executor(None, sandbox)
        with lock:
            if compiled is None or (compiled.done() and compiled.exception() is not None):
                compiled = b.compiler.submit(b.compile, name, source, limits)
            fut = compiled
        code = await asyncio.wrap_future(fut)
        return await b.launch(code, args)

    def memory(instance: int) -> int | None:
        return started.memory_bytes(instance) if started is not None else None

    return Program(name, digest, main, memory=memory)


def core_program(
    name: str, wasm: bytes, limits: SandboxLimits = SandboxLimits(), box: WasmSandbox | None = None
) -> Program:
    """A :class:`Program` whose instances run a core wasm module (C, Zig, ...) in the
    sandbox; it is compiled now (cached by content), each launch instantiates it."""
    box = box or sandbox()
    try:
        box._core_linker().module(wasm)
    except wasmtime.WasmtimeError as e:
        raise ProgramError(f"{name}: not a valid wasm module: {e}") from None
    digest = hashlib.sha256(wasm).hexdigest()

    async def main(args: list[str]) -> str | None:
        return await box.run_core(name, wasm, args, limits)

    return Program(name, digest, main)


def component_program(
    name: str, wasm: bytes, limits: SandboxLimits = SandboxLimits(), box: WasmSandbox | None = None
) -> Program:
    """A :class:`Program` whose instances run a component exporting the ``inferlet``
    world's ``run`` (JavaScript via componentize-qjs, ...); compiled now (cached by
    content), each launch instantiates it."""
    box = box or sandbox()
    try:
        box.compile_component(wasm)
    except wasmtime.WasmtimeError as e:
        raise ProgramError(f"{name}: not a valid wasm component: {e}") from None
    digest = hashlib.sha256(wasm).hexdigest()

    async def main(args: list[str]) -> str | None:
        return await box.run_component(name, wasm, args, limits)

    return Program(name, digest, main)
