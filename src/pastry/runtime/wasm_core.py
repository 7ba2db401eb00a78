"""Core-module guests: inferlets in C (or Zig, AssemblyScript, ...) as plain wasm modules.

A core guest exports ``memory`` and ``int run(void)`` and imports a small C-shaped subset
of the API (``wit/pastry.wit``) under module ``"pastry"`` (header:
``examples/c/pastry.h``). Every parameter and result is an ``i32``; strings and lists are
``(ptr, len)`` in the guest's memory; handles, counts and pending ids are returned as
non-negative numbers and ``-1`` means the call failed (``pastry.error(buf, cap)`` copies
the message). ``set_result`` gives the result text; ``run`` returning non-zero ends the
instance with an error: that text if set, else the last error message.

The host side reuses :class:`~pastry.runtime.wasm.WasmSandbox`'s driving (one fiber per
instance, epoch yields, CPU and memory limits, ``wait`` suspending the fiber until a
Session future completes) with a core Linker (:class:`CoreLinker`) whose imports are
Wasmtime async host functions calling the same Session methods as the component imports.
This module provides the Linker, instantiation (:meth:`CoreLinker.start`) and the outcome
(:func:`outcome`); it imports only :mod:`pastry.runtime.wasm_host`, and ``wasm.py`` it.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import wasmtime

from pastry.api import ApiError
from pastry.paths import cwasm_dir
from pastry.runtime import wasmtime_raw as raw
from pastry.runtime.wasm_host import (
    Guest,
    Kill,
    SandboxError,
    call_host,
    check_message,
    error_text,
    send,
)

log = logging.getLogger(__name__)

MODULE = "pastry"


class _Mem:
    """The guest's linear memory during one host call (bounds-checked views)."""

    def __init__(self, g: Guest) -> None:
        ctx = raw.context(g.store)
        data = raw.ffi.wasmtime_memory_data(ctx, ctypes.byref(g.memory))
        self.base = ctypes.cast(data, ctypes.c_void_p).value or 0
        self.size = raw.ffi.wasmtime_memory_data_size(ctx, ctypes.byref(g.memory))

    def _addr(self, ptr: int, nbytes: int) -> int:
        ptr &= 0xFFFFFFFF
        if nbytes < 0 or ptr + nbytes > self.size:
            raise ApiError(f"guest buffer {ptr}+{nbytes} is outside its memory ({self.size})")
        return self.base + ptr

    def u32s(self, ptr: int, n: int) -> list[int]:
        return list((ctypes.c_uint32 * n).from_address(self._addr(ptr, 4 * n))) if n else []

    def put_u32s(self, ptr: int, values: list[int]) -> None:
        n = len(values)
        if n:
            (ctypes.c_uint32 * n).from_address(self._addr(ptr, 4 * n))[:] = values

    def put_f32s(self, ptr: int, values: list[float]) -> None:
        n = len(values)
        if n:
            (ctypes.c_float * n).from_address(self._addr(ptr, 4 * n))[:] = values

    def text(self, ptr: int, n: int) -> str:
        return ctypes.string_at(self._addr(ptr, n), n).decode("utf-8", "replace")

    def put_text(self, ptr: int, cap: int, text: str) -> int:
        data = text.encode()
        k = min(len(data), max(cap, 0))
        if k:
            ctypes.memmove(self._addr(ptr, k), data, k)
        return len(data)


def _s(g: Guest):
    return g.session


def _arg(g: Guest, m: _Mem, i: int, buf: int, cap: int) -> int:
    args = g.session.get_arguments()
    if not 0 <= i < len(args):
        raise ApiError(f"argument {i} does not exist ({len(args)} arguments)")
    return m.put_text(buf, cap, args[i])


def _create_queue(g: Guest, m: _Mem, ptr: int, n: int) -> int:
    model = m.text(ptr, n) if n else g.session.available_models()[0]
    return g.session.create_queue(model)


def _alloc(kind: str):
    def call(g: Guest, m: _Mem, q: int, n: int, out: int) -> int:
        alloc = g.session.alloc_kvpages if kind == "kv" else g.session.alloc_embeds
        m.put_u32s(out, alloc(q, n))
        return 0

    return call


