"""Polling several guests at once: the event-loop thread and helper threads run guests in
parallel, while host calls stay one at a time.

A guest's own work (CPython inside WebAssembly: ~0.3 ms per generated token here) runs in
native code: wasmtime-py calls Wasmtime through ``ctypes.CDLL``, which releases the GIL for
the call, so two threads polling two guests run them on two cores. What is *not* thread
safe is the host side: Sessions, the scheduler, asyncio futures and timers belong to the
event loop. :class:`GuestPollers` therefore runs a *section*:

1. the loop thread hands a list of guests to the helpers and polls guests itself;
2. each thread takes the next guest (one guest is polled by one thread at a time, so a
   guest's own calls keep their order) and polls it once;
3. a host call made by a guest takes the sandbox's host lock (``WasmSandbox.host_lock``)
   and runs with the loop as the thread's running loop;
4. the loop thread returns once every guest taken has been polled.

While a section runs, the loop thread runs nothing but its share of the polls, so the
host code that runs in it (host calls, under the lock) is never concurrent with any other
code touching the loop: it is the event loop's code, lent to a helper for the duration of
one call. Guests that yield at an epoch tick go to the next section (after the loop's
other callbacks), as before. This module knows nothing of guests beyond "poll this one";
:mod:`pastry.runtime.wasm` decides what a poll does and what happens after it.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

log = logging.getLogger(__name__)

# Threads polling guests at once (the loop's own included), unless configured: one per
# core, up to 4 (host calls are serialized; beyond a few threads they dominate).
DEFAULT_THREADS = max(1, min(4, os.cpu_count() or 1))


class GuestPollers:
    """``threads`` - 1 helper threads that poll guests alongside the event-loop thread
    (:meth:`run`). With ``threads`` = 1 every guest is polled on the calling thread, one
    after another (the serial path). ``threads`` may be changed between sections."""

    def __init__(self, threads: int = DEFAULT_THREADS) -> None:
        if threads < 1:
            raise ValueError(f"poll threads must be >= 1, got {threads}")
        self.threads = threads
        self._lock = threading.Lock()
        self._running = threading.Lock()  # one section at a time (one loop's)
        self._items: collections.deque = collections.deque()
        self._deadline = 0.0  # perf_counter() after which no poll starts
        self._poll: Callable[[Any], None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._section = 0  # the open section's number (0: none)
        self._active = 0  # helpers that joined the open section
        self._done: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._wakeups: list[queue.SimpleQueue[int | None]] = []
        self._helpers: list[threading.Thread] = []
        self._closed = False
        self.sections = 0  # sections run with helpers (statistics)
        self.helped = 0  # polls made by helper threads (statistics)

    def _start(self) -> None:
        for i in range(len(self._helpers), self.threads - 1):
            wake: queue.SimpleQueue[int | None] = queue.SimpleQueue()
            t = threading.Thread(
                target=self._helper, args=(wake,), name=f"pastry-wasm-poll-{i}", daemon=True
            )
            self._wakeups.append(wake)
            self._helpers.append(t)
            t.start()

    def close(self) -> None:
        """Stop the helper threads (idempotent; a section in progress finishes first)."""
        self._closed = True
        for wake in self._wakeups:
            wake.put(None)
        for t in self._helpers:
            if t is not threading.current_thread():
                t.join(timeout=30)
        self._wakeups.clear()
        self._helpers.clear()

    def run(self, items: Sequence[Any], poll: Callable[[Any], None], seconds: float) -> list:
        """``poll(item)`` for the items, in order, on this thread and the helpers, until
        every item is polled or ``seconds`` have passed (no poll starts after that; each
        call makes one at least); returns when the polls started are done, with the
        items not polled. What ``poll`` raises on a helper is logged and dropped (it
        should not raise); on this thread it propagates, once the helpers are done. Call
        from the event loop's thread; a host call inside ``poll`` must take the host lock."""
        n = len(items)
        if self.threads == 1 or n < 2 or self._closed or not self._running.acquire(False):
            return self.serial(items, poll, seconds)  # (or another loop's section runs)
        try:
            self._items = collections.deque(items)
            self._poll = poll
            self._deadline = time.perf_counter() + seconds
            return self._section_run(n)
        finally:
            self._running.release()

    @staticmethod
    def serial(items: Sequence[Any], poll: Callable[[Any], None], seconds: float) -> list:
        """:meth:`run` on this thread only."""
        deadline = time.perf_counter() + seconds
        clock = time.perf_counter
        for i, item in enumerate(items):
            if i and clock() > deadline:
                return list(items[i:])
            poll(item)
        return []

    def _section_run(self, n: int) -> list:
        if len(self._helpers) < self.threads - 1:
            self._start()
        with self._lock:
            self._loop = asyncio.get_running_loop()
            self._section += 1
            self._active = 0
            section = self._section
        for wake in self._wakeups[: min(n, self.threads) - 1]:  # (not more than items)
            wake.put(section)
        try:
            self._drain(guarded=False)
        finally:
            with self._lock:
                self._section = 0  # helpers waking from now on find it closed
                joined = self._active
            for _ in range(joined):
                self._done.get()
            self._poll = self._loop = None
            self.sections += 1
        return list(self._items)

    def _drain(self, guarded: bool) -> int:
        items, poll, deadline, n = self._items, self._poll, self._deadline, 0
        clock = time.perf_counter
        while True:
            if (n or guarded) and clock() > deadline:  # (the loop's thread polls one at least)
                return n
            try:
                item = items.popleft()
            except IndexError:
                return n
            if guarded:
                _guarded(poll, item)
            else:
                poll(item)
            n += 1

    def _helper(self, wake: queue.SimpleQueue[int | None]) -> None:
        while True:
            section = wake.get()
            if section is None:
                return
            with self._lock:
                if section != self._section:  # closed before this thread woke
                    continue
                self._active += 1
                loop = self._loop
            asyncio._set_running_loop(loop)  # host calls use the loop, as its thread
            try:
                n = self._drain(guarded=True)
                with self._lock:
                    self.helped += n
            except BaseException:  # _guarded catches everything; never leave the loop waiting
                log.exception("sandbox: a guest poller failed")
            finally:
                asyncio._set_running_loop(None)
                self._done.put(1)


def _guarded(poll: Callable[[Any], None], item: Any) -> None:
    try:
        poll(item)
    except BaseException:
        log.exception("sandbox: polling a guest failed")
