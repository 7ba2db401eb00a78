"""A client of an engine server (:mod:`pastry.engine.serve`) over ZeroMQ: IPC on one host,
TCP across hosts (wire protocol: :mod:`pastry.engine.wire`)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgpack
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from pastry.engine.auth import secure_client
from pastry.engine.calls import Call, EngineInfo, Result
from pastry.engine.codec import CodecError, Frames, decode_info, decode_results, encode_batch
from pastry.engine.handle import EngineDied, EngineError, EngineHandle, EngineTimeout
from pastry.engine.wire import Op, Status, no_payload, parse_header, request

log = logging.getLogger(__name__)

_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)


class EngineAuthError(EngineError):
    """The engine refused the connection: the token is wrong, or missing on one side."""


class RemoteEngine(EngineHandle):
    """A client of an engine server. Make one with ``await RemoteEngine.connect(endpoint)``
    (async use, on the current event loop) or ``RemoteEngine.connect_sync(endpoint)``
    (blocking use; the handle runs its own event loop on a background thread).

    ``info`` is the engine's capabilities report, fetched on connect. A lost connection
    (process exit, or no heartbeat for ``heartbeat_s * 5`` on TCP) fails all pending and
    later requests with :class:`EngineDied`.
    """

    def __init__(
        self,
        endpoint: str,
        loop: asyncio.AbstractEventLoop,
        heartbeat_s: float,
        token: str | None = None,
    ) -> None:
        self.endpoint = endpoint
        self._info: EngineInfo | None = None
        self._loop = loop
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 0)  # never block a send: in-flight batches are few
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._sock.setsockopt(zmq.HEARTBEAT_IVL, int(heartbeat_s * 1000))
        self._sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(heartbeat_s * 5000))
        secure_client(self._sock, token)
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | _HANDSHAKE_FAILED)
        self._sock.connect(endpoint)
        self._ids = itertools.count(1)
        self._pending: dict[int, tuple[asyncio.Future, Callable[[Frames], Any]]] = {}
        self._dead: EngineError | None = None
        self._thread: threading.Thread | None = None  # set by connect_sync
        self._tasks = [loop.create_task(self._receive()), loop.create_task(self._watch())]

    @classmethod
    async def connect(
        cls,
        endpoint: str,
        timeout: float = 30.0,
        *,
        heartbeat_s: float = 2.0,
        token: str | None = None,
    ) -> RemoteEngine:
        """Connect to the engine at ``endpoint`` (``ipc://PATH`` or ``tcp://HOST:PORT``) and
        fetch its :class:`EngineInfo`; :class:`EngineTimeout` if it does not answer. An
        engine started with a token answers only clients holding the same ``token``."""
        if not endpoint.startswith(("ipc://", "tcp://", "inproc://")):
            raise ValueError(f"endpoint must be ipc://PATH or tcp://HOST:PORT, got {endpoint!r}")
        self = cls(endpoint, asyncio.get_running_loop(), heartbeat_s, token)
        try:
            self._info = await self._request(Op.INFO, [], decode_info, timeout)
        except EngineTimeout:
            await self.aclose()
            hint = "" if token else ", and does it want a token?"
            raise EngineTimeout(
                f"engine at {endpoint} did not answer INFO within {timeout:g} s (is it "
                f"running, is the endpoint right{hint})"
            ) from None
        except BaseException:
            await self.aclose()
            raise
        log.debug("connected to %s (%s)", endpoint, self.info.model_name)
        return self

    @classmethod
    def connect_sync(cls, endpoint: str, timeout: float = 30.0, **kwargs: Any) -> RemoteEngine:
        """Like :meth:`connect`, for blocking use (``execute_sync``) outside any event loop."""
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name="pastry-remote", daemon=True)
        thread.start()
        try:
            coro = cls.connect(endpoint, timeout, **kwargs)
            self = asyncio.run_coroutine_threadsafe(coro, loop).result()
        except BaseException:
            _stop_loop(loop, thread)
            raise
        self._thread = thread
        return self

    @property
    def info(self) -> EngineInfo:
        """The engine's capabilities report, fetched on connect (a server's engine does
        not change while it serves)."""
        if self._info is None:
            raise EngineError(f"not connected to {self.endpoint} yet")
        return self._info

    @property
    def alive(self) -> bool:
        return self._dead is None

    async def execute(self, batch: Sequence[Call], timeout: float | None = None) -> list[Result]:
        frames = encode_batch(batch)
        return await self._on_loop(self._request(Op.EXECUTE, frames, decode_results, timeout))

    def execute_sync(self, batch: Sequence[Call], timeout: float | None = None) -> list[Result]:
        frames = encode_batch(batch)
        return self._blocking(self._request(Op.EXECUTE, frames, decode_results, timeout))

    async def load_adapter(self, name: str, path: str, timeout: float | None = 300.0) -> EngineInfo:  # fmt: skip
        payload = [msgpack.packb([name, str(path)])]
        self._info = await self._on_loop(self._request(Op.LOAD_ADAPTER, payload, decode_info, timeout))  # fmt: skip
        return self._info

    async def unload_adapter(self, name: str, timeout: float | None = 60.0) -> EngineInfo:
        payload = [msgpack.packb([name])]
        self._info = await self._on_loop(self._request(Op.UNLOAD_ADAPTER, payload, decode_info, timeout))  # fmt: skip
        return self._info

    async def ping(self, timeout: float | None = 10.0) -> float:
        """Round-trip time in seconds of an empty request."""
        start = time.perf_counter()
        await self._on_loop(self._request(Op.PING, [], no_payload, timeout))
        return time.perf_counter() - start

    async def shutdown(self, timeout: float | None = 10.0) -> None:
        """Ask the server to exit (after the requests before this one); then close.

        The server acknowledges before it exits, but the connection monitor may see it go
        before the acknowledgement is read: a lost connection here means it did as asked.
        """
        with contextlib.suppress(EngineDied):
            await self._on_loop(self._request(Op.SHUTDOWN, [], no_payload, timeout))
        await self.aclose()

    async def aclose(self) -> None:
        if self._closed:
            return
        if asyncio.get_running_loop() is not self._loop:
            await self._on_loop(self.aclose())
            return
        self._close_now()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def close(self) -> None:
        if not self._closed and self._loop.is_running() and not self._in_loop_thread():
            asyncio.run_coroutine_threadsafe(self.aclose(), self._loop).result()
        self._close_now()
        if self._thread is not None:
            _stop_loop(self._loop, self._thread)
            self._thread = None

    # internals

    @property
    def _closed(self) -> bool:
        return self._sock.closed

    async def _request(
        self, op: Op, payload: Frames, decode: Callable[[Frames], Any], timeout: float | None
    ) -> Any:
        if self._dead is not None:
            raise type(self._dead)(str(self._dead))
        req_id = next(self._ids)
        future = self._loop.create_future()
        self._pending[req_id] = (future, decode)
        try:
            await self._sock.send_multipart(request(op, req_id, payload), copy=False)
            return await asyncio.wait_for(future, timeout)
        except TimeoutError:
            raise EngineTimeout(
                f"engine at {self.endpoint} did not answer {op.name} within {timeout:g} s "
                "(is it running, and is the endpoint right?)"
            ) from None
        finally:
            self._pending.pop(req_id, None)

    async def _receive(self) -> None:
        try:
            while True:
                self._dispatch(await self._sock.recv_multipart(copy=False))
        except (asyncio.CancelledError, zmq.ZMQError):
            pass

    def _dispatch(self, frames: list[zmq.Frame]) -> None:
        try:
            status, req_id, message = parse_header(frames[0], 3)
        except CodecError as e:
            log.warning("engine at %s sent a malformed reply: %s", self.endpoint, e)
            return
        future, decode = self._pending.get(req_id, (None, None))
        if future is None or future.done():
            log.warning("reply to unknown request %s from %s: %s", req_id, self.endpoint, message)
            return
        if status != Status.OK:
            future.set_exception(EngineError(f"engine at {self.endpoint}: {message}"))
            return
        try:
            future.set_result(decode(frames[1:]))
        except CodecError as e:
            future.set_exception(EngineError(f"bad reply from engine at {self.endpoint}: {e}"))

    async def _watch(self) -> None:
        """Fail everything when the connection drops (ipc/tcp close, or heartbeat timeout)."""
        try:
            while True:
                event = parse_monitor_message(await self._monitor.recv_multipart())
                if event["event"] & _HANDSHAKE_FAILED:
                    self._fail(
                        EngineAuthError(
                            f"the engine at {self.endpoint} refused this control layer: its "
                            "token differs (or one side has a token and the other none)"
                        )
                    )
                    return
                if event["event"] == zmq.EVENT_DISCONNECTED:
                    self._fail(
                        EngineDied(
                            f"lost the connection to the engine at {self.endpoint} "
                            "(the engine process exited or the network failed)"
                        )
                    )
                    return
        except (asyncio.CancelledError, zmq.ZMQError):
            pass

    def _fail(self, error: EngineError) -> None:
        self._dead = error
        for future, _ in self._pending.values():
            if not future.done():
                future.set_exception(error)

    def _close_now(self) -> None:
        if self._closed:
            return
        self._fail(EngineError(f"the connection to {self.endpoint} is closed"))
        if not self._loop.is_closed():
            for task in self._tasks:
                task.cancel()
        self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=0)
        self._ctx.destroy(linger=0)

    def _in_loop_thread(self) -> bool:
        try:
            return asyncio.get_running_loop() is self._loop
        except RuntimeError:
            return False

    async def _on_loop(self, coro: Any) -> Any:
        """Await ``coro`` on this handle's loop, from whichever loop the caller runs."""
        if asyncio.get_running_loop() is self._loop:
            return await coro
        if not self._loop.is_running():
            coro.close()
            raise EngineError("use this handle on the event loop that connected it")
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    def _blocking(self, coro: Any) -> Any:
        if self._in_loop_thread() or not self._loop.is_running():
            coro.close()
            raise EngineError(
                "execute_sync needs the handle's event loop running on another thread: use "
                "`await execute()` inside the loop, or RemoteEngine.connect_sync() in scripts"
            )
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()


def _stop_loop(loop: asyncio.AbstractEventLoop, thread: threading.Thread) -> None:
    loop.call_soon_threadsafe(loop.stop)
    thread.join()
    loop.close()
