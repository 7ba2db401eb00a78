"""Outgoing HTTP for inferlets (``http_get`` / ``http_post`` in Pie §4.3), limited to an allowlist.

:class:`HttpClient` is a small HTTP/1.1 client on asyncio streams (one request per
connection, ``Connection: close``; bodies framed by ``Content-Length``, chunked transfer
coding, or end of stream; ``https`` through :mod:`ssl` with certificate checks).

Policy, all checked by :meth:`HttpClient.check` before any connection is opened:

- Only ``http`` and ``https`` URLs; no user info (``http://allowed@evil/`` is denied, as is
  any ``@`` before the path); no whitespace, control characters or backslashes.
- The host must match an allowlist entry. Entries are ``host``, ``host:port``,
  ``scheme://host[:port]``, ``*.domain`` (any subdomain of ``domain``, not ``domain``
  itself), IPv4 literals, and IPv6 literals in brackets (``[::1]:8080``). Without a port an
  entry allows every port; without a scheme, both ``http`` and ``https``. Names compare
  case-insensitively, ignoring one trailing dot; IP literals compare by value, and IPv4
  literals must be dotted quads (``127.1``, ``0x7f.0.0.1`` and ``2130706433`` are denied).
  An empty allowlist denies everything.
- Redirects are never followed: a 3xx response is returned as is (``response.location``),
  and an inferlet that wants to follow it makes a new request, checked again.
- The response body is capped (``max_response_bytes``, :class:`HttpTooLarge`) and the whole
  exchange (connect, send, receive) has a deadline (``timeout``, :class:`HttpTimeout`).

Names are matched as written and resolved by the system resolver; the addresses they resolve
to are not checked, so an allowed name is trusted as far as its DNS is. Proxy environment
variables are ignored.
"""

from __future__ import annotations

import asyncio
import codecs
import ipaddress
import json
import re
import ssl
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlsplit

DEFAULT_TIMEOUT_S = 30.0
DEFAULT_MAX_RESPONSE_BYTES = 8 << 20
MAX_HEADER_BYTES = 64 << 10  # status line plus all header lines of a response
MAX_HEADERS = 128
_DEFAULT_PORTS = {"http": 80, "https": 443}
_READ_SIZE = 64 << 10

_TOKEN_RE = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_NAME_RE = re.compile(r"[a-z0-9_-]+(\.[a-z0-9_-]+)*")
_NUMERIC_LABEL_RE = re.compile(r"[0-9]+|0x[0-9a-f]*")
_CHUNK_SIZE_RE = re.compile(rb"[0-9a-fA-F]{1,16}")
_MANAGED_HEADERS = frozenset(
    {
        "host",
        "content-length",
        "transfer-encoding",
        "connection",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "upgrade",
    }
)


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
            if scheme not in _DEFAULT_PORTS:
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
        return host if self.port == _DEFAULT_PORTS[self.scheme] else f"{host}:{self.port}"


@dataclass(frozen=True)
class HttpResponse:
    """A complete response. ``headers`` has lower-case names; repeated headers are joined
    with ``", "``."""

    url: str
    status: int
    reason: str
    headers: dict[str, str]
    body: bytes

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    @property
    def location(self) -> str | None:
        """The ``Location`` of a redirect (not followed by the client), else ``None``."""
        return self.headers.get("location") if 300 <= self.status < 400 else None

    @property
    def charset(self) -> str:
        match = re.search(r"charset=\"?([\w.:-]+)", self.headers.get("content-type", ""), re.I)
        if match:
            try:
                return codecs.lookup(match.group(1)).name
            except LookupError:
                pass
        return "utf-8"

    @property
    def text(self) -> str:
        """The body decoded with the charset of ``Content-Type`` (default UTF-8); invalid
        bytes become U+FFFD."""
        return self.body.decode(self.charset, errors="replace")

    def json(self) -> Any:
        return json.loads(self.text)


