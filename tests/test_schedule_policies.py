"""Program-aware schedule policies in isolation (control/policies/mlfq.py, plas.py,
atlas.py, schedule.py): entry, demotion, anti-starvation, ranks, by name."""

from __future__ import annotations

import math

import pytest

from commands import fn_command
from pastry.control.commands import Queue, Stage
from pastry.control.policies import (
    SCHEDULES,
    Atlas,
    Fcfs,
    Levels,
    Mlfq,
    Plas,
    SchedulePolicy,
    schedule_policy,
)
from pastry.control.programs import ProcessTable


class World:
    """A process table on a settable clock, and queues with one pending command each."""

    def __init__(self, policy: SchedulePolicy) -> None:
        self.t = 0.0
        self.table = ProcessTable(clock=lambda: self.t)
        self.policy = policy
        policy.bind(self.table)

    def queue(self, instance: int) -> Queue:
        q = Queue(instance, qid=len(self.table.programs()) * 100 + instance)
        q.thread = self.table.open_thread(instance)
        return q

    def submit(self, q: Queue) -> None:
        q.pending.append(fn_command(Stage.FORWARD, lambda: None, created=self.t, future=None))
        self.table.arrive(q.thread, self.t)

    def run(self, queues: list[Queue], seconds: float) -> None:
        """Dispatch the head of each queue now and complete it ``seconds`` later."""
        self.table.dispatched([(q.thread, 1) for q in queues], self.t)
        for q in queues:
            q.pending.popleft()
        self.t += seconds
        self.table.completed([(q.thread, 1, True) for q in queues], seconds, self.t)

    def order(self, queues: list[Queue]) -> list[int]:
        return [q.instance for q in self.policy.order([q for q in queues if q.pending])]


def test_levels():
    lv = Levels.geometric(k=4, first=1.0, ratio=2.0)
    assert lv.bounds == (1.0, 2.0, 4.0) and lv.k == 4
    assert [lv.index(s) for s in (0, 0.99, 1.0, 3.9, 4.0, 1e9)] == [0, 0, 1, 2, 3, 3]
    assert [lv.quantum(i) for i in range(4)] == [1.0, 1.0, 2.0, math.inf]
    with pytest.raises(ValueError, match="must increase"):
        Levels((2.0, 1.0))
    with pytest.raises(ValueError, match="positive finite"):
        Levels((0.0,))
    with pytest.raises(ValueError, match="ratio"):
        Levels.geometric(ratio=1.0)


def test_mlfq_new_calls_enter_q1_and_move_down_as_they_use_quanta():
    w = World(Mlfq(Levels((1.0, 3.0))))
    a, b = w.queue(1), w.queue(2)
    w.submit(a)
    w.run([a], 2.5)  # 2.5 s: past Q1 (quantum 1), within Q2 (quantum 2)
    w.submit(a)
    w.submit(b)
    assert w.order([a, b]) == [2, 1]
    assert (a.thread.call.level, b.thread.call.level) == (1, 0)
    w.run([a], 0.5)  # 3 s in all: Q3
    w.submit(a)
    w.order([a])
    assert a.thread.call.level == 2 and a.thread.call.level_mark == 3.0


def test_plas_enters_by_program_service_and_fcfs_within_a_queue():
    w = World(Plas(Levels((1.0, 4.0)), beta=None))
    old, new1, new2 = w.queue(1), w.queue(2), w.queue(3)
    w.submit(old)
    w.run([old], 2.0)
    w.table.end_call(old.thread)  # program 1 has 2 s of service
    w.t = 10.0
    w.submit(new1)
    w.t = 11.0
    w.submit(old)  # enters Q2 (service 2 in [1, 4))
    w.submit(new2)
    assert w.order([old, new1, new2]) == [2, 3, 1]
    assert old.thread.call.level == 1 and new1.thread.call.entered == 10.0


def test_mlfq_puts_a_long_program_s_new_call_first_plas_does_not():
    """The paper's motivation: MLFQ treats each new call alike, PLAS remembers the program."""
    for policy, expect in ((Mlfq(Levels((1.0, 4.0))), [1, 2]), (Plas(Levels((1.0, 4.0))), [2, 1])):
        w = World(policy)
        long, short = w.queue(1), w.queue(2)
        w.submit(long)
        w.run([long], 3.0)
        w.table.end_call(long.thread)
        w.submit(long)  # long's second call arrives first
        w.t += 0.1
        w.submit(short)
        assert w.order([long, short]) == expect, policy.name


def test_atlas_enters_by_critical_path_not_by_summed_service():
    lv = Levels((1.0, 2.0, 4.0))
    w = World(Atlas(lv, beta=None))
    wide, deep = [w.queue(1) for _ in range(4)], w.queue(2)
    for q in wide:  # 4 parallel calls of 0.9 s: path 0.9, summed service 3.6
        w.submit(q)
    w.run(wide, 0.9)
    for q in wide:
        w.table.end_call(q.thread)
    w.submit(deep)
    w.run([deep], 1.5)  # one call of 1.5 s: path 1.5
    w.table.end_call(deep.thread)
    w.submit(wide[0])
    w.submit(deep)
    assert w.order([wide[0], deep]) == [1, 2]
    p = Plas(lv, beta=None)  # PLAS ranks the other way round
    p.bind(w.table)
    for q in (wide[0], deep):
        q.thread.call.level = -1
    assert [q.instance for q in p.order([wide[0], deep])] == [2, 1]


