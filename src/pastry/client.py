"""A client for the Pastry server's WebSocket protocol (``docs/protocol.md``).

::

    from pastry.client import Client

    async with await Client.connect("http://127.0.0.1:8080", token=None) as client:
        digest = await client.upload(open("examples/hello.py").read(), name="hello")
        inst = await client.launch("hello", ["world"])
        async for ev in inst.events():  # messages as they come, then the end
            print(ev.kind, ev.data)

For scripts, :func:`run` does connect, (upload,) launch and wait in one call.

This module needs only ``websockets``: it imports nothing from the server side.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import MISSING, dataclass, fields
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidURI

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 1


class ClientError(Exception):
    """The connection failed or closed, or the server speaks another protocol."""


class ServerError(ClientError):
    """The server answered a request with an error; ``code`` says which kind."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{message} [{code}]")
        self.code = code
        self.message = message


class InferletError(Exception):
    """The instance ended with an exception; ``traceback`` is the inferlet's traceback."""

    def __init__(self, traceback: str) -> None:
        super().__init__(traceback)
        self.traceback = traceback


class InstanceTerminated(InferletError):
    """The instance was terminated (by a client, the resource policy or shutdown)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class Event:
    """``message`` events, then one of ``result`` / ``error`` / ``terminated`` as the last."""

    kind: str
    data: str | None

    @property
    def final(self) -> bool:
        return self.kind != "message"


@dataclass(frozen=True)
class ProgramInfo:
    hash: str
    name: str
    size: int
    builtin: bool
    owner: str | None = None  # the uploading user (None: built-in)
    trusted: bool = False  # runs in the server process (built-ins; operator uploads)


@dataclass(frozen=True)
class InstanceInfo:
    id: int
    program: str  # hash
    name: str
    args: list[str]
    started: float  # Unix time
    state: str  # "running" or "ended" (a detached instance whose end nobody has seen)
    detached: bool
    mine: bool  # launched by this connection and owned by it
    attached: bool  # this connection receives its events
    memory_bytes: int | None = None  # a sandboxed instance's linear memory (None: trusted)


def ws_url(url: str) -> str:
    """``http://h:p`` / ``ws://h:p`` / ``h:p`` -> ``ws://h:p/ws`` (https -> wss)."""
    if "://" not in url:
        url = "ws://" + url
    parts = urlsplit(url)
    scheme = {"http": "ws", "https": "wss"}.get(parts.scheme, parts.scheme)
    if scheme not in ("ws", "wss"):
        raise ValueError(f"server URL must be http(s):// or ws(s)://, got {url!r}")
    path = parts.path if parts.path not in ("", "/") else "/ws"
    return urlunsplit((scheme, parts.netloc, path, parts.query, ""))


_CLOSED = object()  # queued to every instance when the connection ends


