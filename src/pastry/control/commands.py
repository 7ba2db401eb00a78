"""Commands as data: what a queued API call is, and the stage order of a batch.

An inferlet's call that touches the model becomes a :class:`Command` on its
:class:`Queue`: the :class:`Op` (a record whose class says how it is prepared:
:mod:`pastry.control.ops`, :mod:`pastry.control.steps`, :mod:`pastry.control.prefill`),
its :class:`Stage` in the batch, and the future its caller awaits. The scheduler
(:mod:`pastry.control.scheduler`) orders and batches commands, the op translates itself to
engine calls when its batch is formed, and :meth:`Command.result` turns the engine's
result into the caller's value. :func:`conflicts` says when two commands of one queue may
not share an engine handler invocation.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

from pastry.api import ApiError
from pastry.control.programs import Thread
from pastry.wire.calls import (
    Call,
    CopyKv,
    EmbedImg,
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


class Stage(IntEnum):
    """Order of call types inside one batch; a queue's commands batch while it rises."""

    KV = 0  # SwapOut, SwapIn (the swapper's, first), CopyKv, MaskKv
    EMBED = 1
    FORWARD = 2
    OUTPUT = 3  # NextDist, Sample
    CONTROL = 9  # no engine call


STAGE_OF = {
    SwapOut: Stage.KV,  # out before in: a swap-in may fill pages a swap-out frees
    SwapIn: Stage.KV,
    CopyKv: Stage.KV,
    MaskKv: Stage.KV,
    EmbedTxt: Stage.EMBED,
    EmbedImg: Stage.EMBED,
    Forward: Stage.FORWARD,
    NextDist: Stage.OUTPUT,
    Sample: Stage.OUTPUT,
    SendKv: Stage.OUTPUT,  # after the forward that computes what it sends
}
# Within a batch, same-type calls must be adjacent for the engine to run them together;
# a batch lists them in this order (``STAGE_OF`` lists the types in stage order).
TYPE_ORDER = {t: i for i, t in enumerate(STAGE_OF)}
assert list(STAGE_OF.values()) == sorted(STAGE_OF.values())


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


NEW_FUTURE: Any = object()  # Command's default future: a new one on the running loop


class Command:
    """One queued API call: its :class:`Op` (what it does, as data) and its place in the
    batch.

    A *fused* command (``last_stage`` set) prepares a tuple of calls whose stages rise
    from ``stage`` to ``last_stage`` (the SDK's decode step: embed, forward, sample): they
    go into one batch, the engine runs each with the calls of its type, and the command
    resolves once, with ``finish`` of its last call's result (or the first call's error).

    ``end_stage`` (the stage of its last call) and ``forwards`` (whether it runs a forward,
    which counts against the forward caps) are fixed when it is made: a command's stages
    never change, and batch forming reads both several times per command. Slotted, with
    its own ``__init__``: one is made per API call on the decode path.
    """

    __slots__ = (
        "admission",
        "call",
        "created",
        "end_stage",
        "forwards",
        "future",
        "last_stage",
        "op",
        "queue",
        "stage",
        "tokens",
    )  # fmt: skip

    def __init__(
        self,
        stage: Stage,
        op: Op,
        tokens: int = 0,  # forward tokens, for the batch limit
        future: asyncio.Future | None = NEW_FUTURE,  # default: one on the running loop
        created: float | None = None,  # None: now (time.perf_counter)
        call: Call | tuple[Call, ...] | None = None,
        queue: Queue | None = None,  # set by submit
        admission: Any = None,  # what a waiting prefill asks for (policies/admission.py)
        last_stage: Stage | None = None,  # a fused command's last stage (None: one call)
    ) -> None:
        self.stage, self.op, self.tokens, self.call, self.queue = stage, op, tokens, call, queue
        self.future = asyncio.get_running_loop().create_future() if future is NEW_FUTURE else future
        self.created = time.perf_counter() if created is None else created
        self.admission, self.last_stage = admission, last_stage
        end = stage if last_stage is None else last_stage
        self.end_stage: Stage = end
        self.forwards: bool = stage <= _FORWARD <= end

    def __repr__(self) -> str:
        stages = (
            self.stage.name
            if self.last_stage is None
            else f"{self.stage.name}..{self.end_stage.name}"
        )
        return f"Command({stages}, {type(self.op).__name__}, tokens={self.tokens})"

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


_FORWARD = Stage.FORWARD


@dataclass(eq=False)
class Queue:
    """A command queue of one inferlet instance."""

    instance: int
    qid: int
    priority: int = 0
    pending: deque[Command] = field(default_factory=deque)
    closed: bool = False
    thread: Thread | None = None  # its entry in the process table


def conflicts(earlier: list[Command], cmd: Command, ps: int) -> bool:
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
    """:func:`conflicts` for one engine call against the calls of ``earlier``."""
    if isinstance(call, Forward):
        writes = _forward_writes(call, ps)
        ins = set(call.in_embeds.tolist())
        for e in _calls_of(earlier, Forward):
            if writes & (_forward_reads(e, ps) | _forward_writes(e, ps)):
                return True
            if ins & set(e.out_embeds.tolist()):
                return True
        return False
    if isinstance(call, EmbedTxt | EmbedImg):
        outs = set(call.out_embeds.tolist())
        earlier_embeds = _calls_of(earlier, EmbedTxt, EmbedImg)
        return any(outs & set(e.out_embeds.tolist()) for e in earlier_embeds)
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
