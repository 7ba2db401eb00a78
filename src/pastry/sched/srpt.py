"""Clairvoyant SRPT: the program with the least remaining work first.

Not deployable (it knows every program's future calls); the simulator's yardstick for how
far the non-clairvoyant policies are from optimal (Autellix Fig. 18). Remaining work comes
from a callback (:meth:`pastry.sched.sim.Simulator.remaining_steps`); threads of one program
go in call-arrival order. Preemptive at every step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, ClassVar

from pastry.control.policies.schedule import SchedulePolicy, call_arrival

if TYPE_CHECKING:
    from pastry.control.commands import Queue
    from pastry.control.programs import Program


class Srpt(SchedulePolicy):
    name: ClassVar[str] = "srpt"

    def __init__(self, remaining: Callable[[int], float]) -> None:
        self.remaining = remaining

    def order(self, ready: Sequence[Queue]) -> list[Queue]:
        left = {q.instance: self.remaining(q.instance) for q in ready}
        return sorted(ready, key=lambda q: (left[q.instance], call_arrival(q)))

    def rank(self, program: Program) -> tuple[float, ...]:
        instances = sorted(program.instances)
        return (float(self.remaining(instances[0])),) if instances else (float("inf"),)

    def describe(self) -> str:
        return "srpt (clairvoyant)"