def test_anti_starvation_promotes_and_resets_only_the_call_counters():
    w = World(Plas(Levels((1.0, 2.0)), beta=2.0))
    starved, hog = w.queue(1), w.queue(2)
    w.submit(starved)
    w.run([starved], 3.0)  # 3 s of service: Q3 by quanta
    w.table.end_call(starved.thread)
    p = starved.thread.program
    w.submit(starved)
    w.submit(hog)
    w.order([starved, hog])
    assert starved.thread.call.level == 2
    w.run([hog], 5.0)  # starved waits 5 s: (0 + 5) / (3 + 0) < 2
    w.submit(hog)
    w.order([starved, hog])
    assert starved.thread.call.level == 2
    w.run([hog], 2.0)  # 7 s waiting: 7 / 3 >= 2 -> Q1, W_c and T_c restart
    w.submit(hog)
    assert w.order([starved, hog])[0] == 1
    c = starved.thread.call
    assert (c.level, c.wait, c.run, c.promoted) == (0, 0.0, 0.0, w.t)
    assert starved.thread.current_wait(w.t) == 0.0 and c.waited == 0.0  # still queued
    assert p.service == 3.0  # the program keeps its service and wait
    w.run([starved], 0.5)
    assert c.waited == 7.0 and c.wait == 0.0 and c.model_time == 0.5


def test_anti_starvation_needs_service_to_divide_by():
    w = World(Plas(Levels((1.0,)), beta=0.1))
    q = w.queue(1)
    w.submit(q)
    w.t = 100.0
    w.order([q])  # waited 100 s with no service at all: left where it is (Q1 anyway)
    assert q.thread.call.level == 0 and q.thread.call.promoted == -math.inf


def test_fcfs_is_non_preemptive_at_the_call_level():
    w = World(Fcfs())
    first, second = w.queue(1), w.queue(2)
    w.submit(first)
    w.t = 1.0
    w.submit(second)
    w.run([first], 1.0)
    w.submit(first)  # its next step: newer than second's head, but its call came first
    assert w.order([first, second]) == [1, 2]


def test_ranks_for_preemption():
    w = World(Plas(Levels((1.0,))))
    busy, idle, low = w.queue(1), w.queue(2), w.queue(3)
    w.submit(low)
    w.run([low], 2.0)
    w.table.end_call(low.thread)
    for q in (busy, idle, low):
        w.submit(q)
    w.order([busy, idle, low])
    w.run([idle], 0.1)  # idle ran, then queued nothing: it is in an interrupt
    ranks = {q.instance: w.policy.rank(q.thread.program) for q in (busy, idle, low)}
    assert ranks[1] < ranks[3] < ranks[2]
    assert Fcfs().rank(busy.thread.program) < Fcfs().rank(idle.thread.program)


def test_schedule_policy_by_name():
    assert SCHEDULES == ("fcfs", "mlfq", "plas", "atlas")
    made = {name: schedule_policy(name) for name in SCHEDULES}
    assert [type(p) for p in made.values()] == [Fcfs, Mlfq, Plas, Atlas]
    assert schedule_policy("plas", beta=None).beta is None
    assert made["atlas"].describe().startswith("atlas (8 queues")
    with pytest.raises(ValueError, match="unknown schedule policy 'sjf' \\(one of fcfs, mlfq"):
        schedule_policy("sjf")
    with pytest.raises(ValueError, match=r"schedule policy 'plas': .*quantum"):
        schedule_policy("plas", quantum=3)
    with pytest.raises(ValueError, match="beta"):
        Plas(beta=0)


@pytest.mark.parametrize("name", SCHEDULES)
def test_queue_priority_orders_queues_under_every_policy(name):
    """``set_queue_priority``: FCFS by priority, then arrival; the multilevel policies by
    level first, then priority, then entry into the level."""
    w = World(schedule_policy(name))
    qs = [w.queue(i) for i in range(4)]
    for q in qs:  # arrivals in instance order, all in the first level
        w.submit(q)
        w.t += 0.01
    qs[1].priority, qs[2].priority, qs[3].priority = 5, -1, 5
    assert w.order(qs) == [1, 3, 0, 2]
    if name == "fcfs":
        return
    w.run([qs[1]], 5.0)  # instance 1 used a level's worth of service: it moves down
    w.submit(qs[1])
    assert w.order(qs) == [3, 0, 2, 1]  # a lower level first, whatever its priority


def test_set_queue_priority_is_the_schedulers():
    """The scheduler's door for it (the API handler's) sets what every policy reads."""
    import asyncio

    from pastry.control.scheduler import BatchScheduler

    async def go():
        s = BatchScheduler(lambda calls: None, 100, 4, schedule=Plas())
        q = s.create_queue(1)
        s.set_priority(q, 7)
        return q.priority

    assert asyncio.run(go()) == 7
