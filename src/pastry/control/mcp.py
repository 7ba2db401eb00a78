"""MCP tools for inferlets: the host's client of the Model Context Protocol servers the
operator registers (the ``mcp`` package's ``Client``).

A server is registered by name (:class:`McpServer`): a command the host starts and talks
to over stdio, or a streamable-HTTP URL, which must be on the HTTP allowlist like any URL an
inferlet reaches. ``users`` names who may use it (None: every user), as the operator grants
the HTTP allowlist to the server's inferlets. Inferlets reach the servers through the API
(``mcp_list_servers``, ``mcp_list_tools``, ``mcp_call_tool``, ``mcp_list_resources``,
``mcp_read_resource``; :mod:`pastry.api.services`), trusted and sandboxed alike: the host
holds the connections, an inferlet only names a server.

A connection is opened on first use and kept (one per server, shared by every inferlet);
one that failed is opened again on the next call. Each connection lives in its own task
(the ``mcp`` client's context must be left in the task that entered it), and calls from
any inferlet go through it concurrently. :meth:`McpHub.close` ends them (and the stdio
servers' processes).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 30.0


class McpDenied(PermissionError):
    """No such server for this user (not registered, or not theirs)."""


class McpFailed(RuntimeError):
    """The server could not be reached, or answered with a protocol error."""


@dataclass(frozen=True)
class McpServer:
    """A registered MCP server: ``command`` (argv, started with stdio) or ``url``
    (streamable HTTP); ``env`` for the command; ``users`` allowed (None: all)."""

    name: str
    command: tuple[str, ...] = ()
    url: str | None = None
    env: Mapping[str, str] | None = None
    users: frozenset[str] | None = None
    timeout: float = DEFAULT_TIMEOUT_S

    def __post_init__(self) -> None:
        if not self.name or "/" in self.name:
            raise ValueError(f"an MCP server's name is non-empty, without '/'; got {self.name!r}")
        if bool(self.command) == bool(self.url):
            raise ValueError(f"MCP server {self.name}: give a command or a url (exactly one)")

    @classmethod
    def parse(cls, spec: str | Mapping[str, Any]) -> McpServer:
        """``NAME=COMMAND ARG...`` or ``NAME=http(s)://...`` (what a command line gives),
        or a mapping of the fields."""
        if isinstance(spec, Mapping):
            users = spec.get("users")
            return cls(
                spec["name"],
                tuple(spec.get("command") or ()),
                spec.get("url"),
                spec.get("env"),
                None if users is None else frozenset(users),
                float(spec.get("timeout", DEFAULT_TIMEOUT_S)),
            )
        name, sep, rest = spec.partition("=")
        if not sep or not rest.strip():
            raise ValueError(f"an MCP server is NAME=COMMAND or NAME=URL, got {spec!r}")
        if rest.startswith(("http://", "https://")):
            return cls(name.strip(), url=rest.strip())
        import shlex

        return cls(name.strip(), tuple(shlex.split(rest)))

    def allows(self, user: str) -> bool:
        return self.users is None or user in self.users


@dataclass
class _Connection:
    """One server's client, entered and left by its own task."""

    server: McpServer
    client: Any = None
    task: asyncio.Task | None = None
    ready: asyncio.Future | None = None
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def open(self, check_url: Callable[[str], object]) -> Any:
        if self.task is not None and self.task.done():
            self.task = None  # it failed or ended: open it again
        if self.task is None:
            self.ready = asyncio.get_running_loop().create_future()
            self.stop = asyncio.Event()
            self.task = asyncio.create_task(self._run(check_url), name=f"mcp:{self.server.name}")
        return await asyncio.shield(self.ready)

    async def _run(self, check_url: Callable[[str], object]) -> None:
        from mcp import Client, StdioServerParameters

        s = self.server
        try:
            if s.url is not None:
                check_url(s.url)  # the HTTP allowlist applies to MCP servers too
                target: Any = s.url
            else:
                target = StdioServerParameters(
                    command=s.command[0], args=list(s.command[1:]), env=dict(s.env or {}) or None
                )
            async with Client(target, read_timeout_seconds=s.timeout) as client:
                self.client = client
                self.ready.set_result(client)
                await self.stop.wait()
        except Exception as e:
            log.warning("MCP server %s: %s", s.name, e)
            if not self.ready.done():
                self.ready.set_exception(McpFailed(f"MCP server {s.name}: {_reason(e)}"))
        finally:
            self.client = None

    async def close(self) -> None:
        if self.task is not None:
            self.stop.set()
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.wait_for(self.task, 5.0)
            self.task = None


