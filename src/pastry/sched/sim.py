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

import asyncio
import heapq
import itertools
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np

from pastry.control.policies import Adaptive, SchedulePolicy
from pastry.control.policies.memory import MemoryAdmission
from pastry.control.programs import ProcessTable
from pastry.control.resources import ExportError, ResourceError, ResourceManager
from pastry.control.scheduler import BatchScheduler, Command, Op, Queue
from pastry.control.scheduler import Stage as CommandStage
from pastry.control.swap import MIN_RESIDENT_BATCHES, KvSwapper
from pastry.sched.hardware import CostModel, KvMemory
from pastry.sched.programs import ProgramSpec

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


@dataclass(frozen=True)
class SimConfig:
    max_batch: int = 256  # forward calls per step (vLLM's max_num_seqs), every system alike
    max_batch_tokens: int | None = 8192  # input tokens per step (the first call always fits)
    cost: CostModel = field(default_factory=CostModel.a100_llama8b)
    max_time_s: float = math.inf  # stop then; unfinished programs did not complete
    memory: KvMemory | None = None  # None: no KV limit (scheduling only)
    share_prefix: bool = True  # Pastry: a workload's system prompt computed once, shared
    min_resident: int = MIN_RESIDENT_BATCHES  # the swapper's residency bound (batches)
    steps_per_schedule: int = 1  # N: engine steps per scheduling pass (multi-step)
    measure: tuple[float, float] | None = None  # arrivals measured (None: every program)
    # Pastry: admission by memory (the swapper's; None: swapping without it)
    admission: MemoryAdmission | None = field(default_factory=MemoryAdmission)

    def __post_init__(self) -> None:
        if not isinstance(self.steps_per_schedule, int) or self.steps_per_schedule < 1:
            raise ValueError(
                f"steps_per_schedule must be an integer >= 1, got {self.steps_per_schedule!r}"
            )
        if self.measure is not None and not self.measure[0] < self.measure[1]:
            raise ValueError(
                f"the measured window must be (start, end), start < end: {self.measure}"
            )


@dataclass(frozen=True)
class ProgramResult:
    workload: str
    arrival: float
    finish: float | None  # None: did not complete (time limit, or failed)
    tokens: int  # decode tokens over all threads
    calls: int
    wait_s: float  # summed queueing time of its threads
    failed: str | None = None  # why it was ended, if it was
    measured: bool = True  # arrived in SimConfig.measure (else load around the window)

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
    stats: dict = field(default_factory=dict)  # the engine's counters (swaps, preemptions)

    @property
    def measured(self) -> list[ProgramResult]:
        return [p for p in self.programs if p.measured]

    @property
    def completed(self) -> bool:
        """Whether every measured program finished."""
        return all(p.finish is not None for p in self.measured)

    @property
    def total_wait(self) -> float:
        return sum(p.wait_s for p in self.measured)

    def latencies(self) -> np.ndarray:
        return np.array([p.latency for p in self.measured if p.finish is not None])

    def summary(self) -> dict:
        lat = self.latencies()
        done = len(lat)
        return {
            "policy": self.policy,
            "programs": len(self.measured),
            "completed": done,
            "avg_latency": float(lat.mean()) if done else math.nan,
            "p95_latency": float(np.percentile(lat, 95)) if done else math.nan,
            "p99_latency": float(np.percentile(lat, 99)) if done else math.nan,
            "total_wait_s": self.total_wait,
            "makespan_s": self.end_time,
            "steps": self.steps,
            **self.stats,
        }


@dataclass(eq=False)
class SimThread:
    """A context of a simulated program: its root, or a fork for one stage."""

    program: SimProgram
    root: bool
    context: int = 0  # tokens in its context before its current call (driver's count)
    left: int = 0  # steps left in its current call
    waited: float = 0.0  # queueing time (filled in by the engine)
    # PastryEngine's state
    queue: Queue | None = None
    command: Command | None = None
    kv: int = 0  # tokens with KV
    pages: list[int] = field(default_factory=list)  # KV handles, the shared ones first
    shared: int = 0  # leading pages shared with the root or imported (not its own)


