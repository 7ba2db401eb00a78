"""``PastryServer``: engines, the control layer, the runner and the program registry, wired.

Start-up: one engine per device in ``engine_devices`` (its own process, reached over
ZeroMQ IPC; or in-process when ``in_process``), a :class:`Controller` over them, a
:class:`TrustedRuntime`, and a :class:`ProgramRegistry` with the built-in inferlets.
Instances are launched by program name or hash; the endpoints (``server/ws.py``,
``server/openai.py``) track which connection owns which instance.

Tenancy (``docs/security.md``): clients authenticate as users (:class:`Directory`, from
``auth_token`` and ``users``); every launch names the user it is for, under the quotas of
``ServerConfig.quotas``.
"""

from __future__ import annotations

import ipaddress
import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pastry.control.controller import Controller
from pastry.control.gc_tuning import tune_for_serving
from pastry.control.mcp import McpServer
from pastry.control.policies import (
    DEFAULT_SCHEDULE,
    admission_policy,
    batch_policy,
    schedule_policy,
)
from pastry.control.quotas import Quotas
from pastry.control.users import LOCAL_USER, Account, Directory, User, UsersError, check_token
from pastry.paths import programs_dir
from pastry.runtime.trusted import Instance, TrustedRuntime
from pastry.server.engines import start_engines, supervise, swap_router
from pastry.server.registry import ProgramRegistry
from pastry.wire.config import EngineConfig
from pastry.wire.handle import EngineHandle

log = logging.getLogger(__name__)


class ConfigError(ValueError):
    """The server cannot start with this configuration."""


class LaunchQuotaError(ValueError):
    """A launch would take its user over ``Quotas.instances_per_user``."""


