"""The sandboxed runner: inferlets as WebAssembly components on Wasmtime fibers.

A sandboxed program is Python source like a trusted one (``async def main(args)``), but
it is never executed by the host: each launch instantiates the generic Python runtime
component ("pyrt", :mod:`pastry.runtime.build_pyrt`) in its own Wasmtime ``Store`` and
runs the source there, with ``pastry.sdk`` bound to the component's imports
(``wit/pastry.wit``). The host side of every import is the instance's
:class:`~pastry.control.session.Session`, the same object trusted inferlets call, so
sandboxed and trusted inferlets share the batch scheduler and batch together.

How it is driven (one asyncio loop, no threads per guest):

- One :class:`WasmSandbox` per process: one Engine (epoch interruption; an epoch ticker
  thread), one component Linker, the compiled pyrt component.
- :func:`sandboxed_program` returns a :class:`~pastry.runtime.trusted.Program` whose
  ``main`` runs the guest, so :class:`~pastry.runtime.trusted.TrustedRuntime` launches,
  terminates and reports sandboxed instances exactly like trusted ones.
- The guest runs as a Wasmtime *call future* (a fiber). The loop polls it; it runs until
  it blocks in the host's ``wait`` import, finishes, or yields at an epoch tick. Host
  imports are shallow: they translate values, call the Session and return (queued calls
  return a ``pending`` handle at once). ``wait`` suspends the fiber until one of its
  futures completes; that future's done-callback polls the guest again.
- Limits per instance (:class:`SandboxLimits`): linear memory (store limits), CPU (thread
  time spent polling the guest, checked after every slice of at most one epoch tick),
  message size, and KV pages and embeddings held (set on the instance's resource
  managers at launch, ``ResourceManager.set_limit``). Over a limit, the instance ends with
  an error naming it; the others go on.
- What component and core-module guests share (the Engine, limits, guest state, checks
  inside host calls) is :mod:`pastry.runtime.wasm_host`; core modules' Linker is
  :mod:`pastry.runtime.wasm_core`.

Pitfalls handled here (see ``docs/sandbox.md``): the ctypes binding of
``wasmtime_context_epoch_deadline_async_yield_and_update`` declares a result the library
does not return (restype fixed to None, or reading it segfaults); a finished call future
is never polled again; every callback catches everything and reports through the error
out-parameter; an async callback always fills its continuation.
"""

from __future__ import annotations

import ast
import asyncio
import ctypes
import functools
import hashlib
import itertools
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import wasmtime
from wasmtime import _bindings
from wasmtime import _ffi as ffi
from wasmtime.component import Component, Linker
from wasmtime.component import _types as ctypes_

from pastry.api import ApiError
from pastry.control.session import Session
from pastry.runtime import build_pyrt, wasm_core
from pastry.runtime.trusted import Program, ProgramError
from pastry.runtime.wasm_host import (
    Guest,
    Kill,
    SandboxError,
    SandboxLimits,
    call_host,
    check_message,
    engine,
    error_text,
    send,
)

log = logging.getLogger(__name__)

# wasmtime-py 50 declares this as returning wasmtime_error_t*, the library returns void:
# reading the garbage "error" segfaults.
_bindings._wasmtime_context_epoch_deadline_async_yield_and_update.restype = None

API = "pastry:inferlet/api@0.1.0"


# ---------------------------------------------------------------------------- host imports


def _queued(fn: Callable) -> Callable:
    """A queued Session call: submit now, hand the guest a pending handle."""

    @functools.wraps(fn)
    def call(g: Guest, *args):
        return g.track(fn(g, *args))

    return call


def _value(v) -> ctypes_.Variant:
    if isinstance(v, ctypes_.Variant):  # built by the handler (several engines)
        return v
    if v is None:
        return ctypes_.Variant("none")
    if isinstance(v, int):
        return ctypes_.Variant("token", v)
    if isinstance(v, str):
        return ctypes_.Variant("text", v)
    if len(v) == 4:  # sample-with with logprobs
        return ctypes_.Variant("sampled", tuple(v))
    if len(v) == 3:  # forward-with-logprobs
        return ctypes_.Variant("logprobs", tuple(v))
    a, b = v
    if isinstance(a, int):
        return ctypes_.Variant("http", (a, b))
    return ctypes_.Variant("dist", (list(a), list(b)))


