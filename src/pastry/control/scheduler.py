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
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, Protocol

from pastry.api import ApiError
from pastry.control.policies import Adaptive, BatchPolicy, Fcfs, SchedulePolicy
from pastry.control.programs import ProcessTable, Thread
from pastry.control.resources import ResourceError
from pastry.engine.calls import (
    Call,
    CallError,
    CopyKv,
    EmbedTxt,
    Forward,
    MaskKv,
    NextDist,
    Result,
    Sample,
    SendKv,
    SwapIn,
    SwapOut,
)


class Swapper(Protocol):
    """What the scheduler asks of the KV swapper (:class:`pastry.control.swap.KvSwapper`,
    which the controller sets when the engine can swap)."""

    def new_pass(self) -> None: ...

    def ensure_resident(self, instance: int, force: bool = False) -> bool: ...

    def take_calls(self) -> list[Call]: ...


log = logging.getLogger(__name__)


class Stage(IntEnum):
    """Order of call types inside one batch; a queue's commands batch while it rises."""

    KV = 0  # SwapOut, SwapIn (the swapper's, first), CopyKv, MaskKv
    EMBED = 1
    FORWARD = 2
    OUTPUT = 3  # NextDist, Sample
    CONTROL = 9  # no engine call


_STAGE = {
    SwapOut: Stage.KV,  # out before in: a swap-in may fill pages a swap-out frees
    SwapIn: Stage.KV,
    CopyKv: Stage.KV,
    MaskKv: Stage.KV,
    EmbedTxt: Stage.EMBED,
    Forward: Stage.FORWARD,
    NextDist: Stage.OUTPUT,
    Sample: Stage.OUTPUT,
    SendKv: Stage.OUTPUT,  # after the forward that computes what it sends
}
# Within a batch, same-type calls must be adjacent for the engine to run them together;
# a batch lists them in this order (``_STAGE`` lists the types in stage order).
_TYPE_ORDER = {t: i for i, t in enumerate(_STAGE)}
assert list(_STAGE.values()) == sorted(_STAGE.values())


class CommandError(ApiError):
    """A command was rejected (by the control layer or the engine); only its caller sees it."""


class NotAdmitted(Exception):
    """Raised by an op's ``prepare`` that cannot run yet (e.g. a prefill waiting for KV
    pages): the command stays at the head of its queue and is offered again in a later
    batch."""


class Op:
    """What a command does, as data: a record whose class says how it is prepared.

    ``prepare()`` runs when the command is taken into a batch: it translates the
    inferlet's handles and returns the engine call (or a tuple of calls for a fused
    command); raising fails only this command (:class:`NotAdmitted`: not yet). For a
    ``Stage.CONTROL`` command it is the action itself (run when the batch is dispatched,
    in queue order) and returns None. ``finish(result)`` (None: the result as it is) turns
    the engine's result into the value the caller awaits. An op class with ``batched``
    set also has a static ``prepare_batch(commands)`` that prepares every command of that
    class taken into a batch in one pass (:class:`~pastry.control.steps.Step`).

    Ops hold no closures: a queued command can be ordered, batched, inspected, forwarded
    to another process and run ahead like any other value.
    """

    __slots__ = ()
    batched = False
    finish = None

    def prepare(self) -> Call | tuple[Call, ...] | None:
        raise NotImplementedError

    @staticmethod
    def prepare_batch(commands: list[Command]) -> list[Command]:
        """Set ``call`` of every command (its future's exception where it is refused), in
        one pass and in order; returns those left for :meth:`prepare` one by one (before
        anything was done for them)."""
        raise NotImplementedError


class Prepared(Op):
    """A call the control layer made itself (the swapper's copies): nothing to translate."""

    __slots__ = ("call",)

    def __init__(self, call: Call) -> None:
        self.call = call

    def prepare(self) -> Call:
        return self.call


@dataclass(eq=False)
class Command:
    """One queued API call: its :class:`Op` (what it does, as data) and its place in the
    batch.

    A *fused* command (``last_stage`` set) prepares a tuple of calls whose stages rise
    from ``stage`` to ``last_stage`` (the SDK's decode step: embed, forward, sample): they
    go into one batch, the engine runs each with the calls of its type, and the command
    resolves once, with ``finish`` of its last call's result (or the first call's error).
    """

    stage: Stage
    op: Op
    tokens: int = 0  # forward tokens, for the batch limit
    future: asyncio.Future = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    created: float = field(default_factory=time.perf_counter)
    call: Call | tuple[Call, ...] | None = None
    queue: Queue | None = None  # set by submit
    admission: Any = None  # what a waiting prefill asks for (control/policies/admission.py)
    last_stage: Stage | None = None  # a fused command's last stage (None: one call)

    @property
    def end_stage(self) -> Stage:
        """The stage of the command's last call."""
        return self.stage if self.last_stage is None else self.last_stage

    @property
    def forwards(self) -> bool:
        """Whether the command runs a forward (counts against the forward caps)."""
        return self.stage <= Stage.FORWARD <= self.end_stage

    def parts(self) -> tuple[Call, ...]:
        """The prepared engine calls (none before ``prepare``, or for control commands)."""
        call = self.call
        if call is None:
            return ()
        return call if type(call) is tuple else (call,)

    def result(self, r: Result) -> Any:
        """The value its caller awaits, from the engine's result ``r``."""
        finish = self.op.finish
        return r if finish is None else finish(r)