class HttpClient:
    """HTTP(S) requests for inferlets, limited to the hosts in ``allow``.

    Safe to share between inferlets and to call concurrently from one event loop; it holds
    no connections between requests.
    """

    def __init__(
        self,
        allow: Sequence[str],
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
        ssl_context: ssl.SSLContext | None = None,
        user_agent: str = "pastry",
    ) -> None:
        if isinstance(allow, str):
            raise TypeError("allow must be a list of entries, not one string")
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        if max_response_bytes < 0:
            raise ValueError(f"max_response_bytes must be >= 0, got {max_response_bytes}")
        self.allow = tuple(AllowRule.parse(e) for e in allow)
        self.timeout = timeout
        self.max_response_bytes = max_response_bytes
        self._ssl_context = ssl_context
        self.user_agent = user_agent

    def check(self, url: str) -> HttpTarget:
        """Apply the policy to ``url``: the split target, or :class:`HttpDenied` (not
        allowed) / ``ValueError`` (malformed)."""
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
        if scheme not in _DEFAULT_PORTS:
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
        port = port or _DEFAULT_PORTS[scheme]
        if not any(rule.matches(scheme, host, port) for rule in self.allow):
            allowed = ", ".join(str(r) for r in self.allow) or "(empty: nothing is allowed)"
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

    async def get(
        self,
        url: str,
        headers: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> HttpResponse:
        return await self.request("GET", url, headers=headers, timeout=timeout)

    async def post(
        self,
        url: str,
        body: bytes | str,
        headers: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> HttpResponse:
        return await self.request("POST", url, body=body, headers=headers, timeout=timeout)

    async def request(
        self,
        method: str,
        url: str,
        body: bytes | str | None = None,
        headers: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> HttpResponse:
        """Send one request and read the whole response (redirects are not followed).

        A ``str`` body is sent as UTF-8 (``Content-Type: text/plain; charset=utf-8`` unless
        given). ``timeout`` (seconds, default the client's) bounds the whole exchange."""
        target = self.check(url)
        if not isinstance(method, str) or not _TOKEN_RE.fullmatch(method):
            raise ValueError(f"invalid HTTP method {method!r}")
        method = method.upper()
        head = self._request_head(method, target, body, headers)
        payload = body.encode("utf-8") if isinstance(body, str) else bytes(body or b"")
        timeout = self.timeout if timeout is None else timeout
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        try:
            async with asyncio.timeout(timeout):
                return await self._exchange(method, target, head + payload)
        except TimeoutError:
            raise HttpTimeout(f"{method} {url}: no complete response within {timeout} s") from None

    def _request_head(
        self,
        method: str,
        target: HttpTarget,
        body: bytes | str | None,
        headers: Mapping[str, str] | None,
    ) -> bytes:
        fields = {
            "host": ("Host", target.host_header),
            "user-agent": ("User-Agent", self.user_agent),
            "accept": ("Accept", "*/*"),
            "accept-encoding": ("Accept-Encoding", "identity"),
        }
        for name, value in (headers or {}).items():
            if not isinstance(name, str) or not _TOKEN_RE.fullmatch(name):
                raise ValueError(f"invalid header name {name!r}")
            if name.lower() in _MANAGED_HEADERS:
                raise ValueError(f"header {name!r} is set by the HTTP client; leave it out")
            if not isinstance(value, str) or any(c in value for c in "\r\n\0"):
                raise ValueError(f"invalid value for header {name!r}: {value!r}")
            fields[name.lower()] = (name, value)
        if body is not None:
            if not isinstance(body, bytes | bytearray | memoryview | str):
                raise TypeError(f"body must be bytes or str, got {type(body).__name__}")
            if isinstance(body, str):
                fields.setdefault("content-type", ("Content-Type", "text/plain; charset=utf-8"))
                size = len(body.encode("utf-8"))
            else:
                size = len(memoryview(body).cast("B"))
            fields["content-length"] = ("Content-Length", str(size))
        elif method in ("POST", "PUT", "PATCH"):
            fields["content-length"] = ("Content-Length", "0")
        fields["connection"] = ("Connection", "close")
        lines = [f"{method} {target.target} HTTP/1.1"]
        lines += [f"{name}: {value}" for name, value in fields.values()]
        try:
            return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        except UnicodeEncodeError as e:
            raise ValueError(f"header values must be Latin-1 text: {e}") from None

    async def _exchange(self, method: str, target: HttpTarget, request: bytes) -> HttpResponse:
        ctx = None
        if target.scheme == "https":
            if self._ssl_context is None:
                self._ssl_context = ssl.create_default_context()
            ctx = self._ssl_context
        try:
            reader, writer = await asyncio.open_connection(
                target.host,
                target.port,
                ssl=ctx,
                server_hostname=target.host if ctx else None,
                limit=MAX_HEADER_BYTES,
            )
        except OSError as e:
            raise HttpError(f"cannot connect to {target.host_header} ({target.url}): {e}") from e
        try:
            writer.write(request)
            await writer.drain()
            status, reason, headers = await self._read_head(reader, target)
            while 100 <= status < 200:  # interim responses (100 Continue, 103 Early Hints)
                if status == 101:
                    raise HttpError(f"{target.url}: unexpected 101 Switching Protocols")
                status, reason, headers = await self._read_head(reader, target)
            no_body = method == "HEAD" or status in (204, 304)
            body = b"" if no_body else await self._read_body(reader, headers, target)
            return HttpResponse(target.url, status, reason, headers, body)
        except (OSError, asyncio.IncompleteReadError) as e:
            raise HttpError(f"{target.url}: connection failed: {e}") from e
        finally:
            writer.close()

    async def _read_line(self, reader: asyncio.StreamReader, target: HttpTarget) -> bytes:
        try:
            line = await reader.readline()
        except ValueError:  # the line is longer than the stream limit
            raise HttpError(f"{target.url}: response header line too long") from None
        if not line.endswith(b"\n"):
            raise HttpError(f"{target.url}: connection closed in the middle of the response")
        return line.rstrip(b"\r\n")

    async def _read_head(
        self, reader: asyncio.StreamReader, target: HttpTarget
    ) -> tuple[int, str, dict[str, str]]:
        line = await self._read_line(reader, target)
        size = len(line)
        version, _, rest = line.decode("latin-1").partition(" ")
        code, _, reason = rest.partition(" ")
        if not version.startswith("HTTP/1.") or len(code) != 3 or not code.isdigit():
            raise HttpError(f"{target.url}: malformed status line {line[:100]!r}")
        headers: dict[str, str] = {}
        count = 0
        while line := await self._read_line(reader, target):
            size += len(line)
            count += 1
            if size > MAX_HEADER_BYTES or count > MAX_HEADERS:
                raise HttpError(
                    f"{target.url}: response headers exceed {MAX_HEADER_BYTES} bytes or "
                    f"{MAX_HEADERS} lines"
                )
            name, sep, value = line.decode("latin-1").partition(":")
            if not sep or not _TOKEN_RE.fullmatch(name):
                raise HttpError(f"{target.url}: malformed header line {line[:100]!r}")
            name, value = name.lower(), value.strip(" \t")
            headers[name] = f"{headers[name]}, {value}" if name in headers else value
        return int(code), reason.strip(), headers

    async def _read_body(
        self, reader: asyncio.StreamReader, headers: dict[str, str], target: HttpTarget
    ) -> bytes:
        limit = self.max_response_bytes

        def too_large(size: int | str) -> HttpTooLarge:
            return HttpTooLarge(
                f"{target.url}: response body of {size} bytes exceeds the limit of {limit} "
                f"bytes (max_response_bytes)"
            )

        if "transfer-encoding" in headers:
            codings = [c.strip().lower() for c in headers["transfer-encoding"].split(",")]
            if codings != ["chunked"]:
                raise HttpError(
                    f"{target.url}: unsupported Transfer-Encoding {headers['transfer-encoding']!r}"
                )
            chunks, total = [], 0
            while True:
                line = await self._read_line(reader, target)
                size_text = line.split(b";", 1)[0].strip()
                if not _CHUNK_SIZE_RE.fullmatch(size_text):
                    raise HttpError(f"{target.url}: malformed chunk size line {line[:100]!r}")
                size = int(size_text, 16)
                if size == 0:
                    break
                total += size
                if total > limit:
                    raise too_large(f"more than {limit}")
                chunks.append(await reader.readexactly(size))
                if await self._read_line(reader, target):
                    raise HttpError(f"{target.url}: chunk not followed by CRLF")
            trailer = 0
            while line := await self._read_line(reader, target):  # trailer fields: ignored
                trailer += len(line)
                if trailer > MAX_HEADER_BYTES:
                    raise HttpError(f"{target.url}: trailer exceeds {MAX_HEADER_BYTES} bytes")
            return b"".join(chunks)
        if "content-length" in headers:
            values = {v.strip() for v in headers["content-length"].split(",")}
            if len(values) != 1 or not (text := values.pop()).isdigit():
                raise HttpError(
                    f"{target.url}: invalid Content-Length {headers['content-length']!r}"
                )
            size = int(text)
            if size > limit:
                raise too_large(size)
            try:
                return await reader.readexactly(size)
            except asyncio.IncompleteReadError as e:
                raise HttpError(
                    f"{target.url}: connection closed after {len(e.partial)} of {size} body bytes"
                ) from None
        chunks, total = [], 0  # no framing: the body runs to the end of the stream
        while data := await reader.read(_READ_SIZE):
            total += len(data)
            if total > limit:
                raise too_large(f"more than {limit}")
            chunks.append(data)
        return b"".join(chunks)