def _take(g: Guest, pid: int):
    fut = g.pending.pop(pid, None)
    if fut is None:
        raise ApiError(f"pending call {pid} does not exist in this inferlet")
    if not fut.done():
        g.pending[pid] = fut
        raise ApiError(f"pending call {pid} has not completed (wait for it first)")
    return _value(fut.result())  # an ApiError becomes the guest's err


def _s(g: Guest):
    return g.session


def _broadcast(g: Guest, topic: str, message: str) -> int:
    check_message(g, topic, message)
    return g.session.broadcast(topic, message)


def _store_set(g: Guest, key: str, value: str) -> None:
    check_message(g, key, value)
    g.session.store_set(key, value)


def _words(mask: list[int] | None) -> bytes | None:
    """A WIT bitmask (``list<u32>`` words) as the API's bytes."""
    return None if mask is None else np.asarray(mask, dtype="<u4").tobytes()


def _forward_with_logprobs(g: Guest, q, adapter, *args):
    *fwd, targets, top = args
    s = g.session
    if adapter is None:
        return s.forward(q, *fwd, logprob_targets=targets, logprob_top=top)
    return s.forward_with_adapter(q, adapter, *fwd, logprob_targets=targets, logprob_top=top)


def _get_next_dist_with(g: Guest, q, embed, k, mask, bias, *rest):
    return g.session.get_next_dist(q, embed, k, _words(mask), bias, *rest)


def _sample_with(g: Guest, q, embed, t, top_k, top_p, min_p, seed, mask, bias, *rest):
    return g.session.sample(q, embed, t, top_k, top_p, min_p, seed, _words(mask), bias, *rest)


def _sample_constrained(g: Guest, q, embed, t, top_k, top_p, min_p, seed, mask, bias, *rest):
    *rest, top, constraint = rest
    s = g.session
    return s.sample(
        q, embed, t, top_k, top_p, min_p, seed, _words(mask), bias, *rest, top, constraint
    )


def _constraint_mask(g: Guest, c: int) -> list[int]:
    return np.frombuffer(g.session.constraint_mask(c), dtype="<u4").tolist()


