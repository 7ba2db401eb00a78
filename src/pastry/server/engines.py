"""Starting a server's engines (one or several per model), and stopping them.

- ``--engines N``: N engine processes on this host, each pinned to its share of the CPUs
  with as many torch threads (so they do not fight over cores), each KV pool in shared
  memory so that any of them can write K/V into another (``engine/transfer.py``).
- ``--engine tcp://HOST:PORT`` (repeatable): engines started elsewhere with
  ``pastry engine --listen``, reached with their token.
- ``--ray ADDRESS``: the engines placed as Ray actors of that cluster, one per engine, each
  starting an engine server on its node (``server/ray_engines.py``); Ray only places
  processes.

The engine processes started here are supervised (``server/supervisor.py``): one that
exits, is killed or hangs is restarted with the same configuration.
"""

from __future__ import annotations

import asyncio
import os
import secrets
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pastry.server.ray_engines import RayEngine, start_ray_engines
from pastry.server.supervisor import EngineSupervisor, release_lost_engine
from pastry.wire.config import EngineConfig
from pastry.wire.handle import EngineHandle

if TYPE_CHECKING:
    from pastry.server.config import ServerConfig
    from pastry.server.running import RunningServer


def cpu_shares(n: int, cpus: list[int]) -> list[str]:
    """The CPUs of each of ``n`` engines: disjoint equal shares of ``cpus`` when there are
    enough, else one CPU each, round robin (``"0"``, ``"2,3"``...)."""
    if n <= len(cpus):
        per = len(cpus) // n
        return [",".join(map(str, cpus[i * per : (i + 1) * per])) for i in range(n)]
    return [str(cpus[i % len(cpus)]) for i in range(n)]


class ServerEngines:
    """The engines of one server: the handles its controller drives, and what its stop
    ends. Fill it with :meth:`start`, supervise it with :meth:`supervise` once the
    controller exists, end it with :meth:`close`."""

    def __init__(self) -> None:
        self.handles: list[EngineHandle] = []
        """The engine handles in the controller's order (started, supervised or
        connected); empty until :meth:`start` returns, and after :meth:`close`."""
        self.processes: list[Any] = []
        """What :meth:`close` terminates once the handles are closed: the
        :class:`EngineSupervisor` of each engine process started here, or the Ray actors.
        Each is added as soon as it exists, so that a start that fails half-way is still
        stopped by :meth:`close`."""
        self.in_process: list[Any] = []
        """The engines run in this process (``ServerConfig.in_process``), closed last."""

    async def start(self, cfg: ServerConfig, model: Path) -> None:
        """Start or connect the engines of ``cfg``, serving ``model``, into
        :attr:`handles` (on failure, the handles got so far are closed again)."""
        handles: list[EngineHandle] = []
        local = cfg.engines if cfg.engines > 1 else len(cfg.engine_devices)
        if cfg.remote_engines and cfg.engines <= 1:
            local = 0 if cfg.engines == 0 else local
        several = local + len(cfg.remote_engines) > 1 or cfg.ray_address is not None
        try:
            if cfg.ray_address is not None:  # supervised: reconnected (and re-placed) when lost
                for eng in await start_ray_engines(cfg, model, max(1, cfg.engines), self.processes):
                    sup = await EngineSupervisor.start(
                        f"ray-engine-{eng.rank}", _ray_connector(eng),
                        hang_timeout=cfg.engine_hang_timeout,
                    )  # fmt: skip
                    handles.append(sup)
                local = 0
            for i, (econf, kw) in enumerate(_local_configs(cfg, local, several)):
                if cfg.in_process:
                    handles.append(self._start_in_process(cfg, model, econf))
                    continue
                name = f"{model.stem}/{i}" if local > 1 else model.stem
                sup = await EngineSupervisor.start(
                    name,
                    _starter(model, econf, cfg.adapters, kw),
                    hang_timeout=cfg.engine_hang_timeout,
                )
                self.processes.append(sup)  # stopped with the server
                handles.append(sup)
            for endpoint in cfg.remote_engines:  # supervised: reconnected when lost
                sup = await EngineSupervisor.start(
                    endpoint.removeprefix("tcp://"),
                    _connector(endpoint, cfg.engine_token),
                    hang_timeout=cfg.engine_hang_timeout,
                )
                handles.append(sup)  # not in processes: its host's operator stops it
        except BaseException:
            for h in handles:
                await h.aclose()
            raise
        self.handles = handles

    def _start_in_process(
        self, cfg: ServerConfig, model: Path, econf: EngineConfig
    ) -> EngineHandle:
        """An engine loaded in this process (its adapters too), kept to close at the end."""
        from pastry.engine.engine import Engine
        from pastry.wire.handle import InProcessEngine

        engine = Engine.load(model, econf)
        for name, path in cfg.adapters:
            engine.load_adapter(path, name)
        self.in_process.append(engine)
        return InProcessEngine(engine)

    def supervise(self, server: RunningServer) -> None:
        """Begin supervising the engine processes (once ``server``'s controller exists):
        what a lost one held is released (:func:`release_lost_engine`), then it restarts."""
        for h in self.handles:
            if isinstance(h, EngineSupervisor):
                h.watch(lambda sup, reason: release_lost_engine(server, sup, reason))

    async def close(self) -> None:
        """Close the handles, terminate the processes, close the in-process engines."""
        for h in self.handles:
            await h.aclose()
        for p in self.processes:
            p.terminate()
        for e in self.in_process:
            e.close()
        self.handles, self.processes, self.in_process = [], [], []


