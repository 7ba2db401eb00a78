"""The engine behind one interface, in-process or as its own process over ZeroMQ.

:class:`EngineHandle` is what the control layer talks to. :class:`InProcessEngine` runs an
engine on a worker thread of this process; :class:`RemoteEngine` talks to an engine server
(``python -m pastry.engine.process``) over ZeroMQ: IPC on one host, TCP across hosts.
:func:`spawn_engine` starts a server as a child process.

Wire protocol (DEALER client -> ROUTER server), every message a list of frames:

- request: ``[msgpack([op, request_id]), *payload]`` with ``op`` an :class:`Op`;
  the payload of ``EXECUTE`` is :func:`~pastry.engine.codec.encode_batch`, others have none.
- reply: ``[msgpack([status, request_id, error_text | None]), *payload]``; the payload of
  ``INFO`` is :func:`~pastry.engine.codec.encode_info`, of ``EXECUTE``
  :func:`~pastry.engine.codec.encode_results`.

The server handles one request at a time, in arrival order. A malformed request gets an
``ERROR`` reply naming the problem; an exception inside ``engine.execute`` (a bug) turns
every call of that batch into a :class:`CallError`; in both cases the server keeps serving.
"""

from __future__ import annotations

import abc
import argparse
import asyncio
import collections
import contextlib
import dataclasses
import gc
import importlib
import itertools
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from enum import IntEnum
from pathlib import Path
from typing import Any, Protocol

import msgpack
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from pastry.engine.calls import Call, CallError, EngineInfo, Result
from pastry.engine.codec import (
    CodecError,
    Frames,
    decode_batch,
    decode_info,
    decode_results,
    encode_batch,
    encode_info,
    encode_results,
)
from pastry.engine.config import CheckpointError, EngineConfig

log = logging.getLogger(__name__)

DEFAULT_ENGINE_FACTORY = "pastry.engine.engine:Engine.load"
_SRC_ROOT = str(Path(__file__).resolve().parents[2])  # the directory holding `pastry`


class Op(IntEnum):
    INFO = 1
    EXECUTE = 2
    PING = 3
    SHUTDOWN = 4


class Status(IntEnum):
    OK = 0
    ERROR = 1


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


# --- handles ----------------------------------------------------------------------------


class EngineHandle(abc.ABC):
    """An engine as the control layer sees it.

    ``execute`` may be awaited by several coroutines at once (pipelining: send batch N+1
    while N runs). Batches run one at a time in submission order, and each caller gets the
    results of its own batch, one per call, in call order. The arrays of a batch must not
    be modified until its results are back. ``execute_sync`` is the blocking variant for
    scripts and benchmarks; do not call it from the thread running the handle's event loop.
    """

    info: EngineInfo

    @abc.abstractmethod
    async def execute(self, batch: Sequence[Call]) -> list[Result]: ...

    @abc.abstractmethod
    def execute_sync(self, batch: Sequence[Call]) -> list[Result]: ...

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
        self.info = engine.info
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pastry-engine")
        self._closed = False

    async def execute(self, batch: Sequence[Call]) -> list[Result]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._submitter(), run_batch, self.engine, list(batch))

    def execute_sync(self, batch: Sequence[Call]) -> list[Result]:
        return self._submitter().submit(run_batch, self.engine, list(batch)).result()

    async def aclose(self) -> None:
        await asyncio.to_thread(self.close)

    def close(self) -> None:
        self._closed = True
        self._worker.shutdown(wait=True)

    def _submitter(self) -> ThreadPoolExecutor:
        if self._closed:
            raise EngineError("this InProcessEngine is closed")
        return self._worker


