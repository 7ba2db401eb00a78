"""Discretized priority queues (Autellix Algorithm 1) and the MLFQ baseline.

:class:`MultilevelQueues` is the machinery PLAS, ATLAS and MLFQ share: K queues ``Q_1 ..
Q_K`` over attained service (seconds of engine time). Queue ``Q_i`` covers ``[lo_i,
hi_i)`` (``lo_1 = 0``, ``hi_K = inf``; :class:`Levels`) and has the quantum ``hi_i -
lo_i``. On each scheduler pass, for every ready call (Algorithm 1):

1. a new call enters the queue of its *entry priority* (lines 10-13): 0 for MLFQ (every
   call starts in ``Q_1``), the program's attained service for PLAS and ATLAS;
2. a call that has used its queue's quantum moves down, to the tail of the next queue,
   as often as its model time says (lines 20-23; ``Q_K`` keeps it);
3. anti-starvation (lines 24-30, when ``beta`` is set): if ``(W_p + W_c) / (T_p + T_c) >=
   beta`` (program wait plus the call's wait since its last promotion, over program
   service plus the call's model time since then) the call moves to the tail of ``Q_1``
   and only ``W_c`` and ``T_c`` restart, so that a program's other threads, which share
   ``W_p`` and ``T_p``, are promoted with it. A call with no service yet (``T = 0``) is
   not promoted;
4. the batch takes queues in order: strict priority across queues; within one, the
   inferlets' queue priority (``set_queue_priority``: higher first), then FCFS (by when
   the call entered the queue). The scheduler fills a batch in this order and lets a later
   queue in when an earlier one's next command does not fit the token budget
   (work-conserving; the paper stops at the first call that does not fit).

Counters advance outside the policy: the process table charges model time and waiting per
batch (:mod:`pastry.control.programs`); the policy only places calls.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from pastry.control.policies.schedule import SchedulePolicy
from pastry.control.policies.views import QueueView
from pastry.control.programs import Call, Program, Thread


@dataclass(frozen=True)
class Levels:
    """K queues over attained service: ``bounds`` are ``hi_1 < hi_2 < ... < hi_{K-1}``
    (seconds); ``Q_K`` is unbounded. The quantum of ``Q_i`` is its width."""

    bounds: tuple[float, ...]

    def __post_init__(self) -> None:
        b = self.bounds
        if not all(isinstance(x, int | float) and math.isfinite(x) and x > 0 for x in b):
            raise ValueError(f"queue bounds must be positive finite seconds, got {b!r}")
        if any(x >= y for x, y in itertools.pairwise(b)):
            raise ValueError(f"queue bounds must increase, got {b!r}")

    @classmethod
    def geometric(cls, k: int = 8, first: float = 1.0, ratio: float = 2.0) -> Levels:
        """``k`` queues: ``Q_1 = [0, first)``, each next bound ``ratio`` times the last."""
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"the number of queues must be an integer >= 1, got {k!r}")
        if not ratio > 1:
            raise ValueError(f"the ratio between queue bounds must be > 1, got {ratio!r}")
        return cls(tuple(first * ratio**i for i in range(k - 1)))

    @property
    def k(self) -> int:
        return len(self.bounds) + 1

    def index(self, service: float) -> int:
        """The queue (0-based) whose range holds ``service`` (half-open ranges)."""
        return bisect.bisect_right(self.bounds, service)

    def quantum(self, i: int) -> float:
        if i >= len(self.bounds):
            return math.inf
        return self.bounds[i] - (self.bounds[i - 1] if i else 0.0)

    def describe(self) -> str:
        b = self.bounds
        if not b:
            return "1 queue"
        return f"{self.k} queues, bounds {b[0]:g}..{b[-1]:g} s"


class MultilevelQueues(SchedulePolicy):
    """Algorithm 1 over :class:`Levels`; subclasses say where a call enters
    (:meth:`entry`) and what a program's attained service is (:meth:`attained`)."""

    def __init__(self, levels: Levels | None = None, beta: float | None = None) -> None:
        if beta is not None and not (isinstance(beta, int | float) and beta > 0):
            raise ValueError(f"beta (anti-starvation threshold) must be > 0 or None, got {beta!r}")
        self.levels = levels if levels is not None else Levels.geometric()
        self.beta = beta

    def entry(self, thread: Thread) -> float:
        """The priority ``p(c)`` a new call of ``thread`` enters with (line 11)."""
        raise NotImplementedError

    def attained(self, program: Program) -> float:
        """``T_p`` of the starvation ratio."""
        raise NotImplementedError

    def order(self, ready: Sequence[QueueView]) -> list[QueueView]:
        now = self.programs.clock() if self.programs is not None else 0.0
        for q in ready:
            t = q.thread
            if t is not None and t.call is not None:
                self._update(t, t.call, now)
        return sorted(ready, key=_key)

    def _update(self, t: Thread, c: Call, now: float) -> None:
        lv = self.levels
        if c.level < 0:  # lines 10-13: enter by priority
            c.level, c.level_mark, c.entered = lv.index(self.entry(t)), 0.0, c.arrival
        while c.model_time - c.level_mark >= lv.quantum(c.level):  # lines 20-23: demote
            c.level_mark += lv.quantum(c.level)
            c.level += 1
            c.entered = now
        if self.beta is None or c.level == 0:
            return
        p = t.program
        wait = p.wait + t.current_wait(now)  # lines 24-26: anti-starvation
        service = self.attained(p) + c.run
        if service > 0 and wait >= self.beta * service:
            c.level, c.level_mark, c.entered = 0, c.model_time, now
            c.wait, c.run, c.promoted = 0.0, 0.0, now

    def rank(self, program: Program) -> tuple[float, ...]:
        placed = [t.call for t in program.active if t.call.level >= 0]
        if not placed:
            return super().rank(program)
        best = min(placed, key=lambda c: (c.level, c.entered))
        return (0.0, float(best.level), best.entered)

    def describe(self) -> str:
        beta = f", beta {self.beta:g}" if self.beta is not None else ""
        return f"{self.name} ({self.levels.describe()}{beta})"


def _key(q: QueueView) -> tuple[float, int, float]:
    """Level first, then the queue's priority (higher first), then entry into the level."""
    t = q.thread
    if t is None or t.call is None or t.call.level < 0:
        return (0.0, -q.priority, q.pending[0].created)
    return (float(t.call.level), -q.priority, t.call.entered)


class Mlfq(MultilevelQueues):
    """The paper's MLFQ baseline (after FastServe): every new call enters ``Q_1`` and
    moves down as it uses quanta; no program awareness, no anti-starvation."""

    name: ClassVar[str] = "mlfq"

    def entry(self, thread: Thread) -> float:
        return 0.0

    def attained(self, program: Program) -> float:
        return program.service