def _local_configs(cfg: ServerConfig, local: int, several: bool) -> list[tuple[EngineConfig, dict]]:
    """The configuration and spawn arguments (CPUs, token) of each of the ``local``
    engines on this host; ``several``: the server has more than one engine, so CPU engines
    keep their KV pool in shared memory."""
    shares = cpu_shares(local, sorted(os.sched_getaffinity(0))) if local > 1 else [""] * local
    tag = f"{os.getpid()}-{secrets.token_hex(3)}"
    out = []
    for i in range(local):
        device = cfg.engine_devices[i % len(cfg.engine_devices)]
        shm = f"/dev/shm/pastry-kv-{tag}-{i}" if several and device == "cpu" else ""
        econf = EngineConfig(
            device=device,
            dtype=cfg.dtype,
            page_size=cfg.page_size,
            num_pages=cfg.num_pages,
            num_embeds=cfg.num_embeds,
            kv_shm=shm,
            **cfg.engine_kwargs,
        )
        kw = {"cpus": shares[i]} if shares[i] else {}
        if cfg.engine_token:
            kw["token"] = cfg.engine_token
        out.append((econf, kw))
    return out


class RemoteHost:
    """A ``pastry engine --listen`` process on another host, as its supervisor sees it:
    nothing here to poll or stop (the operator of that host runs it). It is lost when the
    connection is (the process exits: at once; its host dies or the link is cut: within
    the connection's heartbeat timeout, 10 s), and back when it answers a connect again."""

    pid = None

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint

    def terminate(self, timeout: float = 10.0) -> None:
        """Nothing to stop: the remote engine goes on serving whoever connects."""


CONNECT_TIMEOUT_S = 10.0  # a remote engine answers a connect within this, or is down


def _connector(endpoint: str, token: str | None):
    """Connect to the remote engine at ``endpoint`` (a supervisor's starter)."""

    async def start():
        from pastry.wire.remote import RemoteEngine

        handle = await RemoteEngine.connect(endpoint, CONNECT_TIMEOUT_S, token=token)
        return RemoteHost(endpoint), handle

    return start


def _ray_connector(eng: RayEngine):
    """Connect to the engine of a Ray actor, asking it where that is (a supervisor's
    starter: after a loss the actor starts its engine again, or Ray restarts the actor)."""

    async def start():
        from pastry.wire.remote import RemoteEngine

        endpoint = await eng.endpoint()
        handle = await RemoteEngine.connect(endpoint, CONNECT_TIMEOUT_S, token=eng.token)
        return RemoteHost(endpoint), handle

    return start


def _starter(model: Path, econf: EngineConfig, adapters, kw: dict):
    """Start one engine process of this configuration and connect to it (in a worker
    thread: it waits until the process serves)."""

    async def start():
        from pastry.wire.remote import RemoteEngine
        from pastry.wire.spawn import spawn_engine

        proc = await asyncio.to_thread(spawn_engine, model, econf, adapters=adapters, **kw)
        try:
            return proc, await RemoteEngine.connect(proc.endpoint, token=kw.get("token"))
        except BaseException:
            await asyncio.to_thread(proc.terminate, 5.0)
            raise

    return start
