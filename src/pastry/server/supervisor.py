"""Engines that come back: the server supervises the engine processes it started, and the
remote engines it connected to (``--engine``: reconnected when lost).

An :class:`EngineSupervisor` is the engine handle the controller holds for one engine
process. It forwards batches to the process and watches it: a process that exits or is
killed (the connection drops, or ``poll()`` says so), or that hangs (a batch unanswered
for ``hang_timeout`` seconds, or an idle engine that does not answer a ping within it),
is *lost*. Then, at once and in this order:

1. the instances that held anything on the engine (KV pages, embeddings, host pages: all
   gone with its memory) are terminated with a reason that says so (their clients get a
   ``Terminated``; the OpenAI and SGLang endpoints answer 503);
2. the engine's page table is emptied (``ResourceManager.device_lost``: persistent
   exports, the prefix cache and what provenance certified named the lost memory) and
   checked (``check_integrity``); everything else (other instances, other engines) goes
   on;
3. a new process is started with the same configuration, in a worker thread, retried
   with backoff (1 s doubling to 30 s) until it serves (a remote engine: connected to
   again, with the same backoff, until its host serves it again:
   :class:`~pastry.server.engines.RemoteHost`). The adapters loaded and unloaded while
   it served are loaded and unloaded again, in order, so that it comes back with the
   same adapters under the same ids. Batches that arrive meanwhile wait
   for it (up to ``hold_timeout``; after that their instances are terminated too), and
   the router skips the engine (``alive`` is false) when the model has others.

``/health`` reports ``degraded`` while an engine is not up (:func:`health`), and
``pastry_engine_restarts_total`` / ``pastry_engine_up`` are on ``/metrics``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from pastry.server import metrics
from pastry.wire.calls import EngineInfo, Result
from pastry.wire.handle import EngineDied, EngineError, EngineHandle

if TYPE_CHECKING:
    from pastry.server.running import RunningServer

log = logging.getLogger(__name__)

UP, RESTARTING, DOWN = "up", "restarting", "down"
HANG_TIMEOUT_S = 120.0
"""A batch (or, idle, a ping) unanswered this long means the engine hangs: it is killed
and restarted. Longer than any batch of a healthy engine (a full prefill chunk of a large
model on a slow CPU takes seconds)."""
PING_EVERY_S = 5.0  # an idle engine is pinged this often
HOLD_TIMEOUT_S = 600.0  # a batch waits this long for a restarting engine
BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)

Starter = Callable[[], Awaitable[tuple[Any, EngineHandle]]]
"""Starts the engine process: ``(process, handle)``; the process has ``pid``, ``poll()``
(via ``process``) and ``terminate()`` (an :class:`~pastry.wire.spawn.EngineProcess`)."""


class EngineSupervisor(EngineHandle):
    """One engine process, restarted when lost (see the module docstring). Make it with
    :meth:`start`; :meth:`watch` begins supervision once the controller exists, with
    ``on_lost(supervisor, reason)`` releasing what the server held on the engine."""

    def __init__(
        self,
        name: str,
        starter: Starter,
        hang_timeout: float = HANG_TIMEOUT_S,
        hold_timeout: float = HOLD_TIMEOUT_S,
        ping_every: float = PING_EVERY_S,
    ) -> None:
        self.name = name
        self._starter = starter
        self.hang_timeout = hang_timeout
        self.hold_timeout = hold_timeout
        self.ping_every = ping_every
        self.state = DOWN
        self.restarts = 0
        self.last_failure: str | None = None
        self._proc: Any = None
        self._handle: EngineHandle | None = None
        self._info: EngineInfo | None = None
        self._up = asyncio.Event()
        self._inflight: dict[int, float] = {}  # batch id -> when it was sent
        self._ids = 0
        self._last_answer = time.monotonic()
        self._on_lost: Callable[[EngineSupervisor, str], None] | None = None
        self._watchdog: asyncio.Task | None = None
        self._restarting: asyncio.Task | None = None
        self._closed = False
        # adapters loaded and unloaded while it served, in order: replayed on a restarted
        # engine, so that it has the same adapters under the same ids
        self._adapter_ops: list[tuple[str, str | None]] = []

    @classmethod
    async def start(cls, name: str, starter: Starter, **kw: Any) -> EngineSupervisor:
        self = cls(name, starter, **kw)
        self._proc, self._handle = await starter()
        self._info = self._handle.info
        self._set_up()
        return self

    def watch(self, on_lost: Callable[[EngineSupervisor, str], None]) -> None:
        """Begin supervision; ``on_lost`` is called (on the loop) each time it is lost."""
        self._on_lost = on_lost
        if self._watchdog is None:
            self._watchdog = asyncio.get_running_loop().create_task(self._watch())

    # ------------------------------------------------------------------ EngineHandle

    @property
    def info(self) -> EngineInfo:
        assert self._info is not None
        return self._info

    @property
    def alive(self) -> bool:
        return self.state == UP and self._handle is not None and self._handle.alive

    @property
    def pid(self) -> int | None:
        return getattr(self._proc, "pid", None)

    async def execute(self, batch: Sequence[Any]) -> list[Result]:
        if self.state != UP:
            await self._wait_up()
        handle = self._handle
        assert handle is not None
        self._ids += 1
        bid = self._ids
        self._inflight[bid] = time.monotonic()
        try:
            results = await handle.execute(batch)
        except EngineError as e:
            if handle is self._handle and self.state == UP and not handle.alive:
                self._lost(f"lost the connection while running a batch ({e})")
            if handle is not self._handle or self.state != UP:
                raise EngineDied(
                    f"engine {self.name} was lost while running this batch "
                    f"({self.last_failure}); it is restarting"
                ) from None
            raise
        finally:
            self._inflight.pop(bid, None)
        self._last_answer = time.monotonic()
        return results

    def execute_sync(self, batch: Sequence[Any]) -> list[Result]:
        raise EngineError("a supervised engine is used from the server's event loop only")

    async def load_adapter(self, name: str, path: str) -> EngineInfo:
        """Load adapter ``name`` on the engine (kept across its restarts)."""
        if self.state != UP:
            await self._wait_up()
        assert self._handle is not None
        self._info = await self._handle.load_adapter(name, path)
        self._adapter_ops.append((name, path))
        return self._info

    async def unload_adapter(self, name: str) -> EngineInfo:
        """Unload adapter ``name`` from the engine (and from what a restart replays)."""
        if self.state != UP:
            await self._wait_up()
        assert self._handle is not None
        self._info = await self._handle.unload_adapter(name)
        self._adapter_ops.append((name, None))
        return self._info

    async def aclose(self) -> None:
        self._closed = True
        for task in (self._watchdog, self._restarting):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        await self._drop_process()

    def close(self) -> None:
        self._closed = True
        if self._proc is not None:
            self._proc.terminate()

    def terminate(self, timeout: float = 10.0) -> None:
        """Stop the process (the server's shutdown, after :meth:`aclose`)."""
        self.close()

    # ------------------------------------------------------------------ supervision

    def kill(self) -> None:
        """SIGKILL the engine process (for a hung engine; tests use it too)."""
        if self.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)

    def _exited(self) -> int | None:
        process = getattr(self._proc, "process", None)
        return process.poll() if process is not None else None

    async def _watch(self) -> None:
        while not self._closed:
            await asyncio.sleep(0.25)
            if self.state != UP:
                continue
            handle = self._handle
            code = self._exited()
            if code is not None:
                self._lost(f"the engine process exited with code {code}")
            elif handle is not None and not handle.alive:
                self._lost("lost the connection to the engine process")
            elif (
                self._inflight
                and time.monotonic() - min(self._inflight.values()) > self.hang_timeout
            ):
                self._hung(f"a batch got no answer for {self.hang_timeout:g} s")
            elif not self._inflight and time.monotonic() - self._last_answer > self.ping_every:
                await self._ping(handle)

    async def _ping(self, handle: Any) -> None:
        ping = getattr(handle, "ping", None)
        if ping is None:
            self._last_answer = time.monotonic()
            return
        try:
            await ping(timeout=self.hang_timeout)
            self._last_answer = time.monotonic()
        except EngineError as e:
            if handle is self._handle and self.state == UP:
                if handle.alive and self._exited() is None:
                    self._hung(f"no answer to a ping for {self.hang_timeout:g} s ({e})")
                else:
                    self._lost(f"lost the connection to the engine process ({e})")

    def _hung(self, why: str) -> None:
        log.error("engine %s (pid %s) hangs: %s; killing it", self.name, self.pid, why)
        self.kill()
        self._lost(f"it hung ({why}) and was killed")

    def _lost(self, reason: str) -> None:
        """The engine is gone: release what it held, then restart it (once per loss)."""
        if self.state != UP or self._closed:
            return
        self.state = RESTARTING
        self._up.clear()
        self.restarts += 1
        self.last_failure = reason
        log.error("engine %s (pid %s) lost: %s; restarting it", self.name, self.pid, reason)
        metrics.engine_restarted(self.name)
        if self._on_lost is not None:
            try:
                self._on_lost(self, reason)
            except Exception:  # the restart must happen whatever the bookkeeping did
                log.exception("releasing what engine %s held failed", self.name)
        self._restarting = asyncio.get_running_loop().create_task(self._restart())

    async def _restart(self) -> None:
        await self._drop_process()
        attempt = 0
        while not self._closed:
            try:
                proc, handle = await self._starter()
            except Exception as e:  # the engine cannot start now: keep trying
                self.state = DOWN
                self.last_failure = f"restart failed: {e}"
                delay = BACKOFF_S[min(attempt, len(BACKOFF_S) - 1)]
                log.error("engine %s did not restart (%s); next try in %g s", self.name, e, delay)
                attempt += 1
                await asyncio.sleep(delay)
                continue
            try:  # (an engine that ran on, its link back, has them all still)
                info = handle.info
                if info.adapters != self.info.adapters:
                    info = await _replay_adapters(handle, self._adapter_ops)
            except Exception as e:
                info = None
                log.error("engine %s: reloading its adapters failed: %s", self.name, e)
            if info is None or not _same_engine(self.info, info):
                await handle.aclose()
                proc.terminate()
                self.state = DOWN
                self.last_failure = "the restarted engine differs from the one it replaces"
                log.error("engine %s: %s; not using it", self.name, self.last_failure)
                return
            self._proc, self._handle, self._info = proc, handle, info
            self._set_up()
            log.info("engine %s is back (pid %s, restart %d)", self.name, self.pid, self.restarts)
            return

    def _set_up(self) -> None:
        self.state = UP
        self._last_answer = time.monotonic()
        self._inflight.clear()
        self._up.set()

    async def _wait_up(self) -> None:
        try:
            await asyncio.wait_for(self._up.wait(), self.hold_timeout)
        except TimeoutError:
            if self._on_lost is not None:  # what was placed on it meanwhile cannot run
                self._on_lost(self, f"it has been down for {self.hold_timeout:g} s")
            raise EngineDied(
                f"engine {self.name} is down ({self.last_failure}) and did not come back "
                f"within {self.hold_timeout:g} s"
            ) from None

    async def _drop_process(self) -> None:
        handle, proc = self._handle, self._proc
        self._handle = None
        if handle is not None:
            with contextlib.suppress(Exception):
                await handle.aclose()
        if proc is not None:
            self._proc = None
            await asyncio.to_thread(proc.terminate, 5.0)