class McpHub:
    """The registered servers and their connections (see the module docstring)."""

    def __init__(
        self, servers: Sequence[McpServer] = (), check_url: Callable[[str], object] = lambda u: u
    ) -> None:
        self.servers = {s.name: s for s in servers}
        if len(self.servers) != len(servers):
            raise ValueError(f"two MCP servers share a name: {[s.name for s in servers]}")
        self._check_url = check_url
        self._connections = {name: _Connection(s) for name, s in self.servers.items()}

    def names(self, user: str) -> list[str]:
        return [n for n, s in self.servers.items() if s.allows(user)]

    async def list_tools(self, user: str, server: str) -> str:
        result = await self._request(user, server, lambda c: c.list_tools())
        return json.dumps(
            [
                {"name": t.name, "description": t.description or "", "input_schema": t.input_schema}
                for t in result.tools
            ]
        )

    async def call_tool(self, user: str, server: str, tool: str, arguments: str) -> str:
        try:
            args = json.loads(arguments or "{}")
        except ValueError as e:
            raise ValueError(f"mcp_call_tool: arguments must be a JSON object: {e}") from None
        if not isinstance(args, dict):
            raise ValueError(
                f"mcp_call_tool: arguments must be a JSON object, got {arguments!r:.100}"
            )
        result = await self._request(user, server, lambda c: c.call_tool(tool, args))
        return json.dumps(
            {
                "text": _text(result.content),
                "is_error": bool(result.is_error),
                "structured": result.structured_content,
            }
        )

    async def list_resources(self, user: str, server: str) -> str:
        result = await self._request(user, server, lambda c: c.list_resources())
        return json.dumps(
            [
                {
                    "uri": str(r.uri),
                    "name": r.name,
                    "description": r.description or "",
                    "mime_type": r.mime_type,
                }
                for r in result.resources
            ]
        )

    async def read_resource(self, user: str, server: str, uri: str) -> str:
        result = await self._request(user, server, lambda c: c.read_resource(uri))
        return "".join(getattr(c, "text", None) or "" for c in result.contents)

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self._connections.values()))

    async def _request(self, user: str, server: str, call: Callable[[Any], Any]) -> Any:
        s = self.servers.get(server)
        if s is None or not s.allows(user):
            mine = ", ".join(self.names(user)) or "none"
            raise McpDenied(f"no MCP server named {server!r} for this user (yours: {mine})")
        client = await self._connections[server].open(self._check_url)
        from mcp import MCPError

        try:
            return await asyncio.wait_for(call(client), s.timeout)
        except MCPError as e:
            raise McpFailed(f"MCP server {server}: {e}") from None
        except TimeoutError:
            raise McpFailed(f"MCP server {server}: no answer within {s.timeout} s") from None


def _text(content: Sequence[Any]) -> str:
    """The text of a tool result's content blocks (others named by their type)."""
    parts = []
    for block in content:
        text = getattr(block, "text", None)
        parts.append(text if text is not None else f"[{getattr(block, 'type', 'content')}]")
    return "\n".join(parts)


def _reason(e: BaseException) -> str:
    """The innermost message of an exception group (anyio's task groups wrap errors)."""
    while isinstance(e, BaseExceptionGroup) and e.exceptions:
        e = e.exceptions[0]
    return f"{type(e).__name__}: {e}"