@dataclass(eq=False)
class SimProgram:
    spec: ProgramSpec
    instance: int
    stage: int = -1
    running: int = 0  # threads whose call of the current stage is not done
    root: SimThread | None = None
    threads: list[SimThread] = field(default_factory=list)  # of the current stage
    finish: float | None = None
    failed: str | None = None
    wait_s: float = 0.0  # of threads already closed
    prefix_left: int = 0  # shared-prefix tokens the root's first call still computes
    measured: bool = True
    later: tuple[int, ...] = ()  # decode steps of the stages from i on (SRPT's oracle)


class SimEngine(Protocol):
    """What the simulator needs of an engine (Pastry's control layer or the vLLM baseline).

    The driver calls ``start_program`` when a program arrives (before its threads), opens
    threads (``open_thread``; a fork's ``parent`` is its root), starts calls on idle
    threads (``start_call``: ``tokens`` new input tokens, ``decode`` steps), closes forks
    after their stage and ``end_program`` after its last call. ``step`` runs one engine
    step at the simulator's ``now`` and returns its duration, the threads whose call
    ended and the programs that failed (each failed program is then ended by the driver).
    """

    def describe(self) -> str: ...
    def start_program(self, p: SimProgram) -> None: ...
    def open_thread(self, th: SimThread, parent: SimThread | None) -> None: ...
    def start_call(self, th: SimThread, tokens: int, decode: int) -> None: ...
    def close_thread(self, th: SimThread) -> None: ...
    def end_program(self, p: SimProgram) -> None: ...
    def has_work(self) -> bool: ...
    def step(self) -> tuple[float, list[SimThread], list[tuple[SimProgram, str]]]: ...
    def finish(self) -> dict: ...


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


# --------------------------------------------------------------------------- Pastry's engine


