"""How much linear memory a guest instance has: its size as the process maps show it.

Wasmtime's C API gives no access to a component's memories (only core modules export
theirs), so the host cannot ask a Python guest how large its memory has grown. The
process's own mappings show it: each linear memory is a run of read-write mappings (the
runtime's copy-on-write image and the pages around it) followed by its large inaccessible
reservation. Which run is whose: the guest runtime, before any tenant code runs, puts 16
random bytes in its memory and tells the host their address (``memory-probe``); the run
that holds those bytes at that offset is that guest's. The bytes are read through
``/proc/self/mem`` (a run freed meanwhile is a read error, not a crash), and only inside a
run, so a lying guest can only make its own figure unknown.

The size reported is the linear memory's size (what ``SandboxLimits.memory_bytes``
bounds). Most of a Python guest's is the runtime image, shared copy-on-write by every
instance; ``benchmarks/sandbox.py`` measures the private part.
"""

from __future__ import annotations

import os
import time

_RESERVATION_MIN = 1 << 30  # a linear memory's reservation is GiBs of inaccessible space


def _runs() -> list[tuple[int, int]]:
    """(start, end) of every run of adjacent read-write mappings directly followed by a
    reservation, from ``/proc/self/maps`` (empty where it does not exist)."""
    try:
        with open("/proc/self/maps", "rb") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    runs = []
    start = end = -1
    for line in lines:
        span, perms = line.split(maxsplit=2)[:2]
        lo_s, hi_s = span.split(b"-")
        lo, hi = int(lo_s, 16), int(hi_s, 16)
        if perms.startswith(b"rw"):
            if lo != end:
                start = lo
            end = hi
        else:
            if perms.startswith(b"---") and lo == end and hi - lo >= _RESERVATION_MIN:
                runs.append((start, end))
            start = end = -1
    return runs


class MemoryMap:
    """The linear memories of this process, re-read at most every ``ttl`` seconds (so a
    listing of many instances reads the maps once)."""

    def __init__(self, ttl: float = 0.2) -> None:
        self.ttl = ttl
        self._at = -1.0
        self._runs: list[tuple[int, int]] = []

    def runs(self) -> list[tuple[int, int]]:
        now = time.monotonic()
        if now - self._at > self.ttl:
            self._runs, self._at = _runs(), now
        return self._runs

    def size(self, base: int | None, probe: tuple[int, bytes] | None) -> tuple[int | None, int]:
        """``(base, size)`` of the linear memory holding ``probe`` (``(offset, bytes)``
        written by the guest); ``base`` is the cached answer of an earlier call. Size 0
        if it cannot be found."""
        runs = self.runs()
        if base is not None:
            for lo, hi in runs:
                if lo == base:
                    return base, hi - lo
            base = None
        if probe is None:
            return None, 0
        offset, marker = probe
        for lo, hi in runs:
            addr = lo + offset
            if addr + len(marker) <= hi and _read(addr, len(marker)) == marker:
                return lo, hi - lo
        return None, 0


def _read(addr: int, n: int) -> bytes | None:
    """``n`` bytes of this process's memory at ``addr``, through ``/proc/self/mem``: the
    mapping may have been unmapped since the maps were read (a guest ended on the pool's
    thread), and reading it there is an error, not a segmentation fault."""
    try:
        fd = os.open("/proc/self/mem", os.O_RDONLY)
    except OSError:
        return None
    try:
        return os.pread(fd, n, addr)
    except OSError:
        return None
    finally:
        os.close(fd)
