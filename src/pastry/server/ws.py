"""The client protocol over WebSocket at ``/ws`` (specified in ``docs/protocol.md``).

Each socket is a :class:`Connection` of one user (its token's, ``docs/security.md``): a
read loop that parses each JSON request into a typed request (:mod:`pastry.server.
ws_requests`) and answers it before reading the next (replies keep request order), and a
writer task that sends replies and instance events in the order they were queued.
Instance events go through :class:`~pastry.server.ws_streams.Streams`: one pump task per
instance (``Instance.events()`` allows one consumer) hands them to the connections attached
to it, or keeps them for a later ``attach`` when the instance is detached and nobody is
attached.

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
from dataclasses import asdict
from typing import Any

from starlette.routing import WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from pastry import __version__
from pastry.control.session import QuotaError
from pastry.control.users import User
from pastry.runtime.trusted import ProgramError
from pastry.server import limits
from pastry.server.registry import RegistryError, UploadQuotaError
from pastry.server.service import LaunchQuotaError, PastryServer
from pastry.server.ws_requests import (
    Attach,
    Auth,
    DeleteProgram,
    Launch,
    ListInstances,
    ListPrograms,
    ProtocolError,
    Send,
    Terminate,
    Upload,
    parse,
)
from pastry.server.ws_streams import Streams

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
AUTH_TIMEOUT_S = 30.0  # a connection must authenticate within this long
HIGH_WATER = 1 << 20  # bytes of frames queued for one connection before producers wait
CLOSE_POLICY = 1008  # WebSocket close code: authentication failed or missing


class Connection:
    """One client's socket: its read loop, its writer task and its answers to requests."""

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
            case Upload():
                await self._upload(rid, req)
            case Launch():
                self._launch(rid, req)
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
                self._attach(rid, iid)
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

    async def _upload(self, rid: object, req: Upload) -> None:
        try:
            info = await self.server.registry.upload_async(req.source, req.name, self.user)
        except UploadQuotaError as e:
            raise ProtocolError("quota_exceeded", str(e)) from None
        except RegistryError as e:
            raise ProtocolError("upload_rejected", str(e)) from None
        except ProgramError as e:
            raise ProtocolError("invalid_program", str(e)) from None
        self.ok(rid, hash=info.hash, name=info.name, size=info.size, trusted=info.trusted)

    def _launch(self, rid: object, req: Launch) -> None:
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

    def _attach(self, rid: object, iid: int) -> None:
        stream, kept, dropped = self.streams.attach(self, iid)
        prog = stream.inst.program
        state = "ended" if stream.ended else "running"
        self.ok(
            rid, instance=iid, program=prog.digest, name=prog.name, state=state,
            dropped=dropped,
        )  # fmt: skip
        for frame in kept:  # after the reply, before anything the pump sends next
            self.push(frame)

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
