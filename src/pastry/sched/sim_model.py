"""The simulator's records: its configuration, programs, threads and results, and what it
needs of an engine (:mod:`pastry.sched.sim`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from pastry.control.commands import Command, Queue
from pastry.control.policies.memory import MemoryAdmission
from pastry.control.swap import MIN_RESIDENT_BATCHES
from pastry.sched.hardware import CostModel, KvMemory
from pastry.sched.programs import ProgramSpec


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
    first_token: float | None = None  # when its first call's first token came (cluster)

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
