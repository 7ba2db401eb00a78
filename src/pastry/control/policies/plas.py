"""PLAS: Program-Level Attained Service (Autellix §4.2.1, for single-threaded programs).

A new call enters the queue of its program's attained service: the summed model time of
the program's completed calls (Eq. 1), read when the call arrives. Programs that have had
less service go first, so short programs are not stuck behind long ones (program-level
head-of-line blocking). Discretized queues, demotion and anti-starvation:
:mod:`.mlfq`.
"""

from __future__ import annotations

from typing import ClassVar

from pastry.control.policies.mlfq import Levels, MultilevelQueues
from pastry.control.programs import Program, Thread

DEFAULT_BETA = 4.0


class Plas(MultilevelQueues):
    name: ClassVar[str] = "plas"

    def __init__(self, levels: Levels | None = None, beta: float | None = DEFAULT_BETA) -> None:
        super().__init__(levels, beta)

    def entry(self, thread: Thread) -> float:
        assert thread.call is not None
        return thread.call.base_service

    def attained(self, program: Program) -> float:
        return program.service
