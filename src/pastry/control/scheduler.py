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
  :class:`Fcfs`: higher-priority queues first, then the oldest head command);
- **limits**: a batch never holds more forward tokens than the engine's
  ``max_batch_tokens``, nor more queues or forward calls than the batching policy allows.

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
from typing import Any

from pastry.api import ApiError
from pastry.control.policies import Adaptive, BatchPolicy, Fcfs, SchedulePolicy
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
    SwapIn,
    SwapOut,
)

log = logging.getLogger(__name__)


class Stage(IntEnum):
    """Order of call types inside one batch; a queue's commands batch while it rises."""

    KV = 0  # CopyKv, MaskKv, SwapIn, SwapOut
    EMBED = 1
    FORWARD = 2
    OUTPUT = 3  # NextDist, Sample
    CONTROL = 9  # no engine call


_STAGE = {
    CopyKv: Stage.KV,
    MaskKv: Stage.KV,
    SwapIn: Stage.KV,
    SwapOut: Stage.KV,
    EmbedTxt: Stage.EMBED,
    Forward: Stage.FORWARD,
    NextDist: Stage.OUTPUT,
    Sample: Stage.OUTPUT,
}
# Within a batch, same-type calls must be adjacent for the engine to run them together.
_TYPE_ORDER = {t: i for i, t in enumerate(_STAGE)}


class CommandError(ApiError):
    """A command was rejected (by the control layer or the engine); only its caller sees it."""


@dataclass(eq=False)
class Command:
    """One queued API call.

    ``prepare`` runs when the command is taken into a batch: it translates the inferlet's
    handles and returns the engine call (``None`` for control commands, which act inside
    ``prepare``). Raising fails only this command. ``finish`` turns the engine's result
    into the value the caller awaits.
    """

    stage: Stage
    prepare: Callable[[], Call | None]
    finish: Callable[[Result], Any] = lambda r: r
    tokens: int = 0  # forward tokens, for the batch limit
    future: asyncio.Future = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    created: float = field(default_factory=time.perf_counter)
    call: Call | None = None
    queue: Queue | None = None  # set by submit


@dataclass(eq=False)
class Queue:
    """A command queue of one inferlet instance."""

    instance: int
    qid: int
    priority: int = 0
    pending: deque[Command] = field(default_factory=deque)
    closed: bool = False


@dataclass(eq=False)
class _Forming:
    """The batch being formed: commands taken so far and where each queue stopped."""

    commands: list[Command] = field(default_factory=list)
    tokens: int = 0
    forwards: int = 0
    per_queue: dict[Queue, list[Command]] = field(default_factory=dict)
    stage: dict[Queue, Stage] = field(default_factory=dict)
    blocked: set[Queue] = field(default_factory=set)  # no more from these in this batch

    def drop(self, q: Queue) -> list[Command]:
        mine = self.per_queue.pop(q, [])
        if mine:
            gone = set(map(id, mine))
            self.commands = [c for c in self.commands if id(c) not in gone]
            self.tokens -= sum(c.tokens for c in mine)
            self.forwards -= sum(c.stage == Stage.FORWARD for c in mine)
        return mine


@dataclass
class SchedulerStats:
    batches: int = 0
    calls: int = 0
    commands: int = 0
    forward_items: int = 0
    forward_batches: int = 0

    @property
    def mean_batch(self) -> float:
        """Mean number of forward items per batch that had any."""
        return self.forward_items / self.forward_batches if self.forward_batches else 0.0


