"""Scheduling policies: which ready queues the batch being formed considers first.

Batching (:mod:`.batching`) decides *when* a batch goes out and how big it may be; a
:class:`SchedulePolicy` decides *who* gets into it when not everyone fits (``max_batch_tokens``,
``max_forwards``, ``max_queues``). The scheduler takes commands queue by queue in the order
:meth:`~SchedulePolicy.order` returns, so the queues first in the order are served first.

Program-aware policies (MLFQ, PLAS, ATLAS, LPM; Autellix) are new files of this package
implementing the same two methods.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pastry.control.scheduler import Command, Queue


class SchedulePolicy(abc.ABC):
    """The order in which queues join a batch, and service accounting.

    Contract:

    - :meth:`order` is called on the scheduler's event loop each time the scheduler takes
      commands into the batch being formed (before dispatch, and again while the engine is
      busy), with the queues that have a pending command and may still contribute to this
      batch, in creation order. It returns the queues to consider, first served first; a
      queue it leaves out is not considered for this batch (it is offered again next
      time). It may read, per queue: ``queue.instance`` (the inferlet instance, i.e. the
      program run it belongs to: key per-program state by it), ``queue.priority`` (set by
      the inferlet), and its pending commands ``queue.pending`` (head first; each has
      ``created``, its arrival time on the ``time.perf_counter`` clock, ``stage`` and
      ``tokens``, the number of forward input tokens). It must not change queues or
      commands.
    - :meth:`on_batch_done` is called once per dispatched batch, after its results are
      back (or it failed), with every command of the batch (each with ``queue`` set) and the
      seconds from dispatch to completion. Use it to account service (attained service per
      program, tokens processed, ...). It must not submit or resolve commands.

    A policy object belongs to one scheduler (it may keep per-scheduler state).
    """

    @abc.abstractmethod
    def order(self, ready: Sequence[Queue]) -> list[Queue]: ...

    def on_batch_done(self, batch: Sequence[Command], elapsed_s: float) -> None:  # noqa: B027
        """Service accounting hook (nothing by default)."""


class Fcfs(SchedulePolicy):
    """First come, first served: higher queue priority first, then the oldest head command
    (ties keep creation order)."""

    def order(self, ready: Sequence[Queue]) -> list[Queue]:
        return sorted(ready, key=lambda q: (-q.priority, q.pending[0].created))