class RemoteEngine(EngineHandle):
    """A client of an engine server. Make one with ``await RemoteEngine.connect(endpoint)``
    (async use, on the current event loop) or ``RemoteEngine.connect_sync(endpoint)``
    (blocking use; the handle runs its own event loop on a background thread).

    ``info`` is the engine's capabilities report, fetched on connect. A lost connection
    (process exit, or no heartbeat for ``heartbeat_s * 5`` on TCP) fails all pending and
    later requests with :class:`EngineDied`.
    """

    def __init__(self, endpoint: str, loop: asyncio.AbstractEventLoop, heartbeat_s: float) -> None:
        self.endpoint = endpoint
        self.info: EngineInfo
        self._loop = loop
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 0)  # never block a send: in-flight batches are few
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._sock.setsockopt(zmq.HEARTBEAT_IVL, int(heartbeat_s * 1000))
        self._sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(heartbeat_s * 5000))
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._sock.connect(endpoint)
        self._ids = itertools.count(1)
        self._pending: dict[int, tuple[asyncio.Future, Callable[[Frames], Any]]] = {}
        self._dead: EngineError | None = None
        self._thread: threading.Thread | None = None  # set by connect_sync
        self._tasks = [loop.create_task(self._receive()), loop.create_task(self._watch())]

    @classmethod
    async def connect(
        cls, endpoint: str, timeout: float = 30.0, *, heartbeat_s: float = 2.0
    ) -> RemoteEngine:
        """Connect to the engine at ``endpoint`` (``ipc://PATH`` or ``tcp://HOST:PORT``) and
        fetch its :class:`EngineInfo`; :class:`EngineTimeout` if it does not answer."""
        if not endpoint.startswith(("ipc://", "tcp://", "inproc://")):
            raise ValueError(f"endpoint must be ipc://PATH or tcp://HOST:PORT, got {endpoint!r}")
        self = cls(endpoint, asyncio.get_running_loop(), heartbeat_s)
        try:
            self.info = await self._request(Op.INFO, [], decode_info, timeout)
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

    async def execute(self, batch: Sequence[Call], timeout: float | None = None) -> list[Result]:
        frames = encode_batch(batch)
        return await self._on_loop(self._request(Op.EXECUTE, frames, decode_results, timeout))

    def execute_sync(self, batch: Sequence[Call], timeout: float | None = None) -> list[Result]:
        frames = encode_batch(batch)
        return self._blocking(self._request(Op.EXECUTE, frames, decode_results, timeout))

    async def ping(self, timeout: float | None = 10.0) -> float:
        """Round-trip time in seconds of an empty request."""
        start = time.perf_counter()
        await self._on_loop(self._request(Op.PING, [], _no_payload, timeout))
        return time.perf_counter() - start

    async def shutdown(self, timeout: float | None = 10.0) -> None:
        """Ask the server to exit (after the requests before this one); then close.

        The server acknowledges before it exits, but the connection monitor may see it go
        before the acknowledgement is read: a lost connection here means it did as asked.
        """
        with contextlib.suppress(EngineDied):
            await self._on_loop(self._request(Op.SHUTDOWN, [], _no_payload, timeout))
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
            await self._sock.send_multipart([msgpack.packb([op, req_id]), *payload], copy=False)
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
            status, req_id, message = _parse_header(frames[0], 3)
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


def _no_payload(frames: Frames) -> None:
    if frames:
        raise CodecError(f"expected no payload, got {len(frames)} frame(s)")


def _parse_header(frame: Any, size: int) -> list:
    """``[op, request_id]`` (size 2) or ``[status, request_id, message]`` (size 3)."""
    try:
        header = msgpack.unpackb(frame, raw=False)
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        raise CodecError(f"header is not valid msgpack ({e})") from e
    if type(header) is not list or len(header) != size or type(header[1]) is not int:
        raise CodecError(f"header must be a list of {size} with an int request id")
    return header


# --- server -----------------------------------------------------------------------------