class PastryEngine:
    """Pastry's control layer over a simulated engine (see the module docstring): the
    real batch scheduler, process table, resource manager and swapper; the simulated
    inferlets allocate their contexts' pages before each forward, as ``Context`` does."""

    def __init__(self, sim: Simulator, policy: SchedulePolicy) -> None:
        cfg = sim.config
        self.sim = sim
        self.policy = policy
        self.cost = cfg.cost
        self.steps = cfg.steps_per_schedule
        self.memory = cfg.memory
        self.page_size = cfg.memory.page_size if cfg.memory is not None else 16
        self.table = ProcessTable(clock=lambda: sim.now, session_ttl_s=0)
        self.sched = BatchScheduler(
            _no_engine,
            cfg.max_batch_tokens if cfg.max_batch_tokens is not None else sys.maxsize,
            self.page_size,
            Adaptive(),
            policy,
            programs=self.table,
            engine="sim",
            max_batch=cfg.max_batch,
        )
        self.resources: ResourceManager | None = None
        self.swapper: KvSwapper | None = None
        if cfg.memory is not None:
            # No termination callback: a program that even the last resort cannot fit
            # fails itself (the server would end the newest programs instead)
            self.resources = ResourceManager(
                cfg.memory.pages, 0, num_host_pages=cfg.memory.host_pages
            )
            self.swapper = KvSwapper(
                self.resources, self.sched, cfg.min_resident, admission=cfg.admission
            )
        self.share_prefix = cfg.share_prefix
        self._loop = asyncio.new_event_loop()  # commands' futures (never run)
        self._by_queue: dict[Queue, SimThread] = {}
        self._prefixes: set[str] = set()  # exported shared prefixes
        self._pending = 0  # threads with a command not yet taken
        self._failed: list[tuple[SimProgram, str]] = []  # reported by the next step
        self._doomed: set[SimThread] = set()
        self._swap_s = 0.0
        self._prefill_tokens = 0  # input tokens of calls' first forwards (vLLM's count)

    def describe(self) -> str:
        return self.policy.describe()

    def finish(self) -> dict:
        """The engine's counters; the simulation is over."""
        out = {
            "mean_batch": round(self.sched.stats.mean_batch, 2),
            "prefill_tokens": self._prefill_tokens,
        }
        if self.swapper is not None:
            s = self.swapper.stats
            out.update(pages_out=s.pages_out, pages_in=s.pages_in, swap_outs=s.swap_outs,
                       forced=s.forced, held_back=s.held_back,
                       swap_s=round(self._swap_s, 3))  # fmt: skip
        self._loop.close()
        return out

    # ------------------------------------------------------------------ programs, threads

    def start_program(self, p: SimProgram) -> None:
        self.table.start(p.instance)
        if self.resources is not None:
            self.resources.add_instance(p.instance)

    def open_thread(self, th: SimThread, parent: SimThread | None) -> None:
        p = th.program
        th.queue = self.sched.create_queue(p.instance)
        self._by_queue[th.queue] = th
        res = self.resources
        if parent is not None:  # Context.fork: the root's full pages by reference
            full = parent.kv // self.page_size
            th.pages, th.shared, th.kv = parent.pages[:full], full, parent.kv
            if res is not None and parent.kv % self.page_size:
                th.pages = th.pages + res.alloc(p.instance, "kv", 1)  # the partial page's copy
            return
        prefix = p.spec.shared_prefix
        name = f"prefix:{p.spec.workload}:{prefix}"
        if res is None or not self.share_prefix or name not in self._prefixes:
            return
        try:
            th.pages = res.import_(p.instance, "kv", name)
        except ExportError:  # a cache: dropped under memory pressure; computed again
            self._prefixes.discard(name)
            return
        th.shared = len(th.pages)
        th.kv = th.shared * self.page_size
        p.prefix_left = prefix - th.kv

    def start_call(self, th: SimThread, tokens: int, decode: int) -> None:
        self._prefill_tokens += tokens  # the call's new input (its context is in KV)
        self._submit(th, tokens)

    def close_thread(self, th: SimThread) -> None:
        q = th.queue
        assert q is not None
        th.waited = q.thread.waited if q.thread is not None else 0.0
        if th.command is not None and th.command in q.pending:
            self._pending -= 1  # dropped with the queue
        self.sched.close_queue(q, "the program ended")
        if th.command is not None and th.command.future.done():
            th.command.future.exception()  # nobody awaits it (as an ended inferlet would)
        self._by_queue.pop(q, None)
        own = th.pages[th.shared :]
        if self.resources is not None and own and th.program.failed is None:
            self.resources.free(th.program.instance, "kv", own)
        th.pages, th.command = [], None

    def end_program(self, p: SimProgram) -> None:
        if self.resources is not None:
            self.resources.remove_instance(p.instance)
        self.table.end(p.instance)
        self._doomed.difference_update([t for t in self._doomed if t.program is p])

    def has_work(self) -> bool:
        return self._pending > 0 or bool(self._failed)

    # ------------------------------------------------------------------ a step

    def step(self) -> tuple[float, list[SimThread], list[tuple[SimProgram, str]]]:
        """One scheduling pass: a batch formed by the real scheduler, run for up to
        ``steps_per_schedule`` steps (see the module docstring)."""
        sim, sched = self.sim, self.sched
        batch = sched.take_batch() or []
        moved = 0
        if self.swapper is not None:  # the copies go at the front of the batch
            s = self.swapper.stats
            before = s.pages_out + s.pages_in
            self.swapper.take_calls()
            moved = s.pages_out + s.pages_in - before
        self._pending -= len(batch)
        failed, self._failed = self._failed, []
        if not batch:
            return 0.0, [], failed + self._dropped()
        threads = [self._by_queue[c.queue] for c in batch]
        sched.stats.batches += 1
        sched.stats.forward_items += len(batch)
        sched.stats.forward_batches += 1
        self.table.dispatched([(c.queue.thread, 1) for c in batch], sim.now)
        spans = [min(th.left, self.steps) for th in threads]
        swap_s = self.memory.swap_s(moved) if self.memory is not None else 0.0
        self._swap_s += swap_s
        dt = self._run(batch, threads, spans) + swap_s
        end = sim.now + dt
        self.table.completed([(c.queue.thread, 1, True) for c in batch], dt, end)
        self.policy.on_batch_done(batch, dt)
        done = []
        for cmd, th, k in zip(batch, threads, spans, strict=True):
            cmd.future.set_result(None)
            th.command = None
            if th.program.failed is not None or th in self._doomed:
                continue
            th.kv += cmd.tokens + k - 1
            if th.root and th.program.prefix_left == 0 and th.program.stage == 0:
                self._export_prefix(th)
            th.left -= k
            if th.left > 0:
                self._submit(th, 1, at=end)
                continue
            self.table.end_call(th.queue.thread, end)
            done.append(th)
        return dt, done, failed

    def _run(self, batch: list[Command], threads: list[SimThread], spans: list[int]) -> float:
        """Seconds of the pass's steps: step 0 runs every command (its input tokens over
        its context), step s > 0 the calls with more than s steps in the pass, one token
        each over a context grown by s."""
        tokens = sum(c.tokens for c in batch)
        dt = self.cost.step(len(batch), tokens, sum(th.kv for th in threads) + tokens)
        last = max(spans)
        if last == 1:
            return dt
        count = [0] * (last + 1)  # calls with exactly k steps in the pass
        base = [0] * (last + 1)  # their contexts after step 0
        for cmd, th, k in zip(batch, threads, spans, strict=True):
            count[k] += 1
            base[k] += th.kv + cmd.tokens
        n = ctx = 0
        for s in range(last - 1, 0, -1):  # step s runs the calls with k > s
            n += count[s + 1]
            ctx += base[s + 1]
            dt += self.cost.step(n, n, ctx + n * s)
        return dt

    def _submit(self, th: SimThread, tokens: int, at: float | None = None) -> None:
        """Allocate the pages the forwards of the next pass write (``Context`` does before
        a forward; short of device pages they start on the host), then queue it."""
        q = th.queue
        assert q is not None
        res = self.resources
        if res is not None:
            span = min(th.left, self.steps)
            need = -(-(th.kv + tokens + span - 1) // self.page_size) - len(th.pages)
            if need > 0:
                try:
                    th.pages = th.pages + res.alloc(th.program.instance, "kv", need)
                except ResourceError as e:  # neither device nor host pages: it fails
                    self._failed.append((th.program, str(e)))
                    self._doomed.add(th)
                    return
        now = self.sim.now if at is None else at
        cmd = Command(CommandStage.FORWARD, _NOTHING, tokens=tokens,
                      future=self._loop.create_future(), created=now)  # fmt: skip
        th.command = cmd
        self._pending += 1
        self.sched.submit(q, cmd)

    def _export_prefix(self, root: SimThread) -> None:
        """After the first forward of a program that computed the shared prefix itself:
        export its full pages for the programs after it."""
        p = root.program
        spec = p.spec
        if self.resources is None or not self.share_prefix or root.shared:
            return
        full = spec.shared_prefix // self.page_size
        name = f"prefix:{spec.workload}:{spec.shared_prefix}"
        if full == 0 or name in self._prefixes:
            return
        self.resources.export(p.instance, "kv", root.pages[:full], name, persistent=True)
        self._prefixes.add(name)

    def _dropped(self) -> list[tuple[SimProgram, str]]:
        """Programs whose command the scheduler failed (even forced residency could not
        make room)."""
        out = []
        for q, th in list(self._by_queue.items()):
            cmd = th.command
            if cmd is not None and cmd.future.done() and cmd.future.exception() is not None:
                if cmd not in q.pending:
                    self._pending -= 1
                th.command = None
                out.append((th.program, str(cmd.future.exception())))
        return out


async def _no_engine(calls):  # the simulator runs the batch itself
    raise AssertionError("the simulated scheduler never dispatches to an engine")


class _Nothing(Op):
    """A simulated forward: nothing to translate (the simulator runs the batch itself)."""

    __slots__ = ()

    def prepare(self) -> None:
        return None


_NOTHING = _Nothing()
