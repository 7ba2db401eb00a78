"""Physical ids and the errors of the page table: :class:`PhysicalPool`.

The engine owns the memory: KV pages ``[0, num_pages)``, embedding slots
``[0, num_embeds)`` and host pages (swap space). A pool keeps, for one of them, the free
list and a reference count per id, and which ids the prefix cache *holds* (kept at count
0). The resource manager (:mod:`pastry.control.resources`) owns one pool per kind and says
who the references are (:mod:`~pastry.control.handles`, :mod:`~pastry.control.exports`).
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Iterable
from typing import Literal

Kind = Literal["kv", "embed"]
KINDS: tuple[Kind, ...] = ("kv", "embed")

NOUN = {"kv": "kv page", "embed": "embed"}
PLURAL = {"kv": "KV pages", "embed": "embeds"}
SIZE_OPTION = {"kv": "num_pages", "embed": "num_embeds"}
QUOTA_NOUN = {"kv": "KV page", "embed": "embedding"}


class ResourceError(Exception):
    """A resource call was rejected; the message says why and what to do."""


class InvalidHandle(ResourceError):
    """A handle that this instance does not hold: freed, never allocated, or another's."""


class OutOfResources(ResourceError):
    """Not enough free physical ids, even after the eviction policy ran."""


class QuotaExceeded(OutOfResources):
    """An ``alloc`` or ``import_`` would take an instance over its limit (``set_limit``)."""


class ExportError(ResourceError):
    """An export name that is unknown, already taken, of another kind, or not yours."""


class PhysicalPool:
    """Physical ids ``[0, size)`` with a free list and a reference count each.

    ``alloc`` hands out the lowest free ids first (deterministic, so tests can name ids).
    An id is free exactly when its count is 0 and it is not *held* (by the prefix cache:
    :meth:`hold`); a held id keeps its place when its count drops to 0.
    """

    def __init__(self, size: int) -> None:
        if size < 0:
            raise ValueError(f"pool size must be >= 0, got {size}")
        self._size = size
        self._free: list[int] = list(range(size))  # a min-heap (a sorted list is one)
        self._refcount: list[int] = [0] * size
        self._held: set[int] = set()

    @property
    def size(self) -> int:
        return self._size

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return self._size - len(self._free)

    def refcount(self, pid: int) -> int:
        return self._refcount[pid]

    @property
    def counts(self) -> list[int]:
        """Every id's reference count, by id (read it, never change it: the hot paths that
        look at many ids at once index it instead of calling :meth:`refcount`)."""
        return self._refcount

    def held_ids(self) -> frozenset[int]:
        """The ids held (for the prefix cache)."""
        return frozenset(self._held)

    @property
    def held(self) -> int:
        return len(self._held)

    def hold(self, ids: Iterable[int]) -> None:
        """Keep ids that are in use (count > 0) off the free list even at count 0."""
        ids = list(ids)
        bad = [p for p in ids if not (0 <= p < self._size) or self._refcount[p] == 0]
        if bad or self._held.intersection(ids):
            raise ValueError(f"hold of ids that are free or held already: {sorted(ids)}")
        self._held.update(ids)

    def release(self, ids: Iterable[int]) -> list[int]:
        """Stop holding ids; those at count 0 return to the free list (returned)."""
        freed = []
        for pid in ids:
            self._held.remove(pid)
            if self._refcount[pid] == 0:
                heapq.heappush(self._free, pid)
                freed.append(pid)
        return freed

    def alloc(self, n: int) -> list[int]:
        """``n`` free ids, lowest first, each with count 1; all or nothing."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of ids ({n})")
        if n > len(self._free):
            raise OutOfResources(f"cannot allocate {n} ids: {len(self._free)} of {self._size} free")
        ids = [heapq.heappop(self._free) for _ in range(n)]
        rc = self._refcount
        for pid in ids:
            rc[pid] = 1
        return ids

    def incref(self, ids: Iterable[int]) -> None:
        """Add one reference per listed id (an id listed twice gets two); ids must be in use."""
        ids = list(ids)
        held = self._held
        bad = [
            pid
            for pid in ids
            if not (0 <= pid < self._size) or (self._refcount[pid] == 0 and pid not in held)
        ]
        if bad:
            raise ValueError(f"incref of ids that are not in use: {sorted(set(bad))}")
        rc = self._refcount
        for pid in ids:
            rc[pid] += 1

    def decref(self, ids: Iterable[int]) -> list[int]:
        """Drop one reference per listed id; returns the ids that became free (in the order
        their counts hit 0). All or nothing: no count may go below 0."""
        drops = Counter(ids)
        bad = [
            pid
            for pid, k in drops.items()
            if not (0 <= pid < self._size) or self._refcount[pid] < k
        ]
        if bad:
            raise ValueError(f"decref below zero for ids {sorted(bad)}")
        rc = self._refcount
        held = self._held
        freed = []
        for pid, k in drops.items():
            rc[pid] -= k
            if rc[pid] == 0 and pid not in held:
                heapq.heappush(self._free, pid)
                freed.append(pid)
        return freed

    def check_integrity(self) -> None:
        """Assert free + used == size, free ids have count 0, used ids count > 0."""
        free, rc, size = self._free, self._refcount, self._size
        free_set = set(free)
        assert len(free_set) == len(free), f"duplicate ids in the free list: {sorted(free)}"
        assert all(0 <= pid < size for pid in free), f"free list has ids outside [0, {size})"
        negative = [pid for pid, c in enumerate(rc) if c < 0]
        assert not negative, f"negative refcounts at ids {negative}"
        both = sorted(pid for pid in free_set if rc[pid] != 0)
        assert not both, f"ids both free and referenced: {both}"
        held = self._held
        assert not held & free_set, f"ids both free and held: {sorted(held & free_set)}"
        used = sum(1 for pid, c in enumerate(rc) if c > 0 or pid in held)
        assert len(free) + used == size, (
            f"free ({len(free)}) + used ({used}) != size ({size}); ids neither free nor "
            f"in use: {[p for p, c in enumerate(rc) if c == 0 and p not in free_set | held]}"
        )
