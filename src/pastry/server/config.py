"""``ServerConfig``: what a server serves and how, checked when it is made.

The engines (``server/engines.py`` starts them from it), the batching and scheduling
policies, the tenancy (tokens, users, grants and quotas: ``docs/security.md``) and the
limits. A configuration that cannot serve, or would serve unsafely (a non-loopback address
without a token), raises :class:`ConfigError` with what to change.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from pathlib import Path

from pastry.control.policies import (
    DEFAULT_SCHEDULE,
    admission_policy,
    batch_policy,
    schedule_policy,
)
from pastry.control.quotas import Quotas
from pastry.control.users import Account, Directory, UsersError, check_token


class ConfigError(ValueError):
    """The server cannot start with this configuration."""


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
    image_url_allow: tuple[str, ...] = ()  # hosts image URLs may name (server/image_fetch.py)
    # MCP servers inferlets may use: NAME=COMMAND or NAME=URL (control/mcp.py: McpServer)
    mcp_servers: tuple[str, ...] = ()
    max_upload_bytes: int = 1 << 20
    programs_dir: Path | None = None  # default: $PASTRY_HOME/programs
    responses_dir: Path | None = None  # stored /v1/responses on disk (None: memory only)
    store_dir: Path | None = None  # the inferlets' key-value store on disk (None: memory)
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
    # the Ray resources of each engine (once: every engine's; else one per engine) and how
    # the placement group lays them out over the nodes (server/ray_engines.py)
    ray_engine_resources: tuple[dict, ...] = ()
    ray_placement: str = "SPREAD"
    router: str = ""  # NAME[:ARG] of inferlets/routers/, or a program; "" = round-robin
    users: tuple[Account, ...] = field(default=(), repr=False)  # --users FILE
    grants: tuple[tuple[str, str], ...] = ()  # (owner, reader): reader may read owner's
    quotas: Quotas = field(default_factory=Quotas)
    prefix_cache: bool = True  # the automatic prefix cache (RadixAttention)
    # an engine process whose batch (or, idle, a ping) goes unanswered this long is killed
    # and restarted (server/supervisor.py)
    engine_hang_timeout: float = 120.0
    admission: str = "lpm"  # order of waiting prefills: lpm, fcfs or random
    # Seconds an idle HTTP/1.1 connection stays open. Longer than the clients' own idle
    # expiry (httpx and the OpenAI/Anthropic SDKs 5 s, aiohttp 15 s, undici 4 s): a server
    # that closes first races a client reusing the connection, whose request then meets a
    # reset (a ReadError the client cannot tell from a failure).
    keep_alive: float = 65.0

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
        self._check_ray()
        admission_policy(self.admission)  # validates the name
        if not self.keep_alive > 0:
            raise ConfigError(f"--keep-alive must be > 0 seconds, got {self.keep_alive}")

    def _check_ray(self) -> None:
        from pastry.server.ray_placement import check_strategy, engine_bundles

        if self.ray_address is None:
            if self.ray_engine_resources or self.ray_placement != "SPREAD":
                raise ConfigError(
                    "--ray-engine-resources and --ray-placement place engines on a Ray "
                    "cluster: give the cluster with --ray ADDRESS"
                )
            return
        try:
            check_strategy(self.ray_placement)
            engine_bundles(self.ray_engine_resources, max(1, self.engines))
        except ValueError as e:
            raise ConfigError(str(e)) from None

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
