"""Scheduler policy objects in isolation: batching (when, caps) and schedule (order)."""

from __future__ import annotations

import asyncio
import time

import pytest

from commands import fn_command
from pastry.control.commands import Queue, Stage
from pastry.control.policies import (
    BATCH_POLICIES,
    Adaptive,
    BatchPolicy,
    Eager,
    Fcfs,
    KOnly,
    SchedulePolicy,
    TOnly,
    batch_policy,
)
from pastry.control.scheduler import BatchScheduler
from pastry.wire.calls import Sample


class FakeState:
    """A SchedulerState driven by :func:`turns`: ``submitted`` follows ``submitted(turn)``,
    ``ready_count`` pops a script (its last value sticks); reads are counted."""

    def __init__(self, submitted=lambda turn: 0, ready=(0,)) -> None:
        self.turn = 0
        self._submitted, self._ready = submitted, list(ready)
        self.submitted_reads = self.ready_reads = 0

    @property
    def submitted(self) -> int:
        self.submitted_reads += 1
        return self._submitted(self.turn)

    def ready_count(self) -> int:
        self.ready_reads += 1
        return self._ready.pop(0) if len(self._ready) > 1 else self._ready[0]


def turns(coro, state: FakeState | None = None) -> int:
    """How many times ``coro`` yields to the event loop before it returns (no loop needed
    for ``sleep(0)``-only coroutines); each yield advances ``state.turn``."""
    n = 0
    try:
        while True:
            coro.send(None)
            n += 1
            if state is not None:
                state.turn += 1
    except StopIteration:
        return n


def record_sleeps(monkeypatch) -> list[float]:
    slept: list[float] = []

    async def fake_sleep(delay: float) -> None:
        slept.append(delay)

    monkeypatch.setattr(asyncio, "sleep", fake_sleep)
    return slept


# --------------------------------------------------------------------------- batching


def test_caps_of_each_batching_policy():
    caps = {
        name: (p.max_queues, p.max_forwards, p.max_inflight)
        for name, p in {
            "adaptive": Adaptive(),
            "eager": Eager(),
            "k-only": KOnly(k=6),
            "t-only": TOnly(max_inflight=2),
        }.items()
    }
    assert caps == {
        "adaptive": (None, None, 1),
        "eager": (1, None, 1),
        "k-only": (None, 6, 1),
        "t-only": (None, None, 2),
    }
    assert all(isinstance(cls(), BatchPolicy) for cls in BATCH_POLICIES.values())


def test_adaptive_settles_while_commands_keep_coming():
    quiet = FakeState(lambda turn: 5)
    assert turns(Adaptive(settle_ticks=3).wait(quiet), quiet) == 3
    assert quiet.submitted_reads == 1 + 3
    # a new command on each of the first 4 turns: returns after the first quiet one
    busy = FakeState(lambda turn: min(turn, 4))
    assert turns(Adaptive(settle_ticks=3).wait(busy), busy) == 4 + 1
    endless = FakeState(lambda turn: turn)
    assert turns(Adaptive(settle_ticks=3, max_settle_ticks=10).wait(endless), endless) == 10
    assert turns(Adaptive(settle_ticks=0).wait(FakeState())) == 1


def test_eager_never_waits():
    state = FakeState()
    assert turns(Eager().wait(state)) == 0
    assert state.submitted_reads == state.ready_reads == 0


def test_k_only_waits_for_k_ready_or_gives_up(monkeypatch):
    assert turns(KOnly(k=4).wait(FakeState(ready=[4]))) == 0  # already k: no wait
    slept = record_sleeps(monkeypatch)
    ramp = FakeState(ready=[1, 2, 3, 4])
    asyncio.run(KOnly(k=4, t_ms=60_000).wait(ramp))
    assert ramp.ready_reads == 4 and slept == [1e-3] * 3  # polls every ms until 4 are ready
    slept.clear()
    asyncio.run(KOnly(k=4, t_ms=0.5).wait(FakeState(ready=[0])))
    assert slept and set(slept) == {0.5e-3}  # polls at the shorter interval


