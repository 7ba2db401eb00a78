"""One run of a program inside an inferlet: its streams, their contexts, and its driver.

A run starts with the program's own state; forks and nested function calls add streams
to it. It ends when the body has returned and every stream has executed what was
submitted to it; then every context it opened is released (the values stay readable).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from typing import Any

from pastry.lang.driver import Driver, driver_for
from pastry.lang.expr import SamplingParams
from pastry.lang.stream import ProgramError, Stream
from pastry.sdk.context import Context

_active: ContextVar[Run | None] = ContextVar("pastry_lang_run", default=None)


def active_run() -> Run | None:
    """The run whose body is executing here (nested calls join it), if any."""
    return _active.get()


class Run:
    def __init__(
        self,
        model: str,
        defaults: SamplingParams,
        driver: Driver | None = None,
        on_text: Callable[[str], None] | None = None,
        adapter: str | None = None,
    ) -> None:
        self.model = model
        self.adapter = adapter  # a LoRA adapter every context of the run applies
        self.defaults = defaults
        self.driver = driver or driver_for(asyncio.get_running_loop())
        self.on_text = on_text
        self.streams: list[Stream] = []
        self.contexts: list[Context] = []

    def context(self) -> Context:
        """A new context of the run (on its model, with its adapter), released at its end."""
        ctx = Context(self.model, adapter=self.adapter)
        self.contexts.append(ctx)
        return ctx

    def stream(self, **kw: Any) -> Stream:
        s = Stream(self, **kw)
        self.streams.append(s)
        return s

    def execute(self, func: Callable[..., Any], state: Any, args: Sequence, kwargs: dict) -> Any:
        """Run a body with this run active (called where the body runs)."""
        token = _active.set(self)
        try:
            return func(state, *args, **kwargs)
        finally:
            _active.reset(token)

    async def finish(self) -> None:
        """Wait until every stream has executed what was submitted, then release every
        context; raises the first failure (the program's own state first)."""
        try:
            while True:
                busy = [s for s in self.streams if not s.idle()]
                if not busy:
                    break
                await asyncio.gather(*(s.wait_drained() for s in busy))
                await asyncio.sleep(0)  # items enqueued by callbacks still in flight
        finally:
            contexts, self.contexts = self.contexts, []
            await asyncio.gather(*(c.release() for c in contexts), return_exceptions=True)
        for s in self.streams:
            if s.error is not None:
                raise ProgramError(f"the program failed: {s.error}") from s.error
