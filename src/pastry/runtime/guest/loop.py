"""The Python guest's event loop: :class:`GuestLoop`, an asyncio loop with one way to wait.

Inside WebAssembly there are no threads and no sockets: the guest waits only in the host's
``wait-take`` (its fiber is suspended, the server goes on). :class:`GuestLoop` is a complete
asyncio event loop for that world — tasks, futures, ``gather``, timers, ``asyncio.timeout``
— written against asyncio's public interface for loop implementations (``AbstractEventLoop``;
``asyncio._set_running_loop``, listed in ``asyncio.__all__`` for them), not against
``BaseEventLoop``'s internals. Its ``select(loop, timeout)`` (given by the runtime) blocks
in the host until a tracked call completes or ``timeout`` passes, and resolves the
futures of the completed ones.

It can also be *re-entered*: :meth:`GuestLoop.run_until` runs callbacks and tasks until a
condition holds, and may be called from inside one of its callbacks. That is how
synchronous code waits for asynchronous work without threads (``pastry.lang``'s
:class:`~pastry.lang.driver.ReentrantDriver`: a program's body runs as a callback, and
reading a value that is not ready runs the loop until it is). Pure Python; tested on the
host (``tests/test_guest_loop.py``).
"""

from __future__ import annotations

import asyncio
import contextvars
import heapq
import time
from collections import deque
from collections.abc import Callable
from typing import Any


class Handle:
    """A scheduled callback (what ``call_soon`` returns)."""

    __slots__ = ("args", "callback", "context", "is_cancelled", "loop")

    def __init__(self, callback, args, loop: GuestLoop, context) -> None:
        self.callback, self.args, self.loop = callback, args, loop
        self.context = context if context is not None else contextvars.copy_context()
        self.is_cancelled = False

    def cancel(self) -> None:
        self.is_cancelled = True

    def cancelled(self) -> bool:
        return self.is_cancelled

    def get_context(self) -> contextvars.Context:
        return self.context

    def run(self) -> None:
        try:
            self.context.run(self.callback, *self.args)
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as exc:
            self.loop.call_exception_handler(
                {"message": f"exception in callback {self.callback!r}", "exception": exc}
            )


class TimerHandle(Handle):
    """A callback scheduled at a time of :meth:`GuestLoop.time` (what ``call_at`` returns)."""

    __slots__ = ("at",)

    def __init__(self, when: float, callback, args, loop: GuestLoop, context) -> None:
        super().__init__(callback, args, loop, context)
        self.at = when

    def when(self) -> float:
        return self.at

    def __lt__(self, other: TimerHandle) -> bool:
        return self.at < other.at


class GuestLoop(asyncio.AbstractEventLoop):
    """An event loop whose waiting is ``select(loop, timeout)`` (see the module docstring).
    ``pending`` maps the host's pending-call handles to the futures :meth:`track` made."""

    def __init__(self, select: Callable[[GuestLoop, float | None], None]) -> None:
        self.select = select
        self.pending: dict[int, asyncio.Future] = {}
        self.ready: deque[Handle] = deque()
        self.timers: list[TimerHandle] = []
        self.depth = 0  # nested run_until calls
        self.stopping = False
        self.is_closed_ = False
        self.debug = False
        self.exception_handler: Callable | None = None
        self.task_factory: Callable | None = None

    # ------------------------------------------------------------------ the host's calls

    def track(self, pid: int) -> asyncio.Future:
        """A future that ``select`` resolves when the host's pending call ``pid`` ends."""
        fut = self.create_future()
        self.pending[pid] = fut
        return fut

    # ------------------------------------------------------------------ running

    def run_until(self, ready: Callable[[], bool]) -> None:
        """Run callbacks and tasks until ``ready()`` holds (checked between callbacks);
        may be called from inside a callback of this loop (not from a task's step)."""
        asyncio._set_running_loop(self)
        self.depth += 1
        try:
            while not ready():
                self.run_once()
        finally:
            self.depth -= 1
            if self.depth == 0:
                asyncio._set_running_loop(None)

    def run_once(self) -> None:
        """Run the callbacks ready now (due timers included); with none, wait in
        ``select`` until the next timer or a host completion."""
        ready, timers = self.ready, self.timers
        if not ready:
            timeout = None
            if timers:
                timeout = max(0.0, timers[0].at - self.time())
            if timeout is None or timeout > 0:
                self.select(self, timeout)
        now = self.time()
        while timers and (timers[0].is_cancelled or timers[0].at <= now):
            h = heapq.heappop(timers)
            if not h.is_cancelled:
                ready.append(h)
        for _ in range(len(ready)):
            if not ready:  # a nested run_until ran them
                break
            h = ready.popleft()
            if not h.is_cancelled:
                h.run()

    def run_until_complete(self, future: Any) -> Any:
        fut = asyncio.ensure_future(future, loop=self)
        self.run_until(fut.done)
        return fut.result()

    def run_forever(self) -> None:
        self.stopping = False
        self.run_until(lambda: self.stopping)

    def stop(self) -> None:
        self.stopping = True

    def is_running(self) -> bool:
        return self.depth > 0

    def is_closed(self) -> bool:
        return self.is_closed_

    def close(self) -> None:
        self.is_closed_ = True
        self.ready.clear()
        self.timers.clear()

    async def shutdown_asyncgens(self) -> None:
        pass

    async def shutdown_default_executor(self, timeout: float | None = None) -> None:
        pass

    # ------------------------------------------------------------------ scheduling

    def time(self) -> float:
        return time.monotonic()

    def call_soon(self, callback, *args, context=None) -> Handle:
        h = Handle(callback, args, self, context)
        self.ready.append(h)
        return h

    call_soon_threadsafe = call_soon  # (no threads in the guest)

    def call_later(self, delay: float, callback, *args, context=None) -> TimerHandle:
        return self.call_at(self.time() + delay, callback, *args, context=context)

    def call_at(self, when: float, callback, *args, context=None) -> TimerHandle:
        h = TimerHandle(when, callback, args, self, context)
        heapq.heappush(self.timers, h)
        return h

    def create_future(self) -> asyncio.Future:
        return asyncio.Future(loop=self)

    def create_task(self, coro, *, name=None, context=None) -> asyncio.Task:
        if self.task_factory is not None:
            return self.task_factory(self, coro, context=context)
        return asyncio.Task(coro, loop=self, name=name, context=context)

    def set_task_factory(self, factory) -> None:
        self.task_factory = factory

    def get_task_factory(self):
        return self.task_factory

    # ------------------------------------------------------------------ errors and debug

    def get_exception_handler(self):
        return self.exception_handler

    def set_exception_handler(self, handler) -> None:
        self.exception_handler = handler

    def default_exception_handler(self, context: dict) -> None:
        import sys
        import traceback

        exc = context.get("exception")
        text = context.get("message", "unhandled exception in the event loop")
        if exc is not None:
            text += "\n" + "".join(traceback.format_exception(exc))
        print(text, file=sys.stderr)

    def call_exception_handler(self, context: dict) -> None:
        handler = self.exception_handler
        if handler is None:
            self.default_exception_handler(context)
        else:
            handler(self, context)

    def get_debug(self) -> bool:
        return self.debug

    def set_debug(self, enabled: bool) -> None:
        self.debug = enabled
