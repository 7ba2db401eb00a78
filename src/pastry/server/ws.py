"""The client protocol over WebSocket at ``/ws`` (specified in ``docs/protocol.md``).

Each socket is a :class:`Connection`: a read loop that parses each JSON request into a
typed request (:data:`REQUESTS`) and answers it at once (every handler is synchronous, so
replies keep request order), and a writer task that sends replies and instance events in
the order they were queued. Instance events go through :class:`Streams`: one pump task per
instance (``Instance.events()`` allows one consumer) hands them to the connections attached
to it, or keeps them for a later ``attach`` when the instance is detached and nobody is
attached.

Ownership: an instance launched by a connection belongs to it and ends when it closes. A
detached instance lives on; any authenticated connection may attach to it, and every
attached connection receives its events from then on and may send to or terminate it.
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
from pastry.runtime.trusted import Instance, ProgramError
from pastry.server.registry import RegistryError
from pastry.server.service import PastryServer

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
AUTH_TIMEOUT_S = 30.0  # a connection must authenticate within this long
BACKLOG = 1000  # messages kept per detached instance while no connection is attached
MAX_UNCLAIMED = 1000  # ended detached instances remembered until someone attaches
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


REQUESTS: dict[str, type] = {
    cls.type: cls
    for cls in (Auth, Upload, Launch, Send, Terminate, Attach, ListPrograms, ListInstances)
}


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
    """Where one instance's events go: its attached connections, else (detached) a backlog."""

    inst: Instance
    detached: bool
    subscribers: set[Connection] = field(default_factory=set)
    backlog: deque[dict] = field(default_factory=lambda: deque(maxlen=BACKLOG))
    dropped: int = 0  # messages that fell out of the backlog
    ended: bool = False