@dataclass(eq=False)
class Queue:
    """A command queue of one inferlet instance."""

    instance: int
    qid: int
    priority: int = 0
    pending: deque[Command] = field(default_factory=deque)
    closed: bool = False
    thread: Thread | None = None  # its entry in the process table


@dataclass(eq=False)
class _Forming:
    """The batch being formed: commands taken so far and where each queue stopped."""

    commands: list[Command] = field(default_factory=list)
    tokens: int = 0
    forwards: int = 0
    per_queue: dict[Queue, list[Command]] = field(default_factory=dict)
    stage: dict[Queue, Stage] = field(default_factory=dict)
    blocked: set[Queue] = field(default_factory=set)  # no more from these in this batch
    deferred: list[Command] = field(default_factory=list)  # batched ops, not prepared yet

    def drop(self, q: Queue) -> list[Command]:
        mine = self.per_queue.pop(q, [])
        if mine:
            gone = set(map(id, mine))
            self.commands = [c for c in self.commands if id(c) not in gone]
            self.deferred = [c for c in self.deferred if id(c) not in gone]
            self.tokens -= sum(c.tokens for c in mine)
            self.forwards -= sum(c.forwards for c in mine)
        return mine


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
        self._forming: _Forming | None = None
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
            f = self._forming = _Forming()
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
            self._take(q, f, cap)
        if swapped_out and not f.commands and self._inflight == 0:
            q = swapped_out[0]
            if self._force_resident(q):
                self._take(q, f, cap)
        if f.deferred:
            self._prepare_deferred(f)
        return f.commands or None

    def _prepare_deferred(self, f: _Forming) -> None:
        """Prepare the batched commands taken since the last call: each run of one kind in
        one pass (:meth:`BatchPrepared.prepare_batch`), in the order they were taken; the
        refused ones leave the batch (their futures hold the errors)."""
        cmds, f.deferred = f.deferred, []
        i = 0
        while i < len(cmds):
            kind = type(cmds[i].op)
            j = i + 1
            while j < len(cmds) and type(cmds[j].op) is kind:
                j += 1
            for cmd in kind.prepare_batch(cmds[i:j]):
                self._prepare(cmd)
            i = j
        for cmd in cmds:
            if cmd.call is None:  # refused
                if not cmd.future.done():
                    cmd.future.set_exception(CommandError("the command could not be prepared"))
                q = cmd.queue
                mine = f.per_queue.get(q, ())
                if cmd not in mine:  # its queue was closed meanwhile
                    continue
                mine.remove(cmd)
                f.commands.remove(cmd)
                f.tokens -= cmd.tokens
                f.forwards -= cmd.forwards
                self.programs.dropped(q.thread)

    def _take(self, q: Queue, f: _Forming, cap: float) -> None:
        """Take ``q``'s commands into ``f`` while they keep the stage order, do not
        conflict and fit."""
        mine = f.per_queue.setdefault(q, [])
        stage = f.stage.get(q, Stage.KV)
        while q.pending:
            cmd = q.pending[0]
            forwards = cmd.forwards
            if forwards and f.forwards >= cap:
                f.blocked.add(q)
                break
            if cmd.stage != Stage.CONTROL:
                over = f.tokens + cmd.tokens > self.max_batch_tokens and f.commands
                if cmd.stage < stage or over:
                    f.blocked.add(q)
                    break
                if cmd.op.batched and cmd.stage != stage:
                    # Prepared with the batch's others of its kind (form_batch's end): none
                    # of its queue's commands in the batch is at its stage, so it cannot
                    # conflict with them.
                    f.deferred.append(cmd)
                else:
                    if f.deferred:  # those taken before act first, as they were taken
                        self._prepare_deferred(f)
                    ok = self._prepare(cmd)
                    if ok is None:  # not admitted yet: it stays first in its queue
                        f.blocked.add(q)
                        break
                    if not ok:  # rejected: its future holds the error
                        q.pending.popleft()
                        self.programs.dropped(q.thread)
                        continue
                    if cmd.stage == stage and _conflicts(mine, cmd, self.page_size):
                        cmd.call = None  # prepared again when it is taken later
                        f.blocked.add(q)
                        break
                stage = cmd.end_stage
                f.tokens += cmd.tokens
                f.forwards += forwards
            mine.append(cmd)
            f.commands.append(cmd)
            q.pending.popleft()
        f.stage[q] = stage

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

    def _prepare(self, cmd: Command) -> bool | None:
        """Translate ``cmd``: True if prepared, False if rejected (its future holds the
        error), None if it raised :class:`NotAdmitted`."""
        try:
            cmd.call = cmd.op.prepare()
        except NotAdmitted:
            return None
        except Exception as e:  # the control layer rejected it: only this caller sees it
            if not cmd.future.done():
                cmd.future.set_exception(e if isinstance(e, ApiError) else CommandError(str(e)))
            return False
        return True

    # ---------------------------------------------------------------- dispatch

    def _dispatch(self, batch: list[Command]) -> None:
        # (command, engine call) pairs in execution order: by stage, then by call type so
        # that the engine runs each type once; a fused command contributes each of its calls.
        # Bucketed by type (the types are listed in stage order): O(batch), no sort.
        buckets: list[list[tuple[Command, Call]]] = [[] for _ in _TYPE_ORDER]
        for c in batch:
            call = c.call
            if call is None or c.stage == Stage.CONTROL:
                continue
            if type(call) is tuple:
                for part in call:
                    buckets[_TYPE_ORDER[type(part)]].append((c, part))
            else:
                buckets[_TYPE_ORDER[type(call)]].append((c, call))
        calls = [pair for bucket in buckets for pair in bucket]
        if self.on_dispatch is not None:
            self.on_dispatch(calls)
        for c in batch:  # control commands act now, in queue order (see form_batch)
            if c.stage == Stage.CONTROL:
                self._prepare(c)
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
            try:
                c.future.set_result(c.result(r))
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
    return Command(_STAGE[type(call)], Prepared(call), call=call)