async def _replay_adapters(handle: EngineHandle, ops: list[tuple[str, str | None]]) -> EngineInfo:
    """Load and unload on a restarted engine what its predecessor did, in order (the
    same adapters under the same ids); the engine's info after it."""
    info = handle.info
    for name, path in ops:
        info = await (handle.load_adapter(name, path) if path else handle.unload_adapter(name))
    return info


def _same_engine(old: EngineInfo, new: EngineInfo) -> bool:
    keys = ("model_name", "vocab_size", "num_pages", "num_embeds", "page_size", "dtype",
            "num_host_pages", "max_batch_tokens", "adapters")  # fmt: skip
    return all(getattr(old, k, None) == getattr(new, k, None) for k in keys)


def release_lost_engine(server: RunningServer, supervisor: EngineSupervisor, reason: str) -> None:
    """``on_lost`` for a server's engine: end the instances that held anything on it, with
    a reason naming the engine, and empty its page table (checked)."""
    controller, runtime = server.controller, server.runtime
    if controller is None or runtime is None:
        return
    why = (
        f"engine {supervisor.name} failed ({reason}) and is restarting; what this "
        "request had computed on it was lost: retry it"
    )
    for m in controller.all_engines():
        if m.engine is not supervisor:
            continue
        res = m.resources
        for iid in res.holders():
            if iid in runtime.instances:
                runtime.terminate(iid, why)
            controller.end_session(iid)  # idempotent: terminate released it already
        res.device_lost()
        res.check_integrity()
        m.scheduler.wake()


def health(server: RunningServer) -> tuple[str, list[dict]]:
    """``("ok" | "degraded", engines)``: each supervised engine's state."""
    rows = []
    for m in server.controller.all_engines() if server.controller else []:
        eng = m.engine
        state = getattr(eng, "state", UP if eng.alive else DOWN)
        rows.append({
            "model": m.name, "rank": m.rank, "state": state,
            "restarts": getattr(eng, "restarts", 0),
            **({"last_failure": eng.last_failure} if getattr(eng, "last_failure", None) else {}),
        })  # fmt: skip
    status = "ok" if all(r["state"] == UP for r in rows) else "degraded"
    return status, rows
