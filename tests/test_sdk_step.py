"""``Context.generate`` awaits a step's last call only (pastry.sdk.calls.await_step)."""

from __future__ import annotations

import asyncio

import pytest

from pastry.sdk.calls import await_step


def run(coro_fn):
    return asyncio.run(coro_fn())


def test_step_returns_the_last_result_once_all_are_done():
    async def main():
        loop = asyncio.get_running_loop()
        embed, fwd, last = (loop.create_future() for _ in range(3))
        for f, v in ((embed, None), (fwd, None), (last, 42)):
            f.set_result(v)
        return await await_step([embed, fwd], last)

    assert run(main) == 42


def test_step_raises_the_first_failure_in_queue_order_and_retrieves_all():
    async def main():
        loop = asyncio.get_running_loop()
        embed, fwd, last = (loop.create_future() for _ in range(3))
        embed.set_exception(ValueError("embed rejected"))
        fwd.set_exception(KeyError("forward rejected"))
        last.set_exception(RuntimeError("sample rejected"))
        with pytest.raises(ValueError, match="embed rejected"):
            await await_step([embed, fwd], last)
        # every failure was retrieved: no "exception was never retrieved" at collection
        return [f._log_traceback for f in (embed, fwd, last)]

    assert run(main) == [False, False, False]


def test_step_raises_an_earlier_failure_when_the_last_call_succeeded():
    async def main():
        loop = asyncio.get_running_loop()
        embed, last = loop.create_future(), loop.create_future()
        embed.set_exception(ValueError("embed rejected"))
        last.set_result(7)
        await await_step([embed], last)

    with pytest.raises(ValueError, match="embed rejected"):
        run(main)


def test_step_waits_for_earlier_calls_when_the_last_was_rejected_first():
    async def main():
        loop = asyncio.get_running_loop()
        fwd, last = loop.create_future(), loop.create_future()
        last.set_exception(RuntimeError("sample rejected"))  # before the forward ran
        loop.call_later(0.01, fwd.set_result, None)
        with pytest.raises(RuntimeError, match="sample rejected"):
            await await_step([fwd], last)
        return fwd.done()

    assert run(main) is True


def test_cancelling_a_step_cancels_its_earlier_calls():
    async def main():
        loop = asyncio.get_running_loop()
        embed, fwd, last = (loop.create_future() for _ in range(3))
        embed.set_result(None)
        task = asyncio.ensure_future(await_step([embed, fwd], last))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return embed.cancelled(), fwd.cancelled(), last.cancelled()

    # nothing is left to fail unretrieved when the queue closes after the inferlet ended
    assert run(main) == (False, True, True)
