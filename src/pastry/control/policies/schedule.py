"""Scheduling policies: which ready queues a batch takes first, and who gives way.

Batching (:mod:`.batching`) decides *when* a batch goes out and how big it may be; a
:class:`SchedulePolicy` decides *who* gets into it when not everyone fits (``max_batch``,
``max_batch_tokens``, ``max_forwards``, ``max_queues``), and which programs are preempted
(their KV swapped to host memory) when memory is short. The scheduler takes commands queue
by queue in the order :meth:`~SchedulePolicy.order` returns, so the queues first in the
order are served first; a queue left out waits (it is preempted).

Policies: :class:`Fcfs` (here), ``Mlfq`` (:mod:`.mlfq`), ``Plas`` (:mod:`.plas`) and
``Atlas`` (:mod:`.atlas`); :func:`schedule_policy` builds one by name (``pastry serve
--schedule``). Program-aware policies read the process table
(:mod:`pastry.control.programs`) through each queue's ``thread``.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import ClassVar

from pastry.control.policies.views import CommandView, QueueView
from pastry.control.programs import ProcessTable, Program, Thread


class SchedulePolicy(abc.ABC):
    """The order in which queues join a batch, preemption ranks, and service accounting.

    Contract:

    - :meth:`bind` is called once by the scheduler that owns the policy, with the process
      table (:class:`~pastry.control.programs.ProcessTable`) that the scheduler feeds.
    - :meth:`order` is called on the scheduler's event loop each time the scheduler takes
      commands into the batch being formed (before dispatch, and again while the engine is
      busy), with the queues that have a pending command and may still contribute to this
      batch, in creation order. It returns the queues to consider, first served first; a
      queue it leaves out is not considered for this batch (it is offered again next
      time). It may read, per queue: ``queue.instance`` (the inferlet instance),
      ``queue.priority`` (set by the inferlet), its pending commands ``queue.pending``
      (head first; each has ``created``, its arrival time on the table's clock, ``stage``
      and ``tokens``, the number of forward input tokens) and ``queue.thread`` (its
      :class:`~pastry.control.programs.Thread` in the process table, ``None`` for a queue
      made outside a scheduler). It must not change queues or commands; it may change the
      placement fields of a thread's current call (``level``, ``level_mark``,
      ``entered``) and, when it promotes a call, reset its ``wait`` and ``run``.
    - :meth:`rank` orders programs for preemption: when device KV memory is short, the
      pages of programs that rank after the one that needs memory (and are not in the
      batch being formed or on the engine) are swapped out, the last-ranked first. Only a
      strictly better rank may take another program's memory.
    - :meth:`on_batch_done` is called once per dispatched batch, after its results are
      back (or it failed) and after the process table was charged, with every command of
      the batch (each with ``queue`` set) and the seconds from dispatch to completion. It
      must not submit or resolve commands.

    A policy object belongs to one scheduler (it may keep per-scheduler state).
    """

    name: ClassVar[str] = ""
    programs: ProcessTable | None = None

    def bind(self, programs: ProcessTable) -> None:
        """Called by the owning scheduler with its process table."""
        self.programs = programs

    @abc.abstractmethod
    def order(self, ready: Sequence[QueueView]) -> list[QueueView]: ...

    def rank(self, program: Program) -> tuple[float, ...]:
        """Sort key for preemption (smaller: more important). Default: programs with an
        active call (:attr:`~pastry.control.programs.Program.active`) before idle ones (an
        idle program, e.g. in a tool call, gives way first, the longest idle first), then
        by the arrival of their oldest active call."""
        arrivals = [t.call.arrival for t in program.active]
        return (0.0, min(arrivals)) if arrivals else (1.0, -(program.last_completion or 0.0))

    def on_batch_done(self, batch: Sequence[CommandView], elapsed_s: float) -> None:  # noqa: B027
        """Service accounting hook (nothing by default; the process table is charged by
        the scheduler)."""

    def describe(self) -> str:
        """One line for logs and benchmark tables."""
        return self.name or type(self).__name__


def call_arrival(q: QueueView) -> float:
    """When ``q``'s current call began (its head command's arrival if it has no thread)."""
    thread: Thread | None = getattr(q, "thread", None)
    if thread is not None and thread.call is not None:
        return thread.call.arrival
    return q.pending[0].created


class Fcfs(SchedulePolicy):
    """First come, first served: higher queue priority first, then the call that arrived
    first (ties keep creation order).

    A call is a thread's busy period (:mod:`pastry.control.programs`), so a running
    generation keeps its place until it stops (non-preemptive, like vLLM's FCFS): a new
    call waits for the calls before it rather than taking turns with them. For queues
    whose current call began with their head command (every queue, when the batch limits
    take everyone), this is "the oldest head command first".
    """

    name: ClassVar[str] = "fcfs"

    def order(self, ready: Sequence[QueueView]) -> list[QueueView]:
        return sorted(ready, key=lambda q: (-q.priority, call_arrival(q)))

    def describe(self) -> str:
        return "fcfs (by call arrival)"
