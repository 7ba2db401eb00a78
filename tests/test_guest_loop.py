"""The Python guest's event loop (pastry.runtime.guest.loop), on the host: asyncio's tasks,
timers and timeouts on it, waiting only in its ``select``, and re-entry (what
pastry.lang's driver uses in the sandbox instead of threads)."""

from __future__ import annotations

import asyncio

import pytest

from pastry.lang.driver import Cancelled, ReentrantDriver
from pastry.runtime.guest.loop import GuestLoop


class Host:
    """A fake host: calls complete after the loop has waited ``delay`` selects for them."""

    def __init__(self) -> None:
        self.waits: list[float | None] = []
        self.calls: dict[int, tuple[int, object]] = {}  # pid -> (selects left, value)
        self.next = 0

    def call(self, loop: GuestLoop, value: object, delay: int = 1) -> asyncio.Future:
        self.next += 1
        self.calls[self.next] = (delay, value)
        return loop.track(self.next)

    def select(self, loop: GuestLoop, timeout: float | None) -> None:
        self.waits.append(timeout)
        if not self.calls and timeout is None:
            raise RuntimeError("deadlock")
        for pid, (left, value) in list(self.calls.items()):
            if left > 1:
                self.calls[pid] = (left - 1, value)
                continue
            del self.calls[pid]
            loop.pending.pop(pid).set_result(value)


def test_tasks_gather_timers_and_timeouts_run_on_it():
    host = Host()
    loop = GuestLoop(host.select)

    async def main():
        a, b = host.call(loop, "a"), host.call(loop, "b", delay=3)
        order = []

        async def child(name, fut):
            order.append(name + " waits")
            order.append(await fut)

        await asyncio.gather(child("x", a), child("y", b))
        await asyncio.sleep(0.01)
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.01):
                await host.call(loop, "never", delay=10**6)
        assert asyncio.current_task() is not None and asyncio.get_running_loop() is loop
        return order

    assert loop.run_until_complete(main()) == ["x waits", "y waits", "a", "b"]
    assert host.waits[:3] == [None, None, None]  # it only waited when nothing was ready
    assert any(w is not None and w > 0 for w in host.waits)  # the sleep: until its timer


def test_a_synchronous_body_waits_by_running_the_loop_and_nests():
    """ReentrantDriver: a body blocks on a value by running the loop (no threads);
    another body started meanwhile runs nested inside that wait."""
    host = Host()
    loop = GuestLoop(host.select)
    driver = ReentrantDriver(loop)
    log = []

    async def main():
        fut_a = host.call(loop, 1, delay=2)
        fut_b = host.call(loop, 2, delay=1)

        def body(name, fut):
            log.append(f"{name} starts")
            driver.wait_until(fut.done)
            log.append(f"{name} got {fut.result()}")
            return fut.result() * 10

        return await asyncio.gather(driver.run(lambda: body("a", fut_a)),
                                    driver.run(lambda: body("b", fut_b)))  # fmt: skip

    assert loop.run_until_complete(main()) == [10, 20]
    assert log == ["a starts", "b starts", "b got 2", "a got 1"]


def test_a_waiting_body_is_cancelled_with_its_task():
    host = Host()
    loop = GuestLoop(host.select)
    driver = ReentrantDriver(loop)

    async def main():
        never = host.call(loop, None, delay=10**9)
        task = loop.create_task(driver.run(lambda: driver.wait_until(never.done)))
        host.call(loop, "tick", delay=2)
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return driver.cancelled

    assert loop.run_until_complete(main()) is True


def test_a_driver_needs_a_reentrant_loop():
    loop = asyncio.new_event_loop()
    try:
        with pytest.raises(RuntimeError, match="re-entrant"):
            ReentrantDriver(loop)
    finally:
        loop.close()
    assert Cancelled.__mro__[1] is Exception
