"""Preemption that keeps KV: moving programs' pages between device and host memory.

A program the schedule policy does not put into a batch is preempted: its commands wait,
its KV pages stay where they are. When the device runs out of KV pages, the
:class:`KvSwapper` of that model moves pages of preempted programs to the engine's host
pool, and brings a program's pages back before its commands are taken into a batch. The
inferlet never notices: its handles keep their numbers (the
:class:`~pastry.control.resources.ResourceManager` maps each one to a device page or a host
page), and its next forward finds its context where it left it.

- **When memory is short.** An ``alloc`` the device cannot meet is deferred (its pages
  start in host memory, with nothing to copy). When the scheduler is about to take a
  program's commands and some of its pages are on the host, :meth:`KvSwapper.ensure_resident`
  frees device pages by swapping out lower-ranked programs, then swaps the program in; if
  that is not possible, the program stays preempted for this batch.
- **Who gives way** (:meth:`~pastry.control.policies.SchedulePolicy.rank`): programs with
  nothing in the batch being formed or on the engine, that rank strictly after the program
  that needs the memory (idle programs, e.g. in a tool call, before waiting ones; then by
  the policy's priority), the last-ranked first; only the pages they alone reference
  (shared and exported pages stay).
- **Bounded swapping (no thrashing).** (1) Memory only flows to a strictly better-ranked
  program, so two programs cannot take it from each other back and forth unless their
  ranks change; (2) a program brought back stays at least ``min_resident`` batches before
  it may be swapped out again. So each page moves out at most once per ``min_resident``
  batches, and a swap-out always serves a more important program.
- **Admission by memory** (:class:`~pastry.control.policies.memory.MemoryAdmission`): a
  program none of whose own pages are on the device (a new program allocated short of
  device pages, or one swapped out) comes in only when its pages fit in the free device
  pages plus those of idle programs that rank after it; it never pushes out a program
  that is waiting for a batch (optionally, the first one that does not fit stops the
  others after it in the policy's order for this pass). So the device does not hold more
  working programs than fit, and swapped-out programs wait instead of thrashing.
  ``admission=None``: the rules above only.
- **Last resort.** If nothing can run (no batch could be formed and nothing is on the
  engine) and the best-ranked swapped-out program still cannot come back, it is brought
  back by force: any program not running gives way, ignoring ranks and residency; if even
  that is not enough (its pages exceed what can be freed), the eviction policy
  (``TerminateNewest``: the newest programs end) runs as before swapping existed.
- **The copies.** All moves recorded since the last batch go to the engine at the front
  of the next batch as one ``SwapOut`` (one gather of the pages' K/V over every layer into
  one buffer, one bulk copy into the host pool) and one ``SwapIn`` (the reverse), out
  before in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pastry.control.policies.memory import MemoryAdmission
from pastry.control.resources import ResourceManager
from pastry.control.scheduler import BatchScheduler
from pastry.wire.calls import Call, SwapIn, SwapOut, ids

MIN_RESIDENT_BATCHES = 8


@dataclass
class SwapStats:
    pages_out: int = 0
    pages_in: int = 0  # pages that came back with data (deferred allocs not counted)
    swap_outs: int = 0  # programs swapped out (one event per program per call)
    swap_ins: int = 0
    forced: int = 0  # last-resort swap-ins
    held_back: int = 0  # times an out program was refused admission (memory too short)


class KvSwapper:
    """Swaps KV pages of one model's programs between device and host (see the module
    docstring). Installs itself on ``resources`` (deferred allocs) and ``scheduler``.
    ``admission``: the admission-by-memory rule (None: none)."""

    def __init__(
        self,
        resources: ResourceManager,
        scheduler: BatchScheduler,
        min_resident: int = MIN_RESIDENT_BATCHES,
        admission: MemoryAdmission | None = MemoryAdmission(),  # noqa: B008 (frozen)
    ) -> None:
        if not isinstance(min_resident, int) or min_resident < 0:
            raise ValueError(f"min_resident must be an integer >= 0, got {min_resident!r}")
        self.resources = resources
        self.scheduler = scheduler
        self.min_resident = min_resident
        self.admission = admission
        self.stats = SwapStats()
        self._back_at: dict[int, int] = {}  # instance -> batch number when it came back
        # This pass's candidates to give way, (rank, instance) worst last, and the
        # instances made resident in it (see new_pass)
        self._victims: list[tuple[tuple[float, ...], int]] | None = None
        self._ranks: dict[int, tuple[float, ...]] = {}
        self._taken: set[int] = set()
        # ... of them, those idle (admission by memory: they give way to out programs),
        # whether each program is idle, and the candidates dropped from both lists
        self._idle_victims: list[tuple[tuple[float, ...], int]] | None = None
        self._idle: dict[int, bool] = {}
        self._gone: set[int] = set()
        self._held_back = False  # an out program waits for memory in this pass
        self._idle_total: int | None = None  # this pass's idle programs' swappable pages
        self._in_pass = False
        resources.defer_when_short = True
        scheduler.swapper = self

    def new_pass(self) -> None:
        """The scheduler starts a pass over the ready queues (one ``form_batch``): ranks,
        which programs are busy or too recently back to give way, and which are idle
        (admission by memory) are taken once per pass (at its first shortage), so that a
        pass costs O(programs) however many programs it swaps. Programs made resident
        during the pass count as busy. The pass lasts until the batch's copies are taken
        (:meth:`take_calls`); outside a pass every shortage takes them afresh."""
        self._in_pass = True
        alive = self.resources.instances()
        if len(self._back_at) > 2 * len(alive) + 64:  # forget ended instances
            alive = set(alive)
            self._back_at = {i: b for i, b in self._back_at.items() if i in alive}
        self._forget_candidates()
        self._ranks.clear()
        self._taken.clear()
        self._idle.clear()
        self._held_back, self._idle_total = False, None

    def ensure_resident(self, instance: int, force: bool = False) -> bool:
        """Whether ``instance``'s pages are all on the device now, after swapping it in
        (and others out) if the rules allow. ``force``: the last resort (see the module
        docstring); may raise :class:`~pastry.control.resources.OutOfResources`."""
        res = self.resources
        if not res.handles_on_host(instance):
            self._taken.add(instance)
            return True
        need = res.pages_on_host(instance)
        out = not force and self.admission is not None and not res.swappable(instance)
        if out and not self._admit(instance, need):  # admission by memory
            return False
        short = need - res.available("kv")  # (unused prefix-cache pages are evicted first)
        if short > 0:
            self._make_room(instance, short, force)
        if res.available("kv") < need:
            if not force:
                return False
            res.reclaim(instance, "kv", need)  # terminate others (or raise)
        moved = res.swap_in(instance)
        self._taken.add(instance)
        if moved:
            self.stats.swap_ins += 1
            self.stats.forced += force
        self._back_at[instance] = self.scheduler.stats.batches
        return True

    def _admit(self, instance: int, need: int) -> bool:
        """Admission by memory for an out program (none of its own pages on the device):
        whether its ``need`` pages fit in the free pages, after idle programs that rank
        after it gave way (only if that is enough); refused, it holds back the out
        programs after it in this pass if the rule is head-of-line."""
        adm, res = self.admission, self.resources
        assert adm is not None
        if self._in_pass and self._held_back:
            self.stats.held_back += 1
            return False
        short = need - res.available("kv")
        if short > 0 and self._idle_pages() >= short:
            before = res.available("kv")
            self._make_room(instance, short, False, idle_only=True)
            assert self._idle_total is not None
            self._idle_total -= res.available("kv") - before
        if need <= res.available("kv"):
            return True
        self._held_back = self._in_pass and adm.head_of_line
        self.stats.held_back += 1
        return False

    def make_room(self, requester: int, pages: int) -> None:
        """Swap out up to about ``pages`` device pages of programs that rank after
        ``requester`` (and are not in a batch), as the rules allow: what an allocation
        that cannot wait for its pages does (the cache-aware prefill,
        :mod:`pastry.control.prefill`, admitted short of pages)."""
        if pages > 0:
            self._make_room(requester, pages, False)

    def take_calls(self) -> list[Call]:
        """The engine calls for the moves recorded since the last batch (out, then in)."""
        self._in_pass = False
        out, into = self.resources.take_moves()
        calls: list[Call] = []
        if out:
            calls.append(SwapOut(ids([d for d, _ in out]), ids([h for _, h in out])))
            self.stats.pages_out += len(out)
        if into:
            calls.append(SwapIn(ids([h for h, _ in into]), ids([d for _, d in into])))
            self.stats.pages_in += len(into)
        return calls

    def _make_room(self, requester: int, needed: int, force: bool, idle_only: bool = False) -> None:
        res = self.resources
        if not self._in_pass:  # a call outside the scheduler's passes
            self.new_pass()
            self._in_pass = False
        if force:  # the last resort: anyone not running, whatever its rank or residency
            busy = self.scheduler.busy_instances() | self._taken
            ranked = [
                (self._rank(i), i) for i in res.instances() if i != requester and i not in busy
            ]
            for _, inst in sorted(ranked, reverse=True):  # the last-ranked first
                if needed <= 0:
                    break
                if n := res.swap_out(inst, needed):
                    needed -= n
                    self.stats.swap_outs += 1
            self._forget_candidates()  # taken afresh
            return
        # Admission by memory: only idle programs give way, so walk only them (the same
        # order: a sublist of the candidates, by rank)
        victims = self._idle_candidates() if idle_only else self._candidates()
        mine = self._ranks.get(requester) or self._rank(requester)
        taken, gone = self._taken, self._gone
        i = len(victims) - 1
        while needed > 0 and i >= 0:  # the last-ranked first
            rank, inst = victims[i]
            if not rank > mine:
                break  # (sorted: nobody before it ranks after the requester)
            if inst in gone or inst in taken:  # (taken: made resident in this pass, it is
                gone.add(inst)  # in the batch; gone: dropped from the other list)
                del victims[i]
            elif inst != requester:
                n = res.swap_out(inst, needed)
                if n:
                    self.stats.swap_outs += 1
                if n < needed:  # nothing left to move: never a candidate again this pass
                    gone.add(inst)
                    del victims[i]
                needed -= n
            i -= 1

    def _gives_way(self, instance: int) -> bool:
        """Whether ``instance``'s program is idle (admission by memory), taken once per
        pass."""
        idle = self._idle.get(instance)
        if idle is None:
            programs, adm = self.scheduler.programs, self.admission
            program = programs.program_of(instance)
            idle = (
                program is not None and adm is not None and adm.gives_way(program, programs.clock())
            )
            if self._in_pass:
                self._idle[instance] = idle
        return idle

    def _idle_pages(self) -> int:
        """Device pages that this pass's idle candidates could give, counted once per pass
        (an admission that cannot be met with them swaps nobody out). Idle programs rank
        after waiting ones under every built-in policy; with a policy whose ranks mix them,
        :meth:`_make_room` may find fewer that rank after the requester."""
        if self._idle_total is None or not self._in_pass:
            self._idle_total = sum(
                self.resources.swappable(inst) for _, inst in self._idle_candidates()
            )
        return self._idle_total

    def _idle_candidates(self) -> list[tuple[tuple[float, ...], int]]:
        """This pass's candidates whose programs are idle, by rank (the last-ranked last)."""
        if self._idle_victims is None or not self._in_pass:
            gone = self._gone
            self._idle_victims = [
                v for v in self._candidates() if v[1] not in gone and self._gives_way(v[1])
            ]
        return self._idle_victims

    def _forget_candidates(self) -> None:
        self._victims = self._idle_victims = None
        self._gone.clear()

    def _candidates(self) -> list[tuple[tuple[float, ...], int]]:
        """This pass's programs that may give way, by rank (the last-ranked last): not in
        a batch or on the engine, back for at least ``min_resident`` batches."""
        if self._victims is None:
            busy = self.scheduler.busy_instances()
            now, back = self.scheduler.stats.batches, self._back_at
            victims = []
            for inst in self.resources.instances():
                if inst in busy or now - back.get(inst, -math.inf) < self.min_resident:
                    continue
                rank = self._rank(inst)
                self._ranks[inst] = rank
                victims.append((rank, inst))
            victims.sort()
            self._victims = victims
        return self._victims

    def _rank(self, instance: int) -> tuple[float, ...]:
        p = self.scheduler.programs.program_of(instance)
        return self.scheduler.schedule.rank(p) if p is not None else (2.0,)