class Streams:
    """Every instance launched over ``/ws``, and the pump that delivers its events."""

    def __init__(self, server: PastryServer) -> None:
        self.server = server
        self.live: dict[int, Stream] = {}  # running, or ending (end event in flight)
        self.unclaimed: OrderedDict[int, Stream] = OrderedDict()  # detached, ended, unseen
        self._pumps: set[asyncio.Task] = set()

    def launch(self, conn: Connection, req: Launch) -> Stream:
        inst = self.server.launch(req.program, req.args, owner=None if req.detached else conn)
        stream = Stream(inst, req.detached, {conn})
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
                    for conn in stream.subscribers:
                        conn.push(frame)
                elif stream.detached:
                    if len(stream.backlog) == BACKLOG:
                        stream.dropped += 1
                    stream.backlog.append(frame)
        finally:
            stream.ended = True
            self.live.pop(iid, None)
            self.server.owners.pop(iid, None)
            if stream.detached and not stream.subscribers:
                self.unclaimed[iid] = stream
                while len(self.unclaimed) > MAX_UNCLAIMED:
                    self.unclaimed.popitem(last=False)

    def attach(self, conn: Connection, iid: int) -> tuple[Stream, list[dict], int]:
        """Subscribe ``conn``; returns the stream, the events kept for it, and how many
        messages were dropped from the backlog before it attached."""
        stream = self.live.get(iid) or self.unclaimed.pop(iid, None)
        if stream is None:
            raise self._missing(iid)
        if not stream.detached and conn not in stream.subscribers:
            raise ProtocolError(
                "not_permitted",
                f"instance {iid} belongs to another connection (only detached instances "
                "can be attached)",
            )
        stream.subscribers.add(conn)
        kept, dropped = list(stream.backlog), stream.dropped
        stream.backlog.clear()
        stream.dropped = 0
        return stream, kept, dropped

    def attached(self, conn: Connection, iid: int) -> Stream:
        """The stream of ``iid`` if ``conn`` may send to / terminate it, else ProtocolError."""
        stream = self.live.get(iid)
        if stream is None:
            raise self._missing(iid)
        if conn not in stream.subscribers:
            if stream.detached:
                raise ProtocolError(
                    "not_permitted", f"instance {iid} is detached: attach to it first"
                )
            raise ProtocolError("not_permitted", f"instance {iid} belongs to another connection")
        return stream

    def _missing(self, iid: int) -> ProtocolError:
        if iid in self.unclaimed:
            return ProtocolError("not_permitted", f"instance {iid} is detached: attach to it first")
        if self.server.instance(iid) is not None:
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
        self.authenticated = server.config.auth_token is None
        self.outgoing: asyncio.Queue[dict | None] = asyncio.Queue()
        self.open = True

    def push(self, frame: dict) -> None:
        """Queue a frame for the writer (in order; never blocks)."""
        if self.open:
            self.outgoing.put_nowait(frame)

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
        self.push(hello)
        close: tuple[int, str] | None = None
        try:
            close = await self._read()
        finally:
            self.open = False
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
            close = self.handle(text)
            if close is not None:
                return close

    async def _write(self) -> None:
        while (frame := await self.outgoing.get()) is not None:
            try:
                await self.ws.send_text(json.dumps(frame))
            except (WebSocketDisconnect, RuntimeError, OSError):
                return  # the client is gone; the read loop notices too

    # ------------------------------------------------------------------ requests

    def handle(self, text: str) -> tuple[int, str] | None:
        """Answer one request; returns (code, reason) when the connection must close."""
        rid = None
        try:
            try:
                raw = json.loads(text)
            except json.JSONDecodeError as e:
                raise ProtocolError("bad_json", f"not valid JSON: {e}") from None
            if isinstance(raw, dict):
                rid = raw.get("id")
            if not self.authenticated:
                return self._authenticate(rid, raw)
            rid, req = parse(raw)
            self.serve(rid, req)
        except ProtocolError as e:
            self.error(rid, e.code, e.message)
        except Exception as e:  # a bug or a full disk must not take the connection down
            log.exception("request failed: %.200s", text)
            self.error(rid, "internal", f"internal server error: {type(e).__name__}: {e}")
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
        if not self.server.check_token(req.token):
            self.error(rid, "auth_failed", "wrong token")
            return CLOSE_POLICY, "authentication failed"
        self.authenticated = True
        self.ok(rid, models=self.server.models)
        return None

    def serve(self, rid: object, req: Any) -> None:
        """Answer one request with an ``ok`` reply (ProtocolError for a failure)."""
        match req:
            case Auth():
                self.ok(rid, models=self.server.models)  # already authenticated
            case Upload(source=source, name=name):
                try:
                    info = self.server.registry.upload(source, name)
                except RegistryError as e:
                    raise ProtocolError("upload_rejected", str(e)) from None
                except ProgramError as e:
                    raise ProtocolError("invalid_program", str(e)) from None
                self.ok(rid, hash=info.hash, name=info.name, size=info.size)
            case Launch():
                try:
                    stream = self.streams.launch(self, req)
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
                stream.inst.send(message)
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
                self.ok(rid, programs=[asdict(i) for i in self.server.registry.list()])
            case ListInstances():
                self.ok(rid, instances=self._instances())
            case _:
                raise AssertionError(f"no handler for {req!r}")

    def _instances(self) -> list[dict]:
        rows = []
        owners = self.server.owners
        running = [(i, self.streams.live.get(i.id)) for i in self.server.runtime.instances.values()]
        ended = [(s.inst, s) for s in self.streams.unclaimed.values()]
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
                }
            )
        return sorted(rows, key=lambda r: r["id"])

    def ok(self, rid: object, **fields: Any) -> None:
        self.push({"type": "ok", "id": rid, **fields})

    def error(self, rid: object, code: str, message: str) -> None:
        self.push({"type": "error", "id": rid, "code": code, "message": message})


def routes(server: PastryServer) -> list:
    streams = Streams(server)

    async def endpoint(ws: WebSocket) -> None:
        await Connection(server, streams, ws).run()

    return [WebSocketRoute("/ws", endpoint)]
