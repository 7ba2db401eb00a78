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

The runtime's rooms (one asyncio loop, no thread per guest):

- :class:`WasmSandbox` (one per process, :func:`sandbox`): one Engine (epoch interruption;
  an epoch ticker thread, :mod:`~pastry.runtime.wasm_host`), one component Linker, the
  compiled pyrt component, and a :class:`~pastry.runtime.wasm_pool.GuestPool` of
  pre-started instances (each parked in ``load-inferlet``, or loaded with a recently
  launched program and parked in ``start-inferlet``): a launch binds one to its session
  and resumes it, so N simultaneous launches do not queue behind N instantiations.
  :func:`sandboxed_program` returns a :class:`~pastry.runtime.trusted.Program` whose
  ``main`` runs the guest, so :class:`~pastry.runtime.trusted.TrustedRuntime` launches,
  terminates and reports sandboxed instances exactly like trusted ones.
- The imports (:mod:`~pastry.runtime.wasm_callbacks`): synchronous host functions convert
  values (:mod:`~pastry.runtime.wasm_codec`), call the Session and return (queued calls
  return a ``pending`` handle at once); blocking ones (``wait``, ``wait-take``, the
  launcher's, :mod:`~pastry.runtime.wasm_waits`) suspend the fiber until a future they
  wait on completes (or the host's timer fires: ``time.sleep`` and ``asyncio.sleep`` in the
  guest wait here). WASI's own clock waits are refused (the guest traps): Wasmtime would
  block the whole thread, and with it the server, in them.
- Driving (:mod:`~pastry.runtime.wasm_run`): the guest runs as a Wasmtime *call future*
  (a fiber) polled in sections on the loop's thread and a few helpers
  (:mod:`~pastry.runtime.wasm_pollers`), until it blocks, finishes, or yields at an epoch
  tick; host code still runs one call at a time (``host_lock``).
- Limits per instance (:class:`SandboxLimits`): linear memory (store limits), CPU (thread
  time spent polling the guest, checked after every slice of at most one epoch tick),
  wall-clock lifetime (a host timer), message size, and KV pages and embeddings held (set
  on the instance's resource managers at launch). Over a limit, the instance ends with an
  error naming it; the others go on. When an instance ends, its Store is closed at once
  (its memory is returned then, not at the next garbage collection).
- Core modules (C, Zig, ...): :mod:`~pastry.runtime.wasm_core`. Wasmtime's private C API
  is reached only through :mod:`~pastry.runtime.wasmtime_raw`.

Pitfalls handled (see ``docs/sandbox.md``): a finished call future is never polled again;
every callback catches everything and reports through its error result; an async callback
always fills its continuation; a result value is never left half-written
(:mod:`~pastry.runtime.wasm_codec`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import hashlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import wasmtime
from wasmtime.component import Component, Linker

from pastry.runtime import build_pyrt, wasm_core
from pastry.runtime import wasmtime_raw as raw
from pastry.runtime.trusted import Program, ProgramError
from pastry.runtime.wasm_callbacks import Callbacks
from pastry.runtime.wasm_host import Guest, SandboxError, SandboxLimits, engine
from pastry.runtime.wasm_memory import MemoryMap
from pastry.runtime.wasm_pollers import DEFAULT_THREADS, GuestPollers
from pastry.runtime.wasm_pool import GuestPool
from pastry.runtime.wasm_run import Runner, instantiate, start_call, trap_text

POOL_SIZE = 64  # pre-started Python guests kept ready (WasmSandbox(pool_size=...))
Val = raw.Val


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
        self.runner = Runner(self.pollers)
        self.guests = self.runner.guests  # store context address -> guest
        path = pyrt or build_pyrt.cached_path()
        if not path.exists():
            raise FileNotFoundError(
                f"the Python runtime component is not built ({path}): run "
                "`python -m pastry.runtime.build_pyrt`"
            )
        t0 = time.perf_counter()
        self.component = Component.deserialize_file(self.engine, str(path))
        self.load_ms = (time.perf_counter() - t0) * 1e3
        self.callbacks = Callbacks(self.guests, self.host_lock)
        self.linker = Linker(self.engine)
        self.callbacks.link(self.linker, self.engine)
        self._core: wasm_core.CoreLinker | None = None
        self._components: dict[str, Component] = {}  # sha256 -> compiled inferlet component
        self._lifts: dict[tuple, Callable] = {}  # (component, export) -> its result's lifter
        self._memory = MemoryMap()
        self.pool_limits = SandboxLimits()  # what pooled guests are made under
        size = POOL_SIZE if pool_size is None else pool_size
        self.pool = self.runner.pool = GuestPool(
            self._prestart, self._preload, self.runner.end, size
        )
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

    def memory_bytes(self, instance: int) -> int | None:
        """The linear memory size of a running Python guest (see
        :mod:`pastry.runtime.wasm_memory`); None if ``instance`` has none or it cannot be
        found."""
        g = self.runner.bound.get(instance)
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
            err = raw.ErrorPtr()
            ctx = raw.context(store)
            fut = raw.ffi.wasmtime_component_func_call_async(
                ctypes.byref(raw.func_ptr(func)), ctx, params, 2, ctypes.byref(result), 1,
                ctypes.byref(err),
            )  # fmt: skip
            t0 = time.thread_time()
            while True:
                raw.set_deadline(ctx, 1)
                if raw.poll(fut):
                    break
                if time.thread_time() - t0 > limits.compile_cpu_seconds:
                    raise ProgramError(
                        f"{name}: compiling took more than {limits.compile_cpu_seconds:g} s "
                        "of CPU (SandboxLimits.compile_cpu_seconds)"
                    )
            if err:
                trap = trap_text(raw.error(err))
                raise ProgramError(f"{name}: cannot compile: {trap}")
            out = fty.result.convert_from_c(result)
            if out.tag != "ok":
                raise ProgramError(out.payload)
            # (the code as load-inferlet sends it: UTF-8 of the latin-1 text)
            return Code(name, out.payload.encode(), source, limits)
        finally:
            if fut is not None:
                raw.ffi.wasmtime_call_future_delete(fut)
            for v in params:
                raw.ffi.wasmtime_component_val_delete(ctypes.byref(v))
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
        self.runner.bind(g, session, code.limits)
        self.runner.ready(g)  # with the other launches of this loop iteration
        try:
            return await g.result
        finally:
            self.runner.end(g)

    async def run(
        self, name: str, source: str, args: list[str], limits: SandboxLimits = SandboxLimits()
    ) -> str | None:
        """Compile ``source`` (off the event loop) and :meth:`launch` it."""
        loop = asyncio.get_running_loop()
        code = await loop.run_in_executor(self.compiler, self.compile, name, source, limits)
        return await self.launch(code, args)

    def core_linker(self) -> wasm_core.CoreLinker:
        if self._core is None:
            self._core = wasm_core.CoreLinker(self.engine, self.guests)
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
            self.runner.bind(g, api(), limits)
            wasm_core.start(self.core_linker(), g, name, wasm, args)
        except BaseException:
            self.runner.end(g)
            raise
        self.runner.ready(g)
        try:
            return await g.result
        finally:
            self.runner.end(g)

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
            self.runner.bind(g, api(), limits)
            self._call(g, comp, "run", (list(args),))
        except BaseException:
            self.runner.end(g)
            raise
        self.runner.ready(g)
        try:
            return await g.result
        finally:
            self.runner.end(g)

    # ------------------------------------------------------------------ guest lifecycle

    def _store(self, limits: SandboxLimits) -> wasmtime.Store:
        """A Store under ``limits``' memory, with an empty WASI context (no files, env,
        args, sockets or stdio), yielding at every epoch tick."""
        store = wasmtime.Store(self.engine)
        store.set_limits(memory_size=limits.memory_bytes)
        store.set_wasi(wasmtime.WasiConfig())
        raw.yield_at_ticks(raw.context(store), 1)
        return store

    def _new_guest(self, limits: SandboxLimits, wasi: bool) -> Guest:
        """A registered guest with a fresh Store; nothing runs yet, nothing is bound."""
        if wasi:
            store = self._store(limits)
        else:
            store = wasmtime.Store(self.engine)
            store.set_limits(memory_size=limits.memory_bytes)
            raw.yield_at_ticks(raw.context(store), 1)
        g = Guest(0, None, limits, store)
        self.runner.add(g)
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
            self.runner.end(g)
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
        self.runner.end(g)
        return False

    def _run_until_parked(self, g: Guest, cpu_seconds: float) -> bool:
        """Poll ``g`` (not bound, not on the event loop) until it parks in a launcher
        import; False if ``cpu_seconds`` run out first; SandboxError if it ends."""
        g.parked = False
        t0 = time.thread_time_ns()
        try:
            while not g.parked:
                raw.set_deadline(g.ctx, 1)
                if raw.poll(g.future):
                    try:
                        out = self.runner.outcome(g)
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
        start_call(g, self.linker, component, export, values, self._lifts)

    def _instantiate(self, store: wasmtime.Store, component: Component):
        return instantiate(self.linker, store, component)


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
        box.core_linker().module(wasm)
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