class BatchScheduler:
    """Batches the commands of all queues of one model onto its engine.

    ``execute`` is the engine handle's async ``execute(batch) -> results``. ``batching``
    says when to dispatch and caps a batch (default :class:`Adaptive`); ``schedule`` orders
    the queues (default :class:`Fcfs`; one object per scheduler).
    """

    def __init__(
        self,
        execute: Callable[[Sequence[Call]], Any],
        max_batch_tokens: int,
        page_size: int,
        batching: BatchPolicy | None = None,
        schedule: SchedulePolicy | None = None,
    ) -> None:
        self.execute = execute
        self.max_batch_tokens = max_batch_tokens
        self.page_size = page_size
        self.batching: BatchPolicy = batching if batching is not None else Adaptive()
        self.schedule: SchedulePolicy = schedule if schedule is not None else Fcfs()
        self.queues: list[Queue] = []
        self.stats = SchedulerStats()
        self._wake = asyncio.Event()
        self._inflight = 0
        self._task: asyncio.Task | None = None
        self._qids = itertools.count()
        self._forming: _Forming | None = None

    # ---------------------------------------------------------------- queues and commands

    def create_queue(self, instance: int, priority: int = 0) -> Queue:
        q = Queue(instance, next(self._qids), priority)
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

    def submit(self, q: Queue, cmd: Command) -> asyncio.Future:
        if q.closed:
            raise CommandError("the queue is closed")
        cmd.queue = q
        q.pending.append(cmd)
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
                self.form_batch()
                continue
            await policy.wait(self)
            while self._inflight < policy.max_inflight and (batch := self.take_batch()):
                self._dispatch(batch)

    # ---------------------------------------------------------------- what policies read

    @property
    def submitted(self) -> int:
        """Commands submitted so far (:class:`~pastry.control.policies.SchedulerState`)."""
        return self.stats.commands

    def ready_count(self) -> int:
        """Commands taken into the batch being formed plus queues with a pending command."""
        taken = len(self._forming.commands) if self._forming is not None else 0
        return taken + sum(1 for q in self.queues if q.pending)

    # ---------------------------------------------------------------- forming a batch

    def form_batch(self) -> list[Command] | None:
        """Take ready commands into the batch being formed; returns it (None if empty).

        Queues are considered in the schedule policy's order, within the batching policy's
        caps. Can be called repeatedly while the engine is busy: each call adds what became
        ready since, continuing every queue where it stopped. Control commands are taken
        in queue order but act only when the batch is dispatched.
        """
        f = self._forming
        if f is None:
            f = self._forming = _Forming()
        max_queues, max_forwards = self.batching.max_queues, self.batching.max_forwards
        order = self.schedule.order([q for q in self.queues if q.pending and q not in f.blocked])
        if max_queues is not None:  # continue the queues already in, then new ones
            fresh = [q for q in order if q not in f.per_queue]
            order = [q for q in order if q in f.per_queue] + fresh[: max_queues - len(f.per_queue)]
        cap = max_forwards if max_forwards is not None else float("inf")
        for q in order:
            mine = f.per_queue.setdefault(q, [])
            stage = f.stage.get(q, Stage.KV)
            while q.pending:
                cmd = q.pending[0]
                if cmd.stage == Stage.FORWARD and f.forwards >= cap:
                    f.blocked.add(q)
                    break
                if cmd.stage != Stage.CONTROL:
                    over = f.tokens + cmd.tokens > self.max_batch_tokens and f.commands
                    if cmd.stage < stage or over:
                        f.blocked.add(q)
                        break
                    if not self._prepare(cmd):  # rejected: its future holds the error
                        q.pending.popleft()
                        continue
                    if cmd.stage == stage and _conflicts(mine, cmd, self.page_size):
                        cmd.call = None  # prepared again when it is taken later
                        f.blocked.add(q)
                        break
                    stage = cmd.stage
                    f.tokens += cmd.tokens
                    f.forwards += cmd.stage == Stage.FORWARD
                mine.append(cmd)
                f.commands.append(cmd)
                q.pending.popleft()
            f.stage[q] = stage
        return f.commands or None

    def take_batch(self) -> list[Command] | None:
        """Finish forming the current batch and hand it over (None if nothing is ready)."""
        batch = self.form_batch()
        self._forming = None
        return batch

    def _prepare(self, cmd: Command) -> bool:
        try:
            cmd.call = cmd.prepare()
        except Exception as e:  # the control layer rejected it: only this caller sees it
            if not cmd.future.done():
                cmd.future.set_exception(e if isinstance(e, ApiError) else CommandError(str(e)))
            return False
        return True

    # ---------------------------------------------------------------- dispatch

    def _dispatch(self, batch: list[Command]) -> None:
        for c in batch:  # control commands act now, in queue order (see form_batch)
            if c.stage == Stage.CONTROL:
                self._prepare(c)
        engine_cmds = [c for c in batch if c.call is not None]
        engine_cmds.sort(key=lambda c: (_STAGE[type(c.call)], _TYPE_ORDER[type(c.call)]))
        self.stats.batches += 1
        self.stats.calls += len(engine_cmds)
        n_fwd = sum(1 for c in engine_cmds if type(c.call) is Forward)
        if n_fwd:
            self.stats.forward_items += n_fwd
            self.stats.forward_batches += 1
        self._inflight += 1
        task = asyncio.get_running_loop().create_task(
            self._complete(batch, engine_cmds, time.perf_counter())
        )
        task.add_done_callback(_log_failure)

    async def _complete(
        self, batch: list[Command], engine_cmds: list[Command], started: float
    ) -> None:
        try:
            results = await self.execute([c.call for c in engine_cmds]) if engine_cmds else []
        except Exception as e:  # the engine is gone or broke: every caller gets the error
            for c in batch:
                if not c.future.done():
                    c.future.set_exception(CommandError(f"engine failure: {e}"))
            self.schedule.on_batch_done(batch, time.perf_counter() - started)
            return
        finally:
            self._inflight -= 1
            self._wake.set()
        elapsed = time.perf_counter() - started
        for c, r in zip(engine_cmds, results, strict=True):
            if c.future.done():
                continue
            if isinstance(r, CallError):
                c.future.set_exception(CommandError(r.message))
                continue
            try:
                c.future.set_result(c.finish(r))
            except Exception as e:
                c.future.set_exception(e)
        for c in batch:  # control commands resolve once the commands before them are done
            if c.stage == Stage.CONTROL and not c.future.done():
                try:
                    c.future.set_result(c.finish(None))
                except Exception as e:
                    c.future.set_exception(e)
        self.schedule.on_batch_done(batch, elapsed)


