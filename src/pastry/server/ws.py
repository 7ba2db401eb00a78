"""The client protocol over WebSocket at ``/ws`` (specified in ``docs/protocol.md``).

Each socket is a :class:`Connection` of one user (its token's, ``docs/security.md``): a
read loop that parses each JSON request into a typed request (:data:`REQUESTS`) and answers
it before reading the next (replies keep request order), and a writer task that sends
replies and instance events in the order they were queued. Instance events go through
:class:`Streams`: one pump task per instance (``Instance.events()`` allows one consumer)
hands them to the connections attached to it, or keeps them for a later ``attach`` when the
instance is detached and nobody is attached.

Ownership: an instance launched by a connection belongs to it and ends when it closes. A
detached instance lives on; any connection of the same user may attach to it, and every
attached connection receives its events from then on and may send to or terminate it.
Users never see each other's instances or programs.

Backpressure: a connection holds at most :data:`HIGH_WATER` bytes of frames its client has
not taken; beyond that the pumps of its instances and its own read loop wait. An instance
whose client does not read thus stops being drained, and its session ends it once its
unread messages pass the backlog quota. A detached instance nobody is attached to keeps at
most ``Quotas.detached_backlog_bytes`` of messages (the oldest are dropped and counted).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import types
import typing
from collections import OrderedDict, deque
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any, ClassVar

from starlette.routing import WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from pastry import __version__
from pastry.control.events import event_data
from pastry.control.session import QuotaError
from pastry.control.users import User
from pastry.runtime.trusted import Instance, ProgramError
from pastry.server import limits
from pastry.server.registry import RegistryError, UploadQuotaError
from pastry.server.service import LaunchQuotaError, PastryServer

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
AUTH_TIMEOUT_S = 30.0  # a connection must authenticate within this long
BACKLOG = 1000  # messages kept per detached instance while no connection is attached
MAX_UNCLAIMED = 64  # ended detached instances per user remembered until someone attaches
HIGH_WATER = 1 << 20  # bytes of frames queued for one connection before producers wait
CLOSE_POLICY = 1008  # WebSocket close code: authentication failed or missing


# ---------------------------------------------------------------------- requests


@dataclass(frozen=True)
class Auth:
    type: ClassVar[str] = "auth"
    token: str


@dataclass(frozen=True)
class Upload:
    type: ClassVar[str] = "upload"
    source: str
    name: str | None = None


@dataclass(frozen=True)
class Launch:
    type: ClassVar[str] = "launch"
    program: str
    args: list[str] = field(default_factory=list)
    detached: bool = False


@dataclass(frozen=True)
class Send:
    type: ClassVar[str] = "send"
    instance: int
    message: str


@dataclass(frozen=True)
class Terminate:
    type: ClassVar[str] = "terminate"
    instance: int
    reason: str | None = None


@dataclass(frozen=True)
class Attach:
    type: ClassVar[str] = "attach"
    instance: int


@dataclass(frozen=True)
class ListPrograms:
    type: ClassVar[str] = "list_programs"


@dataclass(frozen=True)
class ListInstances:
    type: ClassVar[str] = "list_instances"


@dataclass(frozen=True)
class DeleteProgram:
    type: ClassVar[str] = "delete_program"
    program: str


REQUESTS: dict[str, type] = {
    cls.type: cls
    for cls in (
        Auth, Upload, Launch, Send, Terminate, Attach, ListPrograms, ListInstances, DeleteProgram
    )
}  # fmt: skip


class ProtocolError(Exception):
    """A request that cannot be served; becomes an ``error`` reply with ``code``."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def parse(raw: object) -> tuple[object, Any]:
    """``(request id, typed request)`` from a decoded JSON message, or ProtocolError.

    The id is returned even when the rest is bad, so that the error reply can carry it."""
    if not isinstance(raw, dict):
        raise ProtocolError("bad_request", "a message must be a JSON object")
    rid = raw.get("id")
    kind = raw.get("type")
    if kind is None:
        raise ProtocolError("bad_request", "missing field 'type'")
    cls = REQUESTS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        known = ", ".join(REQUESTS)
        raise ProtocolError("unknown_type", f"unknown message type {kind!r} (known: {known})")
    hints = typing.get_type_hints(cls)
    values = {}
    for f in fields(cls):
        if f.name not in raw:
            if f.default is MISSING and f.default_factory is MISSING:
                raise ProtocolError("bad_request", f"{kind}: missing field '{f.name}'")
            continue
        if not _is(raw[f.name], hints[f.name]):
            raise ProtocolError(
                "bad_request", f"{kind}: field '{f.name}' must be {_describe(hints[f.name])}"
            )
        values[f.name] = raw[f.name]
    return rid, cls(**values)


