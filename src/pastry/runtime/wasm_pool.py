"""Pre-started guest instances, so that a launch does not wait for one to be made.

Making a Python guest costs ~1-3 ms of CPU (a Store, instantiating the runtime component,
its warm-up run that writes the copy-on-write pages every launch writes); a burst of N
simultaneous launches would pay N of those one after another on the event loop.
:class:`GuestPool` keeps up to ``size`` guests made ahead of time, each parked in
``next-inferlet`` (its fiber suspended, nothing bound to it), and refills on a background
thread: Wasmtime runs the guest without holding the GIL, so the server's event loop goes
on meanwhile. A launch takes one (:meth:`take`), binds it to its session and resumes it.
The thread waits for a lull in launches (``QUIET``, at most ``PATIENCE``) before it works:
during a burst it would only compete with the launches for the CPU and the GIL.

A pooled guest has never run tenant code and is used by one launch only, so pooling gives
up no isolation. Its memory is the price: ``size`` × what one parked guest holds
(``benchmarks/sandbox.py`` reports it), whether or not anything is launched.

The same thread also frees ended guests (:meth:`retire`): deleting a Store and its fiber
unmaps their memory (a few hundred µs), which need not delay the event loop either. It
does that before making new guests, so memory is returned within milliseconds of the end
(at most ``PATIENCE`` later during a burst of launches).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable

from pastry.runtime.wasm_host import Guest

log = logging.getLogger(__name__)


class GuestPool:
    """Up to ``size`` pre-started guests, made by ``make`` on a background thread.

    ``make`` must be safe to call on that thread (it only touches its own new Store) and
    ``drop`` must free a guest the pool no longer wants. ``size`` 0 disables the pool.
    """

    # The thread waits for a lull in launches before it works (it would compete with them
    # for the CPU and the GIL): ``QUIET`` s without a take, or ``PATIENCE`` s at most.
    QUIET = 0.01
    PATIENCE = 0.1

    def __init__(self, make: Callable[[], Guest], drop: Callable[[Guest], None], size: int):
        if size < 0:
            raise ValueError(f"pool size must be >= 0, got {size}")
        self.size = size
        self._make, self._drop = make, drop
        self._ready: collections.deque[Guest] = collections.deque()
        self._dead: collections.deque[Callable[[], None]] = collections.deque()
        self._cond = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None
        self._last_take = 0.0
        self.made = 0  # guests made by the pool thread
        self.taken = 0  # launches served from the pool
        self.missed = 0  # launches that found it empty
        self.failures = 0

    def __len__(self) -> int:
        return len(self._ready)

    def start(self) -> None:
        """Start filling (idempotent)."""
        with self._cond:
            if self._thread is None and self.size > 0 and not self._closed:
                self._thread = threading.Thread(
                    target=self._fill, name="pastry-wasm-pool", daemon=True
                )
                self._thread.start()

    def take(self) -> Guest | None:
        """A pre-started guest, or None if none is ready (the caller makes one)."""
        self._last_take = time.monotonic()
        try:
            g = self._ready.popleft()
            self.taken += 1
        except IndexError:
            g = None
            self.missed += self.size > 0
        if self.size > 0:
            with self._cond:
                self._cond.notify()
            self.start()
        return g

    def resize(self, size: int) -> None:
        """Keep ``size`` guests from now on (extra parked ones are freed)."""
        if size < 0:
            raise ValueError(f"pool size must be >= 0, got {size}")
        with self._cond:
            self.size = size
            extra = []
            while len(self._ready) > size:
                extra.append(self._ready.pop())
            self._cond.notify_all()
        for g in extra:
            self._drop(g)
        self.start()

    def retire(self, free: Callable[[], None]) -> None:
        """Run ``free`` (it releases an ended guest's Store) on the pool's thread, soon;
        right here when the pool has no thread."""
        if self.size == 0 or self._closed:
            free()
            return
        with self._cond:
            self._dead.append(free)
            self._cond.notify()
        self.start()

    def idle(self, timeout: float | None = None) -> bool:
        """Block until every retired guest has been freed (tests measure memory after)."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._dead or self._closed, timeout)

    def wait_full(self, timeout: float | None = None) -> bool:
        """Block until the pool holds ``size`` guests (benchmarks measure from there)."""
        self.start()
        with self._cond:
            return self._cond.wait_for(
                lambda: len(self._ready) >= self.size or self._closed, timeout
            )

    def close(self) -> None:
        """Stop filling and free the parked guests."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=10)
        while self._ready:
            self._drop(self._ready.popleft())
        while self._dead:
            self._dead.popleft()()

    def _lull(self) -> None:
        """Wait until launches pause (or PATIENCE passed)."""
        start = time.monotonic()
        while not self._closed:
            now = time.monotonic()
            quiet = now - self._last_take
            if quiet >= self.QUIET or now - start >= self.PATIENCE:
                return
            time.sleep(self.QUIET - quiet)

    def _fill(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(
                    lambda: self._closed or self._dead or len(self._ready) < self.size
                )
                if self._closed:
                    return
            self._lull()
            with self._cond:
                dead = list(self._dead)
            for free in dead:
                try:
                    free()
                except Exception:
                    log.exception("sandbox: freeing an ended guest failed")
            if dead:
                with self._cond:
                    for _ in dead:
                        self._dead.popleft()
                    self._cond.notify_all()
                continue
            try:
                g = self._make()
            except Exception:
                self.failures += 1
                log.exception("sandbox: pre-starting a guest failed; the pool stops filling")
                return
            with self._cond:
                if self._closed:
                    self._drop(g)
                    return
                self._ready.append(g)
                self.made += 1
                self._cond.notify_all()