def _log_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("batch completion failed", exc_info=task.exception())


def _conflicts(earlier: list[Command], cmd: Command, ps: int) -> bool:
    """Whether ``cmd`` may not run in the same engine handler invocation as ``earlier``.

    Same-stage commands of one queue run together. A forward may read KV written by an
    earlier forward of the batch (each layer writes before it reads) but must not write
    slots an earlier one reads or writes, nor read embeddings an earlier one produces.
    Embedding writes must not overlap either. A fused command conflicts if any of its
    calls does (its own calls rise in stage, so they never conflict with each other).
    """
    if cmd.last_stage is not None:
        return any(_call_conflicts(earlier, call, ps) for call in cmd.parts())
    return _call_conflicts(earlier, cmd.call, ps)


def _call_conflicts(earlier: list[Command], call: Call, ps: int) -> bool:
    """:func:`_conflicts` for one engine call against the calls of ``earlier``."""
    if isinstance(call, Forward):
        writes = _forward_writes(call, ps)
        ins = set(call.in_embeds.tolist())
        for e in _calls_of(earlier, Forward):
            if writes & (_forward_reads(e, ps) | _forward_writes(e, ps)):
                return True
            if ins & set(e.out_embeds.tolist()):
                return True
        return False
    if isinstance(call, EmbedTxt):
        outs = set(call.out_embeds.tolist())
        return any(outs & set(e.out_embeds.tolist()) for e in _calls_of(earlier, EmbedTxt))
    if isinstance(call, (CopyKv, MaskKv, SwapIn, SwapOut)):
        # The engine runs all copies of a batch, then all masks, then swaps: calls of one
        # queue that touch different pages may share a batch, in any order.
        mine = _kv_pages(call)
        return any(mine & _kv_pages(e) for e in _calls_of(earlier, CopyKv, MaskKv, SwapIn, SwapOut))
    return False


def _calls_of(commands: list[Command], *types: type) -> list[Call]:
    """The engine calls of ``types`` among ``commands`` (fused ones' parts included)."""
    return [call for c in commands for call in c.parts() if isinstance(call, types)]


def _kv_pages(call: Call) -> set[int]:
    """The KV pages a copy, mask or swap reads or writes (host pages as ``-1 - id``)."""
    if isinstance(call, CopyKv):
        return {int(call.src_page), int(call.dst_page)}
    if isinstance(call, MaskKv):
        return {int(call.page)}
    if isinstance(call, (SwapIn, SwapOut)):
        return set(call.pages.tolist()) | {-1 - h for h in call.host_pages.tolist()}
    return set()


def _slots(pages, offset: int, n: int, ps: int) -> set[int]:
    """Global slot numbers (page * ps + i) of ``n`` tokens from ``offset`` over ``pages``."""
    return {int(pages[i // ps]) * ps + i % ps for i in range(offset, offset + n)}


def _forward_writes(f: Forward, ps: int) -> set[int]:
    return _slots(f.out_pages, f.out_offset, len(f.in_embeds), ps) if len(f.out_pages) else set()


def _forward_reads(f: Forward, ps: int) -> set[int]:
    if len(f.ctx_pages) == 0:
        return set()
    return _slots(f.ctx_pages, 0, (len(f.ctx_pages) - 1) * ps + f.ctx_last_len, ps)
