"""Commands for scheduler tests: an op that hands back what a function computes.

Production ops are records (``pastry.control.ops``); a scheduler test only needs a
command whose call it chooses, so :class:`Fn` calls a test's function at preparation.
"""

from __future__ import annotations

from pastry.control.commands import Command, Op, Stage


class Fn(Op):
    """An op whose ``prepare`` is ``fn()`` (a test's lambda: the call, None, or a raise)."""

    __slots__ = ("fn",)

    def __init__(self, fn) -> None:
        self.fn = fn

    def prepare(self):
        return self.fn()


def fn_command(stage: Stage, fn, **kw) -> Command:
    """A command whose call is ``fn()``, taken when it is prepared."""
    return Command(stage, Fn(fn), **kw)
