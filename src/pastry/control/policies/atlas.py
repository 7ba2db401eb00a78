"""ATLAS: Adaptive Thread-Level Attained Service (Autellix §4.2.1, for programs whose
threads run in parallel: forks, map-reduce, tree search).

A program's completion is set by its critical path, so a new call enters the queue of the
longest critical path its program has shown so far: one scalar per program, updated when
a call ends to ``max(path, path at the call's arrival + its model time)`` (Algorithm 1,
line 4; :mod:`pastry.control.programs`), with no dependency tracking. All threads of a
program start from the same value, so its parallel calls are scheduled together and a
straggler does not hold the program back. For a single-threaded program this is PLAS.
Discretized queues, demotion and anti-starvation: :mod:`.mlfq`.
"""

from __future__ import annotations

from typing import ClassVar

from pastry.control.policies.mlfq import Levels, MultilevelQueues
from pastry.control.policies.plas import DEFAULT_BETA
from pastry.control.programs import Program, Thread


class Atlas(MultilevelQueues):
    name: ClassVar[str] = "atlas"

    def __init__(self, levels: Levels | None = None, beta: float | None = DEFAULT_BETA) -> None:
        super().__init__(levels, beta)

    def entry(self, thread: Thread) -> float:
        assert thread.call is not None
        return thread.call.base_path

    def attained(self, program: Program) -> float:
        return program.critical_path