def _log_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("batch completion failed", exc_info=task.exception())


def _conflicts(earlier: list[Command], cmd: Command, ps: int) -> bool:
    """Whether ``cmd`` may not run in the same engine handler invocation as ``earlier``.

    Same-stage commands of one queue run together. A forward may read KV written by an
    earlier forward of the batch (each layer writes before it reads) but must not write
    slots an earlier one reads or writes, nor read embeddings an earlier one produces.
    Embedding writes must not overlap either.
    """
    call = cmd.call
    if isinstance(call, Forward):
        writes = _forward_writes(call, ps)
        ins = set(call.in_embeds.tolist())
        for e in earlier:
            if not isinstance(e.call, Forward):
                continue
            if writes & (_forward_reads(e.call, ps) | _forward_writes(e.call, ps)):
                return True
            if ins & set(e.call.out_embeds.tolist()):
                return True
        return False
    if isinstance(call, EmbedTxt):
        outs = set(call.out_embeds.tolist())
        return any(
            isinstance(e.call, EmbedTxt) and outs & set(e.call.out_embeds.tolist()) for e in earlier
        )
    if isinstance(call, (CopyKv, MaskKv, SwapIn, SwapOut)):
        return any(e.call is not None and e.stage == Stage.KV for e in earlier)
    return False


def _slots(pages, offset: int, n: int, ps: int) -> set[int]:
    """Global slot numbers (page * ps + i) of ``n`` tokens from ``offset`` over ``pages``."""
    return {int(pages[i // ps]) * ps + i % ps for i in range(offset, offset + n)}


def _forward_writes(f: Forward, ps: int) -> set[int]:
    return _slots(f.out_pages, f.out_offset, len(f.in_embeds), ps) if len(f.out_pages) else set()


def _forward_reads(f: Forward, ps: int) -> set[int]:
    if len(f.ctx_pages) == 0:
        return set()
    return _slots(f.ctx_pages, 0, (len(f.ctx_pages) - 1) * ps + f.ctx_last_len, ps)