class Client:
    """One connection to a server. Create with :meth:`connect`; every method is a coroutine
    of the event loop that connected."""

    def __init__(self, ws: Any, hello: dict) -> None:
        self._ws = ws
        self.hello = hello
        self.server_version: str = hello.get("server", "?")
        self.models: list[str] = hello.get("models", [])
        self.user: str | None = hello.get("user")  # who the server knows us as
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self._queues: dict[int, asyncio.Queue] = {}
        self._closed: str | None = None  # why, once closed (``closed``)
        self._reader: asyncio.Task | None = None

    @property
    def closed(self) -> str | None:
        """Why the connection is closed, or None while it is open."""
        return self._closed

    @classmethod
    async def connect(cls, url: str, token: str | None = None, *, timeout: float = 10) -> Client:
        """Connect to ``url`` (``http://host:port`` or ``ws://host:port/ws``) and, when the
        server requires it, authenticate with ``token``."""
        url = ws_url(url)
        host = urlsplit(url).hostname or ""
        local = host in ("localhost", "::1") or host.startswith("127.")
        try:
            ws = await ws_connect(
                url, max_size=None, open_timeout=timeout, proxy=None if local else True
            )
        except (OSError, TimeoutError, InvalidHandshake, InvalidURI) as e:
            raise ClientError(f"cannot connect to {url}: {e}") from None
        try:
            hello = json.loads(await asyncio.wait_for(ws.recv(), timeout))
        except (ConnectionClosed, TimeoutError, json.JSONDecodeError) as e:
            await ws.close()
            raise ClientError(f"{url} sent no hello: {e!r}") from None
        if hello.get("type") != "hello" or hello.get("protocol") != PROTOCOL_VERSION:
            await ws.close()
            raise ClientError(
                f"{url} does not speak Pastry protocol {PROTOCOL_VERSION} (hello: {hello})"
            )
        client = cls(ws, hello)
        client._reader = asyncio.get_running_loop().create_task(client._read())
        if hello.get("auth_required"):
            if not token:
                await client.close()
                raise ClientError(
                    f"{url} requires a token: pass token= (CLI: --token or PASTRY_AUTH_TOKEN)"
                )
            try:
                reply = await client._request("auth", token=token)
            except ClientError:
                await client.close()
                raise
            client.models = reply.get("models", [])
            client.user = reply.get("user")
        return client

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the connection; instances it owns (not detached) end on the server."""
        await self._ws.close()
        if self._reader is not None:
            await self._reader

    # ------------------------------------------------------------------ requests

    async def upload(self, source: str, name: str | None = None) -> str:
        """Store a program (Python source); returns its hash. ``name`` makes it launchable
        by name (default ``program-<hash prefix>``)."""
        fields_ = {"source": source} if name is None else {"source": source, "name": name}
        return (await self._request("upload", **fields_))["hash"]

    async def launch(
        self, program: str, args: Sequence[str] = (), detached: bool = False
    ) -> RemoteInstance:
        """Start ``program`` (name, hash or hash prefix of 8+ characters) with ``args``.

        A detached instance survives this connection; attach to it from another."""
        reply = await self._request(
            "launch", program=program, args=[str(a) for a in args], detached=detached
        )
        return RemoteInstance(self, reply["instance"], reply["program"], reply["name"])

    async def attach(self, instance: int) -> RemoteInstance:
        """Receive a detached instance's events from now on (including an end that came
        while no connection was attached). ``dropped`` on the result counts messages lost
        from the server's backlog meanwhile."""
        reply = await self._request("attach", instance=instance)
        inst = RemoteInstance(self, instance, reply["program"], reply["name"])
        inst.dropped = reply.get("dropped", 0)
        return inst

    async def delete_program(self, name: str) -> None:
        """Forget one of this user's uploaded programs (frees its upload quota)."""
        await self._request("delete_program", program=name)

    async def list_programs(self) -> list[ProgramInfo]:
        return [_from(ProgramInfo, p) for p in (await self._request("list_programs"))["programs"]]

    async def list_instances(self) -> list[InstanceInfo]:
        rows = (await self._request("list_instances"))["instances"]
        return [_from(InstanceInfo, r) for r in rows]

    async def _request(self, kind: str, **body: Any) -> dict:
        if self._closed is not None:
            raise ClientError(f"the connection is closed ({self._closed})")
        rid = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        try:
            await self._ws.send(json.dumps({"type": kind, "id": rid, **body}))
            return await fut
        except ConnectionClosed as e:
            raise ClientError(f"the connection is closed ({e})") from None
        finally:
            self._pending.pop(rid, None)

    # ------------------------------------------------------------------ incoming

    async def _read(self) -> None:
        why = "closed by the client"
        try:
            async for text in self._ws:
                try:
                    self._dispatch(json.loads(text))
                except (ValueError, KeyError, TypeError) as e:
                    log.warning("ignoring a malformed frame from the server (%r): %.200s", e, text)
        except ConnectionClosed as e:
            why = f"closed by the server: {e}" if e.rcvd else f"connection lost: {e}"
        else:
            code = self._ws.close_code
            if code not in (None, 1000):
                why = f"closed: {code} {self._ws.close_reason or ''}".strip()
        finally:
            self._closed = why
            for fut in self._pending.values():
                if not fut.done():
                    fut.set_exception(ClientError(f"the connection is closed ({why})"))
            for q in self._queues.values():
                q.put_nowait(_CLOSED)

    def _dispatch(self, frame: dict) -> None:
        kind = frame.get("type")
        if kind == "event":
            self._queue(frame["instance"]).put_nowait(Event(frame["kind"], frame.get("data")))
            return
        fut = self._pending.get(frame.get("id"))
        if fut is None or fut.done():
            if kind == "error":  # not for a request of ours (e.g. bad frame)
                log.warning("server error: %s (%s)", frame.get("message"), frame.get("code"))
            return
        if kind == "error":
            fut.set_exception(ServerError(frame.get("code", "?"), frame.get("message", "")))
        else:
            fut.set_result(frame)

    def _queue(self, instance: int) -> asyncio.Queue:
        q = self._queues.get(instance)
        if q is None:
            q = self._queues[instance] = asyncio.Queue()
            if self._closed is not None:
                q.put_nowait(_CLOSED)
        return q