def _is(value: object, tp: Any) -> bool:
    origin = typing.get_origin(tp)
    if origin in (types.UnionType, typing.Union):
        return any(_is(value, a) for a in typing.get_args(tp))
    if origin is list:
        (item,) = typing.get_args(tp)
        return isinstance(value, list) and all(_is(v, item) for v in value)
    if tp is type(None):
        return value is None
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, tp)


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (types.UnionType, typing.Union):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if origin is list:
        return "a list of " + {str: "strings", int: "integers"}[typing.get_args(tp)[0]]
    names = {str: "a string", int: "an integer", bool: "true or false", type(None): "null"}
    return names[tp]


# ---------------------------------------------------------------------- instance events


@dataclass(eq=False)
class Stream:
    """Where one instance's events go: its attached connections, else (detached) a backlog
    of at most :data:`BACKLOG` frames and ``max_bytes`` of data (the oldest go first)."""

    inst: Instance
    detached: bool
    subscribers: set[Connection] = field(default_factory=set)
    backlog: deque[tuple[dict, int]] = field(default_factory=deque)
    backlog_bytes: int = 0
    max_bytes: int = 1 << 20
    dropped: int = 0  # messages that fell out of the backlog
    ended: bool = False

    def keep(self, frame: dict) -> None:
        """Keep ``frame`` for a later attach, dropping the oldest frames over the bounds (never
        the newest, which may be the end event)."""
        size = len(frame["data"] or "")
        self.backlog.append((frame, size))
        self.backlog_bytes += size
        while len(self.backlog) > 1 and (
            len(self.backlog) > BACKLOG or self.backlog_bytes > self.max_bytes
        ):
            _, n = self.backlog.popleft()
            self.backlog_bytes -= n
            self.dropped += 1

    def take_backlog(self) -> tuple[list[dict], int]:
        kept, dropped = [f for f, _ in self.backlog], self.dropped
        self.backlog.clear()
        self.backlog_bytes = self.dropped = 0
        return kept, dropped