def test_k_only_gives_up_after_t_ms():
    t0 = time.perf_counter()
    asyncio.run(KOnly(k=4, t_ms=20).wait(FakeState(ready=[1])))
    assert time.perf_counter() - t0 >= 0.020  # the deadline, not the k, ended the wait


def test_t_only_waits_its_interval(monkeypatch):
    slept = record_sleeps(monkeypatch)
    state = FakeState()
    asyncio.run(TOnly(t_ms=7).wait(state))
    assert slept == [7e-3] and state.ready_reads == 0


def test_batch_policy_by_name():
    assert batch_policy("adaptive") == Adaptive()
    assert batch_policy("k-only", k=8, t_ms=2) == KOnly(k=8, t_ms=2)
    assert batch_policy("t-only", t_ms=3).describe() == "t-only (every 3 ms)"
    assert list(BATCH_POLICIES) == ["adaptive", "eager", "k-only", "t-only"]
    with pytest.raises(ValueError) as e:
        batch_policy("fastest")
    assert str(e.value) == (
        "unknown batching policy 'fastest' (one of adaptive, eager, k-only, t-only)"
    )
    with pytest.raises(ValueError) as e:
        batch_policy("adaptive", k=6)
    assert str(e.value) == (
        "batching policy 'adaptive' takes no parameter 'k' "
        "(it takes settle_ticks, max_settle_ticks, max_inflight)"
    )


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: KOnly(k=0), "k-only: k must be an integer >= 1, got 0"),
        (lambda: TOnly(t_ms=0), "t-only: t_ms must be a positive number, got 0"),
        (lambda: Eager(max_inflight=0), "eager: max_inflight must be an integer >= 1"),
        (lambda: Adaptive(settle_ticks=5, max_settle_ticks=2), "settle_ticks <= max_settle"),
    ],
)
def test_bad_batching_parameters_are_rejected(make, message):
    with pytest.raises(ValueError, match=message):
        make()


# --------------------------------------------------------------------------- schedule


def queue(instance: int, priority: int, *created: float) -> Queue:
    q = Queue(instance, qid=instance, priority=priority)
    for t in created:
        q.pending.append(fn_command(Stage.OUTPUT, lambda: None, created=t))
    return q


def test_fcfs_orders_by_priority_then_oldest_head():
    async def go():
        qs = [
            queue(0, 0, 5.0),
            queue(1, 0, 2.0, 1.0),  # the head counts, not the oldest command
            queue(2, 1, 9.0),
            queue(3, 0, 2.0),  # ties keep the given order
            queue(4, -1, 0.5),
            queue(5, 1, 3.0),
        ]
        return [q.instance for q in Fcfs().order(qs)], [q.instance for q in qs]

    order, untouched = asyncio.run(go())
    assert order == [5, 2, 1, 3, 0, 4]
    assert untouched == [0, 1, 2, 3, 4, 5]


class Reversed(SchedulePolicy):
    """Newest queue first; records what it is shown and told."""

    def __init__(self) -> None:
        self.shown: list[list[int]] = []
        self.done: list[tuple[list[int], float]] = []

    def order(self, ready):
        self.shown.append([q.instance for q in ready])
        return list(reversed(ready))

    def on_batch_done(self, batch, elapsed_s):
        self.done.append(([c.queue.instance for c in batch], elapsed_s))


def test_scheduler_follows_the_schedule_policy_and_reports_batches():
    async def go():
        policy = Reversed()
        s = BatchScheduler(_samples, max_batch_tokens=100, page_size=4, batching=Eager(),
                           schedule=policy)  # fmt: skip
        qs = [s.create_queue(i) for i in range(3)]
        futs = [s.submit(q, fn_command(Stage.OUTPUT, lambda i=i: Sample(i))) for i, q in
                enumerate(qs)]  # fmt: skip
        s.start()
        await asyncio.gather(*futs)
        await s.stop()
        return policy

    policy = asyncio.run(go())
    assert policy.shown[0] == [0, 1, 2]
    # Eager: one queue per batch, the one the policy put first
    assert [instances for instances, _ in policy.done] == [[2], [1], [0]]
    assert all(elapsed >= 0 for _, elapsed in policy.done)


async def _samples(batch):
    await asyncio.sleep(0)
    return [c.embed for c in batch]
