"""Token authentication of engine sockets: ZeroMQ CURVE keys derived from a shared token.

An engine started with a token (``pastry engine --listen tcp://... --token T``) accepts only
peers that hold ``T``: its sockets are CURVE servers whose key pair is derived from ``T``,
and a ZAP handler admits only the client key derived from ``T``. The control layer (and a
peer engine writing KV into it) derives the same keys from the same token, so the token
itself never crosses the network, and the traffic is encrypted. Without a token (local
``ipc://`` engines that the server spawned, private to its user) sockets are plain.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
from dataclasses import dataclass
from typing import Any

import zmq
from zmq.utils import z85

log = logging.getLogger(__name__)


class AuthError(RuntimeError):
    """CURVE is unavailable in this ZeroMQ build, or a token is unusable."""


@dataclass(frozen=True)
class CurveKeys:
    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    @classmethod
    def from_token(cls, token: str) -> CurveKeys:
        if not token:
            raise AuthError("an engine token must be a non-empty string")
        if not zmq.has("curve"):
            raise AuthError("this ZeroMQ build has no CURVE support; engine tokens need it")

        def pair(role: bytes) -> tuple[bytes, bytes]:
            secret = z85.encode(hashlib.sha256(b"pastry-engine\0" + role + token.encode()).digest())
            return zmq.curve_public(secret), secret

        sp, ss = pair(b"server")
        cp, cs = pair(b"client")
        return cls(sp, ss, cp, cs)


def new_token() -> str:
    """A fresh random token (for engines a server starts itself)."""
    return secrets.token_urlsafe(24)


def secure_server(sock: zmq.Socket, token: str | None) -> None:
    """Make ``sock`` (before ``bind``) a CURVE server for ``token`` (no-op without one)."""
    if not token:
        return
    keys = CurveKeys.from_token(token)
    sock.curve_secretkey = keys.server_secret
    sock.curve_publickey = keys.server_public
    sock.curve_server = True


def secure_client(sock: zmq.Socket, token: str | None) -> None:
    """Make ``sock`` (before ``connect``) a CURVE client for ``token`` (no-op without one)."""
    if not token:
        return
    keys = CurveKeys.from_token(token)
    sock.curve_secretkey = keys.client_secret
    sock.curve_publickey = keys.client_public
    sock.curve_serverkey = keys.server_public


class _TokenKeys:
    """ZAP credentials provider: admits exactly the client key derived from the token."""

    def __init__(self, token: str) -> None:
        self.allowed = CurveKeys.from_token(token).client_public

    def callback(self, domain: str, key: bytes) -> bool:
        ok = secrets.compare_digest(z85.encode(key) if len(key) == 32 else key, self.allowed)
        if not ok:
            log.warning("refused a connection with a key not derived from this engine's token")
        return ok


def start_authenticator(ctx: zmq.Context, token: str | None) -> Any:
    """Start a ZAP handler on ``ctx`` that admits only holders of ``token``; returns it
    (``stop()`` it when done), or None without a token."""
    if not token:
        return None
    from zmq.auth.thread import ThreadAuthenticator

    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve_callback("*", credentials_provider=_TokenKeys(token))
    return auth
