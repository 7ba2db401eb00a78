"""A discrete-event simulator of one engine, for policy studies at scales this machine
cannot run (Autellix Fig. 18; ``docs/scheduling.md``).

It runs the real schedule policy objects (:mod:`pastry.control.policies`) over the real
process table (:mod:`pastry.control.programs`) and real scheduler queues and commands:
only the engine and the inferlets are simulated. Each program (:class:`ProgramSpec`)
arrives at its time, runs its stages (parallel calls on threads, then an interrupt), and
ends with its last call. A call of ``prefill`` new tokens and ``decode`` output tokens is
``decode`` forward steps on its thread: the first carries the prefill (as in Pastry's
``Context.generate``), each next one a single token.

Each engine step, like the batch scheduler: the policy orders the threads that have a
step to run; the batch takes them in that order up to ``max_batch`` forwards, skipping one
whose tokens would overflow ``max_batch_tokens`` (the first always fits); the step costs
:meth:`CostModel.step` seconds; the process table is told of the dispatch and completion;
threads whose call ended have it ended in the table (the simulator knows call boundaries).
Arrivals and interrupt ends that fall inside a step join at the next one. The simulator
models scheduling only (no KV memory limit, no swap), like the paper's simulation.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from pastry.control.policies import SchedulePolicy
from pastry.control.programs import ProcessTable
from pastry.control.scheduler import Command, Queue
from pastry.control.scheduler import Stage as CommandStage
from pastry.sched.programs import ProgramSpec


@dataclass(frozen=True)
class CostModel:
    """Seconds per engine step: ``base_s + per_seq_s * forwards + per_token_s * input
    tokens`` of the batch."""

    base_s: float = 1.0
    per_seq_s: float = 0.0
    per_token_s: float = 0.0

    def step(self, seqs: int, tokens: int) -> float:
        return self.base_s + self.per_seq_s * seqs + self.per_token_s * tokens

    @classmethod
    def unit(cls) -> CostModel:
        """Every step takes 1 (the paper's toy example and its Fig. 18 simulation)."""
        return cls(1.0, 0.0, 0.0)

    @classmethod
    def a100_llama8b(cls) -> CostModel:
        """Roughly LLaMA-3.1-8B on one A100 (vLLM): ~11 ms per decode step, nearly flat in
        the batch size, prefill ~0.06 ms per token."""
        return cls(0.011, 2e-5, 6e-5)


@dataclass(frozen=True)
class SimConfig:
    max_batch: int = 256  # forward calls per step (vLLM's max_num_seqs)
    max_batch_tokens: int | None = 8192
    cost: CostModel = field(default_factory=CostModel.a100_llama8b)
    max_time_s: float = math.inf  # stop then; unfinished programs did not complete


@dataclass(frozen=True)
class ProgramResult:
    workload: str
    arrival: float
    finish: float | None  # None: did not complete before max_time_s
    tokens: int  # decode tokens over all threads
    calls: int
    wait_s: float  # summed queueing time of its threads

    @property
    def latency(self) -> float:
        """Program-level token latency: response time (the critical path, for parallel
        programs) over all tokens it generated, in seconds per token."""
        assert self.finish is not None
        return (self.finish - self.arrival) / self.tokens


@dataclass(frozen=True)
class SimResult:
    policy: str
    programs: tuple[ProgramResult, ...]
    steps: int
    end_time: float

    @property
    def completed(self) -> bool:
        return all(p.finish is not None for p in self.programs)

    @property
    def total_wait(self) -> float:
        return sum(p.wait_s for p in self.programs)

    def latencies(self) -> np.ndarray:
        return np.array([p.latency for p in self.programs if p.finish is not None])

    def summary(self) -> dict:
        lat = self.latencies()
        done = len(lat)
        return {
            "policy": self.policy,
            "programs": len(self.programs),
            "completed": done,
            "avg_latency": float(lat.mean()) if done else math.nan,
            "p95_latency": float(np.percentile(lat, 95)) if done else math.nan,
            "p99_latency": float(np.percentile(lat, 99)) if done else math.nan,
            "total_wait_s": self.total_wait,
            "makespan_s": self.end_time,
            "steps": self.steps,
        }


@dataclass(eq=False)
class _Thread:
    queue: Queue
    left: int = 0  # steps left in its current call


@dataclass(eq=False)
class _Program:
    spec: ProgramSpec
    instance: int
    stage: int = -1
    running: int = 0  # threads whose call of the current stage is not done
    threads: list[_Thread] = field(default_factory=list)
    finish: float | None = None
    wait_s: float = 0.0


class Simulator:
    """Runs programs through one simulated engine under ``policy`` (a fresh policy object
    per simulator: policies keep per-scheduler state)."""

    def __init__(self, policy: SchedulePolicy, config: SimConfig | None = None) -> None:
        self.policy = policy
        self.config = config or SimConfig()
        self.now = 0.0
        self.table = ProcessTable(clock=lambda: self.now, session_ttl_s=0)
        policy.bind(self.table)
        self._queues: list[Queue] = []
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._programs: list[_Program] = []
        self._qids = itertools.count()

    def remaining_steps(self, instance: int) -> int:
        """Steps the program still has to run (the clairvoyant oracle for SRPT)."""
        p = self._programs[instance]
        left = sum(t.left for t in p.threads)
        return left + sum(c.decode for s in p.spec.stages[p.stage + 1 :] for c in s.calls)

    def run(self, programs: Sequence[ProgramSpec]) -> SimResult:
        for i, spec in enumerate(sorted(programs, key=lambda s: s.arrival)):
            p = _Program(spec, i)
            self._programs.append(p)
            self._at(spec.arrival, lambda p=p: self._start(p))
        cfg, steps = self.config, 0
        while self._events or self._ready():
            ready = self._ready()
            if not ready:
                self.now = max(self.now, self._events[0][0])
            while self._events and self._events[0][0] <= self.now:
                heapq.heappop(self._events)[2]()
            if self.now > cfg.max_time_s:
                break
            if ready or self._ready():
                self._step()
                steps += 1
        results = tuple(self._result(p) for p in self._programs)
        return SimResult(self.policy.describe(), results, steps, self.now)

    # ------------------------------------------------------------------ internals

    @staticmethod
    def _result(p: _Program) -> ProgramResult:
        wait = p.wait_s + sum(t.queue.thread.waited for t in p.threads)
        s = p.spec
        return ProgramResult(s.workload, s.arrival, p.finish, s.decode_tokens, s.num_calls, wait)

    def _at(self, t: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._events, (t, next(self._seq), action))

    def _ready(self) -> list[Queue]:
        return [q for q in self._queues if q.pending]

    def _start(self, p: _Program) -> None:
        self.table.start(p.instance)
        self._next_stage(p)

    def _next_stage(self, p: _Program) -> None:
        p.stage += 1
        stage = p.spec.stages[p.stage]
        while len(p.threads) < len(stage.calls):
            q = Queue(p.instance, next(self._qids))
            q.thread = self.table.open_thread(p.instance, "sim")
            self._queues.append(q)
            p.threads.append(_Thread(q))
        for i, call in enumerate(stage.calls):
            th = p.threads[i]
            th.left = call.decode
            prefix = p.spec.shared_prefix if p.stage == 0 and i == 0 else 0
            self._submit(th.queue, max(1, prefix + call.prefill))
        p.running = len(stage.calls)

    def _submit(self, q: Queue, tokens: int) -> None:
        cmd = Command(CommandStage.FORWARD, prepare=_nothing, tokens=tokens, future=None,
                      created=self.now, queue=q)  # fmt: skip
        q.pending.append(cmd)
        self.table.arrive(q.thread, self.now)

    def _step(self) -> None:
        cfg = self.config
        order = self.policy.order(self._ready())
        batch: list[Queue] = []
        tokens = 0
        for q in order:
            if len(batch) >= cfg.max_batch:
                break
            n = q.pending[0].tokens
            if cfg.max_batch_tokens is not None and batch and tokens + n > cfg.max_batch_tokens:
                continue
            batch.append(q)
            tokens += n
        self.table.dispatched([(q.thread, 1) for q in batch], self.now)
        commands = [q.pending.popleft() for q in batch]
        dt = cfg.cost.step(len(batch), tokens)
        self.now += dt
        self.table.completed([(q.thread, 1, True) for q in batch], dt, self.now)
        self.policy.on_batch_done(commands, dt)
        for q in batch:
            self._advance(q)

    def _advance(self, q: Queue) -> None:
        p = self._programs[q.instance]
        th = next(t for t in p.threads if t.queue is q)
        th.left -= 1
        if th.left > 0:
            self._submit(q, 1)
            return
        self.table.end_call(q.thread, self.now)
        p.running -= 1
        if p.running:
            return
        interrupt = p.spec.stages[p.stage].interrupt_s
        if p.stage + 1 < len(p.spec.stages):
            self._at(self.now + interrupt, lambda: self._next_stage(p))
            return
        p.finish = self.now
        p.wait_s = sum(t.queue.thread.waited for t in p.threads)
        for t in p.threads:
            self._queues.remove(t.queue)
        p.threads = []
        self.table.end(p.instance)


def _nothing() -> None:
    return None


def simulate(
    policy: SchedulePolicy | Callable[[Simulator], SchedulePolicy],
    programs: Sequence[ProgramSpec],
    config: SimConfig | None = None,
) -> SimResult:
    """Run ``programs`` under ``policy`` (a fresh object, or a function of the simulator
    that makes one: how the clairvoyant SRPT gets its oracle) on a fresh simulator."""
    if isinstance(policy, SchedulePolicy):
        return Simulator(policy, config).run(programs)
    sim = Simulator(_Placeholder(), config)
    sim.policy = policy(sim)
    sim.policy.bind(sim.table)
    return sim.run(programs)


class _Placeholder(SchedulePolicy):
    def order(self, ready: Sequence[Queue]) -> list[Queue]:
        raise AssertionError("replaced before the simulation runs")
