"""Command queues and the batch scheduler.

Every API call that touches the model goes onto a *command queue*. Commands of one queue
take effect in order; commands of different queues are independent. The scheduler turns
the pending commands of all queues into engine batches:

- **horizontal batching**: the head commands of many queues go into one batch;
- **vertical batching**: a queue contributes consecutive commands as long as they keep the
  engine's stage order (copy/mask -> embed -> forward -> outputs, see ``Stage``) and do not
  conflict (a later forward may extend an earlier one's KV, but may not overwrite slots or
  embeddings the earlier one uses);
- **order**: the queues are taken in the order of the :class:`SchedulePolicy` (by default
  :class:`Fcfs`: higher-priority queues first, then the call that arrived first);
- **limits**: a batch never holds more forward tokens than the engine's
  ``max_batch_tokens``, nor more forward calls than ``max_batch`` (the serving system's
  maximum batch size, the same for every schedule policy), nor more queues or forward
  calls than the batching policy allows.
- **programs**: every queue is a thread of a program in the process table
  (:mod:`pastry.control.programs`), which the scheduler tells of arrivals, dispatches and
  completions; program-aware policies read it.
- **preemption**: a queue the policy leaves out, or that does not fit, waits with its KV
  in place. When device KV memory runs short, a :class:`~pastry.control.swap.KvSwapper`
  moves the pages of programs that rank lower to host memory; before a swapped-out
  program's commands are taken, its pages come back (``SwapOut`` / ``SwapIn`` calls at the
  front of the batch, one batched copy each).

Within a batch, calls are ordered by stage, so the engine runs one handler per stage.
*Control* commands (deallocation, export, synchronize) need no engine call: they take
effect when they reach the head of their queue and resolve when the commands before them
have completed.

When to dispatch is a :class:`BatchPolicy` (:mod:`pastry.control.policies`): ``Adaptive``
(work-conserving: as soon as the engine is idle, after letting just-woken inferlets queue
their next calls), ``Eager`` (no horizontal batching: each queue's ready commands go out at
once as their own batch), ``KOnly`` (batches of at most k forward calls, sent when k
commands are ready or after ``t_ms``) and ``TOnly`` (a batch every ``t_ms``, whatever is
ready).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from pastry.control.commands import (
    STAGE_OF,
    TYPE_ORDER,
    Command,
    CommandError,
    Prepared,
    Queue,
    Stage,
)
from pastry.control.forming import Forming, prepare
from pastry.control.policies import Adaptive, BatchPolicy, Fcfs, SchedulePolicy
from pastry.control.programs import ProcessTable, Thread
from pastry.control.resources import ResourceError
from pastry.wire.calls import (
    Call,
    CallError,
    Forward,
)


class Swapper(Protocol):
    """What the scheduler asks of the KV swapper (:class:`pastry.control.swap.KvSwapper`,
    which the controller sets when the engine can swap)."""

    def new_pass(self) -> None: ...

    def ensure_resident(self, instance: int, force: bool = False) -> bool: ...

    def take_calls(self) -> list[Call]: ...


log = logging.getLogger(__name__)


@dataclass
class SchedulerStats:
    batches: int = 0
    calls: int = 0
    commands: int = 0
    forward_items: int = 0
    forward_batches: int = 0
    # The scheduler's own time on the event loop: forming and preparing batches,
    # dispatching them (hooks included) and delivering their results; not the policy's
    # waits, the engine, nor the inferlets' code.
    seconds: float = 0.0

    @property
    def mean_batch(self) -> float:
        """Mean number of forward items per batch that had any."""
        return self.forward_items / self.forward_batches if self.forward_batches else 0.0


class BatchScheduler:
    """Batches the commands of all queues of one model onto its engine.

    ``execute`` is the engine handle's async ``execute(batch) -> results``. ``batching``
    says when to dispatch and caps a batch (default :class:`Adaptive`); ``schedule`` orders
    the queues (default :class:`Fcfs`; one object per scheduler). ``programs`` is the
    process table it reports to (default: its own), ``engine`` the model's name there;
    ``max_batch`` caps the forward calls of a batch (None: no cap). ``swapper`` (set by
    the controller when the engine can swap) keeps preempted programs' KV in host memory.
    """

    def __init__(
        self,
        execute: Callable[[Sequence[Call]], Any],
        max_batch_tokens: int,
        page_size: int,
        batching: BatchPolicy | None = None,
        schedule: SchedulePolicy | None = None,
        *,
        programs: ProcessTable | None = None,
        engine: str = "",
        max_batch: int | None = None,
    ) -> None:
        if max_batch is not None and (not isinstance(max_batch, int) or max_batch < 1):
            raise ValueError(f"max_batch must be an integer >= 1 or None, got {max_batch!r}")
        self.execute = execute
        self.max_batch_tokens = max_batch_tokens
        self.page_size = page_size
        self.max_batch = max_batch
        self.batching: BatchPolicy = batching if batching is not None else Adaptive()
        self.schedule: SchedulePolicy = schedule if schedule is not None else Fcfs()
        self.programs = programs if programs is not None else ProcessTable()
        self.engine = engine
        self.schedule.bind(self.programs)
        self.swapper: Swapper | None = None
        self.queues: list[Queue] = []
        self.stats = SchedulerStats()
        self._wake = asyncio.Event()
        self._inflight = 0
        self._task: asyncio.Task | None = None
        self._qids = itertools.count()
        self._forming: Forming | None = None
        # Called with (batch, seconds from dispatch to results) after each batch completes
        # (metrics); they must be quick and must not raise.
        self.observers: list[Callable[[list[Command], float], None]] = []
        # Called with a batch's (command, engine call) pairs in execution order when it is
        # dispatched, before its control commands act (the prefix cache's provenance of KV
        # pages); then with the same pairs and their results (None: the engine failed)
        # when they are back, before any command resolves. Failures are logged.
        self.on_dispatch: Callable[[list[tuple[Command, Call]]], None] | None = None
        self.on_complete: Callable[[list[tuple[Command, Call]], list | None], None] | None = None

    # ---------------------------------------------------------------- queues and commands

    def create_queue(self, instance: int, priority: int = 0) -> Queue:
        q = Queue(instance, next(self._qids), priority)
        q.thread = self.programs.open_thread(instance, self.engine)
        self.queues.append(q)
        return q

    def close_queue(self, q: Queue, reason: str = "queue closed") -> None:
        """Drop a queue; its pending commands (also those already taken into the batch
        being prepared) fail with ``reason``."""
        q.closed = True
        dropped = list(q.pending)
        q.pending.clear()
        if self._forming is not None:
            dropped += self._forming.drop(q)
        for cmd in dropped:
            if not cmd.future.done():
                cmd.future.set_exception(CommandError(reason))
        if q in self.queues:
            self.queues.remove(q)
        if q.thread is not None:
            self.programs.close_thread(q.thread)

    def set_priority(self, q: Queue, priority: int) -> None:
        """Higher-priority queues are taken first: FCFS orders by priority, then arrival;
        the multilevel policies (MLFQ, PLAS, ATLAS) by level, then priority, then entry."""
        q.priority = int(priority)

    def submit(self, q: Queue, cmd: Command) -> asyncio.Future:
        if q.closed:
            raise CommandError("the queue is closed")
        cmd.queue = q
        q.pending.append(cmd)
        self.programs.arrive(q.thread, cmd.created)
        self.stats.commands += 1
        self._wake.set()
        return cmd.future

    # ---------------------------------------------------------------- the loop

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="batch-scheduler")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        policy = self.batching
        while True:
            await self._wake.wait()
            self._wake.clear()
            if self._inflight >= policy.max_inflight:
                # The engine is busy: prepare the next batch (take and translate what is
                # ready) so that only late arrivals are left to do when it goes idle.
                t0 = time.perf_counter()
                self.form_batch()
                self.stats.seconds += time.perf_counter() - t0
                continue
            await policy.wait(self)
            t0 = time.perf_counter()
            while self._inflight < policy.max_inflight and (batch := self.take_batch()):
                try:
                    self._dispatch(batch)
                except Exception as e:  # a bug in a hook: fail this batch, keep serving
                    log.error("dispatching a batch failed", exc_info=e)
                    for c in batch:
                        if not c.future.done():
                            c.future.set_exception(CommandError(f"internal error: {e}"))
            self.stats.seconds += time.perf_counter() - t0

    # ---------------------------------------------------------------- what policies read

    @property
    def submitted(self) -> int:
        """Commands submitted so far (:class:`~pastry.control.policies.SchedulerState`)."""
        return self.stats.commands

    def busy(self, besides: Queue | None = None) -> bool:
        """Whether work is under way that may release memory: a batch on the engine,
        commands taken into the batch being formed, or queues (but ``besides``) with a
        pending command that is not a prefill waiting for admission."""
        if self._inflight > 0 or (self._forming is not None and self._forming.commands):
            return True
        return any(
            q.pending and q.pending[0].admission is None for q in self.queues if q is not besides
        )

    def wake(self) -> None:
        """Look at the queues again (e.g. memory was released outside any batch)."""
        self._wake.set()

    @property
    def forming(self) -> Forming | None:
        """The batch being formed (None between batches)."""
        return self._forming

    def ready_count(self) -> int:
        """Commands taken into the batch being formed plus queues with a pending command."""
        taken = len(self._forming.commands) if self._forming is not None else 0
        return taken + sum(1 for q in self.queues if q.pending)

    # ---------------------------------------------------------------- forming a batch

    def form_batch(self) -> list[Command] | None:
        """Take ready commands into the batch being formed; returns it (None if empty).

        Queues are considered in the schedule policy's order, within the batching policy's
        caps and ``max_batch``. Can be called repeatedly while the engine is busy: each
        call adds what became ready since, continuing every queue where it stopped. Control
        commands are taken in queue order but act only when the batch is dispatched. A
        queue whose program has KV in host memory is taken only once the swapper brought
        it back; if no queue could be taken and nothing is on the engine, the first such
        queue is brought back by force (or its commands fail), so the loop never stalls.
        """
        f = self._forming
        if f is None:
            f = self._forming = Forming(self.max_batch_tokens, self.page_size, self.programs)
        max_queues, max_forwards = self.batching.max_queues, self.batching.max_forwards
        order = self.schedule.order([q for q in self.queues if q.pending and q not in f.blocked])
        if max_queues is not None:  # continue the queues already in, then new ones
            fresh = [q for q in order if q not in f.per_queue]
            order = [q for q in order if q in f.per_queue] + fresh[: max_queues - len(f.per_queue)]
        caps = [c for c in (max_forwards, self.max_batch) if c is not None]
        cap = min(caps) if caps else float("inf")
        swapper, swapped_out = self.swapper, []
        if swapper is not None:
            swapper.new_pass()
        for q in order:
            if f.forwards >= cap and q.pending[0].forwards:
                f.blocked.add(q)  # the batch is full: it waits, its KV is not brought back
                continue
            if swapper is not None and not swapper.ensure_resident(q.instance):
                swapped_out.append(q)  # preempted: its KV stays in host memory for now
                continue
            f.take(q, cap)
        if swapped_out and not f.commands and self._inflight == 0:
            q = swapped_out[0]
            if self._force_resident(q):
                f.take(q, cap)
        if f.deferred:
            f.prepare_deferred()
        return f.commands or None

    def _force_resident(self, q: Queue) -> bool:
        """Bring ``q``'s program back whatever it costs others; if even that cannot free
        the memory, its pending commands fail with the reason."""
        assert self.swapper is not None
        try:
            return self.swapper.ensure_resident(q.instance, force=True)
        except ResourceError as e:  # OutOfResources: the program cannot fit at all
            dropped = list(q.pending)
            q.pending.clear()
            self.programs.dropped(q.thread, len(dropped))
            for cmd in dropped:
                if not cmd.future.done():
                    cmd.future.set_exception(CommandError(str(e)))
            return False

    def busy_instances(self) -> set[int]:
        """Instances with commands in the batch being formed or on the engine: their KV
        may not move."""
        busy = {q.instance for q in self.queues if q.thread is not None and q.thread.inflight}
        if self._forming is not None:
            busy.update(q.instance for q, mine in self._forming.per_queue.items() if mine)
        return busy

    def take_batch(self) -> list[Command] | None:
        """Finish forming the current batch and hand it over (None if nothing is ready)."""
        batch = self.form_batch()
        self._forming = None
        return batch

    # ---------------------------------------------------------------- dispatch

    def _dispatch(self, batch: list[Command]) -> None:
        # (command, engine call) pairs in execution order: by stage, then by call type so
        # that the engine runs each type once; a fused command contributes each of its calls.
        # Bucketed by type (the types are listed in stage order): O(batch), no sort.
        buckets: list[list[tuple[Command, Call]]] = [[] for _ in TYPE_ORDER]
        for c in batch:
            call = c.call
            if call is None or c.stage == Stage.CONTROL:
                continue
            if type(call) is tuple:
                for part in call:
                    buckets[TYPE_ORDER[type(part)]].append((c, part))
            else:
                buckets[TYPE_ORDER[type(call)]].append((c, call))
        calls = [pair for bucket in buckets for pair in bucket]
        if self.on_dispatch is not None:
            self.on_dispatch(calls)
        for c in batch:  # control commands act now, in queue order (see form_batch)
            if c.stage == Stage.CONTROL:
                prepare(c)
        if self.swapper is not None:  # pages to move first (they free or fill pages used here)
            calls[:0] = [(_internal(call), call) for call in self.swapper.take_calls()]
        self.stats.batches += 1
        self.stats.calls += len(calls)
        n_fwd = sum(1 for _, call in calls if type(call) is Forward)
        if n_fwd:
            self.stats.forward_items += n_fwd
            self.stats.forward_batches += 1
        self._inflight += 1
        started = time.perf_counter()
        self.programs.dispatched(_per_thread(batch).items(), self.programs.clock())
        task = asyncio.get_running_loop().create_task(self._complete(batch, calls, started))
        task.add_done_callback(_log_failure)

    async def _complete(
        self, batch: list[Command], calls: list[tuple[Command, Call]], started: float
    ) -> None:
        try:
            results = await self.execute([call for _, call in calls]) if calls else []
        except Exception as e:  # the engine is gone or broke: every caller gets the error
            self._completed(calls, None)
            for c in batch:
                if not c.future.done():
                    c.future.set_exception(CommandError(f"engine failure: {e}"))
                    # Callers that ended with the engine (their instances are terminated
                    # with its failure) no longer listen: not an unretrieved error.
                    c.future.add_done_callback(_heard)
            self._account(batch, time.perf_counter() - started)
            return
        finally:
            self._inflight -= 1
            self._wake.set()
        back = time.perf_counter()
        elapsed = back - started
        self._completed(calls, results)
        for (c, call), r in zip(calls, results, strict=True):
            if c.queue is None:  # the swapper's: nobody waits for it
                if isinstance(r, CallError):
                    log.error("KV swap failed (a bookkeeping bug): %s", r.message)
                continue
            if c.future.done():
                continue
            if isinstance(r, CallError):  # a fused command fails with its first error
                c.future.set_exception(CommandError(r.message))
                continue
            if c.last_stage is not None and call is not c.call[-1]:
                continue  # a fused command resolves with its last call
            finish = c.op.finish  # Command.result, inline: once per call of every batch
            try:
                c.future.set_result(r if finish is None else finish(r))
            except Exception as e:
                c.future.set_exception(e)
        for c in batch:  # commands without an engine call (control ones) resolve once the
            if c.call is None and not c.future.done():  # commands before them are done
                try:
                    c.future.set_result(c.result(None))
                except Exception as e:
                    c.future.set_exception(e)
        self._account(batch, elapsed)
        self.stats.seconds += time.perf_counter() - back

    def _completed(self, calls: list[tuple[Command, Call]], results: list | None) -> None:
        if self.on_complete is not None and calls:
            try:
                self.on_complete(calls, results)
            except Exception as e:  # a bug in a hook: the callers still get their results
                log.error("the batch completion hook failed", exc_info=e)

    def _account(self, batch: list[Command], elapsed: float) -> None:
        """Charge the batch to the process table, then tell the schedule policy."""
        counts = _per_thread(batch)
        forwards = {c.queue.thread for c in batch if c.forwards}
        done = [(t, n, t in forwards) for t, n in counts.items()]
        self.programs.completed(done, elapsed, self.programs.clock())
        self.schedule.on_batch_done(batch, elapsed)
        for observe in self.observers:
            observe(batch, elapsed)


def _per_thread(batch: Sequence[Command]) -> dict[Thread, int]:
    counts: dict[Thread, int] = {}
    for c in batch:
        t = c.queue.thread
        counts[t] = counts.get(t, 0) + 1
    return counts


def _internal(call: Call) -> Command:
    """A command of the control layer itself (no queue, nobody awaits it)."""
    return Command(STAGE_OF[type(call)], Prepared(call), call=call)


def _heard(future: asyncio.Future) -> None:
    future.exception()  # marks it retrieved; a caller that awaits it still gets it


def _log_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("batch completion failed", exc_info=task.exception())
