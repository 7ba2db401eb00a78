"""KV swap: the resource manager's bookkeeping (exact page ids), the swapper's rules, and
the engine's one-gather swap over every layer."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from commands import fn_command
from inferlet_util import load_engine
from pastry.control.policies import Fcfs
from pastry.control.policies.memory import MemoryAdmission
from pastry.control.programs import ProcessTable
from pastry.control.resources import OutOfResources, ResourceError, ResourceManager
from pastry.control.swap import KvSwapper
from pastry.wire.calls import SwapIn, SwapOut, ids


def manager(pages=6, host=4) -> ResourceManager:
    res = ResourceManager(pages, 8, num_host_pages=host)
    for inst in (1, 2):
        res.add_instance(inst)
    return res


def test_swap_out_and_in_keep_handles_and_record_moves():
    res = manager()
    a = res.alloc(1, "kv", 3)  # pages 0, 1, 2
    res.alloc(2, "kv", 1)  # page 3
    assert res.swappable(1) == 3
    assert res.swap_out(1, 2) == 2  # newest handles first: pages 2, 1 -> host 0, 1
    assert res.translate(1, "kv", a) == [0, -2, -1]
    assert res.handles_on_host(1) == 2 and res.pages_on_host(1) == 2
    assert res.usage("kv") == (4, 2, 6) and res.host_usage() == (2, 2, 4)
    res.check_integrity()
    assert res.take_moves() == ([(2, 0), (1, 1)], [])
    assert res.swap_in(1) == 2  # the lowest free device pages, in handle order
    assert res.translate(1, "kv", a) == [0, 1, 2]  # same handles (pages may differ)
    assert res.host_usage() == (2, 2, 4)  # host pages held until the copies are sent
    res.check_integrity()
    assert res.take_moves() == ([], [(1, 1), (0, 2)])
    assert res.host_usage() == (4, 0, 4)
    res.check_integrity()


def test_shared_and_exported_pages_stay_on_the_device():
    res = manager()
    a = res.alloc(1, "kv", 3)
    res.export(1, "kv", [a[0]], "doc")
    got = res.import_(2, "kv", "doc")
    assert got and res.swappable(1) == 2
    res.swap_out(1)
    assert res.translate(1, "kv", a)[0] == 0  # exported and imported: stays
    with pytest.raises(ResourceError, match="swapped out"):
        res.export(1, "kv", [a[1]], "other")
    res.check_integrity()


def test_a_short_alloc_is_deferred_to_host_pages_with_nothing_to_copy():
    res = manager(pages=2, host=4)
    res.defer_when_short = True
    res.alloc(1, "kv", 2)
    h = res.alloc(2, "kv", 2)  # device full: starts on host pages 0, 1
    assert res.translate(2, "kv", h) == [-1, -2] and res.usage("kv")[0] == 0
    res.free(1, "kv", [0, 1])
    assert res.swap_in(2) == 2
    assert res.take_moves() == ([], [])  # nothing was ever written there
    res.check_integrity()
    # host full too: the last resort (no terminate callback here) refuses
    res.alloc(1, "kv", 0)
    with pytest.raises(OutOfResources):
        res.alloc(1, "kv", 5)


def test_releases_of_host_pages_wait_for_the_pending_moves():
    res = manager(pages=4, host=2)
    res.alloc(1, "kv", 2)
    res.swap_out(1)  # host 0, 1 hold instance 1's pages; the copies are pending
    res.remove_instance(1)  # its host pages are released, but held until the copies go
    assert res.host_usage() == (0, 2, 2)
    res.alloc(2, "kv", 4)
    assert res.swap_out(2) == 0  # no host page may be reused before the moves are sent
    res.check_integrity()
    out, _ = res.take_moves()
    assert out == [(1, 0), (0, 1)] and res.host_usage() == (2, 0, 2)
    assert res.swap_out(2, 1) == 1
    res.check_integrity()


def test_free_and_remove_of_swapped_handles():
    res = manager()
    a = res.alloc(1, "kv", 2)
    res.swap_out(1)
    res.take_moves()
    res.free(1, "kv", [a[0]])
    assert res.handles_on_host(1) == 1 and res.host_usage()[1] == 1
    res.remove_instance(1)
    assert res.host_usage() == (4, 0, 4) and res.usage("kv") == (6, 0, 6)
    res.check_integrity()


def test_swap_in_without_room_changes_nothing():
    res = manager(pages=3, host=4)
    res.alloc(1, "kv", 2)
    res.swap_out(1)
    res.take_moves()
    res.alloc(2, "kv", 2)
    with pytest.raises(OutOfResources, match="swapped pages back"):
        res.swap_in(1)
    assert res.handles_on_host(1) == 2
    res.check_integrity()


class FakeScheduler:
    """What the swapper reads of a scheduler."""

    def __init__(self) -> None:
        self.programs = ProcessTable(clock=lambda: self.now)
        self.schedule = Fcfs()
        self.schedule.bind(self.programs)
        self.now = 0.0
        self.busy: set[int] = set()
        self.swapper = None

        class Stats:
            batches = 0

        self.stats = Stats()

    def busy_instances(self) -> set[int]:
        return set(self.busy)


def swapper_world(pages=4, host=8, min_resident=2, admission=None):
    """A swapper over 3 programs; without admission by memory unless given (the tests of
    the base rules: ranks, residency, the last resort)."""
    res = ResourceManager(pages, 8, num_host_pages=host)
    sched = FakeScheduler()
    sw = KvSwapper(res, sched, min_resident=min_resident, admission=admission)
    for inst in (1, 2, 3):
        res.add_instance(inst)
        sched.programs.start(inst)
    return res, sched, sw


def activate(sched, inst, at):
    t = sched.programs.open_thread(inst)
    sched.now = at
    sched.programs.arrive(t, at)
    return t


def test_only_strictly_better_ranked_programs_take_memory():
    res, sched, sw = swapper_world()
    res.alloc(1, "kv", 2)
    res.alloc(2, "kv", 2)
    activate(sched, 1, 0.0)  # FCFS: 1 first, then 2, then 3
    activate(sched, 2, 1.0)
    activate(sched, 3, 2.0)
    res.alloc(3, "kv", 2)  # deferred
    assert not sw.ensure_resident(3)  # 1 and 2 rank before 3: nobody gives way
    assert res.handles_on_host(3) == 2 and sw.stats.swap_outs == 0
    sched.programs.close_thread(sched.programs.program_of(2).threads[0])  # 2 goes idle
    assert sw.ensure_resident(3)  # now 2 ranks last: it gives way
    assert res.handles_on_host(2) == 2 and res.handles_on_host(3) == 0
    out, into = res.take_moves()
    assert len(out) == 2 and into == []  # 3's pages were deferred: nothing to copy in
    assert [c.__class__ for c in sw.take_calls()] == []
    res.check_integrity()


def test_busy_programs_and_recently_returned_ones_keep_their_pages():
    res, sched, sw = swapper_world(pages=4, host=8, min_resident=2)
    res.alloc(1, "kv", 4)
    res.alloc(2, "kv", 1)  # deferred
    activate(sched, 2, 0.0)  # 2 is active, 1 idle: 1 should give way...
    sched.busy = {1}  # ...but it has commands on the engine
    assert not sw.ensure_resident(2)
    sched.busy = set()
    assert sw.ensure_resident(2)
    calls = sw.take_calls()
    assert [type(c) for c in calls] == [SwapOut]
    assert sw.ensure_resident(1) is False  # 1 is idle: it ranks last, takes nobody's memory
    activate(sched, 1, 1.0)
    sched.programs.close_thread(sched.programs.program_of(2).threads[0])
    assert not sw.ensure_resident(1)  # 1 active, 2 idle, but 2 came back < 2 batches ago
    sched.stats.batches = 2
    assert sw.ensure_resident(1) and res.handles_on_host(2) == 1
    res.check_integrity()


def test_forced_residency_ignores_ranks_then_terminates_as_the_last_resort():
    res, sched, sw = swapper_world(pages=4, host=8)
    ended = []
    res.on_terminate = lambda inst, reason: ended.append(inst)
    res.alloc(1, "kv", 3)
    activate(sched, 1, 0.0)
    res.alloc(2, "kv", 4)  # deferred; 1 ranks first and is busy
    activate(sched, 2, 1.0)
    assert not sw.ensure_resident(2)
    assert sw.ensure_resident(2, force=True)  # 1 gives way (ranks ignored)
    assert sw.stats.forced == 1 and res.handles_on_host(1) == 3
    res.take_moves()
    res.alloc(3, "kv", 5)  # more than the device: even by force it cannot fit
    activate(sched, 3, 2.0)
    with pytest.raises(OutOfResources):
        sw.ensure_resident(3, force=True)
    res.check_integrity()


def test_admission_by_memory_never_pushes_out_a_waiting_program_for_an_out_one():
    res, sched, sw = swapper_world(pages=4, host=8, min_resident=0, admission=MemoryAdmission())
    res.alloc(1, "kv", 3)
    activate(sched, 2, 0.0)  # FCFS: 2 ranks first, then 1
    activate(sched, 1, 1.0)
    res.alloc(2, "kv", 2)  # deferred: 2 is out (none of its own pages on the device)
    # 1 waits for a batch: without admission it would give way to 2 (it ranks after it)
    sw.new_pass()
    assert not sw.ensure_resident(2)
    assert res.handles_on_host(1) == 0 and res.handles_on_host(2) == 2
    assert sw.stats.held_back == 1 and sw.stats.swap_outs == 0
    # 1 goes idle (a tool call): now it gives way, and only as many pages as 2 needs
    sched.programs.close_thread(sched.programs.program_of(1).threads[0])
    sw.new_pass()
    assert sw.ensure_resident(2)
    assert res.handles_on_host(1) == 1 and res.handles_on_host(2) == 0
    assert [type(c) for c in sw.take_calls()] == [SwapOut]  # 2's pages were deferred
    res.check_integrity()
    # without admission by memory the waiting program gives way at once
    res, sched, sw = swapper_world(pages=4, host=8, min_resident=0)
    res.alloc(1, "kv", 3)
    activate(sched, 2, 0.0)
    activate(sched, 1, 1.0)
    res.alloc(2, "kv", 2)
    assert sw.ensure_resident(2) and res.handles_on_host(1) == 1


def test_admission_by_memory_head_of_line_keeps_the_policy_order():
    # 2 (first in the order) needs 3 pages, 3 needs 1; 1 page is free; 1 waits for a batch
    adm = MemoryAdmission(head_of_line=True)
    res, sched, sw = swapper_world(pages=4, host=8, min_resident=0, admission=adm)
    held = res.alloc(1, "kv", 4)
    for inst, at in ((1, 0.0), (2, 1.0), (3, 2.0)):
        activate(sched, inst, at)
    res.alloc(2, "kv", 3)  # deferred
    res.alloc(3, "kv", 1)  # deferred
    res.free(1, "kv", held[:1])
    sw.new_pass()
    assert not sw.ensure_resident(2)
    assert not sw.ensure_resident(3)  # it would fit, but 2 is first: the page is saved up
    assert sw.stats.held_back == 2
    # outside the scheduler's passes (no order to keep) each is judged on its own
    sw.take_calls()
    assert sw.ensure_resident(3)
    # 1 ends: its pages go to 2 at the next pass
    sched.programs.close_thread(sched.programs.program_of(1).threads[0])
    res.remove_instance(1)
    sw.new_pass()
    assert sw.ensure_resident(2) and res.handles_on_host(2) == 0
    assert "head-of-line" in adm.describe()
    res.check_integrity()
    # by default (not head-of-line) 3 passes 2 in the same pass
    res, sched, sw = swapper_world(pages=4, host=8, min_resident=0, admission=MemoryAdmission())
    held = res.alloc(1, "kv", 4)
    for inst, at in ((1, 0.0), (2, 1.0), (3, 2.0)):
        activate(sched, inst, at)
    res.alloc(2, "kv", 3)
    res.alloc(3, "kv", 1)
    res.free(1, "kv", held[:1])
    sw.new_pass()
    assert not sw.ensure_resident(2) and sw.ensure_resident(3)
    res.check_integrity()


def test_a_program_that_is_in_still_takes_pages_for_its_growth():
    # 1 is in (its pages on the device) and its next forward's page was allocated short:
    # it takes it from 2, which ranks after it, although 2 is waiting for a batch
    res, sched, sw = swapper_world(pages=4, host=8, min_resident=0, admission=MemoryAdmission())
    res.alloc(1, "kv", 2)
    res.alloc(2, "kv", 2)
    activate(sched, 1, 0.0)
    activate(sched, 2, 1.0)
    res.alloc(1, "kv", 1)  # deferred
    sw.new_pass()
    assert sw.ensure_resident(1)
    assert res.handles_on_host(1) == 0 and res.handles_on_host(2) == 1
    res.check_integrity()


def test_admission_by_memory_waits_for_programs_to_be_idle_long_enough():
    adm = MemoryAdmission(min_idle_s=5.0)
    res, sched, sw = swapper_world(pages=4, host=8, min_resident=0, admission=adm)
    res.alloc(1, "kv", 4)
    t = activate(sched, 1, 0.0)
    sched.programs.dispatched([(t, 1)], 0.0)
    sched.programs.completed([(t, 1, True)], 1.0, 1.0)
    sched.programs.end_call(t, 1.0)  # idle since 1.0
    activate(sched, 2, 2.0)
    res.alloc(2, "kv", 2)
    sw.new_pass()
    assert not sw.ensure_resident(2)  # 1 has been idle for 1 s
    sched.now = 6.0
    sw.new_pass()
    assert sw.ensure_resident(2) and res.handles_on_host(1) == 2
    assert adm.describe().startswith("admission by memory")
    with pytest.raises(ValueError, match="min_idle_s"):
        MemoryAdmission(min_idle_s=-1.0)
    res.check_integrity()


def test_the_engine_swaps_every_layer_and_the_slot_state_in_one_call(make_tiny):
    eng = load_engine(make_tiny("llama"), num_pages=8, num_host_pages=4, page_size=4)
    kv = eng.kv
    g = torch.Generator().manual_seed(0)
    kv.data.copy_(torch.randn(kv.data.shape, generator=g))
    kv.positions.copy_(torch.arange(len(kv.positions)))
    kv.attendable[:] = torch.rand(len(kv.attendable), generator=g) > 0.5
    before = (kv.data.clone(), kv.positions.clone(), kv.attendable.clone())
    pages = [5, 2]
    slots = np.concatenate([np.arange(p * 4, p * 4 + 4) for p in pages])
    assert eng.execute([SwapOut(ids(pages), ids([3, 0]))]) == [None]
    kv.data.zero_()
    kv.positions.zero_()
    kv.attendable[:] = False
    assert eng.execute([SwapIn(ids([0, 3]), ids([1, 6]))]) == [None]  # to other pages
    back = np.concatenate([np.arange(p * 4, p * 4 + 4) for p in (6, 1)])
    assert torch.equal(kv.data[:, :, back], before[0][:, :, slots])
    assert torch.equal(kv.positions[back], before[1][slots])
    assert torch.equal(kv.attendable[back], before[2][slots])
    assert all(k.data_ptr() == kv.data[i].data_ptr() for i, k in enumerate(kv.k))  # views


def test_a_full_batch_does_not_bring_back_a_program_it_cannot_take():
    """With the batch's forward slots taken, a swapped-out program's forward waits and its
    pages stay on the host (bringing them back would cost a copy and evict others for a
    batch it is not in)."""
    import asyncio

    from pastry.control.commands import Stage
    from pastry.control.scheduler import BatchScheduler

    async def never(calls):
        raise AssertionError("not dispatched in this test")

    async def go():
        res = ResourceManager(4, 8, num_host_pages=8)
        s = BatchScheduler(never, 100, 4, schedule=Fcfs(), max_batch=1)
        KvSwapper(res, s, min_resident=0)
        for inst in (1, 2):
            res.add_instance(inst)
            s.programs.start(inst)
        res.alloc(1, "kv", 2)
        res.alloc(2, "kv", 2)
        assert res.swap_out(2) == 2
        res.take_moves()
        for inst in (1, 2):
            s.submit(s.create_queue(inst), fn_command(Stage.FORWARD, lambda: None, tokens=1))
        batch = s.take_batch()
        res.check_integrity()
        return [c.queue.instance for c in batch], res.handles_on_host(2)

    assert asyncio.run(go()) == ([1], 2)


def test_the_scheduler_admits_by_memory_instead_of_pushing_out_a_waiting_program():
    """The real scheduler with the swapper: program 2 (first in FCFS order) has its pages on
    the host; program 1 holds the device and waits for the same batch. Admission by memory
    keeps 2 waiting and runs 1; without it, 2 pushes 1 out and runs instead."""
    import asyncio

    from pastry.control.commands import Stage
    from pastry.control.scheduler import BatchScheduler

    async def never(calls):
        raise AssertionError("not dispatched in this test")

    async def go(admission):
        res = ResourceManager(4, 8, num_host_pages=8)
        s = BatchScheduler(never, 100, 4, schedule=Fcfs())
        sw = KvSwapper(res, s, min_resident=0, admission=admission)
        for inst in (1, 2):
            res.add_instance(inst)
            s.programs.start(inst)
        res.alloc(1, "kv", 3)
        res.alloc(2, "kv", 2)  # deferred: 2 is out
        for inst in (2, 1):
            s.submit(s.create_queue(inst), fn_command(Stage.FORWARD, lambda: None, tokens=1))
        batch = s.take_batch()
        moved = [type(c) for c in sw.take_calls()]
        res.check_integrity()
        return [c.queue.instance for c in batch], res.handles_on_host(2), moved

    assert asyncio.run(go(MemoryAdmission())) == ([1], 2, [])
    assert asyncio.run(go(None)) == ([2], 0, [SwapOut])


def test_a_page_with_several_handles_of_one_program_moves_once():
    res = manager()
    a = res.alloc(1, "kv", 2)  # pages 0, 1
    res.export(1, "kv", [a[0]], "self")
    again = res.import_(1, "kv", "self")  # a second handle of page 0
    assert res.swappable(1) == 1  # page 0 is also the export's
    res.unexport(1, "self")
    assert res.swappable(1) == 2  # both of page 0's references are instance 1's
    assert res.swap_out(1, 1) == 1  # newest handles first: page 0
    assert res.translate(1, "kv", [a[0], *again, a[1]]) == [-1, -1, 1]
    assert res.handles_on_host(1) == 2 and res.pages_on_host(1) == 1
    res.check_integrity()
    assert res.swap_in(1) == 1
    assert len(set(res.translate(1, "kv", [a[0], *again]))) == 1
    res.check_integrity()
