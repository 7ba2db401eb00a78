"""Where the events of instances launched over ``/ws`` go (:mod:`pastry.server.ws`): one
pump task per instance (``Instance.events()`` allows one consumer) hands them to the
connections attached to it, or keeps them for a later ``attach`` when the instance is
detached and nobody is attached.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Protocol

from pastry.control.events import event_data
from pastry.control.users import User
from pastry.runtime.trusted import Instance
from pastry.server.service import PastryServer
from pastry.server.ws_requests import Launch, ProtocolError

BACKLOG = 1000  # messages kept per detached instance while no connection is attached
MAX_UNCLAIMED = 64  # ended detached instances per user remembered until someone attaches


class Subscriber(Protocol):
    """A connection as the streams see it (:class:`pastry.server.ws.Connection`)."""

    user: User | None

    def push(self, frame: dict) -> None:
        """Queue a frame for the client (never blocks)."""

    async def drained(self) -> None:
        """Wait until the client has taken most of what was queued."""


@dataclass(eq=False)
class Stream:
    """Where one instance's events go: its attached connections, else (detached) a backlog
    of at most :data:`BACKLOG` frames and ``max_bytes`` of data (the oldest go first)."""

    inst: Instance
    detached: bool
    subscribers: set[Subscriber] = field(default_factory=set)
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

    def launch(self, conn: Subscriber, req: Launch) -> Stream:
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

    def attach(self, conn: Subscriber, iid: int) -> tuple[Stream, list[dict], int]:
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

    def _find(self, conn: Subscriber, iid: int) -> Stream | None:
        """The live stream of ``iid`` if it belongs to ``conn``'s user (another user's
        instance does not exist, as far as ``conn`` can tell)."""
        stream = self.live.get(iid)
        return stream if stream is not None and stream.inst.user == conn.user.name else None

    def attached(self, conn: Subscriber, iid: int) -> Stream:
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

    def _missing(self, conn: Subscriber, iid: int) -> ProtocolError:
        if iid in self.unclaimed.get(conn.user.name, {}):
            return ProtocolError("not_permitted", f"instance {iid} is detached: attach to it first")
        if self.server.instance(iid, conn.user) is not None:
            return ProtocolError(
                "not_permitted", f"instance {iid} was not launched over this protocol"
            )
        return ProtocolError("unknown_instance", f"no instance {iid} (never launched, or ended)")

    def forget(self, conn: Subscriber) -> None:
        """``conn`` closed: it receives nothing more (its instances are ended by the caller)."""
        for stream in self.live.values():
            stream.subscribers.discard(conn)
