"""Admission order of waiting prefills: LPM, FCFS and random, composed with a schedule
policy, with the starvation guard — exact orders on hand-made queues; and which KV calls
of one queue may share a batch (a prefill's copy and masks do)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import numpy as np
import pytest

from commands import fn_command
from pastry.control.commands import Queue, Stage
from pastry.control.policies import (
    ADMISSION_POLICIES,
    CacheAwareSchedule,
    Fcfs,
    FirstComeFirstServed,
    LongestPrefixMatch,
    RandomOrder,
    admission_policy,
)


@dataclass(eq=False)
class Waiting:
    """Stands in for :class:`pastry.control.prefill.Admission`."""

    hit: int
    arrived: float
    seen: int | None = None
    starved: bool = False

    def cached(self) -> int:
        return self.hit


def queues(specs) -> list[Queue]:
    """One queue per spec: ``None`` (a queue whose head is not a prefill) or
    ``(cached tokens, arrival)``; head commands created in list order."""

    async def make():
        out = []
        for i, spec in enumerate(specs):
            q = Queue(instance=i, qid=i)
            cmd = fn_command(Stage.KV if spec else Stage.FORWARD, lambda: None)
            cmd.created = float(i)
            if spec is not None:
                cmd.admission = Waiting(*spec)
            q.pending.append(cmd)
            out.append(q)
        return out

    return asyncio.run(make())


def ids(order: list[Queue]) -> list[int]:
    return [q.qid for q in order]


def test_lpm_orders_prefills_by_cached_prefix_in_the_places_the_inner_policy_gives_them():
    qs = queues([(0, 0.0), None, (50, 1.0), (10, 2.0), None, (50, 3.0)])
    policy = CacheAwareSchedule(Fcfs(), LongestPrefixMatch())
    # prefill places are 0, 2, 3, 5 (FCFS); LPM fills them 50, 50 (ties: inner order), 10, 0
    assert ids(policy.order(qs)) == [2, 1, 5, 3, 4, 0]


def test_fcfs_and_random_orders():
    qs = queues([(9, 3.0), (0, 1.0), (5, 2.0)])
    assert ids(CacheAwareSchedule(Fcfs(), FirstComeFirstServed()).order(qs)) == [1, 2, 0]
    a = CacheAwareSchedule(Fcfs(), RandomOrder(seed=1)).order(qs)
    b = CacheAwareSchedule(Fcfs(), RandomOrder(seed=1)).order(qs)
    assert ids(a) == ids(b) and sorted(ids(a)) == [0, 1, 2]
    many = queues([(0, float(i)) for i in range(8)])
    orders = {tuple(ids(CacheAwareSchedule(Fcfs(), RandomOrder(s)).order(many))) for s in range(5)}
    assert len(orders) > 1


def test_the_inner_policy_still_decides_priorities():
    qs = queues([(0, 0.0), (90, 1.0), None])
    qs[2].priority = 5  # a high-priority queue keeps the first place
    qs[0].priority = 1  # and this prefill's place is before the other prefill's
    policy = CacheAwareSchedule(Fcfs(), LongestPrefixMatch())
    assert ids(policy.order(qs)) == [2, 1, 0]


def test_a_prefill_passed_over_for_max_wait_batches_goes_first():
    """Queue 0 never hits; every batch two new prefills that do arrive and are admitted."""
    policy = CacheAwareSchedule(Fcfs(), LongestPrefixMatch(), max_wait_batches=3)
    [stuck] = queues([(0, 0.0)])
    for batch in range(4):
        fresh = queues([None, (100, 1.0 + batch), (100, 2.0 + batch)])[1:]
        order = policy.order([stuck, *fresh])
        if batch < 3:
            assert order[-1] is stuck  # no hit: last
        else:
            assert order[0] is stuck and stuck.pending[0].admission.starved  # first now
            assert not any(q.pending[0].admission.starved for q in fresh)
        policy.on_batch_done([], 0.0)


def test_policies_by_name():
    assert set(ADMISSION_POLICIES) == {"lpm", "fcfs", "random"}
    assert isinstance(admission_policy("lpm"), LongestPrefixMatch)
    with pytest.raises(ValueError, match="one of lpm, fcfs, random"):
        admission_policy("sjf")
    with pytest.raises(ValueError, match="max_wait_batches"):
        CacheAwareSchedule(Fcfs(), LongestPrefixMatch(), max_wait_batches=0)


def test_kv_calls_of_one_queue_share_a_batch_unless_they_touch_the_same_page():
    from pastry.control.commands import conflicts
    from pastry.wire.calls import CopyKv, MaskKv, SwapIn, SwapOut, ids

    def cmd(call):
        async def make():
            c = fn_command(Stage.KV, lambda: call)
            c.call = call
            return c

        return asyncio.run(make())

    hidden = np.ones(4, dtype=np.bool_)
    earlier = [cmd(MaskKv(1, hidden)), cmd(CopyKv(2, 3, 0, 0, 4))]
    assert not conflicts(earlier, cmd(MaskKv(4, hidden)), 4)
    assert conflicts(earlier, cmd(MaskKv(3, hidden)), 4)  # the copy's destination
    assert conflicts(earlier, cmd(CopyKv(1, 5, 0, 0, 4)), 4)  # reads the masked page
    # a swap-out then a swap-in through the same host page: the engine runs swap-ins first
    out = [cmd(SwapOut(ids([6]), ids([0])))]
    assert conflicts(out, cmd(SwapIn(ids([0]), ids([7]))), 4)
    assert not conflicts(out, cmd(SwapIn(ids([1]), ids([7]))), 4)
