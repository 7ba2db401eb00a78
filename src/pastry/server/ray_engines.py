"""Engines as Ray actors (``pastry serve --engines N --ray ADDRESS``).

Ray places the processes; Pastry does the rest as for engines on other hosts. The engines
are reserved as one Ray *placement group* (gang-scheduled: all of them or none), one
bundle of resources per engine (``--ray-engine-resources``, default ``{"CPU": 1}``), laid
out across the nodes by a placement strategy (``--ray-placement``, default ``SPREAD``: on
distinct nodes as far as they fit). A bundle says how many cores the engine gets
(``CPU``: its torch threads) and, with a custom resource that only some nodes were
started with (``ray start --resources '{"pastry_host_a": 1}'``) or Ray's own
``node:IP``, which host it runs on. Each engine is an :class:`EngineActor` in its bundle,
which starts an engine server on its node (:func:`~pastry.wire.spawn.spawn_engine`) on
``tcp://NODE_IP:PORT``, token-authenticated, with a shared-memory KV pool (engines on
one node write K/V straight into each other) and a ``--kv-recv`` endpoint (engines on
other nodes send it K/V over TCP). The control layer connects to each as to any remote
engine. The model path must exist on every node. ``ADDRESS`` is a Ray cluster address
(``HEAD_IP:6379``), ``auto`` (the cluster this host belongs to) or ``local`` (start a Ray
instance in this process, for tests and trials). Needs the ``ray`` extra
(``pip install 'pastry[ray]'``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import socket
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pastry.server.ray_placement import engine_bundles
from pastry.wire.config import EngineConfig

if TYPE_CHECKING:
    from pastry.server.config import ServerConfig

log = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 120.0  # the cluster has room for every bundle within this, or fails


class RayPlacementError(RuntimeError):
    """The Ray cluster cannot place the engines as asked."""


class EngineActor:
    """Runs one engine server on the node Ray placed this actor on, with ``threads``
    torch threads (its bundle's ``CPU``)."""

    def __init__(self, model: str, config: dict, token: str, threads: int) -> None:
        self.model, self.config, self.token, self.threads = model, config, token, threads
        self.proc = self._spawn()

    def _spawn(self):
        import ray

        from pastry.wire.spawn import spawn_engine

        ip = ray.util.get_node_ip_address()
        with socket.socket() as s:  # a free port on the node's address
            s.bind((ip, 0))
            port = s.getsockname()[1]
        shm = f"/dev/shm/pastry-kv-ray-{secrets.token_hex(6)}"
        self.node = f"{socket.gethostname()} ({ip})"
        return spawn_engine(
            self.model,
            EngineConfig(**{**self.config, "kv_shm": shm}),
            endpoint=f"tcp://{ip}:{port}",
            token=self.token,
            kv_recv=f"tcp://{ip}:0",
            echo_stderr=False,
            threads=self.threads,
        )

    def where(self) -> tuple[str, str]:
        """The engine's endpoint, and the node it runs on (hostname and address); an
        engine process that exited is started again first (the server asks this when it
        lost the engine). A lost node's actor is restarted by Ray in its bundle, which Ray
        places again, and starts its engine anew."""
        if self.proc.process.poll() is not None:
            self.proc.terminate()
            self.proc = self._spawn()
        return self.proc.endpoint, self.node

    def stop(self) -> None:
        self.proc.terminate()


class _RayPlacement:
    """What the server terminates at stop: the actors (each after its engine), then the
    placement group that reserved their resources."""

    def __init__(self, group) -> None:
        self.group = group
        self.actors: list = []

    def terminate(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for actor in self.actors:
            try:
                ray.get(actor.stop.remote(), timeout=30)
            except Exception as e:  # the actor or its node is gone already
                log.warning("stopping a Ray engine actor: %s", e)
            ray.kill(actor)
        try:
            remove_placement_group(self.group)
        except Exception as e:  # the cluster is gone: nothing left to release
            log.warning("removing the engines' Ray placement group: %s", e)


def _check_feasible(nodes: list[dict], bundles: list[dict[str, float]]) -> None:
    """Raise :class:`RayPlacementError` when some bundle fits no alive node at all (a
    resource no node was started with, more CPUs than any node has)."""
    alive = [n for n in nodes if n.get("Alive")]
    for i, bundle in enumerate(bundles):
        if not any(all(n["Resources"].get(k, 0) >= v for k, v in bundle.items()) for n in alive):
            have = "; ".join(
                f"{n['NodeManagerAddress']}: "
                + ", ".join(f"{k}={v:g}" for k, v in sorted(n["Resources"].items())
                            if not k.startswith("node:") and "memory" not in k)
                for n in alive
            )  # fmt: skip
            raise RayPlacementError(
                f"no node of the Ray cluster can hold engine {i}'s resources "
                f"{json.dumps(bundle)} (--ray-engine-resources); the nodes have: {have}. "
                "Start a node with them (ray start --num-cpus N --resources "
                "'{\"NAME\": 1}') or ask for what a node has"
            )


async def start_ray_engines(
    cfg: ServerConfig, model: Path, n: int, processes: list
) -> list[RayEngine]:
    """``n`` engines as Ray actors of the cluster at ``cfg.ray_address``, one per bundle
    of a placement group (``cfg.ray_engine_resources``, ``cfg.ray_placement``). The
    placement is added to ``processes`` (what the server terminates at stop) as soon as
    it exists, and each actor with it."""
    try:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    except ImportError:
        raise ValueError("--ray needs Ray: pip install 'pastry[ray]' (the `ray` extra)") from None
    bundles = engine_bundles(cfg.ray_engine_resources, n)
    token = cfg.engine_token or secrets.token_urlsafe(24)
    address = None if cfg.ray_address == "local" else cfg.ray_address
    if not ray.is_initialized():
        await asyncio.to_thread(ray.init, address=address, log_to_driver=False,
                                include_dashboard=False)  # fmt: skip
    _check_feasible(await asyncio.to_thread(ray.nodes), bundles)
    group = placement_group(bundles, strategy=cfg.ray_placement)
    if not await asyncio.to_thread(group.wait, PLACEMENT_TIMEOUT_S):
        free = await asyncio.to_thread(ray.available_resources)
        remove_placement_group(group)
        raise RayPlacementError(
            f"the Ray cluster did not make room for {n} engines {json.dumps(bundles)} "
            f"({cfg.ray_placement}) within {PLACEMENT_TIMEOUT_S:g} s; free now: "
            f"{json.dumps({k: v for k, v in free.items() if not k.startswith('node:')})}"
        )
    placement = _RayPlacement(group)
    processes.append(placement)
    econf = EngineConfig(dtype=cfg.dtype, page_size=cfg.page_size, num_pages=cfg.num_pages,
                         num_embeds=cfg.num_embeds, **cfg.engine_kwargs)  # fmt: skip
    for i, bundle in enumerate(bundles):
        actor = ray.remote(EngineActor).options(
            num_cpus=bundle["CPU"],
            max_restarts=-1,  # a lost node's actor comes back where Ray re-places its bundle
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, i),
        )
        threads = int(bundle["CPU"])
        placement.actors.append(actor.remote(str(model), asdict(econf), token, threads))
    # the actors start their engines now, all at once; each supervisor waits for its own
    return [RayEngine(i, actor, token, bundles[i]) for i, actor in enumerate(placement.actors)]


WHERE_TIMEOUT_S = 600.0  # a (re)started engine serves within this, or the try fails


class RayEngine:
    """One engine placed by Ray: its actor, and how to reach the engine it runs (the
    server's supervisor connects through :meth:`endpoint` at start and after a loss)."""

    def __init__(self, rank: int, actor: Any, token: str, bundle: Mapping[str, float]) -> None:
        self.rank, self.actor, self.token, self.bundle = rank, actor, token, bundle

    async def endpoint(self) -> str:
        import ray

        ref = self.actor.where.remote()
        endpoint, node = await asyncio.to_thread(ray.get, ref, timeout=WHERE_TIMEOUT_S)
        log.info("Ray engine %d: %s on %s, %s", self.rank, endpoint, node, json.dumps(self.bundle))
        return endpoint