# name -> (handler(guest, *args), blocking). Handlers return the import's result; a
# blocking one (``wait``) is completed by the continuation.
HOST: dict[str, Callable] = {
    "take": _take,
    "get-arguments": lambda g: _s(g).get_arguments(),
    "get-instance-id": lambda g: _s(g).get_instance_id(),
    "get-version": lambda g: _s(g).get_version(),
    "send": send,
    "receive": lambda g: g.track(_s(g).receive()),
    "available-models": lambda g: _s(g).available_models(),
    "available-traits": lambda g, m: _s(g).available_traits(m),
    "create-queue": lambda g, m: _s(g).create_queue(m),
    "synchronize": _queued(lambda g, q: _s(g).synchronize(q)),
    "set-queue-priority": lambda g, q, p: _s(g).set_queue_priority(q, p),
    "close-queue": lambda g, q: _s(g).close_queue(q),
    "get-kv-page-size": lambda g, q: _s(g).get_kv_page_size(q),
    "alloc-kvpages": lambda g, q, n: _s(g).alloc_kvpages(q, n),
    "dealloc-kvpages": _queued(lambda g, q, p: _s(g).dealloc_kvpages(q, p)),
    "alloc-embeds": lambda g, q, n: _s(g).alloc_embeds(q, n),
    "dealloc-embeds": _queued(lambda g, q, e: _s(g).dealloc_embeds(q, e)),
    "copy-kvpage": _queued(lambda g, *a: _s(g).copy_kvpage(*a)),
    "export-kvpages": _queued(lambda g, *a: _s(g).export_kvpages(*a)),
    "import-kvpages": lambda g, q, n: _s(g).import_kvpages(q, n),
    "unexport-kvpages": lambda g, q, n: _s(g).unexport_kvpages(q, n),
    "list-exported-kvpages": lambda g, q: [tuple(x) for x in _s(g).list_exported_kvpages(q)],
    "forward": _queued(lambda g, *a: _s(g).forward(*a)),
    "forward-with-adapter": _queued(lambda g, *a: _s(g).forward_with_adapter(*a)),
    "get-adapters": lambda g, q: _s(g).get_adapters(q),
    "mask-kvpage": _queued(lambda g, q, p, m: _s(g).mask_kvpage(q, p, m)),
    "embed-txt": _queued(lambda g, *a: _s(g).embed_txt(*a)),
    "tokenize": lambda g, q, t, s=False: _s(g).tokenize(q, t, s),
    "detokenize": lambda g, q, t: _s(g).detokenize(q, t),
    "get-vocabs": lambda g, q: _s(g).get_vocabs(q),
    "get-eos-token-ids": lambda g, q: _s(g).get_eos_token_ids(q),
    "get-vocab-size": lambda g, q: _s(g).get_vocab_size(q),
    "apply-chat-template": lambda g, q, m, a: _s(g).apply_chat_template(q, m, a),
    "get-next-dist": _queued(lambda g, q, e, k: _s(g).get_next_dist(q, e, k)),
    "sample": _queued(lambda g, *a: _s(g).sample(*a)),
    "broadcast": _broadcast,
    "subscribe": lambda g, t: _s(g).subscribe(t),
    "next-message": lambda g, sub: g.track(_s(g).next_message(sub)),
    "unsubscribe": lambda g, sub: _s(g).unsubscribe(sub),
    "store-get": lambda g, k: _s(g).store_get(k),
    "store-set": _store_set,
    "store-delete": lambda g, k: _s(g).store_delete(k),
    "store-exists": lambda g, k: _s(g).store_exists(k),
    "store-list-keys": lambda g, p: _s(g).store_list_keys(p),
    "http-get": lambda g, url: g.track(_s(g).http_get(url)),
    "http-post": lambda g, url, body: g.track(_s(g).http_post(url, body)),
    "forward-with-logprobs": _queued(_forward_with_logprobs),
    "get-next-dist-with": _queued(_get_next_dist_with),
    "sample-with": _queued(_sample_with),
    "available-engines": lambda g, m: _s(g).available_engines(m),
    "create-queue-on": lambda g, m, e: _s(g).create_queue(m, e),
    "get-queue-engine": lambda g, q: _s(g).get_queue_engine(q),
    "get-engine-load": lambda g, m: [tuple(x) for x in _s(g).get_engine_load(m)],
    "route": lambda g, q, p, w: _variant(g, "placed", _s(g).route(q, p, w)),
    "prep-recv": lambda g, q, p, e: _variant(g, "received", _s(g).prep_recv(q, p, e)),
    "remote-send": _queued(lambda g, *a: _s(g).remote_send(*a)),
    "start-generate": lambda g, q, p, b, r: _s(g).start_generate(q, p, b, r),
    "next-request": lambda g: _variant(g, "request", _s(g).next_request()),
    "reject-request": lambda g, r, why: _s(g).reject_request(r, why),
    "sample-constrained": _queued(_sample_constrained),
    "create-constraint": lambda g, q, grammar: _s(g).create_constraint(q, grammar),
    "constraint-state": lambda g, c: _s(g).constraint_state(c),
    "constraint-consume": lambda g, c, tokens: _s(g).constraint_consume(c, tokens),
    "constraint-mask": _constraint_mask,
    "free-constraint": lambda g, c: _s(g).free_constraint(c),
}


def _variant(g: Guest, case: str, fut: asyncio.Future) -> int:
    """Track ``fut`` for the guest, its result taken as the ``value`` case ``case``."""
    out = asyncio.get_running_loop().create_future()

    def done(f: asyncio.Future) -> None:
        if f.cancelled():
            out.cancel()
        elif f.exception() is not None:
            out.set_exception(f.exception())
        else:
            out.set_result(ctypes_.Variant(case, tuple(f.result())))

    fut.add_done_callback(done)
    return g.track(out)


