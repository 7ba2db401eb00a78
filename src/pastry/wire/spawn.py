"""Start an engine server (:mod:`pastry.engine.serve`) as a child process.

:func:`spawn_engine` runs ``python -m pastry.engine.serve``, waits until it answers a ping
and returns an :class:`EngineProcess`; connect to its ``endpoint`` with
:class:`~pastry.wire.remote.RemoteEngine`.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import zmq

from pastry.wire.auth import secure_client
from pastry.wire.config import EngineConfig
from pastry.wire.handle import EngineStartError
from pastry.wire.protocol import Op, Status, parse_header, request

log = logging.getLogger(__name__)

_SRC_ROOT = str(Path(__file__).resolve().parents[2])  # the directory holding `pastry`
TOKEN_ENV = "PASTRY_ENGINE_TOKEN"
# OpenMP threads that finish their share of a step spin for the next one (libgomp's default
# ACTIVE policy, ~200k spins); on a shared or oversubscribed CPU they burn the cycles that
# the one thread still computing (or the server's event loop) needs (an earlier measurement:
# loaded runs 4-6x faster with PASSIVE). PASSIVE makes them sleep; the user's setting wins.
ENGINE_ENV_DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE"}


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
        kv_shm: str = "",
    ) -> None:
        self.process = process
        self.endpoint = endpoint
        self._tmpdir = tmpdir
        self._stderr = stderr
        self._reader = reader
        self._kv_shm = kv_shm  # removed here too: a killed engine cannot remove it

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
        if self._kv_shm:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._kv_shm)
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
    token: str | None = None,
    threads: int = 0,
    cpus: str = "",
    kv_recv: str = "",
) -> EngineProcess:
    """Start ``python -m pastry.engine.serve`` and wait until it answers a ping.

    ``adapters``: (name, PEFT directory) pairs loaded at start (listed in its info).
    ``token``: only clients holding it may connect (passed in the environment, not argv).
    ``threads`` / ``cpus``: torch threads and CPU affinity of the engine process.
    ``kv_recv``: a ``tcp://HOST:PORT`` where peer engines on other hosts may write KV.
    ``config.kv_shm`` (a shared-memory KV pool) is removed when the process is terminated.

    ``endpoint`` defaults to a fresh ``ipc://`` path in a new temporary directory.
    ``engine_factory`` (``"module:callable"``, called as ``f(model_dir, config)``) replaces
    ``Engine.load``, for tests. ``env`` adds environment variables. The child's stderr is
    echoed to ours when ``echo_stderr``; if it dies during start-up, :class:`EngineStartError`
    carries the end of its stderr. The child exits when this process does. The child's
    OpenMP threads wait passively (:data:`ENGINE_ENV_DEFAULTS`) unless the environment
    sets ``OMP_WAIT_POLICY``.
    """
    config = config or EngineConfig()
    tmpdir = None
    if endpoint is None:
        tmpdir = tempfile.mkdtemp(prefix="pastry-engine-")
        endpoint = f"ipc://{tmpdir}/engine.sock"
    cmd = _command(model_dir, endpoint, config, adapters, engine_factory, threads, cpus)
    if kv_recv:
        cmd += ["--kv-recv", kv_recv]
    child_env = engine_environment(env)
    if token:
        child_env[TOKEN_ENV] = token
        cmd += ["--token-env", TOKEN_ENV]
    proc = subprocess.Popen(
        cmd, stdin=subprocess.PIPE, stderr=subprocess.PIPE, env=child_env, text=True
    )
    tail: collections.deque[str] = collections.deque(maxlen=40)
    reader = threading.Thread(
        target=_pump_stderr, args=(proc, tail, echo_stderr), name="pastry-engine-stderr"
    )
    reader.daemon = True
    reader.start()
    child = EngineProcess(proc, endpoint, tmpdir, tail, reader, config.kv_shm)
    try:
        _wait_until_serving(child, startup_timeout, token)
    except BaseException:
        child.terminate(timeout=5)
        raise
    log.info("engine process %d serving on %s", proc.pid, endpoint)
    return child


def _command(
    model_dir: str | Path,
    endpoint: str,
    config: EngineConfig,
    adapters: Sequence[tuple[str, str | Path]],
    engine_factory: str | None,
    threads: int,
    cpus: str,
) -> list[str]:
    """The command line of an engine process serving ``model_dir`` on ``endpoint``."""
    cmd = [sys.executable, "-m", "pastry.engine.serve", "--model", str(model_dir)]
    cmd += ["--endpoint", endpoint, "--exit-with-parent", *_config_args(config)]
    for name, path in adapters:
        cmd += ["--adapter", f"{name}={path}"]
    if engine_factory is not None:
        cmd += ["--engine-factory", engine_factory]
    if threads:
        cmd += ["--threads", str(threads)]
    if cpus:
        cmd += ["--cpus", cpus]
    return cmd


def _pump_stderr(proc: subprocess.Popen, tail: collections.deque[str], echo: bool) -> None:
    assert proc.stderr is not None
    for line in proc.stderr:
        tail.append(line)
        if echo:
            sys.stderr.write(line)


def _wait_until_serving(child: EngineProcess, timeout: float, token: str | None) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    secure_client(sock, token)
    try:
        sock.connect(child.endpoint)
        sock.send_multipart(request(Op.PING, 0))
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
        status, _, message = parse_header(sock.recv_multipart()[0], 3)
        if status != Status.OK:
            raise EngineStartError(f"engine at {child.endpoint} answered ping with: {message}")
    finally:
        sock.close()
        ctx.term()


def engine_environment(env: dict[str, str] | None = None) -> dict[str, str]:
    """The engine process's environment: :data:`ENGINE_ENV_DEFAULTS` under ours, ``env``
    over both, and ``PYTHONPATH`` led by the directory holding this ``pastry``."""
    child_env = {**ENGINE_ENV_DEFAULTS, **os.environ, **(env or {})}
    child_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (_SRC_ROOT, child_env.get("PYTHONPATH")) if p
    )
    return child_env


def _config_args(config: EngineConfig) -> list[str]:
    args = []
    for f in dataclasses.fields(EngineConfig):
        value = getattr(config, f.name)
        if value != f.default:
            args += [f"--{f.name.replace('_', '-')}", str(value)]
    return args
