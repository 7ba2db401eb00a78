"""MessageBus: delivery, ordering, limits, overflow, closing (exact queue state)."""

from __future__ import annotations

import asyncio

import pytest

from pastry.control.messaging import (
    MessageBus,
    MessageBusConfig,
    MessageTooLarge,
    MessagingError,
    SubscriptionClosed,
)


def test_broadcast_reaches_current_subscribers_but_not_sender():
    bus = MessageBus()
    a = bus.subscribe("A", "t")
    b = bus.subscribe("B", "t")
    other = bus.subscribe("C", "other")
    assert bus.broadcast("A", "t", "hello") == 1
    assert a.get_nowait() is None
    assert b.get_nowait() == "hello"
    assert other.get_nowait() is None
    late = bus.subscribe("D", "t")  # no replay of earlier messages
    assert late.get_nowait() is None
    assert bus.broadcast("X", "nobody-listens", "m") == 0
    assert bus.topics() == {"other": 1, "t": 3}
    bus.check_integrity()


def test_deliver_to_sender_and_multiple_subscriptions_per_instance():
    bus = MessageBus(MessageBusConfig(deliver_to_sender=True))
    a1 = bus.subscribe("A", "t")
    a2 = bus.subscribe("A", "t")
    assert bus.broadcast("A", "t", "x") == 2
    assert (a1.get_nowait(), a2.get_nowait()) == ("x", "x")
    assert [s.id for s in bus.subscriptions("A")] == [a1.id, a2.id]


def test_fifo_per_sender_and_async_get():
    async def main():
        bus = MessageBus()
        sub = bus.subscribe("R", "t")
        got = []

        async def reader():
            async for msg in sub:
                got.append(msg)

        task = asyncio.create_task(reader())
        await asyncio.sleep(0)  # reader is now waiting
        for i in range(5):
            bus.broadcast("S1", "t", f"s1-{i}")
            bus.broadcast("S2", "t", f"s2-{i}")
            if i % 2:
                await asyncio.sleep(0)  # let the reader take some messages in between
        await asyncio.sleep(0)
        sub.close()  # ends the async for
        await asyncio.wait_for(task, 1)
        assert [m for m in got if m.startswith("s1")] == [f"s1-{i}" for i in range(5)]
        assert [m for m in got if m.startswith("s2")] == [f"s2-{i}" for i in range(5)]
        assert len(got) == 10
        assert sub.received == 10 and sub.dropped == 0

    asyncio.run(main())


def test_overflow_drops_oldest_and_counts():
    bus = MessageBus(MessageBusConfig(queue_messages=3))
    sub = bus.subscribe("R", "t")
    for i in range(5):
        bus.broadcast("S", "t", str(i))
    assert len(sub) == 3 and sub.dropped == 2 and sub.received == 5
    assert [sub.get_nowait() for _ in range(4)] == ["2", "3", "4", None]
    bus.check_integrity()


def test_overflow_by_bytes():
    bus = MessageBus(MessageBusConfig(max_message_bytes=4, queue_bytes=10))
    sub = bus.subscribe("R", "t")
    for msg in ("aaaa", "bbbb", "cccc", "d"):
        bus.broadcast("S", "t", msg)
    assert sub.dropped == 1 and sub.queued_bytes == 9
    assert [sub.get_nowait() for _ in range(3)] == ["bbbb", "cccc", "d"]
    assert sub.queued_bytes == 0


def test_message_size_limit_counts_utf8_bytes():
    bus = MessageBus(MessageBusConfig(max_message_bytes=4, queue_bytes=4))
    sub = bus.subscribe("R", "t")
    assert bus.broadcast("S", "t", "abcd") == 1
    with pytest.raises(MessageTooLarge, match=r"6 bytes, over the limit of 4 bytes"):
        bus.broadcast("S", "t", "éèê")  # 3 characters, 6 bytes
    assert len(sub) == 1  # the rejected message reached no one
    with pytest.raises(TypeError, match="str"):
        bus.broadcast("S", "t", b"bytes")  # type: ignore[arg-type]


def test_topic_validation():
    bus = MessageBus(MessageBusConfig(max_topic_length=8))
    for bad in ("", "has space", "tab\t", "ünïcode", "x" * 9):
        with pytest.raises(MessagingError, match="invalid topic"):
            bus.subscribe("A", bad)
        with pytest.raises(MessagingError, match="invalid topic"):
            bus.broadcast("A", bad, "m")
    bus.subscribe("A", "a/b.c:d-")


def test_subscription_limit_per_instance():
    bus = MessageBus(MessageBusConfig(max_subscriptions_per_instance=2))
    s1 = bus.subscribe("A", "t")
    bus.subscribe("A", "u")
    with pytest.raises(MessagingError, match=r"2 subscriptions \(limit 2\)"):
        bus.subscribe("A", "v")
    bus.subscribe("B", "v")  # other instances are not affected
    s1.close()
    bus.subscribe("A", "v")


def test_unsubscribe_all_wakes_pending_getters_with_clear_error():
    async def main():
        bus = MessageBus()
        s1 = bus.subscribe("A", "t")
        s2 = bus.subscribe("A", "u")
        keep = bus.subscribe("B", "t")
        pending = asyncio.create_task(s1.get())
        await asyncio.sleep(0)
        bus.broadcast("B", "u", "queued")  # discarded on close
        assert bus.unsubscribe_all("A") == 2
        with pytest.raises(SubscriptionClosed, match=r"topic 't' of instance 'A' is closed"):
            await pending
        assert "instance 'A' ended" in repr(s1)
        with pytest.raises(SubscriptionClosed):
            await s2.get()
        assert s2.get_nowait() is None and s1.closed and s2.closed
        assert bus.broadcast("B", "t", "m") == 0  # A gone; B is the sender
        assert bus.subscriptions() == [keep]
        assert bus.unsubscribe_all("A") == 0
        bus.check_integrity()

    asyncio.run(main())


def test_close_is_idempotent_and_context_manager():
    bus = MessageBus()
    with bus.subscribe("A", "t") as sub:
        bus.broadcast("B", "t", "m")
    assert sub.closed and bus.topics() == {}
    sub.close()
    bus.check_integrity()


def test_cancelled_getter_loses_no_message():
    async def main():
        bus = MessageBus()
        sub = bus.subscribe("R", "t")
        first = asyncio.create_task(sub.get())
        second = asyncio.create_task(sub.get())
        await asyncio.sleep(0)
        bus.broadcast("S", "t", "m1")  # handed to `first`, which is cancelled before it runs
        first.cancel()
        await asyncio.sleep(0)
        assert first.cancelled()
        assert await asyncio.wait_for(second, 1) == "m1"  # passed on to the next getter

        third = asyncio.create_task(sub.get())
        await asyncio.sleep(0)
        bus.broadcast("S", "t", "m2")
        bus.broadcast("S", "t", "m3")
        third.cancel()
        await asyncio.sleep(0)
        assert [sub.get_nowait(), sub.get_nowait()] == ["m2", "m3"]  # back at the front
        bus.check_integrity()

    asyncio.run(main())


def test_config_validation():
    with pytest.raises(ValueError, match="queue_messages"):
        MessageBusConfig(queue_messages=0)
    with pytest.raises(ValueError, match="queue_bytes"):
        MessageBusConfig(max_message_bytes=10, queue_bytes=5)