class Streams:
    """Every instance launched over ``/ws``, and the pump that delivers its events."""

    def __init__(self, server: PastryServer) -> None:
        self.server = server
        self.live: dict[int, Stream] = {}  # running, or ending (end event in flight)
        # user -> detached instances that ended while nobody was attached, oldest first
        self.unclaimed: dict[str, OrderedDict[int, Stream]] = {}
        self._pumps: set[asyncio.Task] = set()

    def launch(self, conn: Connection, req: Launch) -> Stream:
        inst = self.server.launch(
            req.program, req.args, owner=None if req.detached else conn, user=conn.user
        )
        max_bytes = self.server.config.quotas.detached_backlog_bytes
        stream = Stream(inst, req.detached, {conn}, max_bytes=max_bytes)
        self.live[inst.id] = stream
        task = asyncio.get_running_loop().create_task(self._pump(stream), name=f"ws-pump-{inst.id}")
        self._pumps.add(task)
        task.add_done_callback(self._pumps.discard)
        return stream

    async def _pump(self, stream: Stream) -> None:
        iid = stream.inst.id
        try:
            async for ev in stream.inst.events():
                frame = {"type": "event", "instance": iid, "kind": ev.kind, "data": event_data(ev)}
                if stream.subscribers:
                    subscribers = list(stream.subscribers)
                    for conn in subscribers:
                        conn.push(frame)
                    for conn in subscribers:  # the next event waits for slow clients
                        await conn.drained()
                elif stream.detached:
                    stream.keep(frame)
        finally:
            stream.ended = True
            self.live.pop(iid, None)
            self.server.owners.pop(iid, None)
            if stream.detached and not stream.subscribers:
                mine = self.unclaimed.setdefault(stream.inst.user, OrderedDict())
                mine[iid] = stream
                while len(mine) > MAX_UNCLAIMED:
                    mine.popitem(last=False)

    def attach(self, conn: Connection, iid: int) -> tuple[Stream, list[dict], int]:
        """Subscribe ``conn``; returns the stream, the events kept for it, and how many
        messages were dropped from the backlog before it attached."""
        stream = self._find(conn, iid)
        if stream is None:
            stream = self.unclaimed.get(conn.user.name, {}).pop(iid, None)
        if stream is None:
            raise self._missing(conn, iid)
        if not stream.detached and conn not in stream.subscribers:
            raise ProtocolError(
                "not_permitted",
                f"instance {iid} belongs to another connection (only detached instances "
                "can be attached)",
            )
        stream.subscribers.add(conn)
        kept, dropped = stream.take_backlog()
        return stream, kept, dropped

    def _find(self, conn: Connection, iid: int) -> Stream | None:
        """The live stream of ``iid`` if it belongs to ``conn``'s user (another user's
        instance does not exist, as far as ``conn`` can tell)."""
        stream = self.live.get(iid)
        return stream if stream is not None and stream.inst.user == conn.user.name else None

    def attached(self, conn: Connection, iid: int) -> Stream:
        """The stream of ``iid`` if ``conn`` may send to / terminate it, else ProtocolError."""
        stream = self._find(conn, iid)
        if stream is None:
            raise self._missing(conn, iid)
        if conn not in stream.subscribers:
            if stream.detached:
                raise ProtocolError(
                    "not_permitted", f"instance {iid} is detached: attach to it first"
                )
            raise ProtocolError("not_permitted", f"instance {iid} belongs to another connection")
        return stream

    def _missing(self, conn: Connection, iid: int) -> ProtocolError:
        if iid in self.unclaimed.get(conn.user.name, {}):
            return ProtocolError("not_permitted", f"instance {iid} is detached: attach to it first")
        if self.server.instance(iid, conn.user) is not None:
            return ProtocolError(
                "not_permitted", f"instance {iid} was not launched over this protocol"
            )
        return ProtocolError("unknown_instance", f"no instance {iid} (never launched, or ended)")

    def forget(self, conn: Connection) -> None:
        """``conn`` closed: it receives nothing more (its instances are ended by the caller)."""
        for stream in self.live.values():
            stream.subscribers.discard(conn)


# ---------------------------------------------------------------------- connections


