"""Quotas: what one tenant may take of a shared server (``docs/security.md`` lists them).

One frozen :class:`Quotas` per server (``ServerConfig.quotas``, a ``pastry serve`` flag
each). The control layer enforces the memory, message, store and result quotas; the server
the instance, upload and request quotas. ``None`` switches a quota off.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from pastry.api import ApiError

MiB = 1 << 20


@dataclass(frozen=True)
class Quotas:
    # Memory on each model, as fractions of its pool (KV pages and embeddings alike). An
    # instance holds the pages its handles and its own exports reference; a user holds those
    # of its instances plus its persistent exports (reclaimed first when short).
    instance_share: float | None = 0.5
    user_share: float | None = 0.5  # applies only when the server has several users
    instances_per_user: int | None = 256  # running at once (WebSocket and HTTP together)
    # Messages an instance sent that its client has not read yet; over it, the instance is
    # ended (its client does not keep up). A detached instance nobody is attached to keeps
    # at most detached_backlog_bytes (the oldest are dropped and counted).
    backlog_bytes: int | None = 8 * MiB
    detached_backlog_bytes: int = 1 * MiB
    result_bytes: int | None = 16 * MiB  # what main returns
    store_bytes_per_user: int | None = 16 * MiB  # keys plus values in the key-value store
    uploads_per_user: int | None = 64  # programs stored (names)
    upload_bytes_per_user: int | None = 16 * MiB  # their sources, together
    request_bytes: int | None = 8 * MiB  # one HTTP request body or WebSocket message
    json_depth: int = 64  # nesting of a JSON request
    request_choices: int | None = 64  # prompts x n of one completion request
    tokenize_bytes: int | None = 1 * MiB  # text one tokenize call takes (runs on the loop)
    max_connections: int | None = 1024  # HTTP and WebSocket connections at once
    responses_per_user: int | None = 1024  # stored /v1/responses (the oldest go first)
    image_bytes: int | None = 20 * MiB  # one encoded image (embed_img, image parts)
    image_pixels: int | None = 64 * MiB  # its width x height, read from its header

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                if f.name in ("json_depth", "detached_backlog_bytes"):
                    raise ValueError(f"Quotas.{f.name} cannot be switched off")
                continue
            if f.name.endswith("_share"):
                if not (isinstance(value, int | float) and 0 < value <= 1):
                    raise ValueError(f"Quotas.{f.name} must be in (0, 1], got {value!r}")
            elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Quotas.{f.name} must be a positive integer, got {value!r}")

    @classmethod
    def none(cls) -> Quotas:
        """Every quota that can be off, off (a controller used as a library)."""
        return cls(**{
            f.name: None for f in fields(cls) if f.name not in ("json_depth", "detached_backlog_bytes")
        })  # fmt: skip


# The ``pastry serve`` flag of each quota, and what it caps (docs/security.md has the table).
FLAGS: dict[str, tuple[str, str]] = {
    "instance_share": ("--instance-share", "fraction of each model's KV pages and embeddings "
                       "one instance may hold"),
    "user_share": ("--user-share", "fraction one user may hold (instances and persistent "
                   "exports; only with several users)"),
    "instances_per_user": ("--max-instances-per-user", "instances one user runs at once"),
    "backlog_bytes": ("--max-backlog-bytes", "unread messages of an instance before it is "
                      "ended"),
    "detached_backlog_bytes": ("--max-detached-backlog-bytes", "messages kept for a detached "
                               "instance nobody is attached to (oldest dropped)"),
    "result_bytes": ("--max-result-bytes", "size of an instance's result"),
    "store_bytes_per_user": ("--max-store-bytes-per-user", "one user's key-value store"),
    "uploads_per_user": ("--max-uploads-per-user", "programs one user stores"),
    "upload_bytes_per_user": ("--max-upload-bytes-per-user", "their total size"),
    "request_bytes": ("--max-request-bytes", "an HTTP request body or WebSocket message"),
    "json_depth": ("--max-json-depth", "nesting of request JSON"),
    "request_choices": ("--max-request-choices", "prompts x n of one completion request"),
    "tokenize_bytes": ("--max-tokenize-bytes", "text one tokenize call takes"),
    "image_bytes": ("--max-image-bytes", "one encoded image (embed_img, chat image parts)"),
    "image_pixels": ("--max-image-pixels", "one image's width x height"),
    "max_connections": ("--max-connections", "HTTP and WebSocket connections at once"),
    "responses_per_user": ("--max-responses-per-user", "stored /v1/responses of one user "
                           "(the oldest go first, with their KV)"),
}  # fmt: skip


def parse_quota(field_name: str, text: str) -> float | int | None:
    """A quota's value from the command line: a number (sizes may end in K, M or G, binary
    units), or ``none``/``off`` to switch it off."""
    text = text.strip()
    if text.lower() in ("none", "off"):
        return None
    if field_name.endswith("_share"):
        return float(text)
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    low = text.lower().removesuffix("ib").removesuffix("b")
    if low and low[-1] in units:
        return int(float(low[:-1]) * units[low[-1]])
    return int(text)


def share_of(share: float | None, size: int) -> int | None:
    """How many of a pool of ``size`` a ``share`` allows (at least 1), or None (no cap)."""
    if share is None or share >= 1:
        return None
    return max(1, int(share * size))


class QuotaError(ApiError):
    """A call would take the instance over a resource limit (:meth:`Session.set_limit`)."""
