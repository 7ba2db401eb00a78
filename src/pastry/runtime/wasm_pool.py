"""Pre-started guest instances, so that a launch does not wait for one to be made.

Making a Python guest costs ~1-3 ms of CPU (a Store, instantiating the runtime component,
its warm-up run that writes the copy-on-write pages every launch writes); a burst of N
simultaneous launches would pay N of those one after another on the event loop.
:class:`GuestPool` keeps up to ``size`` guests made ahead of time on a background thread
(Wasmtime runs a guest without holding the GIL, so the server's event loop goes on):

- ``size`` *generic* guests, parked in ``load-inferlet``: any launch can take one; it
  then loads its program (unmarshals and executes the module) and runs;
- up to ``size`` *loaded* guests, which have also executed one program's module and are
  parked in ``start-inferlet``: a launch of that program only hands them its arguments.
  The pool loads guests for the programs launched recently, as many as the largest burst
  of each (launches less than ``BURST_GAP`` apart), most recently launched first.

A launch takes one (:meth:`take`), binds it to its session and resumes it. The thread
waits for a lull in launches (``QUIET``, at most ``PATIENCE``) before it works: during a
burst it would only compete with the launches for the CPU and the GIL.

A pooled guest is used by one launch only, and a loaded one has run nothing but its own
program's module (which runs unbound: it cannot reach any session), so pooling gives up
no isolation. Its memory is the price: up to 2 × ``size`` × what one parked guest holds
(``benchmarks/sandbox.py`` reports it), whether or not anything is launched.

The same thread also frees ended guests (:meth:`retire`): deleting a Store and its fiber
unmaps their memory (a few hundred µs), which need not delay the event loop either. It
does that before anything else, so memory is returned within milliseconds of the end (at
most ``PATIENCE`` later during a burst of launches).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from pastry.runtime.wasm_host import Guest

log = logging.getLogger(__name__)


@dataclass
class _Demand:
    """Launches of one program: the current burst and the largest seen."""

    last: float = 0.0
    count: int = 0
    want: int = 0


class GuestPool:
    """Up to ``size`` pre-started guests, made by ``make`` on a background thread;
    ``load(guest, program)`` loads one with a program there (False: that program cannot
    be loaded ahead, the guest is gone), ``drop`` frees a guest the pool no longer wants.
    ``size`` 0 disables the pool.
    """

    QUIET = 0.01  # s without a launch before the thread works
    PATIENCE = 0.1  # ... or at most this long after it has work
    BURST_GAP = 0.1  # launches closer than this are one burst
    FORGET = 300.0  # a program not launched for this long gets no loaded guests

    def __init__(
        self,
        make: Callable[[], Guest],
        load: Callable[[Guest, Hashable], bool],
        drop: Callable[[Guest], None],
        size: int,
    ) -> None:
        if size < 0:
            raise ValueError(f"pool size must be >= 0, got {size}")
        self.size = size
        self._make, self._load, self._drop = make, load, drop
        self._ready: collections.deque[Guest] = collections.deque()  # generic
        self._loaded: dict[Hashable, collections.deque[Guest]] = {}
        self._demand: dict[Hashable, _Demand] = {}  # least recently launched first
        self._unloadable: set[Hashable] = set()
        self._dead: collections.deque[Callable[[], None]] = collections.deque()
        self._cond = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None
        self._last_take = 0.0
        self.made = 0  # guests made by the pool thread
        self.taken = 0  # launches served from the pool (generic or loaded)
        self.taken_loaded = 0  # ... by a guest loaded with their program
        self.missed = 0  # launches that found it empty
        self.failures = 0

    def __len__(self) -> int:
        return len(self._ready) + sum(len(q) for q in self._loaded.values())

    def start(self) -> None:
        """Start the thread (idempotent)."""
        with self._cond:
            if self._thread is None and self.size > 0 and not self._closed:
                self._thread = threading.Thread(
                    target=self._run, name="pastry-wasm-pool", daemon=True
                )
                self._thread.start()

    def take(self, program: Hashable | None = None) -> Guest | None:
        """A guest loaded with ``program`` if there is one, else a generic one, else None
        (the caller makes one). Counts the launch in ``program``'s demand."""
        now = time.monotonic()
        self._last_take = now
        g = None
        with self._cond:
            if program is not None and self.size > 0:
                d = self._demand.pop(program, None) or _Demand()
                if now - d.last > self.BURST_GAP:
                    d.count = 0
                d.count += 1
                d.want = min(self.size, max(d.want, d.count))
                d.last = now
                self._demand[program] = d  # most recent last
                q = self._loaded.get(program)
                if q:
                    g = q.popleft()
                    self.taken_loaded += 1
            if g is None and self._ready:
                g = self._ready.popleft()
            if g is not None:
                self.taken += 1
            elif self.size > 0:
                self.missed += 1
            self._cond.notify()
        self.start()
        return g

    def hold(self) -> None:
        """Launches are still starting (their first polls run in pieces, between which
        earlier ones end): the thread waits for a lull, as after a :meth:`take`, instead
        of competing with them for the CPU and the GIL."""
        self._last_take = time.monotonic()

    def resize(self, size: int) -> None:
        """Keep ``size`` guests from now on (extra parked ones are freed)."""
        if size < 0:
            raise ValueError(f"pool size must be >= 0, got {size}")
        with self._cond:
            self.size = size
            for d in self._demand.values():
                d.want = min(d.want, size)
            self._cond.notify_all()
        self.start()

    def retire(self, free: Callable[[], None]) -> None:
        """Run ``free`` (it releases an ended guest's Store) on the pool's thread, soon;
        right here when the pool has no thread."""
        if self._thread is None or self._closed:
            free()
            return
        with self._cond:
            self._dead.append(free)
            self._cond.notify()

    def idle(self, timeout: float | None = None) -> bool:
        """Block until every retired guest has been freed (tests measure memory after)."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._dead or self._closed, timeout)

    def wait_full(self, timeout: float | None = None) -> bool:
        """Block until the pool holds what it wants (benchmarks measure from there)."""
        self.start()
        with self._cond:
            return self._cond.wait_for(lambda: self._closed or self._step() is None, timeout)

    def close(self) -> None:
        """Stop the thread and free the parked guests."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=30)
        guests = list(self._ready) + [g for q in self._loaded.values() for g in q]
        self._ready.clear()
        self._loaded.clear()
        for g in guests:
            self._drop(g)
        while self._dead:
            self._dead.popleft()()

    # ------------------------------------------------------------------ the thread

    def _targets(self) -> tuple[int, dict[Hashable, int]]:
        """How many generic guests (``size``: a burst of a new program finds them), and
        how many loaded with each program (``size`` in all), to keep."""
        now = time.monotonic()
        for program in [p for p, d in self._demand.items() if now - d.last > self.FORGET]:
            del self._demand[program]
        avail = self.size
        loaded = {}
        for program, d in reversed(self._demand.items()):
            if avail <= 0:
                break
            if program in self._unloadable:
                continue
            loaded[program] = n = min(d.want, avail)
            avail -= n
        return self.size, loaded

    def _step(self):
        """The next piece of work (under the lock): ("free", fns), ("drop", guests),
        ("make", None), ("load", program), or None when there is nothing to do."""
        if self._dead:
            return "free", None
        generic, loaded = self._targets()
        extra = [g for p, q in self._loaded.items() for g in list(q)[loaded.get(p, 0) :]]
        extra += list(self._ready)[generic:]
        if extra:
            return "drop", extra
        if len(self._ready) < generic:
            return "make", None
        for program, n in loaded.items():
            if len(self._loaded.get(program, ())) < n:
                return "load", program
        return None

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or self._step() is not None)
                if self._closed:
                    return
            self._lull()
            with self._cond:
                if self._closed:
                    return
                work = self._step()
                if work is None:
                    continue
                kind, arg = work
                if kind == "free":
                    dead = list(self._dead)
                elif kind == "drop":
                    for g in arg:
                        if g in self._ready:
                            self._ready.remove(g)
                        for q in self._loaded.values():
                            if g in q:
                                q.remove(g)
            try:
                if kind == "free":
                    for free in dead:
                        free()
                    with self._cond:
                        for _ in dead:
                            self._dead.popleft()
                elif kind == "drop":
                    for g in arg:
                        self._drop(g)
                else:
                    g = self._make()
                    self.made += 1
                    if kind == "load" and not self._load(g, arg):
                        with self._cond:
                            self._unloadable.add(arg)
                        continue
                    with self._cond:
                        if kind == "load":
                            self._loaded.setdefault(arg, collections.deque()).append(g)
                        else:
                            self._ready.append(g)
            except Exception:
                self.failures += 1
                log.exception("sandbox: the guest pool failed (%s); it stops", kind)
                with self._cond:
                    self._closed = True
                    self._cond.notify_all()
                return
            finally:
                with self._cond:
                    self._cond.notify_all()

    def _lull(self) -> None:
        """Wait until launches pause (or PATIENCE passed)."""
        start = time.monotonic()
        while not self._closed:
            now = time.monotonic()
            quiet = now - self._last_take
            if quiet >= self.QUIET or now - start >= self.PATIENCE:
                return
            time.sleep(self.QUIET - quiet)