def _embed_txt(g: Guest, m: _Mem, q: int, toks: int, pos: int, embs: int, n: int) -> int:
    return g.track(g.session.embed_txt(q, m.u32s(toks, n), m.u32s(pos, n), m.u32s(embs, n)))


def _forward(g: Guest, m: _Mem, q, in_kv, n_in_kv, last, in_e, n_in_e, out_kv, n_out_kv,
             off, out_e, n_out_e) -> int:  # fmt: skip
    fut = g.session.forward(
        q, m.u32s(in_kv, n_in_kv), last, m.u32s(in_e, n_in_e), m.u32s(out_kv, n_out_kv), off,
        m.u32s(out_e, n_out_e),
    )  # fmt: skip
    return g.track(fut)


def _outcome(g: Guest, pid: int):
    fut = g.pending.pop(pid, None)
    if fut is None:
        raise ApiError(f"pending call {pid} does not exist in this inferlet")
    if not fut.done():
        g.pending[pid] = fut
        raise ApiError(f"pending call {pid} has not completed (wait for it first)")
    return fut.result()


def _take(g: Guest, m: _Mem, pid: int) -> int:
    v = _outcome(g, pid)
    return v if isinstance(v, int) else 0


def _take_dist(g: Guest, m: _Mem, pid: int, ids: int, probs: int, cap: int) -> int:
    v = _outcome(g, pid)
    if not isinstance(v, tuple):
        raise ApiError(f"pending call {pid} is not a distribution")
    a, b = list(v[0])[: max(cap, 0)], list(v[1])[: max(cap, 0)]
    m.put_u32s(ids, a)
    m.put_f32s(probs, b)
    return len(a)


def _send(g: Guest, m: _Mem, ptr: int, n: int) -> int:
    send(g, m.text(ptr, n))
    return 0


def _set_result(g: Guest, m: _Mem, ptr: int, n: int) -> int:
    text = m.text(ptr, n)
    check_message(g, text)
    g.core_result = text
    return 0


def _error(g: Guest, m: _Mem, buf: int, cap: int) -> int:
    return m.put_text(buf, cap, g.core_error or "")


# name -> (number of i32 parameters, handler(guest, memory, *params) -> i32). ``wait`` is
# handled by the callback (it suspends the fiber).
IMPORTS: dict[str, tuple[int, Callable]] = {
    "arg_count": (0, lambda g, m: len(g.session.get_arguments())),
    "arg": (3, _arg),
    "create_queue": (2, _create_queue),
    "get_kv_page_size": (1, lambda g, m, q: g.session.get_kv_page_size(q)),
    "alloc_kvpages": (3, _alloc("kv")),
    "alloc_embeds": (3, _alloc("embed")),
    "embed_txt": (5, _embed_txt),
    "forward": (11, _forward),
    "get_next_dist": (3, lambda g, m, q, e, k: g.track(g.session.get_next_dist(q, e, k))),
    "sample_greedy": (2, lambda g, m, q, e: g.track(g.session.sample(q, e))),
    "receive": (0, lambda g, m: g.track(g.session.receive())),
    "take": (1, _take),
    "take_dist": (4, _take_dist),
    "send": (2, _send),
    "set_result": (2, _set_result),
    "error": (2, _error),
    "wait": (1, None),
}


# The unchecked callback with plain integers for the caller and the value array (ctypes
# builds no pointer objects per call); cast to Wasmtime's declared type when registered.
_UncheckedFn = ctypes.CFUNCTYPE(
    ctypes.c_size_t, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_size_t
)
_RAW = ctypes.sizeof(raw.ffi.wasmtime_val_raw_t)  # 16 bytes per parameter / result


