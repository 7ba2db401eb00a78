"""Where a program's Python body runs, and how it blocks on a value.

An SGLang program is ordinary synchronous Python: ``s += gen("x")`` returns at once (the
generation is queued on the state's stream), and ``s["x"]`` blocks until the value is
there. The streams run as asyncio tasks on the inferlet's event loop, next to its KV. Two
drivers let the synchronous body wait without stopping that loop:

- :class:`ThreadDriver` (wherever threads exist: the trusted runner, a test): the body
  runs in a thread of its own, as SGLang's interpreter does; blocking waits on a
  condition that the streams notify.
- :class:`ReentrantDriver` (the WebAssembly sandbox, which has no threads): the body runs
  on the loop itself, and blocking runs the loop — the streams' tasks and the host's
  completions — until the value is there. While one body waits, others run nested inside
  that wait (each resumes once everything above it on the stack has).
"""

from __future__ import annotations

import asyncio
import contextvars
import sys
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class Cancelled(Exception):
    """The program was cancelled (its inferlet ended) while its body was waiting."""


class Driver:
    """Contract: ``call`` runs ``fn`` on the loop's thread (now when already there, else
    soon, in call order); ``wait_until(ready)`` returns once ``ready()`` is true (it is
    re-checked after every ``notify``); ``run(body)`` runs the body and resolves with its
    result; ``notify`` is called on the loop thread whenever a stream made progress."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.cancelled = False

    def call(self, fn: Callable[..., Any], *args: Any) -> None:
        raise NotImplementedError

    def wait_until(self, ready: Callable[[], bool]) -> None:
        raise NotImplementedError

    async def run(self, body: Callable[[], T]) -> T:
        raise NotImplementedError

    def notify(self) -> None:
        pass


class ThreadDriver(Driver):
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        import threading

        super().__init__(loop)
        self._cond = threading.Condition()
        self._threading = threading

    def _on_loop(self) -> bool:
        try:
            return asyncio.get_running_loop() is self.loop
        except RuntimeError:
            return False

    def call(self, fn, *args) -> None:
        if self._on_loop():
            fn(*args)
        else:
            self.loop.call_soon_threadsafe(fn, *args)

    def wait_until(self, ready) -> None:
        if self._on_loop():
            if ready():
                return
            raise RuntimeError(
                "a pastry.lang value was read on the event loop before it was ready; inside "
                "an inferlet, run programs with `await f.arun(...)` and read their values "
                "after it returns"
            )
        with self._cond:
            while not ready():
                if self.cancelled:
                    raise Cancelled("the program was cancelled")
                self._cond.wait()

    def notify(self) -> None:
        with self._cond:
            self._cond.notify_all()

    async def run(self, body):
        fut = self.loop.create_future()

        def settle(ok: bool, value: Any) -> None:
            if not fut.done():
                (fut.set_result if ok else fut.set_exception)(value)

        def target() -> None:
            try:
                value = body()
            except BaseException as e:  # handed to the awaiting coroutine
                self.loop.call_soon_threadsafe(settle, False, e)
            else:
                self.loop.call_soon_threadsafe(settle, True, value)

        ctx = contextvars.copy_context()
        thread = self._threading.Thread(
            target=ctx.run, args=(target,), name="pastry.lang program", daemon=True
        )
        thread.start()
        try:
            return await fut
        except asyncio.CancelledError:
            self.cancelled = True
            self.notify()
            raise


class ReentrantDriver(Driver):
    """The body runs as a loop callback (not inside a task, so the tasks it waits for can
    run from a nested iteration) and waits with the loop's ``run_until``."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        if not callable(getattr(loop, "run_until", None)):
            raise RuntimeError(
                "pastry.lang without threads needs a re-entrant event loop (the sandbox's "
                "pastry.runtime.guest.loop.GuestLoop)"
            )
        super().__init__(loop)

    def call(self, fn, *args) -> None:
        fn(*args)

    def wait_until(self, ready) -> None:
        if ready():
            return
        self.loop.run_until(lambda: ready() or self.cancelled)
        if not ready():
            raise Cancelled("the program was cancelled")

    async def run(self, body):
        fut = self.loop.create_future()

        def step() -> None:
            try:
                value = body()
            except BaseException as e:  # handed to the awaiting coroutine
                if not fut.done():
                    fut.set_exception(e)
            else:
                if not fut.done():
                    fut.set_result(value)

        self.loop.call_soon(step)
        try:
            return await fut
        except asyncio.CancelledError:
            self.cancelled = True
            raise


def threads_available() -> bool:
    return sys.platform != "wasi"


def driver_for(loop: asyncio.AbstractEventLoop) -> Driver:
    return ThreadDriver(loop) if threads_available() else ReentrantDriver(loop)
