"""Forming one batch: which commands of which queues go in, and their translation.

:class:`Forming` is the batch the scheduler (:mod:`pastry.control.scheduler`) is forming:
it takes a queue's commands while they keep the stage order, do not conflict
(:func:`~pastry.control.commands.conflicts`) and fit; it prepares each as it is taken
(:func:`prepare`: the op's ``prepare``), except ops whose class prepares a whole run of
them in one pass (``batched``: the fused decode step), which wait for the end of the pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pastry.api import ApiError
from pastry.control.commands import Command, CommandError, NotAdmitted, Queue, Stage, conflicts
from pastry.control.programs import ProcessTable


@dataclass(eq=False)
class Forming:
    """The batch being formed: commands taken so far and where each queue stopped
    (under the engine's ``max_batch_tokens``; KV slots of ``page_size``)."""

    max_batch_tokens: int
    page_size: int
    programs: ProcessTable
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

    def prepare_deferred(self) -> None:
        """Prepare the batched commands taken since the last call: each run of one kind in
        one pass (:meth:`~pastry.control.commands.Op.prepare_batch`), in the order they
        were taken; the refused ones leave the batch (their futures hold the errors)."""
        cmds, self.deferred = self.deferred, []
        i = 0
        while i < len(cmds):
            kind = type(cmds[i].op)
            j = i + 1
            while j < len(cmds) and type(cmds[j].op) is kind:
                j += 1
            for cmd in kind.prepare_batch(cmds[i:j]):
                prepare(cmd)
            i = j
        for cmd in cmds:
            if cmd.call is None:  # refused
                if not cmd.future.done():
                    cmd.future.set_exception(CommandError("the command could not be prepared"))
                q = cmd.queue
                mine = self.per_queue.get(q, ())
                if cmd not in mine:  # its queue was closed meanwhile
                    continue
                mine.remove(cmd)
                self.commands.remove(cmd)
                self.tokens -= cmd.tokens
                self.forwards -= cmd.forwards
                self.programs.dropped(q.thread)

    def take(self, q: Queue, cap: float) -> None:
        """Take ``q``'s commands into the batch while they keep the stage order, do not
        conflict and fit."""
        mine = self.per_queue.setdefault(q, [])
        stage = self.stage.get(q, Stage.KV)
        while q.pending:
            cmd = q.pending[0]
            forwards = cmd.forwards
            if forwards and self.forwards >= cap:
                self.blocked.add(q)
                break
            if cmd.stage != Stage.CONTROL:
                over = self.tokens + cmd.tokens > self.max_batch_tokens and self.commands
                if cmd.stage < stage or over:
                    self.blocked.add(q)
                    break
                if cmd.op.batched and cmd.stage != stage:
                    # Prepared with the batch's others of its kind (form_batch's end): none
                    # of its queue's commands in the batch is at its stage, so it cannot
                    # conflict with them.
                    self.deferred.append(cmd)
                else:
                    if self.deferred:  # those taken before act first, as they were taken
                        self.prepare_deferred()
                    ok = prepare(cmd)
                    if ok is None:  # not admitted yet: it stays first in its queue
                        self.blocked.add(q)
                        break
                    if not ok:  # rejected: its future holds the error
                        q.pending.popleft()
                        self.programs.dropped(q.thread)
                        continue
                    if cmd.stage == stage and conflicts(mine, cmd, self.page_size):
                        cmd.call = None  # prepared again when it is taken later
                        self.blocked.add(q)
                        break
                stage = cmd.end_stage
                self.tokens += cmd.tokens
                self.forwards += forwards
            mine.append(cmd)
            self.commands.append(cmd)
            q.pending.popleft()
        self.stage[q] = stage


def prepare(cmd: Command) -> bool | None:
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