class CoreLinker:
    """The core-module Linker of a sandbox and its ctypes callbacks. ``guests`` is the
    sandbox's table of running guests by store context address.

    Every import but ``wait`` is a synchronous *unchecked* host function: Wasmtime hands
    it the raw ``i32`` values in place (no boxed ``wasmtime_val_t`` per value, no
    continuation); ``wait`` is an async host function, because it suspends the fiber."""

    def __init__(self, engine: wasmtime.Engine, guests: dict[int, Guest]) -> None:
        self.engine = engine
        self.guests = guests
        self.names = [""]  # index 0: a NULL env, never used
        self.host = raw.ffi.wasmtime_func_async_callback_t(self._host_call)
        self.raw = _UncheckedFn(self._raw_call)
        self.done = raw.ffi.wasmtime_func_async_continuation_callback_t(lambda env: True)
        self.resume = raw.ffi.wasmtime_func_async_continuation_callback_t(self._resume)
        self.noop = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(lambda env: None)
        self.linker = wasmtime.Linker(engine)
        i32 = wasmtime.ValType.i32()
        mod = MODULE.encode()
        unchecked = ctypes.cast(self.raw, raw.ffi.wasmtime_func_unchecked_callback_t)
        for name, (nparams, _) in IMPORTS.items():
            self.names.append(name)
            ty = wasmtime.FuncType([i32] * nparams, [i32])
            define, cb = (
                (raw.ffi.wasmtime_linker_define_async_func, self.host)
                if name == "wait"
                else (raw.ffi.wasmtime_linker_define_func_unchecked, unchecked)
            )
            err = define(
                self.linker.ptr(), ctypes.create_string_buffer(mod), len(mod),
                ctypes.create_string_buffer(name.encode()), len(name), ty.ptr(), cb,
                len(self.names) - 1, self.noop,
            )  # fmt: skip
            if err:
                raise raw.error(err)
        self.modules: dict[bytes, wasmtime.Module] = {}

    def module(self, wasm: bytes) -> wasmtime.Module:
        key = hashlib.sha256(wasm).digest()
        mod = self.modules.get(key)
        if mod is None:
            mod = self.modules[key] = wasmtime.Module(self.engine, wasm)
        return mod

    def _raw_call(self, env, caller, values, nvalues) -> int:
        # Runs on the guest's fiber; never raises (a failure becomes a trap). ``values``
        # holds the i32 parameters; the result goes into its first slot.
        g = None
        name = self.names[env or 0]
        try:
            g = self.guests.get(raw.caller_context(caller))
            if g is None:
                raise RuntimeError(f"host import {name} called by an unknown store")
            nparams, handler = IMPORTS[name]
            packed = ctypes.string_at(values, max(nvalues, 1) * _RAW)
            params = memoryview(packed).cast("i")[:: _RAW // 4][:nparams].tolist()
            try:
                value = call_host(handler, g, _Mem(g), *params)
            except ApiError as e:
                g.core_error = str(e)
                value = -1
            ctypes.c_int32.from_address(values).value = int(value)
            return 0
        except BaseException as e:
            return ctypes.cast(self._trap(g, e), ctypes.c_void_p).value or 0

    def _trap(self, g: Guest | None, e: BaseException):
        msg = error_text(e)
        if g is not None and isinstance(e, Kill):
            g.kill_reason = str(e)
        data = msg.encode("utf-8", "replace")
        return raw.ffi.wasmtime_trap_new(ctypes.create_string_buffer(data), len(data))

    def _host_call(self, env, caller, args, nargs, results, nresults, trap_ret, cont):
        # ``wait`` only. Runs on the guest's fiber; never raises (a failure becomes a trap).
        cont.contents.callback = self.done
        cont.contents.env = None
        cont.contents.finalizer = self.noop
        g = None
        try:
            ctx = raw.ffi.wasmtime_caller_context(caller)
            g = self.guests.get(ctypes.cast(ctx, ctypes.c_void_p).value)
            if g is None:
                raise RuntimeError("host import wait called by an unknown store")
            results[0].kind = raw.ffi.WASMTIME_I32
            self._wait(g, cont, results, args[0].of.i32)
        except BaseException as e:
            trap_ret[0] = self._trap(g, e)

    def _wait(self, g: Guest, cont, results, pid: int) -> None:
        fut = g.pending.get(pid)
        if fut is None:
            g.core_error = f"pending call {pid} does not exist in this inferlet"
            results[0].of.i32 = -1
            return
        results[0].of.i32 = 0
        if fut.done():
            return
        g.waiting, g.wait_done, g.wait_out = [pid], False, (results, None)
        fut.add_done_callback(g.wake)
        cont.contents.callback = self.resume
        cont.contents.env = g.ctx_addr

    def _resume(self, env) -> bool:
        try:
            g = self.guests.get(env or 0)
            if g is None or g.waiting is None:
                return True
            if not any(p in g.pending and g.pending[p].done() for p in g.waiting):
                return False
            g.waiting = g.wait_out = None
            return True
        except BaseException:
            log.exception("sandbox: resuming a core guest failed")
            return True


def start(core: CoreLinker, g: Guest, name: str, wasm: bytes, args: Sequence[str]) -> None:
    """Instantiate ``wasm`` in ``g``'s store and start its ``run`` as ``g``'s call future
    (the caller drives it, and ends ``g`` if this raises)."""
    module = core.module(wasm)
    ctx = raw.context(g.store)
    g.core = True
    inst = raw.ffi.wasmtime_instance_t()
    trap = ctypes.POINTER(raw.ffi.wasm_trap_t)()
    err = ctypes.POINTER(raw.ffi.wasmtime_error_t)()
    fut = raw.ffi.wasmtime_linker_instantiate_async(
        core.linker.ptr(), ctx, module.ptr(), ctypes.byref(inst), ctypes.byref(trap),
        ctypes.byref(err),
    )  # fmt: skip
    try:
        while not raw.ffi.wasmtime_call_future_poll(fut):
            pass
    finally:
        raw.ffi.wasmtime_call_future_delete(fut)
    if err:
        raise SandboxError(f"instantiation failed: {raw.error(err)}")
    if trap:
        raise SandboxError(f"instantiation trapped: {raw.trap(trap)}")
    exports = {}
    for ename in ("memory", "run"):
        item = raw.ffi.wasmtime_extern_t()
        b = ename.encode()
        if not raw.ffi.wasmtime_instance_export_get(
            ctx, ctypes.byref(inst), ctypes.create_string_buffer(b), len(b), ctypes.byref(item)
        ):
            raise SandboxError(f"{name}: the module does not export `{ename}`")
        exports[ename] = item
    g.memory = exports["memory"].of.memory
    run_fn = exports["run"].of.func
    results = (raw.ffi.wasmtime_val_t * 1)()
    trap = ctypes.POINTER(raw.ffi.wasm_trap_t)()
    err = ctypes.POINTER(raw.ffi.wasmtime_error_t)()
    g.keep = [results, trap, err, run_fn, exports, list(args)]
    g.future = raw.ffi.wasmtime_func_call_async(
        ctx, ctypes.byref(run_fn), None, 0, results, 1, ctypes.byref(trap), ctypes.byref(err)
    )


def outcome(g: Guest) -> str | None:
    """The result text of a core guest whose ``run`` has finished (its call future is
    dropped); :class:`SandboxError` if it failed, trapped or was killed."""
    results, trap, err = g.keep[:3]
    raw.ffi.wasmtime_call_future_delete(g.future)
    g.future = None
    if g.kill_reason is not None:
        raise SandboxError(g.kill_reason)
    if err:
        raise SandboxError(f"the inferlet failed: {raw.error(err)}")
    if trap:
        raise SandboxError(f"the inferlet trapped: {raw.trap(trap)}")
    rc = results[0].of.i32
    if rc != 0:
        raise SandboxError(g.core_result or g.core_error or f"run returned {rc}")
    return g.core_result


def build_c(source, *, cache_dir=None, extra_flags=()) -> bytes:
    """Compile a C inferlet (and the headers next to it) with ``zig cc`` (the ``ziglang``
    package) for wasm32-freestanding; cached by the hash of the sources and flags."""
    source = Path(source)
    flags = ["--target=wasm32-freestanding", "-O2", "-nostdlib", "-Wl,--no-entry",
             *extra_flags]  # fmt: skip
    h = hashlib.sha256(" ".join(flags).encode())
    for f in [*sorted(source.parent.glob("*.h")), source]:
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    cache = Path(cache_dir) if cache_dir else cwasm_dir()
    out = cache / f"{source.stem}-{h.hexdigest()[:16]}.wasm"
    if not out.exists():
        cache.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        cmd = [sys.executable, "-m", "ziglang", "cc", *flags, "-o", str(tmp), str(source)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"zig cc failed ({r.returncode}):\n{r.stderr}")
        tmp.replace(out)
    return out.read_bytes()