# ---------------------------------------------------------------------------- ctypes glue


class _Callbacks:
    """The ctypes callbacks shared by every guest (module-level so they outlive them)."""

    def __init__(self, sandbox: WasmSandbox) -> None:
        self.sandbox = sandbox
        self.names: list[str] = []
        self.types: dict[int, tuple[list, Any]] = {}  # function index -> (params, result)
        self.host = ffi.wasmtime_component_func_async_callback_t(self._host_call)
        self.done = ffi.wasmtime_func_async_continuation_callback_t(lambda env: True)
        self.resume = ffi.wasmtime_func_async_continuation_callback_t(self._resume)
        self.noop = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(lambda env: None)

    def _host_call(self, env, context, ty, args, nargs, results, nresults, err_ret, cont):
        # Runs on the guest's fiber. Never raises: every failure becomes a trap.
        cont.contents.callback = self.done
        cont.contents.env = None
        cont.contents.finalizer = self.noop
        g = None
        try:
            idx = env or 0
            name = self.names[idx]
            g = self.sandbox._guests.get(ctypes.cast(context, ctypes.c_void_p).value)
            if g is None:
                raise RuntimeError(f"host import {name} called by an unknown store")
            params, rty = self._types(idx, ty)
            pyargs = [t.convert_from_c(args[i]) for i, (_, t) in enumerate(params)]
            if name == "wait":
                self._wait(g, cont, results, rty, *pyargs)
                return
            try:
                value = call_host(HOST[name], g, *pyargs)
                ok = True
            except Kill:
                raise
            except Exception as e:
                if not isinstance(rty, ctypes_.ResultType):
                    raise
                ok, value = False, error_text(e)
            if rty is None:
                return
            if isinstance(rty, ctypes_.ResultType):
                value = _result(rty, ok, value)
            rty.convert_to_c(None, value, results)
        except BaseException as e:
            msg = error_text(e)
            if g is not None:
                if isinstance(e, Kill):
                    g.kill_reason = str(e)
                elif not isinstance(e, ApiError):
                    log.warning("host import failed in inferlet %d:\n%s", g.id, msg)
            err_ret[0] = ffi.wasmtime_error_new(msg.encode("utf-8", "replace"))

    def _types(self, idx: int, ty) -> tuple[list, Any]:
        t = self.types.get(idx)
        if t is None:
            fty = ctypes_.FuncType._from_ptr(ty, owner=self)
            rty = fty.result  # a property: a new object each time
            t = self.types[idx] = (fty.params, rty)
            if isinstance(rty, ctypes_.ResultType):
                _TAGGED[id(rty)] = rty._tagged()  # costly: once per import
            for case in [rty, *(p for _, p in fty.params)]:
                _freeze_cases(case)
        return t

    def _wait(self, g: Guest, cont, results, rty, pids: list[int], timeout_ns: int | None):
        for pid in pids:
            if pid not in g.pending:
                raise ApiError(f"pending call {pid} does not exist in this inferlet")
        ready = [p for p in pids if g.pending[p].done()]
        if ready or timeout_ns == 0:
            rty.convert_to_c(None, ready, results)
            return
        g.waiting, g.wait_done, g.wait_out = pids, False, (results, rty)
        for pid in pids:
            g.pending[pid].add_done_callback(g.wake)
        if timeout_ns is not None:
            g.timer = asyncio.get_running_loop().call_later(timeout_ns / 1e9, g.wake, None)
        cont.contents.callback = self.resume
        cont.contents.env = g.ctx_addr

    def _resume(self, env) -> bool:
        # Polled (on the fiber) each time the loop polls a guest blocked in ``wait``.
        try:
            g = self.sandbox._guests.get(env or 0)
            if g is None or g.waiting is None:
                return True
            ready = [p for p in g.waiting if p in g.pending and g.pending[p].done()]
            if not ready and not g.wait_done:
                return False
            results, rty = g.wait_out
            g.waiting = g.wait_out = None
            if g.timer is not None:
                g.timer.cancel()
                g.timer = None
            rty.convert_to_c(None, ready, results)
            return True
        except BaseException:
            log.exception("sandbox: resuming a guest failed")
            return True  # the unwritten result makes the call fail: a trap, not a crash