@dataclass(frozen=True)
class ServerConfig:
    model: Path | None = None  # None: the embedded default model
    host: str = "127.0.0.1"
    port: int = 8080
    auth_token: str | None = field(default=None, repr=False)
    engine_devices: tuple[str, ...] = ("cpu",)
    dtype: str = "auto"
    page_size: int = 16
    num_pages: int = 0  # 0: from available memory
    num_embeds: int = 0
    policy: str = "adaptive"
    http_allow: tuple[str, ...] = ()
    # MCP servers inferlets may use: NAME=COMMAND or NAME=URL (control/mcp.py: McpServer)
    mcp_servers: tuple[str, ...] = ()
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
    users: tuple[Account, ...] = field(default=(), repr=False)  # --users FILE
    grants: tuple[tuple[str, str], ...] = ()  # (owner, reader): reader may read owner's
    quotas: Quotas = field(default_factory=Quotas)
    prefix_cache: bool = True  # the automatic prefix cache (RadixAttention)
    # an engine process whose batch (or, idle, a ping) goes unanswered this long is killed
    # and restarted (server/supervisor.py)
    engine_hang_timeout: float = 120.0
    admission: str = "lpm"  # order of waiting prefills: lpm, fcfs or random

    def __post_init__(self) -> None:
        if self.auth_token:  # "" is no token, like an empty PASTRY_AUTH_TOKEN
            try:
                check_token(self.auth_token, "the auth token (--auth-token / PASTRY_AUTH_TOKEN)")
            except UsersError as e:
                raise ConfigError(str(e)) from None
        if not self.auth_token and not self.users and not is_loopback(self.host):
            raise ConfigError(
                f"refusing to listen on {self.host} without an auth token: anyone who can "
                "reach it could run programs. Set --auth-token (or PASTRY_AUTH_TOKEN) or "
                "--users FILE, or bind 127.0.0.1"
            )
        self.directory()  # validates users and grants
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
        admission_policy(self.admission)  # validates the name

    def directory(self) -> Directory:
        """Who may connect, as which user (from ``auth_token`` and ``users``)."""
        try:
            return Directory.build(self.auth_token or None, self.users, self.grants)
        except UsersError as e:
            raise ConfigError(str(e)) from None


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
        self.directory = config.directory()
        self.controller: Controller | None = None
        self.runtime: TrustedRuntime | None = None
        q = config.quotas
        self.registry = ProgramRegistry(
            config.programs_dir or programs_dir(),
            config.max_upload_bytes,
            trusted_uploads=config.trusted_uploads,
            max_programs_per_user=q.uploads_per_user,
            max_bytes_per_user=q.upload_bytes_per_user,
        )
        self.registry.add_builtins()
        self._procs: list = []
        self._handles: list[EngineHandle] = []
        self._in_process: list = []  # engines run in this process (closed at stop)
        self.owners: dict[int, object] = {}  # instance id -> owning connection (None: detached)
        self.running: Counter[str] = Counter()  # user -> instances running
        self.streams = None  # the /ws endpoint's instance streams (server/ws.py sets it)
        self.loop = None  # the event loop the server runs on, set by start()

    async def start(self) -> None:
        import asyncio

        self.loop = asyncio.get_running_loop()
        cfg = self.config
        if cfg.trusted_uploads:
            operators = [u.name for u in self.directory.users.values() if u.operator]
            log.warning(
                "--trusted-uploads: programs uploaded from now on by an operator (%s) run "
                "inside the server process, unsandboxed, with its files, environment and "
                "network; uploads by other users stay sandboxed",
                ", ".join(operators) or "the local user",
            )
        model = cfg.model
        if model is None:  # SmolLM2 if fetched, else a random model (written with torch)
            from pastry.engine.default_model import default_model

            model = default_model()
        self._handles = await start_engines(self, model)
        self.controller = Controller(
            self._handles,
            batch_policy(cfg.policy),
            http_allow=cfg.http_allow,
            schedule=lambda: schedule_policy(cfg.schedule),
            max_batch=cfg.max_batch,
            quotas=cfg.quotas,
            grants=self.directory.grants,
            several_users=not self.directory.single_user,
            prefix_cache=cfg.prefix_cache,
            admission=lambda: admission_policy(cfg.admission),
            mcp_servers=[McpServer.parse(spec) for spec in cfg.mcp_servers],
        )
        self.runtime = TrustedRuntime(self.controller)
        supervise(self)  # engines that exit, are killed or hang come back
        # Long-lived objects (tokenizers, an in-process model) stay out of later garbage
        # collections, and young collections are rare enough that a batch cycle's objects
        # die first (control/gc_tuning.py: the per-step cost stays flat in the inferlets).
        tune_for_serving()
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

    async def set_router(self, spec: str, user: User = LOCAL_USER) -> Instance:
        """Make ``spec`` (``NAME[:ARG]`` of ``inferlets/routers/``, or a program's name or
        hash with ``:ARGS``) the active router, without restarting engines: the new router
        runs detached; the old one ends, and what it had not placed is placed anew."""
        return await swap_router(self, spec, user)

    async def _start_engine(self, model: Path, econf: EngineConfig, **spawn_kw) -> EngineHandle:
        if self.config.in_process:
            from pastry.engine.engine import Engine
            from pastry.wire.handle import InProcessEngine

            engine = Engine.load(model, econf)
            for name, path in self.config.adapters:
                engine.load_adapter(path, name)
            self._in_process.append(engine)
            return InProcessEngine(engine)
        from pastry.wire.remote import RemoteEngine
        from pastry.wire.spawn import spawn_engine

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
        self.registry.close()

    # ------------------------------------------------------------------ instances

    def launch(
        self,
        program: str,
        args: Sequence[str] = (),
        owner: object | None = None,
        user: User = LOCAL_USER,
        builtin: bool = False,
    ) -> Instance:
        """Launch ``user``'s program by name or hash (``builtin``: the built-in of that
        name, whatever the user uploaded); ``owner`` None means detached. Raises
        :class:`LaunchQuotaError` over the user's instance quota."""
        prog = self.registry.builtin(program) if builtin else self.registry.get(program, user.name)
        self.admit(user, 1)
        inst = self.runtime.launch(prog, list(args), user.name)
        self.owners[inst.id] = owner
        self.running[user.name] += 1

        async def forget() -> None:
            await inst.wait()
            self.owners.pop(inst.id, None)
            self.running[user.name] -= 1
            if not self.running[user.name]:
                del self.running[user.name]

        self.loop.create_task(forget())
        return inst

    def admit(self, user: User, n: int) -> None:
        """Raise :class:`LaunchQuotaError` unless ``user`` may start ``n`` more instances."""
        limit = self.config.quotas.instances_per_user
        if limit is not None and self.running[user.name] + n > limit:
            raise LaunchQuotaError(
                f"user {user.name} runs {self.running[user.name]} instances; {n} more would "
                f"exceed the quota of {limit} (--max-instances-per-user): wait for some to end"
            )

    def instance(self, iid: int, user: User | None = None) -> Instance | None:
        """Instance ``iid`` (only if it belongs to ``user``, when given)."""
        inst = self.runtime.instances.get(iid)
        if inst is None or (user is not None and inst.user != user.name):
            return None
        return inst

    def owned_by(self, owner: object) -> list[Instance]:
        return [i for i in self.runtime.instances.values() if self.owners.get(i.id) is owner]

    def disown(self, owner: object) -> None:
        """A connection closed: end the instances it owns (detached ones live on)."""
        for inst in self.owned_by(owner):
            self.runtime.terminate(inst.id, "the client that launched it disconnected")
        for iid in [i for i, o in self.owners.items() if o is owner]:
            self.owners.pop(iid, None)

    def authenticate(self, token: object) -> User | None:
        """The user ``token`` names (the local user when the server has no tokens)."""
        return self.directory.authenticate(token)

    @property
    def models(self) -> list[str]:
        return list(self.controller.models) if self.controller else []
