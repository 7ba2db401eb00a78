"""What the two kinds of sandboxed guests share on the host side.

Components (:mod:`pastry.runtime.wasm`: Python through pyrt, JavaScript, any language with a
WIT binding) and core modules (:mod:`pastry.runtime.wasm_core`: C, Zig, ...) run on one
Wasmtime :func:`engine`, under the same :class:`SandboxLimits`, with the same per-guest
driving state (:class:`Guest`) and the same checks inside host calls. This module imports
neither of them (nor :mod:`pastry.runtime.build_pyrt`, which compiles with :func:`engine`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import re
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import wasmtime

from pastry.api import ApiError
from pastry.control.http import HttpError
from pastry.control.session import QuotaError, Session
from pastry.runtime import wasmtime_raw as raw
from pastry.runtime.trusted import InferletFailure

log = logging.getLogger(__name__)


class SandboxError(InferletFailure):
    """A sandboxed inferlet failed: its traceback, a trap, or a limit it went over (the
    message is what its client sees; no host traceback)."""


@dataclass(frozen=True)
class SandboxLimits:
    memory_bytes: int = 256 * 2**20  # linear memory of the whole component
    cpu_seconds: float = 30.0  # host thread time spent running the guest
    max_kv_pages: int | None = None  # KV pages held at once (None: only the pool limits)
    max_embeds: int | None = None  # embedding slots held at once (None: only the pool)
    max_message_bytes: int = 1 << 20  # one send / broadcast / store value
    max_constraints: int = 32  # grammar constraints held by the host at once
    wall_seconds: float | None = 3600.0  # lifetime, sleeping and waiting included (None: none)
    compile_cpu_seconds: float = 5.0  # checking and compiling the source (once per program)

    def apply(self, session: Session) -> None:
        """Set the resource limits (KV pages, embeddings, grammar constraints) on the
        instance's session."""
        if self.max_kv_pages is not None:
            session.set_limit("kv", self.max_kv_pages, "SandboxLimits.max_kv_pages")
        if self.max_embeds is not None:
            session.set_limit("embed", self.max_embeds, "SandboxLimits.max_embeds")
        session.max_constraints = self.max_constraints


@dataclass(frozen=True)
class WasmEngineConfig:
    tick_ms: float = 2.0  # epoch period: the longest a guest runs before yielding
    async_stack_bytes: int = 4 << 20  # fiber stack (host callbacks run on it too)
    max_wasm_stack_bytes: int = 1 << 20


_engine: wasmtime.Engine | None = None
_engine_lock = threading.Lock()


def engine(config: WasmEngineConfig = WasmEngineConfig()) -> wasmtime.Engine:
    """The process's Engine, with epoch interruption and its ticker thread (the first
    call's ``config`` wins)."""
    global _engine
    with _engine_lock:
        if _engine is None:
            cfg = wasmtime.Config()
            cfg.wasm_component_model = True
            cfg.epoch_interruption = True
            cfg.max_wasm_stack = config.max_wasm_stack_bytes
            raw.ffi.wasmtime_config_async_stack_size_set(cfg.ptr(), config.async_stack_bytes)
            eng = wasmtime.Engine(cfg)
            threading.Thread(
                target=_tick, args=(eng, config.tick_ms / 1e3), name="wasm-epoch", daemon=True
            ).start()
            _engine = eng
        return _engine


def _tick(eng: wasmtime.Engine, period: float) -> None:
    while True:
        time.sleep(period)
        eng.increment_epoch()


class Kill(Exception):
    """Raised inside a host call to end its instance (a limit was exceeded)."""


