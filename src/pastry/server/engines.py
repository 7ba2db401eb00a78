"""Starting a server's engines (one or several per model) and swapping its router.

- ``--engines N``: N engine processes on this host, each pinned to its share of the CPUs
  with as many torch threads (so they do not fight over cores), each KV pool in shared
  memory so that any of them can write K/V into another (``engine/transfer.py``).
- ``--engine tcp://HOST:PORT`` (repeatable): engines started elsewhere with
  ``pastry engine --listen``, reached with their token.
- ``--ray ADDRESS``: the engines placed as Ray actors of that cluster, one per engine, each
  starting an engine server on its node (``RayEngines``); Ray only places processes.

The engine processes started here are supervised (``server/supervisor.py``): one that
exits, is killed or hangs is restarted with the same configuration.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
from pathlib import Path
from typing import TYPE_CHECKING

from pastry.control.users import LOCAL_USER, User
from pastry.server.supervisor import EngineSupervisor, release_lost_engine
from pastry.wire.config import EngineConfig
from pastry.wire.handle import EngineHandle

if TYPE_CHECKING:
    from pastry.runtime.trusted import Instance
    from pastry.server.service import PastryServer

log = logging.getLogger(__name__)


def cpu_shares(n: int, cpus: list[int]) -> list[str]:
    """The CPUs of each of ``n`` engines: disjoint equal shares of ``cpus`` when there are
    enough, else one CPU each, round robin (``"0"``, ``"2,3"``...)."""
    if n <= len(cpus):
        per = len(cpus) // n
        return [",".join(map(str, cpus[i * per : (i + 1) * per])) for i in range(n)]
    return [str(cpus[i % len(cpus)]) for i in range(n)]


async def start_engines(server: PastryServer, model: Path) -> list[EngineHandle]:
    """The engine handles of ``server``'s configuration, started or connected."""
    cfg = server.config
    handles: list[EngineHandle] = []
    local = cfg.engines if cfg.engines > 1 else len(cfg.engine_devices)
    if cfg.remote_engines and cfg.engines <= 1:
        local = 0 if cfg.engines == 0 else local
    total = local + len(cfg.remote_engines)
    several = total > 1 or cfg.ray_address is not None
    shares = cpu_shares(local, sorted(os.sched_getaffinity(0))) if local > 1 else [""] * local
    tag = f"{os.getpid()}-{secrets.token_hex(3)}"
    try:
        if cfg.ray_address is not None:
            from pastry.server.ray_engines import start_ray_engines

            handles += await start_ray_engines(server, model, max(1, cfg.engines))
            local = 0
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
            if cfg.in_process:
                handles.append(await server._start_engine(model, econf, **kw))
                continue
            sup = await EngineSupervisor.start(
                f"{model.stem}/{i}" if local > 1 else model.stem,
                _starter(model, econf, cfg.adapters, kw),
                hang_timeout=cfg.engine_hang_timeout,
            )
            server._procs.append(sup)  # stopped with the server
            handles.append(sup)
        for endpoint in cfg.remote_engines:
            from pastry.wire.remote import RemoteEngine

            handles.append(await RemoteEngine.connect(endpoint, token=cfg.engine_token))
    except BaseException:
        for h in handles:
            await h.aclose()
        raise
    return handles


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


def supervise(server: PastryServer) -> None:
    """Begin supervising the server's engine processes (once its controller exists)."""
    for h in server._handles:
        if isinstance(h, EngineSupervisor):
            h.watch(lambda sup, reason: release_lost_engine(server, sup, reason))


async def swap_router(server: PastryServer, spec: str, user: User = LOCAL_USER) -> Instance:
    """Launch ``spec`` (``NAME[:ARG,...]``: ``router-NAME`` of the built-ins, or any
    program's name or hash) as the active router; the previous one ends. Raises
    ``ValueError`` naming the routers when the program is unknown or fails at start."""
    from pastry.server.registry import RegistryError

    name, _, arg = spec.partition(":")
    args = [a for a in arg.split(",") if a]
    known = sorted(p.name[7:] for p in server.registry.list() if p.name.startswith("router-"))
    program = f"router-{name}" if name in known else name
    try:
        prog = server.registry.get(program, user.name)  # a built-in, or one of user's
    except RegistryError:
        raise ValueError(
            f"no router '{name}' (built-in routers: {', '.join(known)}; or upload a program "
            "and name it)"
        ) from None
    routing = server.controller.routing
    old = routing.router
    inst = server.runtime.launch(prog, args, user.name)
    server.owners[inst.id] = None
    routing.set_router(inst.id, spec)
    for _ in range(20):  # a router that fails at once (a bad argument) is reported here
        await asyncio.sleep(0)
        if inst.done.is_set():
            end = inst.end
            why = getattr(end, "error", None) or getattr(end, "reason", None) or end
            raise ValueError(f"router '{spec}' failed at start:\n{why}")
    if old is not None and old != inst.id:
        server.runtime.terminate(old, f"replaced by router '{spec}'")
    log.info("router %s is instance %d", spec, inst.id)
    return inst
