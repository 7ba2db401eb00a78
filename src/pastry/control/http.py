"""Outgoing HTTP for inferlets (``http_get`` / ``http_post`` in Pie §4.3), limited to an allowlist.

:class:`HttpClient` is a small HTTP/1.1 client on asyncio streams (one request per
connection, ``Connection: close``; bodies framed by ``Content-Length``, chunked transfer
coding, or end of stream; ``https`` through :mod:`ssl` with certificate checks).

Policy, all checked by :meth:`HttpClient.check` (:mod:`pastry.control.http_policy`) before
any connection is opened:

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
import json
import re
import ssl
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pastry.control.http_policy import (
    AllowRule,
    HttpDenied,
    HttpError,
    HttpTarget,
    HttpTimeout,
    HttpTooLarge,
    check_url,
)

__all__ = [
    "AllowRule",
    "HttpClient",
    "HttpDenied",
    "HttpError",
    "HttpResponse",
    "HttpTarget",
    "HttpTimeout",
    "HttpTooLarge",
]

DEFAULT_TIMEOUT_S = 30.0
DEFAULT_MAX_RESPONSE_BYTES = 8 << 20
MAX_HEADER_BYTES = 64 << 10  # status line plus all header lines of a response
MAX_HEADERS = 128
_READ_SIZE = 64 << 10

_TOKEN_RE = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
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
        return check_url(url, self.allow)

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