def serve(engine: EngineLike, endpoint: str) -> None:
    """Serve ``engine`` on ``endpoint`` (binds a ROUTER) until a SHUTDOWN request."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    try:
        sock.bind(endpoint)
        log.info("serving %s on %s", engine.info.model_name, endpoint)
        while True:
            ident, *frames = sock.recv_multipart(copy=False)
            reply, stop = handle_request(engine, frames)
            sock.send_multipart([ident, *reply], copy=False)
            if stop:
                log.info("shutdown requested")
                return
    finally:
        sock.close(linger=1000)
        ctx.term()


def handle_request(engine: EngineLike, frames: Sequence[Any]) -> tuple[Frames, bool]:
    """The reply frames to one request, and whether to stop serving after sending them."""
    req_id = None
    try:
        if not frames:
            raise CodecError("empty request")
        op, req_id = _parse_header(frames[0], 2)
        if type(op) is not int or op not in _OPS:
            known = ", ".join(f"{o.value} ({o.name})" for o in Op)
            raise CodecError(f"unknown op {op!r:.20} (known: {known})")
        op = Op(op)
        if op is Op.EXECUTE:
            payload = _execute(engine, decode_batch(frames[1:]))
        elif len(frames) != 1:
            raise CodecError(f"{op.name} takes no payload, got {len(frames) - 1} frame(s)")
        else:
            payload = encode_info(engine.info) if op is Op.INFO else []
        return _reply(Status.OK, req_id, None, payload), op is Op.SHUTDOWN
    except CodecError as e:
        log.warning("malformed request %s: %s", req_id, e)
        return _reply(Status.ERROR, req_id, f"malformed request: {e}", []), False
    except Exception as e:  # a bug here must not take the server down
        log.exception("failed to handle request %s", req_id)
        return _reply(Status.ERROR, req_id, f"internal error: {type(e).__name__}: {e}", []), False


_OPS = frozenset(o.value for o in Op)


def _execute(engine: EngineLike, batch: list[Call]) -> Frames:
    results = run_batch(engine, batch)
    try:
        return encode_results(results)
    except CodecError as e:
        log.error("cannot encode the results of a batch: %s", e)
        return encode_results([CallError(f"engine error: cannot send result: {e}")] * len(batch))


def _reply(status: Status, req_id: int | None, message: str | None, payload: Frames) -> Frames:
    return [msgpack.packb([status, req_id, message]), *payload]


# --- child process ----------------------------------------------------------------------


class EngineProcess:
    """An engine server started by :func:`spawn_engine`; ``terminate()`` (or leaving the
    ``with`` block) stops it and removes its temporary directory."""

    def __init__(
        self,
        process: subprocess.Popen,
        endpoint: str,
        tmpdir: str | None,
        stderr: collections.deque[str],
        reader: threading.Thread,
    ) -> None:
        self.process = process
        self.endpoint = endpoint
        self._tmpdir = tmpdir
        self._stderr = stderr
        self._reader = reader

    @property
    def pid(self) -> int:
        return self.process.pid

    def stderr_tail(self) -> str:
        """The last lines the engine wrote to stderr."""
        return "".join(self._stderr)

    def terminate(self, timeout: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout`` seconds; returns the exit code."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("engine %d ignored SIGTERM for %g s; killing it", self.pid, timeout)
                self.process.kill()
                self.process.wait()
        if self.process.stdin is not None:
            self.process.stdin.close()
        self._reader.join(timeout=5)
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
        return self.process.returncode

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.terminate()


def spawn_engine(
    model_dir: str | Path,
    config: EngineConfig | None = None,
    endpoint: str | None = None,
    *,
    startup_timeout: float = 600.0,
    engine_factory: str | None = None,
    env: dict[str, str] | None = None,
    echo_stderr: bool = True,
    adapters: Sequence[tuple[str, str | Path]] = (),
) -> EngineProcess:
    """Start ``python -m pastry.engine.process`` and wait until it answers a ping.

    ``adapters``: (name, PEFT directory) pairs loaded at start (listed in its info).

    ``endpoint`` defaults to a fresh ``ipc://`` path in a new temporary directory.
    ``engine_factory`` (``"module:callable"``, called as ``f(model_dir, config)``) replaces
    ``Engine.load``, for tests. ``env`` adds environment variables. The child's stderr is
    echoed to ours when ``echo_stderr``; if it dies during start-up, :class:`EngineStartError`
    carries the end of its stderr. The child exits when this process does.
    """
    config = config or EngineConfig()
    tmpdir = None
    if endpoint is None:
        tmpdir = tempfile.mkdtemp(prefix="pastry-engine-")
        endpoint = f"ipc://{tmpdir}/engine.sock"
    cmd = [sys.executable, "-m", "pastry.engine.process", "--model", str(model_dir)]
    cmd += ["--endpoint", endpoint, "--exit-with-parent", *_config_args(config)]
    for name, path in adapters:
        cmd += ["--adapter", f"{name}={path}"]
    if engine_factory is not None:
        cmd += ["--engine-factory", engine_factory]
    child_env = {**os.environ, **(env or {})}
    child_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (_SRC_ROOT, child_env.get("PYTHONPATH")) if p
    )
    proc = subprocess.Popen(
        cmd, stdin=subprocess.PIPE, stderr=subprocess.PIPE, env=child_env, text=True
    )
    tail: collections.deque[str] = collections.deque(maxlen=40)
    reader = threading.Thread(
        target=_pump_stderr, args=(proc, tail, echo_stderr), name="pastry-engine-stderr"
    )
    reader.daemon = True
    reader.start()
    child = EngineProcess(proc, endpoint, tmpdir, tail, reader)
    try:
        _wait_until_serving(child, startup_timeout)
    except BaseException:
        child.terminate(timeout=5)
        raise
    log.info("engine process %d serving on %s", proc.pid, endpoint)
    return child


def _pump_stderr(proc: subprocess.Popen, tail: collections.deque[str], echo: bool) -> None:
    assert proc.stderr is not None
    for line in proc.stderr:
        tail.append(line)
        if echo:
            sys.stderr.write(line)


def _wait_until_serving(child: EngineProcess, timeout: float) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(child.endpoint)
        sock.send_multipart([msgpack.packb([Op.PING, 0])])
        deadline = time.monotonic() + timeout
        while not sock.poll(50):
            if child.process.poll() is not None:
                child._reader.join(timeout=5)
                raise EngineStartError(
                    f"engine process exited with code {child.process.returncode} during "
                    f"start-up; the end of its stderr:\n{child.stderr_tail()}"
                )
            if time.monotonic() > deadline:
                raise EngineStartError(
                    f"engine process did not answer on {child.endpoint} within {timeout:g} s "
                    f"(raise startup_timeout if loading is slow); the end of its stderr:\n"
                    f"{child.stderr_tail()}"
                )
        status, _, message = _parse_header(sock.recv_multipart()[0], 3)
        if status != Status.OK:
            raise EngineStartError(f"engine at {child.endpoint} answered ping with: {message}")
    finally:
        sock.close()
        ctx.term()


def _config_args(config: EngineConfig) -> list[str]:
    args = []
    for f in dataclasses.fields(EngineConfig):
        value = getattr(config, f.name)
        if value != f.default:
            args += [f"--{f.name.replace('_', '-')}", str(value)]
    return args


def _load_factory(spec: str) -> Callable[[str, EngineConfig], EngineLike]:
    module, _, attr = spec.partition(":")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pastry.engine.process", description="Serve one engine over ZeroMQ."
    )
    p.add_argument("--model", required=True, help="checkpoint directory")
    p.add_argument("--endpoint", required=True, help="ipc:///path or tcp://host:port to bind")
    for f in dataclasses.fields(EngineConfig):
        flag = f"--{f.name.replace('_', '-')}"
        p.add_argument(flag, type=type(f.default), default=f.default, help=f"default {f.default}")
    p.add_argument(
        "--engine-factory",
        default=DEFAULT_ENGINE_FACTORY,
        help="module:callable(model_dir, config) that builds the engine (tests)",
    )
    p.add_argument(
        "--exit-with-parent", action="store_true", help="exit when stdin closes (set by spawn)"
    )
    p.add_argument("--log-level", default="INFO")
    p.add_argument(
        "--adapter", action="append", default=[], metavar="NAME=DIR",
        help="load a PEFT LoRA adapter at start (repeatable)",
    )  # fmt: skip
    return p


def main(argv: Sequence[str] | None = None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s engine[%(process)d] %(name)s: %(message)s",
    )
    try:
        config = EngineConfig(
            **{f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)}
        )
    except ValueError as e:
        parser.error(str(e))
    signal.signal(signal.SIGTERM, _exit_on_signal)
    if args.exit_with_parent:
        threading.Thread(target=_exit_when_stdin_closes, daemon=True).start()
        # Ctrl-C in a terminal reaches the whole process group; the parent decides when
        # the engine stops (it terminates us, or we exit when it goes away).
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        engine = _load_factory(args.engine_factory)(args.model, config)
    except CheckpointError as e:
        raise SystemExit(f"cannot load the model: {e}") from e
    for spec in args.adapter:
        name, sep, path = spec.partition("=")
        if not sep:
            parser.error(f"--adapter takes NAME=DIR, got '{spec}'")
        try:
            engine.load_adapter(path, name)
        except (CheckpointError, ValueError) as e:
            raise SystemExit(f"cannot load adapter '{name}': {e}") from e
    # Objects alive now (model, tokenizer) live forever: keep them out of every future
    # garbage collection, which otherwise rescans them on each full pass.
    gc.collect()
    gc.freeze()
    try:
        serve(engine, args.endpoint)
    except zmq.ZMQError as e:
        raise SystemExit(f"engine server on {args.endpoint} failed: {e}") from e


def _exit_on_signal(signum: int, frame: Any) -> None:
    log.info("received signal %d, exiting", signum)
    raise SystemExit(0)


def _exit_when_stdin_closes() -> None:
    sys.stdin.read()
    log.warning("parent process went away, exiting")
    os.kill(os.getpid(), signal.SIGTERM)


if __name__ == "__main__":
    main()
