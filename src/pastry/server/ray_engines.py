"""Engines as Ray actors (``pastry serve --engines N --ray ADDRESS``).

Ray places the processes; Pastry does the rest as for engines on one host. Each engine is
an :class:`EngineActor` on some node of the cluster (``num_cpus`` each, the engine pinned
to none: Ray's scheduler shares the node), which starts an engine server there
(:func:`~pastry.wire.spawn.spawn_engine`) on ``tcp://NODE_IP:PORT``, token-authenticated,
with a shared-memory KV pool (engines on one node write K/V straight into each other) and a
``--kv-recv`` endpoint (engines on other nodes send it K/V over TCP). The control layer
connects to each as to any remote engine. The model path must exist on every node.
``ADDRESS`` is a Ray cluster address, ``auto`` (the cluster this host belongs to) or
``local`` (start a Ray instance in this process, for tests and trials). Needs the ``ray``
extra (``pip install 'pastry[ray]'``).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import socket
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from pastry.wire.config import EngineConfig
from pastry.wire.handle import EngineHandle

if TYPE_CHECKING:
    from pastry.server.config import ServerConfig

log = logging.getLogger(__name__)


class EngineActor:
    """Runs one engine server on the node Ray placed this actor on."""

    def __init__(self, model: str, config: dict, token: str) -> None:
        import ray

        from pastry.wire.spawn import spawn_engine

        ip = ray.util.get_node_ip_address()
        with socket.socket() as s:  # a free port on the node's address
            s.bind((ip, 0))
            port = s.getsockname()[1]
        shm = f"/dev/shm/pastry-kv-ray-{secrets.token_hex(6)}"
        self.proc = spawn_engine(
            model,
            EngineConfig(**{**config, "kv_shm": shm}),
            endpoint=f"tcp://{ip}:{port}",
            token=token,
            kv_recv=f"tcp://{ip}:0",
            echo_stderr=False,
        )

    def endpoint(self) -> str:
        return self.proc.endpoint

    def stop(self) -> None:
        self.proc.terminate()


class _RayEngine:
    """What the server terminates at stop: the actor, after its engine."""

    def __init__(self, actor) -> None:
        self.actor = actor

    def terminate(self) -> None:
        import ray

        try:
            ray.get(self.actor.stop.remote(), timeout=30)
        except Exception as e:  # the actor or its node is gone already
            log.warning("stopping a Ray engine actor: %s", e)
        ray.kill(self.actor)


async def start_ray_engines(
    cfg: ServerConfig, model: Path, n: int, processes: list
) -> list[EngineHandle]:
    """``n`` engines as Ray actors of the cluster at ``cfg.ray_address``. The actors are
    added to ``processes`` (what the server terminates at stop) as soon as they exist."""
    try:
        import ray
    except ImportError:
        raise ValueError("--ray needs Ray: pip install 'pastry[ray]' (the `ray` extra)") from None
    from pastry.wire.remote import RemoteEngine

    token = cfg.engine_token or secrets.token_urlsafe(24)
    address = None if cfg.ray_address == "local" else cfg.ray_address
    if not ray.is_initialized():
        await asyncio.to_thread(ray.init, address=address, log_to_driver=False,
                                include_dashboard=False)  # fmt: skip
    econf = EngineConfig(dtype=cfg.dtype, page_size=cfg.page_size, num_pages=cfg.num_pages,
                         num_embeds=cfg.num_embeds, **cfg.engine_kwargs)  # fmt: skip
    actor = ray.remote(num_cpus=1)(EngineActor)
    actors = [actor.remote(str(model), asdict(econf), token) for _ in range(n)]
    processes.extend(_RayEngine(a) for a in actors)
    endpoints = await asyncio.to_thread(ray.get, [a.endpoint.remote() for a in actors])
    log.info("Ray placed %d engines: %s", n, ", ".join(endpoints))
    return [await RemoteEngine.connect(ep, token=token) for ep in endpoints]