class RemoteInstance:
    """An instance on the server, as seen by the connection that launched or attached it."""

    def __init__(self, client: Client, id: int, program: str, name: str) -> None:
        self.client = client
        self.id = id
        self.program = program  # hash
        self.name = name
        self.dropped = 0
        self.end: Event | None = None  # the last event, once seen

    def __repr__(self) -> str:
        return f"RemoteInstance({self.id}, {self.name!r})"

    async def send(self, message: str) -> None:
        """Deliver ``message`` to the inferlet's ``receive()``."""
        await self.client._request("send", instance=self.id, message=message)

    async def terminate(self, reason: str | None = None) -> None:
        """End the instance; its ``terminated`` event follows."""
        body = {} if reason is None else {"reason": reason}
        await self.client._request("terminate", instance=self.id, **body)

    async def events(self) -> AsyncIterator[Event]:
        """Its messages as they come, then its final event. Raises :class:`ClientError` if
        the connection closes first."""
        if self.end is not None:
            return
        q = self.client._queue(self.id)
        while True:
            ev = await q.get()
            if ev is _CLOSED:
                q.put_nowait(_CLOSED)
                raise ClientError(
                    f"instance {self.id}: the connection closed ({self.client._closed})"
                )
            if ev.final:
                self.end = ev
                self.client._queues.pop(self.id, None)
            yield ev
            if ev.final:
                return

    async def result(self) -> str | None:
        """Wait for the end (skipping messages); the result, or :class:`InferletError` with
        the traceback, or :class:`InstanceTerminated` with the reason."""
        async for _ in self.events():
            pass
        assert self.end is not None
        if self.end.kind == "result":
            return self.end.data
        if self.end.kind == "error":
            raise InferletError(self.end.data or "")
        raise InstanceTerminated(self.end.data or "terminated")


def _from(cls: type, row: dict) -> Any:
    """``cls`` from a reply row (fields with defaults may be missing: older servers)."""
    return cls(
        **{f.name: row[f.name] for f in fields(cls) if f.name in row or f.default is MISSING}
    )


def run(
    url: str,
    program: str,
    args: Sequence[str] = (),
    *,
    token: str | None = None,
    source: str | None = None,
    on_message: Callable[[str], None] | None = None,
) -> str | None:
    """Blocking: connect, upload ``source`` first if given (then ``program`` is its name),
    launch, call ``on_message`` for each message, and return the result (raises
    :class:`InferletError` on error)."""

    async def go() -> str | None:
        async with await Client.connect(url, token) as client:
            ref = program
            if source is not None:
                ref = await client.upload(source, name=program)
            inst = await client.launch(ref, args)
            async for ev in inst.events():
                if ev.kind == "message" and on_message is not None:
                    on_message(ev.data or "")
            return await inst.result()

    return asyncio.run(go())


__all__ = [
    "Client",
    "ClientError",
    "Event",
    "InferletError",
    "InstanceInfo",
    "InstanceTerminated",
    "ProgramInfo",
    "RemoteInstance",
    "ServerError",
    "run",
]