@dataclass(eq=False)
class Guest:
    """One guest instance and its driving state. A pre-started one (``session`` None) is
    parked in a launcher import until a launch binds it (:meth:`~pastry.runtime.wasm_run.Runner.bind`)."""

    id: int
    session: Session | None
    limits: SandboxLimits
    store: wasmtime.Store
    result: asyncio.Future | None = None
    ctx: Any = None  # its store's context pointer
    ctx_addr: int = 0
    future: Any = None  # the wasmtime_call_future_t of the guest's entry point
    keep: list = field(default_factory=list)  # ctypes buffers alive while the call runs
    result_ty: Any = None
    pending: dict[int, asyncio.Future] = field(default_factory=dict)
    values: dict[int, Callable] = field(default_factory=dict)  # pid -> its value case maker
    hooked: set[int] = field(default_factory=set)  # pending calls whose future wakes us
    pids: itertools.count = field(default_factory=lambda: itertools.count(1))
    waiting: list[int] | None = None  # pids the fiber is blocked on
    wait_done: bool = False
    wait_out: tuple | None = None  # (results pointer, type) of the blocked wait
    wake: Callable | None = None  # done-callback resuming the guest
    timer: asyncio.TimerHandle | None = None
    cpu_ns: int = 0
    slices: int = 0
    polling: bool = False  # being polled (or about to be, in this section)
    scheduled: bool = False  # in the loop's next polling section
    returned: bool = False  # its call future completed at the last poll
    finished: bool = False
    kill_reason: str | None = None
    core: bool = False  # a core-module guest (pastry.runtime.wasm_core)
    memory: Any = None  # its wasmtime_memory_t
    core_result: str | None = None
    core_error: str | None = None
    parked: bool = False  # blocked in a launcher import (load- or start-inferlet)
    stage: int = 0  # launcher imports answered (wasm_waits.LAUNCH_STAGES)
    code: Any = None  # the wasm.Code it runs (set when loaded ahead, or at its launch)
    args: list[str] | None = None  # for start-inferlet, set when bound
    source: str | None = None  # the inferlet's source (for its tracebacks)
    deadline: asyncio.TimerHandle | None = None  # the wall-clock limit's timer
    wall_end: float = 0.0  # loop.time() when the wall-clock limit ends it
    probe: tuple[int, bytes] | None = None  # (offset, marker) from memory-probe
    mem_base: int | None = None  # where its linear memory is, once found
    host_call: asyncio.Future | None = None  # what a suspending HOST import waits on

    def track(self, fut, value: Callable | None = None) -> int:
        """A pending handle for ``fut`` (a future or coroutine); ``value`` makes the WIT
        ``value`` case of its result when it is taken."""
        pid = next(self.pids)
        self.pending[pid] = asyncio.ensure_future(fut)
        if value is not None:
            self.values[pid] = value
        return pid


def call_host(fn: Callable, g: Guest, *args: Any) -> Any:
    """``fn(g, *args)``; going over a resource limit ends the instance (:class:`Kill`)."""
    try:
        return fn(g, *args)
    except QuotaError as e:
        raise Kill(str(e)) from None


def check_message(g: Guest, *texts: str) -> None:
    n = sum(len(t.encode()) for t in texts)
    if n > g.limits.max_message_bytes:
        raise Kill(f"a message of {n} bytes exceeds the limit of {g.limits.max_message_bytes}")


def send(g: Guest, message: str) -> None:
    check_message(g, message)
    g.session.send(message)


def error_text(e: BaseException, where: str = "a host call") -> str:
    """What the guest is told about ``e``: the message of an :class:`ApiError` or a
    limit, else the exception's type and message. Never a host traceback or a server
    path: an unexpected error is logged here in full and the guest gets its type only."""
    if isinstance(e, ApiError | Kill):
        return str(e)
    if isinstance(e, _TOLD):
        return f"{where} failed: {type(e).__name__}: {_no_paths(str(e))}"
    log.warning("sandbox: %s failed:\n%s", where, "".join(traceback.format_exception(e)))
    return f"{where} failed: internal error ({type(e).__name__}; logged on the server)"


# Errors whose message is about the guest's request (a bad value, a denied or failed URL):
# the guest gets their message. Anything else is a host bug: logged, not shown.
_TOLD = (ValueError, TypeError, LookupError, OSError, HttpError)


def _no_paths(text: str) -> str:
    """``text`` with absolute file paths cut to their last component."""
    return re.sub(r"(?<![\w.:/])/(?:[\w.+-]+/)+([\w.+-]+)", r"\1", text)