def _result(rty, ok: bool, value):
    tag = "ok" if ok else "err"
    return ctypes_.Variant(tag, value) if _TAGGED[id(rty)] else value


_TAGGED: dict[int, bool] = {}  # id(result type) -> does wasmtime-py want a Variant


def _freeze_cases(ty) -> None:
    """Compute once the cases of ``ty`` and of the variants, results and options in it.

    wasmtime-py lowers a variant by listing its cases twice (``_tagged`` and ``_cases``),
    building every case's type through ctypes each time: ~150 us per ``take`` (10 cases)
    instead of ~12 us, most of a sandboxed inferlet's per-call cost. A host import's types
    never change, so the lists are computed here once and returned from then on.
    """
    if not isinstance(ty, ctypes_.VariantLikeType) or "_cases" in vars(ty):
        return
    cases = ty._cases()
    for _, case in cases:
        _freeze_cases(case)
    tagged = ty._tagged()
    ty._cases = lambda: cases
    ty._tagged = lambda: tagged


# ---------------------------------------------------------------------------- the sandbox


class WasmSandbox:
    """Runs sandboxed inferlets in this process (use :func:`sandbox` for the shared one)."""

    def __init__(self, pyrt: Path | None = None) -> None:
        self.engine = engine()
        path = pyrt or build_pyrt.cached_path()
        if not path.exists():
            raise FileNotFoundError(
                f"the Python runtime component is not built ({path}): run "
                "`python -m pastry.runtime.build_pyrt`"
            )
        t0 = time.perf_counter()
        self.component = Component.deserialize_file(self.engine, str(path))
        self.load_ms = (time.perf_counter() - t0) * 1e3
        self._cb = _Callbacks(self)
        self.linker = Linker(self.engine)
        self.linker.add_wasip2()
        with self.linker.root() as root, root.add_instance(API) as inst:
            self._cb.names.append("")  # index 0 is never used (a NULL env)
            for name in ("wait", *HOST):
                self._cb.names.append(name)
                name_b = name.encode()
                err = ffi.wasmtime_component_linker_instance_add_func_async(
                    inst.ptr(),
                    ctypes.create_string_buffer(name_b),
                    len(name_b),
                    self._cb.host,
                    len(self._cb.names) - 1,
                    self._cb.noop,
                )
                if err:
                    raise wasmtime.WasmtimeError._from_ptr(err)
        self._guests: dict[int, Guest] = {}
        self._ids = itertools.count(1)
        self._core: wasm_core.CoreLinker | None = None
        self._components: dict[str, Component] = {}  # sha256 -> compiled inferlet component

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

        g = self._new_guest(api(), limits, wasi=False)
        try:
            wasm_core.start(self._core_linker(), g, name, wasm, args)
        except BaseException:
            self._end(g)
            raise
        self._schedule(g)
        try:
            return await g.result
        finally:
            self._end(g)

    # ------------------------------------------------------------------ running a guest

    async def run(
        self, name: str, source: str, args: list[str], limits: SandboxLimits = SandboxLimits()
    ) -> str | None:
        """Run ``source``'s ``main(args)`` in a fresh instance bound to the calling
        inferlet's Session (call inside a runner task, e.g. :class:`TrustedRuntime`)."""
        from pastry.sdk import api

        g = self._start(api(), limits, self.component, "run-source", (name, source, list(args)))
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
        g = self._start(api(), limits, comp, "run", (list(args),))
        try:
            return await g.result
        finally:
            self._end(g)

    def _new_guest(self, session: Session, limits: SandboxLimits, wasi: bool) -> Guest:
        """A registered guest with a fresh Store under ``limits`` (also set on the session:
        KV pages and embeddings), yielding at every epoch tick; nothing runs yet."""
        limits.apply(session)
        store = wasmtime.Store(self.engine)
        store.set_limits(memory_size=limits.memory_bytes)
        if wasi:
            store.set_wasi(wasmtime.WasiConfig())  # no files, env, args, sockets or stdio
        ctx = store._context()
        g = Guest(
            session.instance, session, limits, store, asyncio.get_running_loop().create_future()
        )
        g.ctx_addr = ctypes.cast(ctx, ctypes.c_void_p).value
        g.wake = functools.partial(self._wake, g)
        self._guests[g.ctx_addr] = g
        ffi.wasmtime_context_epoch_deadline_async_yield_and_update(ctx, 1)
        return g

    def _start(self, session, limits, component: Component, export: str, values) -> Guest:
        g = self._new_guest(session, limits, wasi=True)
        store, ctx = g.store, g.store._context()
        try:
            instance = self._instantiate(store, component)
            func = instance.get_func(store, export)
            if func is None:
                raise SandboxError(f"the component does not export `{export}`")
            fty = func.type(store)
            params = (ffi.wasmtime_component_val_t * len(values))()
            for i, ((_, t), v) in enumerate(zip(fty.params, values, strict=True)):
                t.convert_to_c(store, v, ctypes.pointer(params[i]))
            result = ffi.wasmtime_component_val_t()
            err = ctypes.POINTER(ffi.wasmtime_error_t)()
            g.result_ty = fty.result
            g.keep = [params, result, err, func]
            g.future = ffi.wasmtime_component_func_call_async(
                ctypes.byref(func._func), ctx, params, len(values), ctypes.byref(result), 1,
                ctypes.byref(err),
            )  # fmt: skip
        except BaseException:
            self._end(g)
            raise
        self._schedule(g)
        return g

    def _instantiate(self, store: wasmtime.Store, component: Component):
        from wasmtime.component._instance import Instance as CInstance

        raw = ffi.wasmtime_component_instance_t()
        err = ctypes.POINTER(ffi.wasmtime_error_t)()
        fut = ffi.wasmtime_component_linker_instantiate_async(
            self.linker.ptr(), store._context(), component.ptr(), ctypes.byref(raw),
            ctypes.byref(err),
        )  # fmt: skip
        try:
            while not ffi.wasmtime_call_future_poll(fut):
                pass  # epoch yields only
        finally:
            ffi.wasmtime_call_future_delete(fut)
        if err:
            raise SandboxError(f"instantiation failed: {wasmtime.WasmtimeError._from_ptr(err)}")
        return CInstance._from_raw(raw)

    def _schedule(self, g: Guest) -> None:
        if not g.scheduled and not g.finished:
            g.scheduled = True
            asyncio.get_running_loop().call_soon(self._step, g)

    def _wake(self, g: Guest, _fut=None) -> None:
        """A future the guest waits on completed (or its timeout passed)."""
        if g.finished or g.waiting is None:
            return
        if _fut is None:
            g.wait_done = True
        if not g.polling:
            self._step(g)

    def _step(self, g: Guest) -> None:
        """Run the guest until it blocks, yields at an epoch tick, or ends."""
        g.scheduled = False
        if g.finished or g.polling:
            return
        ctx = g.store._context()
        ffi.wasmtime_context_set_epoch_deadline(ctx, 1)
        t0 = time.thread_time_ns()
        g.polling = True
        try:
            done = ffi.wasmtime_call_future_poll(g.future)
        finally:
            g.polling = False
            g.cpu_ns += time.thread_time_ns() - t0
            g.slices += 1
        if done:
            self._complete(g)
        elif g.kill_reason is not None:
            self._fail(g, g.kill_reason)
        elif g.cpu_ns > g.limits.cpu_seconds * 1e9:
            self._fail(g, f"CPU budget of {g.limits.cpu_seconds:g} s exceeded")
        elif g.waiting is None:
            self._schedule(g)  # yielded at an epoch tick: let the others run, then go on

    def _complete(self, g: Guest) -> None:
        if g.core:
            try:
                result = wasm_core.outcome(g)
            except SandboxError as e:
                return self._fail(g, str(e))
            return self._finish(g, result)
        _params, result, err, _func = g.keep[:4]
        ffi.wasmtime_call_future_delete(g.future)
        g.future = None
        if g.kill_reason is not None:
            return self._fail(g, g.kill_reason)
        if err:
            trap = wasmtime.WasmtimeError._from_ptr(err)
            return self._fail(g, f"the inferlet trapped: {trap}")
        out = g.result_ty.convert_from_c(result)
        tag, payload = (out.tag, out.payload) if isinstance(out, ctypes_.Variant) else ("ok", out)
        if tag == "ok":
            self._finish(g, payload)
        else:
            self._fail(g, payload)

    def _fail(self, g: Guest, message: str) -> None:
        self._finish(g, SandboxError(message))

    def _finish(self, g: Guest, outcome) -> None:
        if not g.result.done():
            if isinstance(outcome, BaseException):
                g.result.set_exception(outcome)
            else:
                g.result.set_result(outcome)
        self._end(g)

    def _end(self, g: Guest) -> None:
        """Drop the guest (its fiber, store and pending calls). Idempotent; deferred while
        the guest is being polled."""
        if g.finished:
            return
        if g.polling:
            g.kill_reason = g.kill_reason or "terminated"
            return
        g.finished = True
        if g.future is not None:
            ffi.wasmtime_call_future_delete(g.future)
            g.future = None
        if g.timer is not None:
            g.timer.cancel()
        for fut in g.pending.values():
            fut.remove_done_callback(g.wake)
            if not fut.done():
                fut.cancel()
        g.pending.clear()
        self._guests.pop(g.ctx_addr, None)
        if not g.result.done():
            g.result.set_exception(SandboxError(g.kill_reason or "terminated"))
        if g.keep and not g.core:  # the call's arguments are ours to free
            for v in g.keep[0]:
                ffi.wasmtime_component_val_delete(ctypes.byref(v))
        g.keep = []
        g.wait_out = None


