"""A discrete-event simulator of one engine, for policy studies at scales this machine
cannot run (Autellix Fig. 18, and its Fig. 12 at the paper's scale; ``docs/scheduling.md``).

The simulator drives programs (:class:`~pastry.sched.programs.ProgramSpec`): each arrives
at its time, runs its stages (parallel calls on its root context and forks of it, then an
interrupt) and ends with its last call. A call of ``prefill`` new tokens and ``decode``
output tokens is ``decode`` forward steps: the first carries the prefill, each next one a
single token. Each step costs :meth:`~pastry.sched.hardware.CostModel.step` seconds plus
the time of the KV swaps in front of it. Arrivals and interrupt ends that fall inside a
step join at the next one. Two engines serve them:

- **Pastry** (:class:`PastryEngine`, any :class:`~pastry.control.policies.SchedulePolicy`):
  the real control layer with only the engine and the inferlets simulated. The real
  :class:`~pastry.control.scheduler.BatchScheduler` forms every batch (the policy's
  order, ``max_batch`` forwards, the token budget) and tells the real process table;
  with a memory model (``SimConfig.memory``) the real
  :class:`~pastry.control.resources.ResourceManager` holds every program's KV pages and the
  real :class:`~pastry.control.swap.KvSwapper` swaps them, so admission and preemption
  under memory pressure are the real rules. Programs keep their contexts between calls
  (an inferlet holds its pages: every call reuses its program's prefix), forks share their
  root's full pages, and with ``share_prefix`` a workload's system prompt is computed once
  and shared by every program (an export that programs import, as a prefix cache would).
- **vLLM** (:class:`~pastry.sched.vllm.Vllm`): the paper's vLLM v0.6.1 baseline, FCFS
  with no prefix caching and preemption by recomputation (:mod:`pastry.sched.vllm`).

Without a memory model the simulator models scheduling only, like the paper's Fig. 18.

**Multi-step scheduling** (``SimConfig.steps_per_schedule`` = N, Autellix §4.2.3): Pastry's
engine forms a batch once per N steps and runs it N steps (each call in it at most N
forwards of its own: the first carries its new input, the next ones one token each; a
call that ends early leaves the batch, and calls that arrive meanwhile wait for the next
pass). Each step is still costed on its own; the process table is charged, and the
policy re-ranks, once per pass. N = 1 (the default) schedules every step.

**Steady state** (``SimConfig.measure``): only programs arriving in the window are
measured, the others are load before and after them, and the run stops as soon as every
measured program has finished.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

from pastry.control.policies import SchedulePolicy
from pastry.control.programs import ProcessTable
from pastry.sched.hardware import CostModel, KvMemory
from pastry.sched.pastry_engine import PastryEngine
from pastry.sched.programs import ProgramSpec
from pastry.sched.sim_model import (
    ProgramResult,
    SimConfig,
    SimEngine,
    SimProgram,
    SimResult,
    SimThread,
)

__all__ = [
    "CostModel",
    "KvMemory",
    "PastryEngine",
    "ProgramResult",
    "SimConfig",
    "SimResult",
    "Simulator",
    "simulate",
]


@runtime_checkable
class Baseline(Protocol):
    """Another serving system to simulate (:class:`~pastry.sched.vllm.Vllm`)."""

    def engine(self, sim: Simulator) -> SimEngine: ...


# A fresh schedule policy object (run on Pastry's engine; policies keep per-scheduler
# state), a function of the simulator that makes one (how the clairvoyant SRPT gets its
# oracle), or a baseline system.
System = SchedulePolicy | Callable[["Simulator"], SchedulePolicy] | Baseline


class Simulator:
    """Runs programs through one simulated engine serving ``system`` (see :data:`System`)."""

    def __init__(self, system: System, config: SimConfig | None = None) -> None:
        self.config = config or SimConfig()
        self.now = 0.0
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._programs: list[SimProgram] = []
        self._measuring = 0  # measured programs not finished or failed yet
        self.engine: SimEngine
        if isinstance(system, SchedulePolicy):
            self.engine = PastryEngine(self, system)
        elif isinstance(system, Baseline):
            self.engine = system.engine(self)
        else:
            self.engine = PastryEngine(self, system(self))

    @property
    def table(self) -> ProcessTable:
        """The process table (Pastry engine only)."""
        assert isinstance(self.engine, PastryEngine)
        return self.engine.table

    def remaining_steps(self, instance: int) -> int:
        """Steps the program still has to run (the clairvoyant oracle for SRPT)."""
        p = self._programs[instance]
        if not p.later:
            p.later = tuple(
                itertools.accumulate(
                    (sum(c.decode for c in s.calls) for s in reversed(p.spec.stages)),
                    initial=0,
                )
            )[::-1]
        return sum(t.left for t in p.threads) + p.later[p.stage + 1]

    def run(self, programs: Sequence[ProgramSpec]) -> SimResult:
        window = self.config.measure
        for i, spec in enumerate(sorted(programs, key=lambda s: s.arrival)):
            if spec.shared_prefix and spec.stages[0].fork:
                raise ValueError(
                    "a program with a shared prefix must run its first stage on its root "
                    "(the prefix is its first call's input)"
                )
            p = SimProgram(spec, i)
            p.measured = window is None or window[0] <= spec.arrival < window[1]
            self._measuring += p.measured
            self._programs.append(p)
            self._at(spec.arrival, lambda p=p: self._start(p))
        cfg, engine, steps, idle = self.config, self.engine, 0, 0
        while (self._events or engine.has_work()) and self._measuring:
            if not engine.has_work():
                self.now = max(self.now, self._events[0][0])
            while self._events and self._events[0][0] <= self.now:
                heapq.heappop(self._events)[2]()
            if self.now > cfg.max_time_s:
                break
            if not engine.has_work():
                continue
            dt, done, failed = engine.step()
            self.now += dt
            steps += 1 if dt > 0 else 0
            idle = idle + 1 if dt == 0 and not done and not failed else 0
            if idle > 2:  # an engine with work that runs nothing twice over: a bug
                raise RuntimeError(f"the simulated engine ({engine.describe()}) stalled")
            for p, why in failed:
                self._fail(p, why)
            for th in done:
                self._call_done(th)
        results = tuple(self._result(p) for p in self._programs)
        return SimResult(engine.describe(), results, steps, self.now, engine.finish())

    # ------------------------------------------------------------------ the programs

    @staticmethod
    def _result(p: SimProgram) -> ProgramResult:
        wait = p.wait_s + sum(t.waited for t in p.threads)
        s = p.spec
        return ProgramResult(
            s.workload, s.arrival, p.finish, s.decode_tokens, s.num_calls, wait, p.failed,
            p.measured,
        )  # fmt: skip

    def _at(self, t: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._events, (t, next(self._seq), action))

    def _start(self, p: SimProgram) -> None:
        self.engine.start_program(p)
        p.root = SimThread(p, root=True)
        p.prefix_left = p.spec.shared_prefix
        self.engine.open_thread(p.root, None)
        self._next_stage(p)

    def _next_stage(self, p: SimProgram) -> None:
        if p.failed is not None:
            return
        p.stage += 1
        stage = p.spec.stages[p.stage]
        root = p.root
        assert root is not None
        p.threads = [] if stage.fork else [root]
        while len(p.threads) < len(stage.calls):
            fork = SimThread(p, root=False, context=root.context)
            self.engine.open_thread(fork, root)
            p.threads.append(fork)
        for th, call in zip(p.threads, stage.calls, strict=True):
            tokens = call.prefill
            if th.root and p.prefix_left:
                tokens += p.prefix_left
                p.prefix_left = 0
            th.left = call.decode
            self.engine.start_call(th, max(1, tokens), call.decode)
        p.running = len(stage.calls)

    def _call_done(self, th: SimThread) -> None:
        p = th.program
        if p.failed is not None:
            return
        call = p.spec.stages[p.stage].calls[p.threads.index(th)]
        th.context += call.prefill + call.decode
        p.running -= 1
        if p.running:
            return
        if p.stage == 0 and p.root is not None:
            p.root.context += p.spec.shared_prefix
        for t in p.threads:
            if not t.root:
                self._close(t)
        p.threads = [p.root] if p.root is not None else []
        interrupt = p.spec.stages[p.stage].interrupt_s
        if p.stage + 1 < len(p.spec.stages):
            self._at(self.now + interrupt, lambda: self._next_stage(p))
            return
        p.finish = self.now
        self._measuring -= p.measured
        self._close(p.root)
        p.threads = []
        self.engine.end_program(p)

    def _close(self, th: SimThread | None) -> None:
        if th is None:
            return
        self.engine.close_thread(th)
        th.program.wait_s += th.waited
        th.waited = 0.0

    def _fail(self, p: SimProgram, why: str) -> None:
        if p.failed is not None or p.finish is not None:
            return
        p.failed = why
        self._measuring -= p.measured
        for t in p.threads:
            if not t.root:
                self._close(t)
        self._close(p.root)
        p.threads = []
        self.engine.end_program(p)


def simulate(
    system: System, programs: Sequence[ProgramSpec], config: SimConfig | None = None
) -> SimResult:
    """Run ``programs`` on a fresh simulator serving ``system`` (see :data:`System`)."""
    return Simulator(system, config).run(programs)