class Connection:
    def __init__(self, server: PastryServer, streams: Streams, ws: WebSocket) -> None:
        self.server = server
        self.streams = streams
        self.ws = ws
        # without tokens everyone is the local user; with them, the auth message says who
        self.user: User | None = server.authenticate(None) if server.directory.open else None
        self.outgoing: asyncio.Queue[str | None] = asyncio.Queue()
        self.queued = 0  # bytes of frames in ``outgoing``
        self._room = asyncio.Event()  # set while queued <= HIGH_WATER (or closed)
        self._room.set()
        self.open = True

    @property
    def authenticated(self) -> bool:
        return self.user is not None

    def push(self, frame: dict) -> None:
        """Queue a frame for the writer (in order; never blocks: producers that must not
        run ahead of a slow client wait on :meth:`drained`)."""
        if self.open:
            text = json.dumps(frame)
            self.queued += len(text)
            if self.queued > HIGH_WATER:
                self._room.clear()
            self.outgoing.put_nowait(text)

    async def drained(self) -> None:
        """Wait until the client has taken all but :data:`HIGH_WATER` bytes (or is gone)."""
        while self.open and self.queued > HIGH_WATER:
            self._room.clear()
            await self._room.wait()

    async def run(self) -> None:
        await self.ws.accept()
        writer = asyncio.create_task(self._write())
        hello = {
            "type": "hello",
            "protocol": PROTOCOL_VERSION,
            "server": f"pastry {__version__}",
            "auth_required": not self.authenticated,
        }
        if self.authenticated:
            hello["models"] = self.server.models
            hello["user"] = self.user.name
        self.push(hello)
        close: tuple[int, str] | None = None
        try:
            close = await self._read()
        finally:
            self.open = False
            self._room.set()  # nobody waits for a closed connection
            self.streams.forget(self)
            self.server.disown(self)
            self.outgoing.put_nowait(None)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(writer, 5)
            if close is not None:
                with contextlib.suppress(WebSocketDisconnect, RuntimeError, OSError):
                    await self.ws.close(*close)

    async def _read(self) -> tuple[int, str] | None:
        """Serve requests until the client goes away (None) or must be closed (code, reason)."""
        while True:
            timeout = None if self.authenticated else AUTH_TIMEOUT_S
            try:
                msg = await asyncio.wait_for(self.ws.receive(), timeout)
            except TimeoutError:
                self.error(None, "auth_required", f"no auth message within {AUTH_TIMEOUT_S:g} s")
                return CLOSE_POLICY, "authentication timed out"
            if msg["type"] == "websocket.disconnect":
                return None
            text = msg.get("text")
            if text is None:
                self.error(None, "bad_request", "send JSON as text frames, not binary")
                continue
            close = await self.handle(text)
            if close is not None:
                return close
            await self.drained()  # a client that does not read its replies is not served

    async def _write(self) -> None:
        while (text := await self.outgoing.get()) is not None:
            try:
                await self.ws.send_text(text)
            except (WebSocketDisconnect, RuntimeError, OSError):
                return  # the client is gone; the read loop notices too
            finally:
                self.queued -= len(text)
                if self.queued <= HIGH_WATER:
                    self._room.set()

    # ------------------------------------------------------------------ requests

    async def handle(self, text: str) -> tuple[int, str] | None:
        """Answer one request; returns (code, reason) when the connection must close."""
        rid = None
        quotas = self.server.config.quotas
        try:
            if quotas.request_bytes is not None and len(text) > quotas.request_bytes:
                raise ProtocolError(
                    "bad_request",
                    f"a message of {len(text)} characters is over this server's limit of "
                    f"{quotas.request_bytes} bytes (--max-request-bytes)",
                )
            try:
                raw = limits.loads(text, quotas.json_depth)
            except limits.BadRequest as e:
                raise ProtocolError("bad_request", str(e)) from None
            except ValueError as e:
                raise ProtocolError("bad_json", f"not valid JSON: {e}") from None
            if isinstance(raw, dict):
                rid = raw.get("id")
            if not self.authenticated:
                return self._authenticate(rid, raw)
            rid, req = parse(raw)
            await self.serve(rid, req)
        except ProtocolError as e:
            self.error(rid, e.code, e.message)
        except Exception:  # a bug or a full disk must not take the connection down
            log.exception("request failed: %.200s", text)
            self.error(rid, "internal", "internal server error (logged on the server)")
        return None

    def _authenticate(self, rid: object, raw: object) -> tuple[int, str] | None:
        kind = raw.get("type") if isinstance(raw, dict) else None
        if kind != "auth":
            self.error(rid, "auth_required", 'authenticate first: send {"type": "auth", ...}')
            return CLOSE_POLICY, "authentication required"
        try:
            _, req = parse(raw)
        except ProtocolError as e:
            self.error(rid, e.code, e.message)
            return CLOSE_POLICY, "authentication required"
        user = self.server.authenticate(req.token)
        if user is None:
            self.error(rid, "auth_failed", "wrong token")
            return CLOSE_POLICY, "authentication failed"
        self.user = user
        self.ok(rid, models=self.server.models, user=user.name)
        return None

    async def serve(self, rid: object, req: Any) -> None:
        """Answer one request with an ``ok`` reply (ProtocolError for a failure)."""
        match req:
            case Auth():
                self.ok(rid, models=self.server.models, user=self.user.name)  # already in
            case Upload(source=source, name=name):
                try:
                    info = await self.server.registry.upload_async(source, name, self.user)
                except UploadQuotaError as e:
                    raise ProtocolError("quota_exceeded", str(e)) from None
                except RegistryError as e:
                    raise ProtocolError("upload_rejected", str(e)) from None
                except ProgramError as e:
                    raise ProtocolError("invalid_program", str(e)) from None
                self.ok(rid, hash=info.hash, name=info.name, size=info.size, trusted=info.trusted)
            case Launch():
                try:
                    stream = self.streams.launch(self, req)
                except LaunchQuotaError as e:
                    raise ProtocolError("quota_exceeded", str(e)) from None
                except RegistryError as e:
                    raise ProtocolError("unknown_program", str(e)) from None
                except ProgramError as e:
                    raise ProtocolError("invalid_program", str(e)) from None
                prog = stream.inst.program
                # queued before any event of the instance: its pump has not run yet
                self.ok(rid, instance=stream.inst.id, program=prog.digest, name=prog.name)
            case Send(instance=iid, message=message):
                stream = self.streams.attached(self, iid)
                if stream.inst.done.is_set():
                    raise ProtocolError("instance_ended", f"instance {iid} has ended")
                try:
                    stream.inst.send(message)
                except QuotaError as e:
                    raise ProtocolError("quota_exceeded", str(e)) from None
                self.ok(rid)
            case Terminate(instance=iid, reason=reason):
                self.streams.attached(self, iid)
                self.server.runtime.terminate(iid, reason or "terminated by its client")
                self.ok(rid)
            case Attach(instance=iid):
                stream, kept, dropped = self.streams.attach(self, iid)
                prog = stream.inst.program
                state = "ended" if stream.ended else "running"
                self.ok(
                    rid, instance=iid, program=prog.digest, name=prog.name, state=state,
                    dropped=dropped,
                )  # fmt: skip
                for frame in kept:  # after the reply, before anything the pump sends next
                    self.push(frame)
            case ListPrograms():
                programs = self.server.registry.list(self.user.name)
                self.ok(rid, programs=[asdict(i) for i in programs])
            case ListInstances():
                self.ok(rid, instances=self._instances())
            case DeleteProgram(program=ref):
                try:
                    info = self.server.registry.delete(ref, self.user)
                except RegistryError as e:
                    raise ProtocolError("unknown_program", str(e)) from None
                self.ok(rid, hash=info.hash, name=info.name)
            case _:
                raise AssertionError(f"no handler for {req!r}")

    def _instances(self) -> list[dict]:
        """This user's instances (another user's are none of its business)."""
        rows = []
        owners = self.server.owners
        user = self.user.name
        running = [
            (i, self.streams.live.get(i.id))
            for i in self.server.runtime.instances.values()
            if i.user == user
        ]
        ended = [(s.inst, s) for s in self.streams.unclaimed.get(user, {}).values()]
        for inst, stream in running + ended:
            rows.append(
                {
                    "id": inst.id,
                    "program": inst.program.digest,
                    "name": inst.program.name,
                    "args": inst.args,
                    "started": inst.started,
                    "state": "ended" if inst.done.is_set() else "running",
                    "detached": stream.detached if stream else owners.get(inst.id) is None,
                    "mine": owners.get(inst.id) is self,
                    "attached": stream is not None and self in stream.subscribers,
                    "memory_bytes": inst.program.memory(inst.id) if inst.program.memory else None,
                }
            )
        return sorted(rows, key=lambda r: (r["started"], r["id"]))

    def ok(self, rid: object, **fields: Any) -> None:
        self.push({"type": "ok", "id": rid, **fields})

    def error(self, rid: object, code: str, message: str) -> None:
        self.push({"type": "error", "id": rid, "code": code, "message": message})


def routes(server: PastryServer) -> list:
    streams = server.streams = Streams(server)

    async def endpoint(ws: WebSocket) -> None:
        await Connection(server, streams, ws).run()

    return [WebSocketRoute("/ws", endpoint)]
