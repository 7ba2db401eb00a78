"""``PastryServer``: engines, the control layer, the runner and the program registry, wired.

Start-up: one engine per device in ``engine_devices`` (its own process, reached over
ZeroMQ IPC; or in-process when ``in_process``), a :class:`Controller` over them, a
:class:`TrustedRuntime`, and a :class:`ProgramRegistry` with the built-in inferlets.
Instances are launched by program name or hash; the endpoints (``server/ws.py``,
``server/openai.py``) track which connection owns which instance.
"""

from __future__ import annotations

import gc
import ipaddress
import logging
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pastry.control.controller import Controller
from pastry.control.policies import DEFAULT_SCHEDULE, batch_policy, schedule_policy
from pastry.engine.config import EngineConfig
from pastry.engine.handle import EngineHandle
from pastry.paths import programs_dir
from pastry.runtime.trusted import Instance, TrustedRuntime
from pastry.server.engines import start_engines, swap_router
from pastry.server.registry import ProgramRegistry

log = logging.getLogger(__name__)


class ConfigError(ValueError):
    """The server cannot start with this configuration."""


@dataclass(frozen=True)
class ServerConfig:
    model: Path | None = None  # None: the embedded default model
    host: str = "127.0.0.1"
    port: int = 8080
    auth_token: str | None = None
    engine_devices: tuple[str, ...] = ("cpu",)
    dtype: str = "auto"
    page_size: int = 16
    num_pages: int = 0  # 0: from available memory
    num_embeds: int = 0
    policy: str = "adaptive"
    http_allow: tuple[str, ...] = ()
    max_upload_bytes: int = 1 << 20
    programs_dir: Path | None = None  # default: $PASTRY_HOME/programs
    in_process: bool = False  # run the engine in this process (tests, smallest setups)
    trusted_uploads: bool = False  # run uploaded programs in the server, not the sandbox
    adapters: tuple[tuple[str, str], ...] = ()  # (name, PEFT LoRA directory) to load
    engine_kwargs: dict = field(default_factory=dict)
    schedule: str = DEFAULT_SCHEDULE  # fcfs | mlfq | plas | atlas (docs/scheduling.md)
    max_batch: int | None = None  # forward calls per batch (None: no cap)
    # Several engines (docs/multi-engine.md): engine processes per device on this host,
    # engines started elsewhere (`pastry engine --listen`), Ray placement, the router.
    engines: int = 1
    remote_engines: tuple[str, ...] = ()  # tcp:// endpoints of `pastry engine` processes
    engine_token: str | None = None  # the token remote engines were started with
    ray_address: str | None = None  # place the engines as Ray actors of this cluster
    router: str = ""  # NAME[:ARG] of inferlets/routers/, or a program; "" = round-robin

    def __post_init__(self) -> None:
        if not self.auth_token and not is_loopback(self.host):
            raise ConfigError(
                f"refusing to listen on {self.host} without an auth token: anyone who can "
                "reach it could run programs. Set --auth-token (or PASTRY_AUTH_TOKEN), or "
                "bind 127.0.0.1"
            )
        batch_policy(self.policy)  # validates the name
        schedule_policy(self.schedule)
        if self.max_batch is not None and self.max_batch < 1:
            raise ConfigError(
                f"max_batch must be >= 1 (forward calls per batch), got {self.max_batch}"
            )
        if self.engines < 0 or (self.engines == 0 and not self.remote_engines):
            raise ConfigError(
                f"--engines must be at least 1 (0 only with --engine), got {self.engines}"
            )
        if self.remote_engines and not self.engine_token:
            raise ConfigError(
                "--engine needs the engines' token (--engine-token or PASTRY_ENGINE_TOKEN): "
                "`pastry engine --listen` prints it, and refuses clients without it"
            )


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class PastryServer:
    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.controller: Controller | None = None
        self.runtime: TrustedRuntime | None = None
        self.registry = ProgramRegistry(
            config.programs_dir or programs_dir(),
            config.max_upload_bytes,
            sandbox_uploads=not config.trusted_uploads,
        )
        self.registry.add_builtins()
        self._procs: list = []
        self._handles: list[EngineHandle] = []
        self._in_process: list = []  # engines run in this process (closed at stop)
        self.owners: dict[int, object] = {}  # instance id -> owning connection (None: detached)
        self.loop = None  # the event loop the server runs on, set by start()

    async def start(self) -> None:
        import asyncio

        self.loop = asyncio.get_running_loop()
        cfg = self.config
        model = cfg.model
        if model is None:  # writing the default model needs torch: imported only then
            from pastry.engine.tiny import ensure_default_model

            model = ensure_default_model()
        self._handles = await start_engines(self, model)
        self.controller = Controller(
            self._handles, batch_policy(cfg.policy), http_allow=cfg.http_allow,
            schedule=lambda: schedule_policy(cfg.schedule), max_batch=cfg.max_batch,
        )  # fmt: skip
        self.runtime = TrustedRuntime(self.controller)
        # Long-lived objects (tokenizers, an in-process model) stay out of later garbage
        # collections, which otherwise rescan them on every full pass (measured: about
        # half of the control layer's per-step time at 128 inferlets).
        gc.collect()
        gc.freeze()
        if len(self._handles) > 1:
            try:
                await self.set_router(cfg.router or "round-robin")
            except ValueError as e:
                raise ConfigError(f"--router: {e}") from None
        for h in self._handles:
            i = h.info
            log.info(
                "model %s (%s, %s on %s): %d KV pages x %d tokens, %d embeds, max %d tokens/batch",
                i.model_name, i.arch, i.dtype, i.device, i.num_pages, i.page_size,
                i.num_embeds, i.max_batch_tokens,
            )  # fmt: skip

    async def set_router(self, spec: str) -> Instance:
        """Make ``spec`` (``NAME[:ARG]`` of ``inferlets/routers/``, or a program's name or
        hash with ``:ARGS``) the active router, without restarting engines: the new router
        runs detached; the old one ends, and what it had not placed is placed anew."""
        return await swap_router(self, spec)

    async def _start_engine(self, model: Path, econf: EngineConfig, **spawn_kw) -> EngineHandle:
        if self.config.in_process:
            from pastry.engine.engine import Engine
            from pastry.engine.handle import InProcessEngine

            engine = Engine.load(model, econf)
            for name, path in self.config.adapters:
                engine.load_adapter(path, name)
            self._in_process.append(engine)
            return InProcessEngine(engine)
        from pastry.engine.remote import RemoteEngine
        from pastry.engine.spawn import spawn_engine

        proc = spawn_engine(model, econf, adapters=self.config.adapters, **spawn_kw)
        self._procs.append(proc)
        return await RemoteEngine.connect(proc.endpoint, token=spawn_kw.get("token"))

    async def stop(self) -> None:
        if self.controller is not None:
            for inst in list(self.runtime.instances.values()):
                self.runtime.terminate(inst.id, "the server is shutting down")
            await self.controller.close()
        for h in self._handles:
            await h.aclose()
        for p in self._procs:
            p.terminate()
        for e in self._in_process:
            e.close()
        self._handles, self._procs, self._in_process = [], [], []

    # ------------------------------------------------------------------ instances

    def launch(
        self, program: str, args: Sequence[str] = (), owner: object | None = None
    ) -> Instance:
        """Launch a program by name or hash; ``owner`` None means detached."""
        inst = self.runtime.launch(self.registry.get(program), list(args))
        self.owners[inst.id] = owner

        async def forget() -> None:
            await inst.wait()
            self.owners.pop(inst.id, None)

        self.loop.create_task(forget())
        return inst

    def instance(self, iid: int) -> Instance | None:
        return self.runtime.instances.get(iid)

    def owned_by(self, owner: object) -> list[Instance]:
        return [i for i in self.runtime.instances.values() if self.owners.get(i.id) is owner]

    def disown(self, owner: object) -> None:
        """A connection closed: end the instances it owns (detached ones live on)."""
        for inst in self.owned_by(owner):
            self.runtime.terminate(inst.id, "the client that launched it disconnected")
        for iid in [i for i, o in self.owners.items() if o is owner]:
            self.owners.pop(iid, None)

    def check_token(self, token: str | None) -> bool:
        expected = self.config.auth_token
        return expected is None or (token is not None and secrets.compare_digest(token, expected))

    @property
    def models(self) -> list[str]:
        return list(self.controller.models) if self.controller else []
