"""Topic messaging between inferlets: ``broadcast`` and ``subscribe`` (Pie §4.3).

One :class:`MessageBus` per server, used from its event loop only (no locks, no threads).
An inferlet subscribes to a topic and gets a :class:`Subscription`; every later
``broadcast`` to that topic puts the message on the queue of each subscription open at that
moment (a late subscriber does not see earlier messages). By default the sender's own
subscriptions are skipped (``MessageBusConfig.deliver_to_sender``).

Topics are per user (every call takes ``user``; ``None`` is a user like any other): a
broadcast reaches the subscribers of that user's topic only. Subscribing to another user's
topic, where the owner granted it, is the caller's to allow (``docs/security.md``).

Guarantees and limits:

- Order: a broadcast is delivered to all subscriptions before it returns, so each
  subscription sees the messages of one sender on one topic in the order they were sent
  (in fact, all messages of a topic in broadcast order).
- A message is at most ``max_message_bytes`` of UTF-8; a larger one is rejected with
  :class:`MessageTooLarge` and delivered to no one.
- Each subscription queues at most ``queue_messages`` messages and ``queue_bytes`` bytes; on
  overflow the oldest queued messages are dropped and counted in ``Subscription.dropped``,
  so a slow reader never blocks a sender nor grows memory without bound.
- Topic names: 1..``max_topic_length`` printable ASCII characters without spaces.
- When an instance ends, the server calls :meth:`MessageBus.unsubscribe_all`: its
  subscriptions close, queued messages are discarded and pending ``get()`` calls raise
  :class:`SubscriptionClosed`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import re
from collections import deque
from dataclasses import dataclass

_TOPIC_RE = re.compile(r"[!-~]+")  # printable ASCII, no space


class MessagingError(ValueError):
    """A broadcast or subscribe was rejected (bad topic, message too large, too many
    subscriptions)."""


class MessageTooLarge(MessagingError):
    """A message is larger than ``MessageBusConfig.max_message_bytes``."""


class SubscriptionClosed(RuntimeError):
    """``get()`` on a subscription that was closed (by ``close()`` or because its instance
    ended)."""


@dataclass(frozen=True)
class MessageBusConfig:
    max_message_bytes: int = 1 << 20
    queue_messages: int = 1024
    queue_bytes: int = 16 << 20
    max_topic_length: int = 256
    max_subscriptions_per_instance: int = 1024
    deliver_to_sender: bool = False

    def __post_init__(self) -> None:
        for name in (
            "max_message_bytes",
            "queue_messages",
            "queue_bytes",
            "max_topic_length",
            "max_subscriptions_per_instance",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"MessageBusConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.queue_bytes < self.max_message_bytes:
            raise ValueError(
                f"MessageBusConfig.queue_bytes ({self.queue_bytes}) must be >= "
                f"max_message_bytes ({self.max_message_bytes}) so that any message fits"
            )


class Subscription:
    """The receiving end of ``subscribe(topic)``: a bounded FIFO of message strings.

    ``await sub.get()`` waits for the next message; ``sub.get_nowait()`` returns it or
    ``None`` (upstream's ``subscription.get()``); ``async for msg in sub`` iterates until the
    subscription is closed. ``close()`` is idempotent. ``dropped`` counts messages dropped
    because the queue was full. Create through :meth:`MessageBus.subscribe` only.
    """

    def __init__(
        self,
        bus: MessageBus,
        sub_id: int,
        instance_id: str,
        topic: str,
        config: MessageBusConfig,
        user: object = None,
    ) -> None:
        self._bus = bus
        self.id = sub_id
        self.instance_id = instance_id
        self.topic = topic
        self.user = user  # whose topic it is
        self._max_messages = config.queue_messages
        self._max_bytes = config.queue_bytes
        self._items: deque[tuple[str, int]] = deque()  # (message, size in bytes)
        self._queued_bytes = 0
        self._waiters: deque[asyncio.Future[str]] = deque()
        self._closed_reason: str | None = None
        self.received = 0  # messages put on this subscription (including dropped ones)
        self.dropped = 0

    @property
    def closed(self) -> bool:
        return self._closed_reason is not None

    def __len__(self) -> int:
        """Messages queued and not yet read."""
        return len(self._items)

    @property
    def queued_bytes(self) -> int:
        return self._queued_bytes

    def __repr__(self) -> str:
        state = f"closed: {self._closed_reason}" if self.closed else f"{len(self)} queued"
        return (
            f"Subscription(id={self.id}, instance={self.instance_id!r}, topic={self.topic!r}, "
            f"{state}, dropped={self.dropped})"
        )

    def get_nowait(self) -> str | None:
        """The next queued message, or ``None`` if there is none (even when closed)."""
        if not self._items:
            return None
        message, size = self._items.popleft()
        self._queued_bytes -= size
        return message

    async def get(self) -> str:
        """Wait for the next message. Raises :class:`SubscriptionClosed` once closed."""
        if self._items:
            message, size = self._items.popleft()
            self._queued_bytes -= size
            return message
        if self._closed_reason is not None:
            raise self._closed_error()
        waiter: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            return await waiter
        except asyncio.CancelledError:
            # A message handed to this waiter just before the cancellation must not be lost.
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                self._return(waiter.result())
            raise
        finally:
            if not waiter.done():
                waiter.cancel()
            with contextlib.suppress(ValueError):  # already taken by _put or _close
                self._waiters.remove(waiter)

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> str:
        try:
            return await self.get()
        except SubscriptionClosed:
            raise StopAsyncIteration from None

    def close(self) -> None:
        """Unsubscribe: discard queued messages; pending ``get()`` calls raise."""
        self._close("closed by unsubscribe")

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- used by MessageBus --------------------------------------------------------------

    def _closed_error(self) -> SubscriptionClosed:
        return SubscriptionClosed(
            f"subscription {self.id} to topic {self.topic!r} of instance "
            f"{self.instance_id!r} is closed ({self._closed_reason})"
        )

    def _return(self, message: str) -> None:
        """Give back a message taken by a getter that was cancelled before it ran: to the
        next waiting getter, else to the front of the queue (it stays the oldest)."""
        if self._closed_reason is not None:
            return
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(message)
                return
        self._items.appendleft((message, _size(message)))
        self._queued_bytes += self._items[0][1]
        self._trim()

    def _trim(self) -> None:
        while len(self._items) > self._max_messages or self._queued_bytes > self._max_bytes:
            _, size = self._items.popleft()
            self._queued_bytes -= size
            self.dropped += 1

    def _put(self, message: str, size: int) -> None:
        self.received += 1
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(message)
                return
        self._items.append((message, size))
        self._queued_bytes += size
        self._trim()

    def _close(self, reason: str) -> None:
        if self._closed_reason is not None:
            return
        self._closed_reason = reason
        self._items.clear()
        self._queued_bytes = 0
        self._bus._forget(self)
        waiters, self._waiters = self._waiters, deque()
        for waiter in waiters:
            if not waiter.done():
                waiter.set_exception(self._closed_error())


def _size(message: str) -> int:
    return len(message.encode("utf-8"))


class MessageBus:
    """Topic-based publish/subscribe between inferlet instances (one event loop)."""

    def __init__(self, config: MessageBusConfig | None = None) -> None:
        self.config = config or MessageBusConfig()
        self._ids = itertools.count(1)
        self._topics: dict[tuple[object, str], dict[int, Subscription]] = {}
        self._by_instance: dict[str, dict[int, Subscription]] = {}

    def subscribe(self, instance_id: str, topic: str, user: object = None) -> Subscription:
        """Open a subscription of ``instance_id`` to ``user``'s ``topic``; it receives every
        message broadcast there from now on. An instance may hold several subscriptions to
        one topic; each gets its own copy of every message."""
        self._check_topic(topic)
        mine = self._by_instance.get(instance_id, {})
        limit = self.config.max_subscriptions_per_instance
        if len(mine) >= limit:
            raise MessagingError(
                f"instance {instance_id!r} already holds {len(mine)} subscriptions (limit "
                f"{limit}); close unused ones with unsubscribe()"
            )
        sub = Subscription(self, next(self._ids), instance_id, topic, self.config, user)
        self._topics.setdefault((user, topic), {})[sub.id] = sub
        self._by_instance.setdefault(instance_id, {})[sub.id] = sub
        return sub

    def broadcast(self, instance_id: str, topic: str, message: str, user: object = None) -> int:
        """Deliver ``message`` to every open subscription of ``user``'s ``topic`` (except
        the sender's own unless ``deliver_to_sender``); returns the number of subscriptions
        it reached."""
        self._check_topic(topic)
        if not isinstance(message, str):
            raise TypeError(f"message must be a str, got {type(message).__name__}")
        limit = self.config.max_message_bytes
        size = len(message) if message.isascii() else _size(message)
        if size > limit:
            raise MessageTooLarge(
                f"message to topic {topic!r} is {size} bytes, over the limit of {limit} bytes "
                f"(MessageBusConfig.max_message_bytes); split it or share it via the store"
            )
        subs = self._topics.get((user, topic))
        if not subs:
            return 0
        delivered = 0
        for sub in subs.values():  # _put never changes subscriptions
            if sub.instance_id == instance_id and not self.config.deliver_to_sender:
                continue
            sub._put(message, size)
            delivered += 1
        return delivered

    def unsubscribe_all(self, instance_id: str, reason: str | None = None) -> int:
        """Close every subscription of ``instance_id`` (call when the instance ends);
        returns how many were closed."""
        subs = list(self._by_instance.get(instance_id, {}).values())
        why = reason or f"instance {instance_id!r} ended"
        for sub in subs:
            sub._close(why)
        return len(subs)

    def subscriptions(self, instance_id: str | None = None) -> list[Subscription]:
        """Open subscriptions, of one instance or all, oldest first."""
        if instance_id is None:
            subs = [s for t in self._topics.values() for s in t.values()]
        else:
            subs = list(self._by_instance.get(instance_id, {}).values())
        return sorted(subs, key=lambda s: s.id)

    def topics(self, user: object = None) -> dict[str, int]:
        """``user``'s topics with open subscriptions and their subscriber counts, sorted by
        name."""
        mine = [(t, len(subs)) for (u, t), subs in self._topics.items() if u == user]
        return dict(sorted(mine))

    def check_integrity(self) -> None:
        """Assert that the topic and instance indexes agree (for tests and idle checks)."""
        by_topic = {s.id: s for subs in self._topics.values() for s in subs.values()}
        by_inst = {s.id: s for subs in self._by_instance.values() for s in subs.values()}
        assert by_topic.keys() == by_inst.keys(), (by_topic.keys(), by_inst.keys())
        assert all(subs for subs in self._topics.values()), "empty topic entry"
        assert all(subs for subs in self._by_instance.values()), "empty instance entry"
        for s in by_topic.values():
            assert not s.closed and by_inst[s.id] is s
            assert self._topics[(s.user, s.topic)][s.id] is s
            assert self._by_instance[s.instance_id][s.id] is s
            assert s.queued_bytes == sum(n for _, n in s._items)
            assert len(s._items) <= self.config.queue_messages
            assert s.queued_bytes <= self.config.queue_bytes

    def _forget(self, sub: Subscription) -> None:
        for index, key in (
            (self._topics, (sub.user, sub.topic)),
            (self._by_instance, sub.instance_id),
        ):
            subs = index.get(key)
            if subs is not None:
                subs.pop(sub.id, None)
                if not subs:
                    del index[key]

    def _check_topic(self, topic: str) -> None:
        if not isinstance(topic, str):
            raise TypeError(f"topic must be a str, got {type(topic).__name__}")
        limit = self.config.max_topic_length
        if not 1 <= len(topic) <= limit or not _TOPIC_RE.fullmatch(topic):
            raise MessagingError(
                f"invalid topic {topic[: limit + 16]!r}: use 1..{limit} printable ASCII "
                f"characters without spaces (e.g. 'swarm/results')"
            )