_shared: WasmSandbox | None = None


def sandbox() -> WasmSandbox:
    """The process's sandbox (created on first use; needs the built pyrt)."""
    global _shared
    if _shared is None:
        _shared = WasmSandbox()
    return _shared


def sandboxed_program(
    name: str, source: str, limits: SandboxLimits = SandboxLimits(), box: WasmSandbox | None = None
) -> Program:
    """A :class:`Program` whose instances run ``source`` in the sandbox. The host only
    compiles it (a syntax check, nothing runs); launch it with any runner."""
    try:
        tree = ast.parse(source, f"<inferlet {name}>")
        compile(tree, f"<inferlet {name}>", "exec", dont_inherit=True)
    except SyntaxError as e:
        raise ProgramError(f"{name}: syntax error at line {e.lineno}: {e.msg}") from None
    except (ValueError, RecursionError, MemoryError) as e:
        raise ProgramError(f"{name}: cannot compile: {e}") from None
    # The entry point, checked statically (the host never runs untrusted code).
    mains = [
        n
        for n in tree.body
        if isinstance(n, ast.AsyncFunctionDef | ast.FunctionDef) and n.name == "main"
    ]
    if not mains or not isinstance(mains[-1], ast.AsyncFunctionDef):
        raise ProgramError(f"{name}: an inferlet must define `async def main(args)`")
    a = mains[-1].args
    if len(a.posonlyargs) + len(a.args) != 1 or a.vararg or a.kwonlyargs or a.kwarg:
        raise ProgramError(f"{name}: main must take exactly one parameter (the argument list)")
    digest = hashlib.sha256(source.encode()).hexdigest()
    box = box or sandbox()

    async def main(args: list[str]) -> str | None:
        return await box.run(name, source, args, limits)

    return Program(name, digest, main)


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
