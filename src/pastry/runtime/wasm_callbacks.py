"""The host functions every component guest's imports call (ctypes callbacks, shared).

One :class:`Callbacks` per sandbox defines each import of the guests' worlds
(``wit/pastry.wit``: the inferlet API, whose synchronous imports are the request table's
:data:`~pastry.runtime.wasm_imports.HOST`; the blocking ones, :mod:`pastry.runtime.wasm_waits`;
the launcher's) as a Wasmtime host function whose environment is the import's index. At an
import's first call its value conversions are compiled from its type
(:mod:`pastry.runtime.wasm_codec`); after that a call lifts the arguments, calls the handler
with the calling guest (found by its store's context address) under the host lock, and
writes the result. Every callback catches everything: a failure becomes a trap with a
message for the guest (:func:`~pastry.runtime.wasm_host.error_text`), never a crash, and an
async callback always fills its continuation.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable

import wasmtime
from wasmtime.component import Linker, ResultType

from pastry.api import ApiError
from pastry.runtime import wasm_codec
from pastry.runtime import wasmtime_raw as raw
from pastry.runtime.wasm_host import Guest, Kill, SandboxError, call_host, error_text
from pastry.runtime.wasm_imports import HOST, SUSPENDING
from pastry.runtime.wasm_waits import BLOCKING, LAUNCH_STAGES, STARTED, Sig, block, unblock

log = logging.getLogger(__name__)

API = "pastry:inferlet/api@0.1.0"
LAUNCHER = "pastry:inferlet/launcher@0.1.0"
WASI_CLOCK = "wasi:clocks/monotonic-clock"


def _memory_probe(g: Guest, offset: int, marker: bytes) -> None:
    if g.probe is None:  # the runtime's call, before the inferlet runs; later ones are ignored
        g.probe = (offset, bytes(marker))


LAUNCHER_IMPORTS: dict[str, Callable] = {
    "inferlet-source": lambda g: g.source or "",
    "memory-probe": _memory_probe,
}


class Callbacks:
    """The ctypes callbacks shared by every guest (they outlive them)."""

    def __init__(self, guests: dict[int, Guest], lock: threading.RLock) -> None:
        self.guests = guests  # store context address -> guest
        self.lock = lock
        self.names: list[tuple[str, dict | None]] = [("", None)]  # index 0: a NULL env
        self.sigs: dict[int, Sig] = {}
        self.sync = raw.SyncFn(self._sync_call)
        self.async_ = raw.AsyncFn(self._async_call)
        self.deny = raw.SyncFn(self._deny)
        self.done = raw.ffi.wasmtime_func_async_continuation_callback_t(lambda env: True)
        self.resume = raw.ffi.wasmtime_func_async_continuation_callback_t(self._resume)
        self.noop = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(lambda env: None)

    def define(self, inst, name: str, table: dict | None, blocking: bool) -> None:
        """Add import ``name`` (its handler in ``table``) to linker instance ``inst``."""
        self.names.append((name, table))
        b = name.encode()
        add = (
            raw.ffi.wasmtime_component_linker_instance_add_func_async
            if blocking
            else raw.ffi.wasmtime_component_linker_instance_add_func
        )
        cb = ctypes.cast(
            self.async_ if blocking else self.sync,
            raw.ffi.wasmtime_component_func_async_callback_t
            if blocking
            else raw.ffi.wasmtime_component_func_callback_t,
        )
        err = add(inst.ptr(), ctypes.create_string_buffer(b), len(b), cb, len(self.names) - 1,
                  self.noop)  # fmt: skip
        if err:
            raise raw.error(err)

    def link(self, linker: Linker, eng: wasmtime.Engine) -> None:
        """Define every import of the guests' worlds in ``linker`` (with WASI p2 added):
        the inferlet API (:data:`~pastry.runtime.wasm_imports.HOST` and the blocking
        waits), the launcher's imports, and WASI's clock waits replaced by ones that end
        the instance."""
        linker.add_wasip2()
        with linker.root() as root:
            with root.add_instance(API) as inst:
                for name in BLOCKING:
                    self.define(inst, name, None, blocking=True)
                for name in HOST:
                    self.define(inst, name, HOST, blocking=name in SUSPENDING)
            with root.add_instance(LAUNCHER) as inst:
                for name in LAUNCH_STAGES:
                    self.define(inst, name, None, blocking=True)
                for name in LAUNCHER_IMPORTS:
                    self.define(inst, name, LAUNCHER_IMPORTS, blocking=False)
        self._deny_wasi_waits(linker, eng)

    def _deny_wasi_waits(self, linker: Linker, eng: wasmtime.Engine) -> None:
        """Replace WASI's clock subscriptions (what ``poll``, ``sleep`` and ``select``
        wait on) by imports that end the instance: Wasmtime would block this thread in
        them. ``time.sleep`` and ``asyncio.sleep`` in the guest use the host's timer."""
        name = _wasi_instance_name(eng, WASI_CLOCK)
        linker.allow_shadowing = True
        with linker.root() as root, root.add_instance(name) as inst:
            for fn in ("subscribe-duration", "subscribe-instant"):
                self.names.append((fn, None))
                b = fn.encode()
                cb = ctypes.cast(self.deny, raw.ffi.wasmtime_component_func_callback_t)
                err = raw.ffi.wasmtime_component_linker_instance_add_func(
                    inst.ptr(), ctypes.create_string_buffer(b), len(b), cb,
                    len(self.names) - 1, self.noop,
                )  # fmt: skip
                if err:
                    raise raw.error(err)
        linker.allow_shadowing = False

    def _sig(self, idx: int, ty: int) -> Sig:
        sig = self.sigs.get(idx)
        if sig is None:
            name, table = self.names[idx]
            fty = raw.func_type(
                ctypes.cast(ty, ctypes.POINTER(raw.ffi.wasmtime_component_func_type_t)), owner=self
            )
            rty = fty.result
            fallible = isinstance(rty, ResultType)
            if rty is None:
                write = None
            elif fallible:
                write = wasm_codec.result_writer(rty)
            else:
                low = wasm_codec.lowerer(rty)

                def write(ok, value, val, low=low):
                    low(value, val)

            sig = self.sigs[idx] = Sig(
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
        err = raw.ffi.wasmtime_error_new(msg.encode("utf-8", "replace"))
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
            if block(g, sig, results, *pyargs):
                c.callback = self.resume
                c.env = context
        except BaseException as e:
            err_ret[0] = ctypes.cast(
                self._fail(g, sig.name if sig else "a host import", e),
                ctypes.POINTER(raw.ffi.wasmtime_error_t),
            )

    def _resume(self, env) -> bool:
        # Polled (on the fiber) each time a guest blocked in an import is polled.
        with self.lock:
            try:
                g = self.guests.get(env or 0)
                if g is None or g.wait_out is None:
                    return True
                return unblock(g)
            except BaseException:
                log.exception("sandbox: resuming a guest failed")
                return True  # the unwritten result makes the call fail: a trap, not a crash


_WASI_NAMES: dict[str, str] = {}


def _wasi_instance_name(eng: wasmtime.Engine, interface: str) -> str:
    """The exact name (with version) under which ``add_wasip2`` defines ``interface``:
    shadowing a function must target that instance (another version would be a new
    instance, hiding WASI's)."""
    name = _WASI_NAMES.get(interface)
    if name is None:
        probe = Linker(eng)
        probe.add_wasip2()
        cb = raw.ffi.wasmtime_component_func_callback_t(lambda *a: 0)
        fin = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(lambda env: None)
        with probe.root() as root:
            for minor in range(64):
                candidate = f"{interface}@0.2.{minor}"
                with root.add_instance(candidate) as inst:
                    err = raw.ffi.wasmtime_component_linker_instance_add_func(
                        inst.ptr(), ctypes.create_string_buffer(b"now"), 3, cb, None, fin
                    )
                if err:  # "defined twice": WASI's own instance
                    raw.error(err)  # frees it
                    name = candidate
                    break
        if name is None:
            raise SandboxError(
                f"cannot find WASI's {interface} in Wasmtime's linker (wasmtime "
                "changed?): refusing to run guests whose sleeps would block the server"
            )
        _WASI_NAMES[interface] = name
    return name
