"""The engine as the control layer sees it: one interface, in this process or elsewhere.

:class:`EngineHandle` is the interface (the controller types its engines as handles).
:class:`InProcessEngine` runs an engine on a worker thread of this process;
:class:`~pastry.engine.remote.RemoteEngine` talks to an engine server in another process
(:mod:`pastry.engine.serve`, started by :func:`~pastry.engine.spawn.spawn_engine`).
"""

from __future__ import annotations

import abc
import asyncio
import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from pastry.engine.calls import Call, CallError, EngineInfo, Result

log = logging.getLogger(__name__)


class EngineError(RuntimeError):
    """An engine could not serve a request: it answered with an error or is unreachable."""


class EngineTimeout(EngineError, TimeoutError):
    """An engine did not answer in time."""


class EngineDied(EngineError):
    """The connection to an engine was lost (its process exited, or the network failed)."""


class EngineStartError(EngineError):
    """An engine process failed to start; the message ends with its stderr."""


class EngineLike(Protocol):
    """What a handle needs of an engine (``pastry.engine.engine.Engine`` has it)."""

    info: EngineInfo

    def execute(self, batch: Sequence[Call]) -> list[Result]: ...


def run_batch(engine: EngineLike, batch: Sequence[Call]) -> list[Result]:
    """``engine.execute(batch)``, turning an engine exception into one CallError per call."""
    try:
        results = engine.execute(batch)
        if len(results) != len(batch):
            raise RuntimeError(f"engine returned {len(results)} results for {len(batch)} calls")
    except Exception as e:  # an engine bug: fail this batch, keep serving
        log.exception("engine.execute failed on a batch of %d calls", len(batch))
        return [CallError(f"engine error: {type(e).__name__}: {e}")] * len(batch)
    return results


class EngineHandle(abc.ABC):
    """An engine as the control layer sees it.

    ``info`` is the engine's current capabilities report (live: an adapter the engine
    loaded after the handle was made is listed). ``execute`` may be awaited by several
    coroutines at once (pipelining: send batch N+1 while N runs). Batches run one at a time
    in submission order, and each caller gets the results of its own batch, one per call,
    in call order. The arrays of a batch must not be modified until its results are back.
    ``execute_sync`` is the blocking variant for scripts and benchmarks; do not call it
    from the thread running the handle's event loop.
    """

    @property
    @abc.abstractmethod
    def info(self) -> EngineInfo: ...

    @abc.abstractmethod
    async def execute(self, batch: Sequence[Call]) -> list[Result]: ...

    @property
    def alive(self) -> bool:
        """False once the engine is known to be gone (its process died, its host is lost)."""
        return True

    @abc.abstractmethod
    def execute_sync(self, batch: Sequence[Call]) -> list[Result]: ...

    async def load_adapter(self, name: str, path: str) -> EngineInfo:
        """Load the PEFT LoRA directory ``path`` as adapter ``name`` between batches; the
        new info. ``ValueError`` says why it cannot be loaded."""
        raise EngineError(f"{type(self).__name__} cannot load adapters")

    async def unload_adapter(self, name: str) -> EngineInfo:
        """Unload adapter ``name`` between batches (its id is not reused); the new info."""
        raise EngineError(f"{type(self).__name__} cannot unload adapters")

    @abc.abstractmethod
    async def aclose(self) -> None: ...

    @abc.abstractmethod
    def close(self) -> None: ...

    async def __aenter__(self) -> EngineHandle:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __enter__(self) -> EngineHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class InProcessEngine(EngineHandle):
    """Runs ``engine.execute`` on one dedicated worker thread (torch releases the GIL), in
    submission order; ``execute`` resolves on the caller's event loop."""

    def __init__(self, engine: EngineLike) -> None:
        self.engine = engine
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pastry-engine")
        self._closed = False

    @property
    def info(self) -> EngineInfo:
        return self.engine.info

    async def execute(self, batch: Sequence[Call]) -> list[Result]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._submitter(), run_batch, self.engine, list(batch))

    def execute_sync(self, batch: Sequence[Call]) -> list[Result]:
        return self._submitter().submit(run_batch, self.engine, list(batch)).result()

    async def load_adapter(self, name: str, path: str) -> EngineInfo:
        loop = asyncio.get_running_loop()  # on the worker: between batches
        await loop.run_in_executor(self._submitter(), self.engine.load_adapter, path, name)
        return self.info

    async def unload_adapter(self, name: str) -> EngineInfo:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._submitter(), self.engine.unload_adapter, name)
        return self.info

    async def aclose(self) -> None:
        await asyncio.to_thread(self.close)

    def close(self) -> None:
        self._closed = True
        self._worker.shutdown(wait=True)

    def _submitter(self) -> ThreadPoolExecutor:
        if self._closed:
            raise EngineError("this InProcessEngine is closed")
        return self._worker
