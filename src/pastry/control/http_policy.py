"""The outgoing-HTTP policy: which URLs an inferlet may fetch (:mod:`pastry.control.http`).

:func:`check_url` applies the policy described in :mod:`pastry.control.http`'s docstring to
one URL against the allowlist's :class:`AllowRule` entries, before any connection is opened.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import quote, urlsplit

DEFAULT_PORTS = {"http": 80, "https": 443}
_NAME_RE = re.compile(r"[a-z0-9_-]+(\.[a-z0-9_-]+)*")
_NUMERIC_LABEL_RE = re.compile(r"[0-9]+|0x[0-9a-f]*")


class HttpError(RuntimeError):
    """A request failed after it was allowed: connection, protocol, size or time."""


class HttpDenied(PermissionError):
    """A URL is not allowed by the policy; raised before any connection is made."""


class HttpTooLarge(HttpError):
    """A response body is larger than ``max_response_bytes``."""


class HttpTimeout(HttpError, TimeoutError):
    """A request did not complete within its timeout."""


def _normalize_host(raw: str) -> str:
    """Canonical form of a host: lower-case name without trailing dot, or an IP literal.

    Raises ``ValueError`` for malformed hosts and :class:`HttpDenied` for IPv4 literals in
    a non-canonical form."""
    host = raw.lower()
    if ":" in host:
        if "%" in host:
            raise ValueError(f"IPv6 zone ids are not supported: {raw!r}")
        try:
            return str(ipaddress.IPv6Address(host))
        except ValueError:
            raise ValueError(f"invalid IPv6 address {raw!r}") from None
    if host.endswith("."):
        host = host[:-1]
    if not host.isascii():
        raise ValueError(f"non-ASCII host {raw!r}: write it in its xn-- (punycode) form")
    if _NUMERIC_LABEL_RE.fullmatch(host.rsplit(".", 1)[-1]):
        try:
            return str(ipaddress.IPv4Address(host))
        except ValueError:
            raise HttpDenied(
                f"host {raw!r} is a number but not a canonical IPv4 address; write IPv4 "
                f"addresses as four decimal parts (e.g. 127.0.0.1)"
            ) from None
    if not _NAME_RE.fullmatch(host):
        raise ValueError(f"invalid host name {raw!r}")
    return host


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class AllowRule:
    """One allowlist entry: scheme (``None``: http or https), host, port (``None``: any).

    ``wildcard`` rules match strict subdomains of ``host``."""

    scheme: str | None
    host: str
    port: int | None = None
    wildcard: bool = False

    @classmethod
    def parse(cls, entry: str) -> AllowRule:
        def bad(why: str) -> ValueError:
            return ValueError(
                f"invalid HTTP allowlist entry {entry!r}: {why}; expected forms: 'localhost', "
                f"'127.0.0.1:8080', '*.example.com', 'https://api.example.com', '[::1]:8080'"
            )

        if not isinstance(entry, str):
            raise TypeError(f"allowlist entries must be str, got {type(entry).__name__}")
        rest = entry.strip()
        scheme = None
        if "://" in rest:
            scheme, _, rest = rest.partition("://")
            scheme = scheme.lower()
            if scheme not in DEFAULT_PORTS:
                raise bad(f"scheme {scheme!r} is not http or https")
        rest = rest.removesuffix("/")
        if not rest:
            raise bad("no host")
        if any(c in rest for c in "/?#@\\") or any(c.isspace() for c in rest):
            raise bad("only a host with optional scheme and port is allowed (no path or user)")
        wildcard = rest.startswith("*.")
        if wildcard:
            rest = rest[2:]
        port_text = None
        if rest.startswith("["):
            host, sep, tail = rest[1:].partition("]")
            if not sep or (tail and not tail.startswith(":")):
                raise bad("unbalanced brackets")
            port_text = tail[1:] if tail else None
        elif rest.count(":") == 1:
            host, port_text = rest.split(":")
        else:
            host = rest  # a name, an IPv4 literal, or a bare IPv6 literal
        port = None
        if port_text is not None:
            if not port_text.isdigit() or not 0 < int(port_text) < 65536:
                raise bad(f"port {port_text!r} is not a number in 1..65535")
            port = int(port_text)
        if "*" in host:
            raise bad("'*' is only allowed as a leading '*.' before a domain")
        try:
            host = _normalize_host(host)
        except (ValueError, HttpDenied) as e:
            raise bad(str(e)) from None
        if wildcard and _is_ip(host):
            raise bad("a wildcard cannot apply to an IP address")
        return cls(scheme, host, port, wildcard)

    def matches(self, scheme: str, host: str, port: int) -> bool:
        """Whether a normalized (scheme, host, port) is allowed by this rule."""
        if self.scheme is not None and scheme != self.scheme:
            return False
        if self.port is not None and port != self.port:
            return False
        if self.wildcard:
            return host.endswith("." + self.host)
        return host == self.host

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        text = ("*." if self.wildcard else "") + host
        if self.port is not None:
            text += f":{self.port}"
        return f"{self.scheme}://{text}" if self.scheme else text


@dataclass(frozen=True)
class HttpTarget:
    """A URL that passed the policy, split for the request."""

    url: str
    scheme: str
    host: str  # normalized; IPv6 without brackets
    port: int
    target: str  # path and query, ASCII, as sent in the request line

    @property
    def host_header(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port == DEFAULT_PORTS[self.scheme] else f"{host}:{self.port}"


def check_url(url: str, allow: Sequence[AllowRule]) -> HttpTarget:
    """Apply the policy to ``url`` with the allowlist ``allow``: the split target, or
    :class:`HttpDenied` (not allowed) / ``ValueError`` (malformed)."""
    if not isinstance(url, str):
        raise TypeError(f"url must be a str, got {type(url).__name__}")
    if any(c <= " " or c == "\x7f" or c == "\\" for c in url):
        raise ValueError(
            f"URL {url!r} contains whitespace, control characters or a backslash; "
            f"percent-encode them (%20, %5C)"
        )
    try:
        parts = urlsplit(url)
    except ValueError as e:
        raise ValueError(f"invalid URL {url!r}: {e}") from None
    scheme = parts.scheme.lower()
    if scheme not in DEFAULT_PORTS:
        raise HttpDenied(f"URL {url!r}: scheme {scheme!r} is not allowed, only http and https")
    if "@" in parts.netloc:
        raise HttpDenied(f"URL {url!r}: user info (user@host) is not allowed in URLs")
    if not parts.hostname:
        raise ValueError(f"invalid URL {url!r}: no host")
    try:
        port = parts.port
    except ValueError as e:
        raise ValueError(f"invalid URL {url!r}: {e}") from None
    if port == 0:
        raise ValueError(f"invalid URL {url!r}: port 0")
    try:
        host = _normalize_host(parts.hostname)
    except HttpDenied as e:
        raise HttpDenied(f"URL {url!r}: {e}") from None
    except ValueError as e:
        raise ValueError(f"invalid URL {url!r}: {e}") from None
    port = port or DEFAULT_PORTS[scheme]
    if not any(rule.matches(scheme, host, port) for rule in allow):
        allowed = ", ".join(str(r) for r in allow) or "(empty: nothing is allowed)"
        raise HttpDenied(
            f"URL {url!r}: host {host!r} port {port} ({scheme}) is not in the HTTP "
            f"allowlist [{allowed}]; the server operator can add it"
        )
    target = parts.path or "/"
    if parts.query:
        target += "?" + parts.query
    if not target.isascii():
        target = "".join(c if c.isascii() else quote(c) for c in target)
    return HttpTarget(url, scheme, host, port, target)
