"""``PastryServer``: engines, the control layer, the runner and the program registry, wired.

Start-up, from a :class:`ServerConfig` (``server/config.py``): one engine per device in
``engine_devices`` (its own process, reached over ZeroMQ IPC; or in-process when
``in_process``; several: ``server/engines.py``), a :class:`Controller` over them, a
:class:`TrustedRuntime`, and a :class:`ProgramRegistry` with the built-in inferlets.
Instances are launched by program name or hash; the endpoints (``server/ws.py``,
``server/openai.py``) track which connection owns which instance.

Tenancy (``docs/security.md``): clients authenticate as users (:class:`Directory`, from
``auth_token`` and ``users``); every launch names the user it is for, under the quotas of
``ServerConfig.quotas``.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Sequence

from pastry.control.controller import Controller
from pastry.control.gc_tuning import tune_for_serving
from pastry.control.mcp import McpServer
from pastry.control.policies import admission_policy, batch_policy, schedule_policy
from pastry.control.users import LOCAL_USER, User
from pastry.paths import programs_dir
from pastry.runtime.trusted import Instance, TrustedRuntime
from pastry.server.config import ConfigError, ServerConfig  # importable from here too
from pastry.server.engines import ServerEngines
from pastry.server.image_fetch import ImageFetcher
from pastry.server.registry import ProgramRegistry, RegistryError

log = logging.getLogger(__name__)


class LaunchQuotaError(ValueError):
    """A launch would take its user over ``Quotas.instances_per_user``."""


class PastryServer:
    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.directory = config.directory()
        self.controller: Controller | None = None
        self.runtime: TrustedRuntime | None = None
        q = config.quotas
        # image URLs in requests, from the hosts the operator allows (none by default)
        self.image_fetch = ImageFetcher(config.image_url_allow, q.image_bytes or 64 << 20)
        self.registry = ProgramRegistry(
            config.programs_dir or programs_dir(),
            config.max_upload_bytes,
            trusted_uploads=config.trusted_uploads,
            max_programs_per_user=q.uploads_per_user,
            max_bytes_per_user=q.upload_bytes_per_user,
        )
        self.registry.add_builtins()
        self.engines = ServerEngines()
        """The engines: their handles, and what :meth:`stop` ends (``server/engines.py``)."""
        self.owners: dict[int, object] = {}  # instance id -> owning connection (None: detached)
        self.running: Counter[str] = Counter()  # user -> instances running
        self.streams = None  # the /ws endpoint's instance streams (server/ws.py sets it)
        self.loop = None  # the event loop the server runs on, set by start()

    async def start(self) -> None:
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
        await self.engines.start(cfg, model)
        self.controller = Controller(
            self.engines.handles,
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
            store_dir=cfg.store_dir,
        )
        self.runtime = TrustedRuntime(self.controller)
        self.engines.supervise(self)  # engines that exit, are killed or hang come back
        # Long-lived objects (tokenizers, an in-process model) stay out of later garbage
        # collections, and young collections are rare enough that a batch cycle's objects
        # die first (control/gc_tuning.py: the per-step cost stays flat in the inferlets).
        tune_for_serving()
        if len(self.engines.handles) > 1:
            try:
                await self.set_router(cfg.router or "round-robin")
            except ValueError as e:
                raise ConfigError(f"--router: {e}") from None
        for h in self.engines.handles:
            i = h.info
            log.info(
                "model %s (%s, %s on %s): %d KV pages x %d tokens, %d embeds, max %d tokens/batch",
                i.model_name, i.arch, i.dtype, i.device, i.num_pages, i.page_size,
                i.num_embeds, i.max_batch_tokens,
            )  # fmt: skip

    async def set_router(self, spec: str, user: User = LOCAL_USER) -> Instance:
        """Make ``spec`` (``NAME[:ARG]`` of ``inferlets/routers/``, or a program's name or
        hash with ``:ARGS``) the active router, without restarting engines: the new router
        runs detached; the old one ends, and what it had not placed is placed anew. Raises
        ``ValueError`` naming the routers when the program is unknown or fails at start."""
        name, _, arg = spec.partition(":")
        args = [a for a in arg.split(",") if a]
        known = sorted(p.name[7:] for p in self.registry.list() if p.name.startswith("router-"))
        program = f"router-{name}" if name in known else name
        try:
            prog = self.registry.get(program, user.name)  # a built-in, or one of user's
        except RegistryError:
            raise ValueError(
                f"no router '{name}' (built-in routers: {', '.join(known)}; or upload a "
                "program and name it)"
            ) from None
        routing = self.controller.routing
        old = routing.router
        inst = self.runtime.launch(prog, args, user.name)
        self.owners[inst.id] = None
        routing.set_router(inst.id, spec)
        for _ in range(20):  # a router that fails at once (a bad argument) is reported here
            await asyncio.sleep(0)
            if inst.done.is_set():
                end = inst.end
                why = getattr(end, "error", None) or getattr(end, "reason", None) or end
                raise ValueError(f"router '{spec}' failed at start:\n{why}")
        if old is not None and old != inst.id:
            self.runtime.terminate(old, f"replaced by router '{spec}'")
        log.info("router %s is instance %d", spec, inst.id)
        return inst

    async def stop(self) -> None:
        if self.controller is not None:
            for inst in list(self.runtime.instances.values()):
                self.runtime.terminate(inst.id, "the server is shutting down")
            await self.controller.close()
        await self.engines.close()
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
