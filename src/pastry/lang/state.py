"""``ProgramState`` — the ``s`` of a program — and ``ProgramStateGroup``, what ``fork``
returns. Appending never blocks; reading a value (``s["x"]``, ``s.text()``) waits until
the stream has produced it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from pastry.lang.expr import Expr, ExprList, RoleBegin, RoleEnd, Text
from pastry.lang.stream import Fork, Stream


class ProgramState:
    def __init__(self, stream: Stream) -> None:
        self.stream = stream

    # ------------------------------------------------------------------ appending

    def __iadd__(self, other: Expr | str) -> ProgramState:
        if other is None:
            raise ValueError("tried to append None to a prompt state")
        self.stream.submit(other)
        return self

    def _role(self, role: str, expr: Expr | str | None):
        if expr is not None:
            block = ExprList((RoleBegin(role), *_as_items(expr), RoleEnd(role)))
            self.stream.submit(block)
            return block

        @contextmanager
        def scope() -> Iterator[None]:
            self.stream.submit(RoleBegin(role))
            yield
            self.stream.submit(RoleEnd(role))

        return scope()

    def system(self, expr: Expr | str | None = None):
        """``s.system("...")``, or ``with s.system(): ...`` — a system message."""
        return self._role("system", expr)

    def user(self, expr: Expr | str | None = None):
        return self._role("user", expr)

    def assistant(self, expr: Expr | str | None = None):
        return self._role("assistant", expr)

    # ------------------------------------------------------------------ reading

    def __getitem__(self, name: str) -> Any:
        return self.stream.get(name)

    def get_var(self, name: str) -> Any:
        return self.stream.get(name)

    def __setitem__(self, name: str, value: Any) -> None:
        self.stream.variables[name] = value

    set_var = __setitem__

    def __contains__(self, name: str) -> bool:
        return name in self.stream.variables

    def get_meta_info(self, name: str) -> dict[str, Any] | None:
        """What the server reported for variable ``name``: token counts, the finish
        reason, log-probabilities when asked for (``select``: every choice's scores)."""
        self.stream.get(name)
        return self.stream.meta_info.get(name)

    def text(self) -> str:
        self.stream.sync()
        return self.stream.text

    def messages(self) -> list[dict[str, str]]:
        """The role blocks so far, as OpenAI-style messages."""
        self.stream.sync()
        return [{"role": r, "content": c} for r, c in self.stream.messages]

    def sync(self) -> None:
        self.stream.sync()

    def error(self) -> BaseException | None:
        s = self.stream
        s.run.driver.wait_until(s.drained)
        return s.error

    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        """The text (or a variable) once it is complete; streaming a program as it runs is
        :meth:`Function.run` with ``stream=True`` from a client, or ``on_text`` in
        :meth:`Function.arun`."""
        yield self.text() if var_name is None else self[var_name]

    # ------------------------------------------------------------------ forking

    def fork(self, size: int = 1) -> ProgramStateGroup:
        """``size`` independent copies of this state that share its prefix's KV pages; the
        prefix is computed once, before any of them runs."""
        size = int(size)
        if size < 1:
            raise ValueError(f"fork size must be at least 1, got {size}")
        s = self.stream
        op = Fork(size)
        s.submit(op)
        s.sync()
        states = [
            ProgramState(
                s.run.stream(
                    ctx=op.out[i],
                    text=s.text,
                    messages=s.messages,
                    variables=s.variables,
                    images=s.images,
                    role=(s.cur_role, s.role_begin),
                )
            )
            for i in range(size)
        ]
        return ProgramStateGroup(states, self)

    @contextmanager
    def copy(self) -> Iterator[ProgramState]:
        group = self.fork(1)
        try:
            yield group[0]
        finally:
            group.join()

    def __repr__(self) -> str:
        return f"ProgramState({self.text()!r})"


class ProgramStateGroup:
    def __init__(self, states: list[ProgramState], src: ProgramState) -> None:
        self.states = states
        self.src = src

    def __getitem__(self, i: int) -> ProgramState:
        return self.states[i]

    def __iter__(self) -> Iterator[ProgramState]:
        return iter(self.states)

    def __len__(self) -> int:
        return len(self.states)

    def __iadd__(self, other: Callable[[int], Expr | str] | Expr | str | list | tuple):
        """Append to every fork: ``other(i)``, the same expression, or ``other[i]``."""
        for i, state in enumerate(self.states):
            if callable(other):
                state += other(i)
            elif isinstance(other, list | tuple):
                state += other[i]
            else:
                state += other
        return self

    def join(self, mode: str = "gather_variable") -> None:
        """Wait for every fork. ``gather_variable``: each variable the forks created becomes
        a list (one value per fork) in the source state. ``concate_and_append``: the text
        each fork added is appended to the source state, in order."""
        if mode not in ("gather_variable", "concate_and_append"):
            raise ValueError(
                f"join mode must be gather_variable or concate_and_append, got {mode!r}"
            )
        for state in self.states:
            state.stream.sync()
        src = self.src.stream
        if mode == "gather_variable":
            known = set(src.variables)
            for state in self.states:
                for k, v in state.stream.variables.items():
                    if k not in known:
                        src.variables.setdefault(k, []).append(v)
        else:
            added = "".join(s.stream.text[s.stream.fork_start :] for s in self.states)
            self.src += added


def _as_items(expr: Expr | str):
    if isinstance(expr, ExprList):
        return expr.items
    return (expr if isinstance(expr, Expr) else Text(str(expr)),)
