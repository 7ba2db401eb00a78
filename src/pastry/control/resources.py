"""Resource bookkeeping: per-inferlet virtual handles over the engine's physical memory.

The engine owns the memory: KV pages ``[0, num_pages)`` and embedding slots
``[0, num_embeds)``. This module owns who holds which of them (Pie §4.1, §5.2):

- :class:`PhysicalPool` — a free list and a reference count per physical id.
- :class:`ResourceManager` — one virtual handle space per inferlet instance and kind.
  Handles are ``0, 1, 2, ...`` per instance and kind, never reused, so a stale handle can
  never alias a newer allocation. A handle maps to one physical id; several handles (of one
  or many instances) and the export registry may reference the same id, which returns to the
  free list only when its last reference goes.
- Export/import: ``export`` puts physical ids in a named registry entry that holds its own
  references; ``import_`` gives the importer new handles to the same ids. A non-persistent
  export ends with its exporter, a persistent one at ``unexport``. What an importer got stays
  valid either way (it holds its own references).
- Contention: when an ``alloc`` cannot be met, an :class:`EvictionPolicy` names instances to
  terminate; the default :class:`TerminateNewest` is the paper's FCFS policy (the most
  recently created inferlets end first).
- Limits: :meth:`ResourceManager.set_limit` caps how many ids of a kind one instance may
  hold at once (the sandbox's ``SandboxLimits``, the server's ``--instance-share``; several
  sources may each set one, the smallest wins); ``alloc`` and ``import_`` over it raise
  :class:`QuotaExceeded` and change nothing.
- Users (``docs/security.md``): every instance belongs to a user (any hashable name;
  ``None`` by default). Export names are per user: an instance exports into, imports from
  and unexports in its own user's namespace (``import_`` may name another ``owner``; the
  caller checks the grant). What a party *holds* is the number of distinct physical ids
  it references: an instance through its handles and its non-persistent exports, a user
  through its instances and its persistent exports. :meth:`ResourceManager.set_user_limit`
  caps a user's; a user over it first loses its least recently used persistent exports.
  A page swapped to host memory is still held (charges count what handles map to).
- Persistent exports are a cache: when an ``alloc`` cannot be met, those whose ids nothing
  else references are dropped, least recently imported first, before any instance ends.
- Swap: a KV page an instance alone references may move to a *host page* (the engine's
  swap space): its handles then map to ``-1 - host_id`` (:meth:`~ResourceManager.swap_out`)
  until :meth:`~ResourceManager.swap_in` maps them to device pages again. With swap space
  enabled (``defer_when_short``, set by :class:`~pastry.control.swap.KvSwapper`), an
  ``alloc`` the device cannot meet is *deferred*: its pages start in host memory (no data
  to copy) and get device pages before the instance's next batch. Moves are recorded
  here and sent to the engine at the front of the next batch (:meth:`take_moves`); host
  pages released meanwhile stay held until then, so that no move of that batch can
  overwrite another's source.

- The prefix cache (optional, :mod:`pastry.control.prefix_cache`): a KV page may be *held
  by the cache* instead. It then belongs to the radix tree (the tree of its user's
  namespace); handles and exports that still reference it *borrow* it read-only, and their
  references are the tree node's uses (a used node is never evicted). A page whose last
  reference goes and whose content is certified canonical
  (:mod:`pastry.control.provenance`) is offered to the cache instead of being freed (the
  prompt *and* the generated tokens of a released context). When an ``alloc`` cannot be
  met, least-recently-used cached pages nobody uses are evicted first. A write to a cached
  page is allowed only to an instance that is its only user (the page and what the tree
  holds after it then leave the cache: :meth:`ResourceManager.claim_writes`). Cached
  pages are never swapped (the cache evicts instead).
- Reserved handles: :meth:`ResourceManager.reserve` gives handles that are bound later
  (:meth:`ResourceManager.bind_cached`, :meth:`ResourceManager.bind_fresh`), so that a
  prefill can decide at admission which pages come from the cache.

Each physical KV page is in exactly one of these states: free, referenced by inferlets
(handles and exports, ref-counted), held by the prefix cache (maybe borrowed), or — for the
handles' view — swapped to a host page; :meth:`ResourceManager.check_integrity` checks all
of it.

Used from the control loop only (no locks). Pure Python; numpy only for ``translate_array``.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

import numpy as np

if TYPE_CHECKING:
    from pastry.control.prefix_cache import PrefixCache
    from pastry.control.provenance import KvProvenance, PageRecord

log = logging.getLogger(__name__)

Kind = Literal["kv", "embed"]
KINDS: tuple[Kind, ...] = ("kv", "embed")

_NOUN = {"kv": "kv page", "embed": "embed"}
_PLURAL = {"kv": "KV pages", "embed": "embeds"}
_SIZE_OPTION = {"kv": "num_pages", "embed": "num_embeds"}
_QUOTA_NOUN = {"kv": "KV page", "embed": "embedding"}


_SAME = object()  # "the instance's own user" (a default that None cannot be)


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


# ---------------------------------------------------------------------------------------------
# Physical ids


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
    def held(self) -> int:
        return len(self._held)

    def is_held(self, pid: int) -> bool:
        return pid in self._held

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


# ---------------------------------------------------------------------------------------------
# Eviction policies


class EvictionPolicy(Protocol):
    """Chooses which inferlet instances to terminate when an ``alloc`` cannot be met.

    Called by :meth:`ResourceManager.alloc` when fewer than ``needed`` ids of ``kind`` are
    free, before anything has changed. It must only read the manager (``instances()``,
    ``held()``, ``usage()``, ``reclaimable()``), never change it. It returns the instances to
    terminate, in the order they should end; ``[]`` refuses (the requester gets
    :class:`OutOfResources`). If the list contains ``requester`` the requester itself is the
    one to give way: the manager then terminates nobody and raises :class:`OutOfResources`
    to the requester. An optional ``description`` attribute names the policy in messages.
    """

    def choose_victims(
        self, manager: ResourceManager, kind: Kind, needed: int, requester: int
    ) -> list[int]: ...


class TerminateNewest:
    """The paper's FCFS policy: terminate the most recently created instances until enough
    ids would return to the free list.

    Walks instances newest first; reaching the requester means that the requester is the
    newest one left, so it is returned (and nobody older is ever chosen). Only ids that would
    really be freed count (those referenced by the chosen instances alone). A chosen instance
    whose end would free nothing more (e.g. it holds only pages shared with older inferlets)
    is left running.
    """

    description = "FCFS policy: the newest inferlets end first"

    def choose_victims(
        self, manager: ResourceManager, kind: Kind, needed: int, requester: int
    ) -> list[int]:
        free = manager.usage(kind)[0]
        victims: list[int] = []
        for inst in reversed(manager.instances()):
            if inst == requester:
                return [*victims, requester]
            victims.append(inst)
            if free + manager.reclaimable(kind, victims) >= needed:
                break
        else:
            return victims  # the requester is not registered; the manager rejects the call
        return only_needed(manager, kind, victims)


def only_needed(manager: ResourceManager, kind: Kind, victims: list[int]) -> list[int]:
    """``victims`` less those whose end would free nothing the others' end does not (e.g.
    an instance holding only pages shared with the others): they are left running."""
    total = manager.reclaimable(kind, victims)
    for inst in list(victims):
        rest = [v for v in victims if v != inst]
        if manager.reclaimable(kind, rest) == total:
            victims = rest
    return victims


# ---------------------------------------------------------------------------------------------
# The manager


@dataclass(frozen=True, slots=True)
class _Export:
    kind: Kind
    ids: tuple[int, ...]
    owner: int  # the exporting instance
    persistent: bool
    user: object = None  # the namespace it lives in (the exporter's user)
    pinned: bool = False  # never reclaimed (the server's holds, e.g. pages being written)


def _on_host(host_id: int) -> int:
    """The table value of a KV handle whose page is host page ``host_id``."""
    return -1 - host_id


class ResourceManager:
    """Virtual handles of every inferlet instance over the engine's KV pages and embeds.

    ``on_terminate(instance_id, reason)`` ends an instance chosen by ``policy``; it must call
    :meth:`remove_instance` before returning (the manager calls it afterwards anyway, so the
    memory is reclaimed even if the callback does not). Without ``on_terminate`` nobody can
    be terminated and contention raises :class:`OutOfResources` at once.

    Instances are ``int`` ids, remembered in creation order. Calls naming an instance that is
    not registered raise :class:`ResourceError`; an unknown kind raises ``ValueError``.

    With a ``cache`` (and the ``provenance`` that certifies page contents), KV pages can be
    held by the prefix cache (see the module docstring); ``cache_seconds`` accumulates the
    time spent in its bookkeeping here, ``cache_events`` counts pages ``adopted``,
    ``evicted`` and ``detached``.
    """

    def __init__(
        self,
        num_pages: int,
        num_embeds: int,
        policy: EvictionPolicy | None = None,
        on_terminate: Callable[[int, str], None] | None = None,
        num_host_pages: int = 0,
        first_handle: int = 0,
        cache: PrefixCache | None = None,
        provenance: KvProvenance | None = None,
    ) -> None:
        if (cache is None) != (provenance is None):
            raise ValueError("a prefix cache needs the provenance that certifies its pages")
        self.first_handle = first_handle  # handles start here (distinct per engine)
        self._pools: dict[Kind, PhysicalPool] = {
            "kv": PhysicalPool(num_pages),
            "embed": PhysicalPool(num_embeds),
        }
        self.policy: EvictionPolicy = policy if policy is not None else TerminateNewest()
        self.on_terminate = on_terminate
        # kind -> instance -> handle -> physical id (the hot-path table)
        self._handles: dict[Kind, dict[int, dict[int, int]]] = {k: {} for k in KINDS}
        # kind -> instance -> next handle
        self._next: dict[Kind, dict[int, int]] = {k: {} for k in KINDS}
        # instance -> keys of its non-persistent exports; insertion order = creation order
        self._instances: dict[int, set[tuple[object, str]]] = {}
        self._users: dict[int, object] = {}  # instance -> its user
        self._exports: dict[tuple[object, str], _Export] = {}  # (user, name) -> export
        self._last_import: dict[tuple[object, str], int] = {}  # persistent exports' LRU
        self._clock = itertools.count()
        # instance -> kind -> source -> most ids it may hold
        self._limits: dict[int, dict[Kind, dict[str, int]]] = {}
        # user -> kind -> (most ids it may hold, who set that limit)
        self._user_limits: dict[object, dict[Kind, tuple[int, str]]] = {}
        # What each party holds: kind -> instance / user -> references per physical id
        self._charge: dict[Kind, dict[int, Counter[int]]] = {k: {} for k in KINDS}
        self._user_charge: dict[Kind, dict[object, Counter[int]]] = {k: {} for k in KINDS}
        # swap: host pages; per instance the number of its KV handles on host pages
        self._host = PhysicalPool(num_host_pages)
        self._handles_on_host: dict[int, int] = {}
        self._unbacked: set[int] = set()  # host pages of deferred allocs (nothing to copy)
        self._moves_out: list[tuple[int, int]] = []  # (device page, host page), not yet sent
        self._moves_in: list[tuple[int, int]] = []  # (host page, device page), not yet sent
        self._arriving: set[int] = set()  # device pages that _moves_in fill
        self._held: list[int] = []  # host references released while moves are unsent
        self.defer_when_short = False  # set by the swapper: short allocs start on host
        # kind -> instance -> handles reserved but not bound yet
        self._reserved: dict[Kind, dict[int, set[int]]] = {k: {} for k in KINDS}
        self.cache = cache
        self.provenance = provenance
        self.cache_seconds = 0.0
        self.cache_events: Counter[str] = Counter()

    # ------------------------------------------------------------------ instances

    def add_instance(self, instance_id: int, user: object = None) -> None:
        """Register an instance of ``user`` (its export namespace and quota)."""
        if instance_id in self._instances:
            raise ValueError(f"inferlet {instance_id} is already registered")
        self._instances[instance_id] = set()
        self._users[instance_id] = user
        for kind in KINDS:
            self._handles[kind][instance_id] = {}
            self._next[kind][instance_id] = self.first_handle
            self._charge[kind][instance_id] = Counter()
            self._reserved[kind][instance_id] = set()

    def remove_instance(self, instance_id: int) -> None:
        """Release everything the instance holds: its handles' references and its
        non-persistent exports. Idempotent (an unknown id is a no-op)."""
        keys = self._instances.pop(instance_id, None)
        if keys is None:
            return
        self._limits.pop(instance_id, None)
        user = self._users.pop(instance_id)
        for key in keys:
            exp = self._exports.pop(key)
            self._uncharge_user(exp.kind, user, exp.ids)
            self._drop(exp.kind, exp.ids, user)
        for kind in KINDS:
            table = self._handles[kind].pop(instance_id)
            del self._next[kind][instance_id]
            del self._charge[kind][instance_id]
            del self._reserved[kind][instance_id]
            self._uncharge_user(kind, user, table.values())
            self._release(kind, table.values(), user)
        self._handles_on_host.pop(instance_id, None)

    def instances(self) -> list[int]:
        """Registered instances, oldest first."""
        return list(self._instances)

    # ------------------------------------------------------------------ limits

    def set_limit(
        self, instance: int, kind: Kind, max_held: int | None, source: str = "set_limit"
    ) -> None:
        """Let ``instance`` hold at most ``max_held`` ids of ``kind`` at once (``None``:
        lift the limit ``source`` set). ``alloc`` and ``import_`` that would go over it
        raise :class:`QuotaExceeded` naming the limit and ``source`` (where it is set, so
        the user knows what to raise, e.g. ``"SandboxLimits.max_kv_pages"``); ids already
        held are kept. Each source sets its own limit; the smallest applies. Limits end
        with the instance."""
        self._table(instance, kind)
        limits = self._limits.setdefault(instance, {}).setdefault(kind, {})
        if max_held is None:
            limits.pop(source, None)
            return
        limits[source] = _check_cap(max_held)

    def limit(self, instance: int, kind: Kind) -> int | None:
        """The most ids of ``kind`` that ``instance`` may hold (``None``: no limit)."""
        self._table(instance, kind)
        caps = self._limits.get(instance, {}).get(kind)
        return min(caps.values()) if caps else None

    def set_user_limit(
        self, user: object, kind: Kind, max_held: int | None, source: str = "set_user_limit"
    ) -> None:
        """Let ``user`` hold at most ``max_held`` ids of ``kind`` at once, counting its
        instances' and its persistent exports' (``None``: no limit). Over it, ``alloc`` and
        ``import_`` first drop the user's least recently used persistent exports, then raise
        :class:`QuotaExceeded`. The limit outlives the user's instances."""
        self._pool(kind)
        limits = self._user_limits.setdefault(user, {})
        if max_held is None:
            limits.pop(kind, None)
            return
        limits[kind] = (_check_cap(max_held), source)

    def user_limit(self, user: object, kind: Kind) -> int | None:
        cap = self._user_limits.get(user, {}).get(kind)
        return None if cap is None else cap[0]

    # ------------------------------------------------------------------ alloc / free

    def alloc(self, instance: int, kind: Kind, n: int) -> list[int]:
        """``n`` new handles of ``kind`` for ``instance`` (all or nothing).

        Over the instance's limit (:meth:`set_limit`) raises :class:`QuotaExceeded`. When
        fewer than ``n`` ids are free, the policy's victims are terminated first; if that is
        refused, chooses the requester, or frees too little, raises :class:`OutOfResources`.
        """
        table = self._table(instance, kind)
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of {_PLURAL[kind]} ({n})")
        self._check_limit(instance, kind, n + len(self._reserved[kind][instance]))
        pool = self._pools[kind]
        if pool.free < n and kind == "kv" and self.cache is not None:
            self._evict(n - pool.free)  # the prefix cache's unused pages go first
        if pool.free < n and self._last_import:
            self._drop_cached(kind, n)  # before swapping anyone: stale caches go first
        if pool.free < n and kind == "kv" and self.defer_when_short and self._host.free >= n:
            hosts = self._host.alloc(n)  # deferred: device pages come with the next swap-in
            self._unbacked.update(hosts)
            self._handles_on_host[instance] = self._handles_on_host.get(instance, 0) + n
            return self._bind(instance, kind, table, [_on_host(h) for h in hosts])
        if pool.free < n:
            self._reclaim(instance, kind, n)
        return self._bind(instance, kind, table, pool.alloc(n))

    def free(self, instance: int, kind: Kind, handles: Iterable[int]) -> None:
        """Drop the handles (a reserved one that was never bound just stops being
        reserved). Any bad handle (or one listed twice) raises :class:`InvalidHandle` and
        nothing changes."""
        table = self._table(instance, kind)
        handles = list(handles)
        reserved = self._reserved[kind][instance]
        if len(set(handles)) != len(handles) or not all(
            h in table or h in reserved for h in handles
        ):
            raise self._invalid(instance, kind, handles, twice_is_bad=True)
        reserved.difference_update(handles)
        ids = [table.pop(h) for h in handles if h in table]
        on_host = sum(1 for pid in ids if pid < 0)
        if on_host:
            self._handles_on_host[instance] -= on_host
        self._uncharge(kind, instance, ids)
        self._release(kind, ids, self._users[instance])

    def check(self, instance: int, kind: Kind, handles: Sequence[int]) -> None:
        """Raise :class:`InvalidHandle` unless every handle is the instance's (bound or
        reserved)."""
        table = self._table(instance, kind)
        reserved = self._reserved[kind][instance]
        if not all(h in table or h in reserved for h in handles):
            raise self._invalid(instance, kind, handles)

    def translate(self, instance: int, kind: Kind, handles: Sequence[int]) -> list[int]:
        """Physical ids of ``handles`` (hot path: one dict lookup per handle)."""
        try:
            table = self._handles[kind][instance]
            return [table[h] for h in handles]
        except KeyError:
            raise self._lookup_error(instance, kind, handles) from None

    def tables(self, instance: int) -> tuple[dict[int, int], dict[int, int]]:
        """The instance's KV and embedding handle tables (handle -> physical id), for the
        batch scheduler's one-pass translation of a batch (:mod:`pastry.control.steps`):
        read them, never change them. A missing handle is a ``KeyError`` (:meth:`translate`
        names what is wrong with it); an unknown instance raises :class:`ResourceError`."""
        handles = self._handles
        try:
            return handles["kv"][instance], handles["embed"][instance]
        except KeyError:
            raise self._lookup_error(instance, "kv", ()) from None

    def translate_array(self, instance: int, kind: Kind, handles: np.ndarray) -> np.ndarray:
        """:meth:`translate` for an integer array of any shape; returns int64 of that shape."""
        arr = np.asarray(handles)
        flat = arr.ravel().tolist()
        try:
            get = self._handles[kind][instance].__getitem__
            out = np.fromiter(map(get, flat), dtype=np.int64, count=len(flat))
        except KeyError:
            raise self._lookup_error(instance, kind, flat) from None
        return out.reshape(arr.shape)

    # ------------------------------------------------------------------ export / import

    def export(
        self,
        instance: int,
        kind: Kind,
        handles: Iterable[int],
        name: str,
        persistent: bool = False,
        pinned: bool = False,
    ) -> None:
        """Publish the physical ids of ``handles`` under ``name`` in the instance's user's
        namespace (the registry takes its own references). A non-persistent export is
        dropped when ``instance`` ends and counts as the instance's; a persistent one lives
        until :meth:`unexport` (or is reclaimed, unless ``pinned``: the server's own holds,
        never an inferlet's) and counts as its user's. The handles stay the exporter's."""
        table = self._table(instance, kind)
        handles = list(handles)
        if not all(h in table for h in handles):
            raise self._invalid(instance, kind, handles)
        if not isinstance(name, str) or not name:
            raise ExportError(f"export name must be a non-empty string, got {name!r}")
        user = self._users[instance]
        key = (user, name)
        if key in self._exports:
            raise ExportError(
                f"export name {name!r} is already taken; unexport it first or choose another name"
            )
        ids = tuple(table[h] for h in handles)
        if any(pid < 0 for pid in ids):
            raise ResourceError(
                f"inferlet {instance}: cannot export pages that are swapped out to host memory "
                "(the scheduler brings them back before the instance's commands run)"
            )
        self._take(kind, ids)
        self._exports[key] = _Export(kind, ids, instance, persistent, user, pinned)
        if persistent:
            self._last_import[key] = next(self._clock)
            self._charge_user(kind, user, ids)
        else:
            self._instances[instance].add(key)
            self._charge_ids(kind, instance, ids)

    def import_(self, instance: int, kind: Kind, name: str, owner: object = _SAME) -> list[int]:
        """New handles of ``instance`` for the physical ids exported as ``name`` in
        ``owner``'s namespace (default: the instance's own user; reading another's is the
        caller's to allow), in the exported order (each takes a reference). Over the
        instance's or its user's limit raises :class:`QuotaExceeded`."""
        table = self._table(instance, kind)
        key = (self._users[instance] if owner is _SAME else owner, name)
        exp = self._exports.get(key)
        if exp is None:
            raise ExportError(f"no export named {name!r}; list_exports() shows what exists")
        if exp.kind != kind:
            raise ExportError(
                f"export {name!r} holds {_PLURAL[exp.kind]}, not {_PLURAL[kind]}; "
                f"import it as kind {exp.kind!r}"
            )
        self._check_limit(instance, kind, exp.ids, keep=key)
        if exp.persistent:
            self._last_import[key] = next(self._clock)
        self._take(kind, exp.ids)
        return self._bind(instance, kind, table, list(exp.ids))

    def unexport(self, instance: int | None, name: str, owner: object = None) -> None:
        """Drop the export ``name`` of the instance's user and its references (handles
        imported from it stay valid).

        A non-persistent export may only be dropped by its exporter; a persistent one by any
        instance of its user. ``instance=None`` is the server itself and may drop any
        export (of ``owner``'s namespace).
        """
        if instance is not None:
            self._require(instance)
            owner = self._users[instance]
        key = (owner, name)
        exp = self._exports.get(key)
        if exp is None:
            raise ExportError(f"no export named {name!r}; list_exports() shows what exists")
        if instance is not None and not exp.persistent and exp.owner != instance:
            raise ExportError(
                f"export {name!r} belongs to inferlet {exp.owner}; only its exporter can "
                f"unexport a non-persistent export (it ends with its exporter)"
            )
        self._drop_export(key)

    def list_exports(self, owner: object = _SAME) -> list[tuple[str, str, int]]:
        """``(name, kind, count)`` of every export in ``owner``'s namespace (default: every
        user's), oldest first."""
        return [
            (name, exp.kind, len(exp.ids))
            for (user, name), exp in self._exports.items()
            if owner is _SAME or user == owner
        ]

    # ------------------------------------------------------------------ reserved handles

    def reserve(self, instance: int, kind: Kind, n: int) -> list[int]:
        """``n`` new handles of ``kind`` bound to nothing yet (a queued call binds them:
        :meth:`bind_cached`, :meth:`bind_fresh`). They count against the instance's limit
        as fresh ids; using one before it is bound is an :class:`InvalidHandle` error."""
        self._table(instance, kind)
        if n < 0:
            raise ValueError(f"cannot reserve a negative number of {_PLURAL[kind]} ({n})")
        reserved = self._reserved[kind][instance]
        self._check_limit(instance, kind, n + len(reserved))
        start = self._next[kind][instance]
        handles = list(range(start, start + n))
        self._next[kind][instance] = start + n
        reserved.update(handles)
        return handles

    def unreserve(self, instance: int, kind: Kind, handles: Iterable[int]) -> None:
        """Give up reserved handles that were never bound (a no-op for any other)."""
        mine = self._reserved[kind].get(instance)
        if mine is not None:
            mine.difference_update(handles)

    def bind_cached(self, instance: int, handles: Sequence[int], pages: Sequence[int]) -> None:
        """Bind reserved KV handles to pages held by the prefix cache (borrowed: each takes a
        reference, so the tree node stays in use while the handle lives)."""
        self._take("kv", pages)
        self._bind_reserved(instance, "kv", handles, pages)

    def bind_fresh(self, instance: int, kind: Kind, handles: Sequence[int]) -> list[int]:
        """Bind reserved handles to newly allocated ids (evicting cached pages, then the
        eviction policy's victims, when short; raises like :meth:`alloc`). Returns the ids."""
        self._table(instance, kind)
        pool = self._pools[kind]
        n = len(handles)
        if pool.free < n and kind == "kv" and self.cache is not None:
            self._evict(n - pool.free)
        if pool.free < n and self._last_import:
            self._drop_cached(kind, n)
        if pool.free < n:
            self._reclaim(instance, kind, n)
        ids = pool.alloc(n)
        self._bind_reserved(instance, kind, handles, ids)
        return ids

    def unbind(self, instance: int, kind: Kind, handles: Sequence[int]) -> None:
        """Make bound handles reserved again (their references are dropped)."""
        table = self._table(instance, kind)
        if not all(h in table for h in handles):
            raise self._invalid(instance, kind, handles)
        ids = [table.pop(h) for h in handles]
        self._reserved[kind][instance].update(handles)
        self._uncharge(kind, instance, ids)
        self._drop(kind, ids, self._users[instance])

    def _bind_reserved(
        self, instance: int, kind: Kind, handles: Sequence[int], ids: Sequence[int]
    ) -> None:
        table = self._table(instance, kind)
        mine = self._reserved[kind][instance]
        missing = [h for h in handles if h not in mine]
        if missing or len(handles) != len(ids):
            raise InvalidHandle(
                f"inferlet {instance}: {_NOUN[kind]} handles {missing} are not reserved "
                "(freed or bound already)"
            )
        mine.difference_update(handles)
        table.update(zip(handles, ids, strict=True))
        self._charge_ids(kind, instance, ids)

    # ------------------------------------------------------------------ prefix cache

    def available(self, kind: Kind) -> int:
        """Ids of ``kind`` an allocation could get now: free ones plus cached pages that
        eviction could free."""
        free = self._pool(kind).free
        if kind == "kv" and self.cache is not None:
            free += self.cache.evictable_pages
        return free

    def claim_writes(self, instance: int, pages: Iterable[int]) -> None:
        """Check that ``instance`` may write the physical KV ``pages`` (a forward's output
        pages, a mask, a copy's destination). A page held by the prefix cache may be written
        only when every reference to it, and to what the cache holds after it, is this
        instance's own: the page and everything cached after it then leave the cache (the
        instance owns them again, as before it shared them). Otherwise raises
        :class:`ResourceError`: other inferlets read the page."""
        cache = self.cache
        if cache is None:
            return
        for pid in pages:
            if pid in cache:
                self._claim(instance, pid)

    def uncache(self, pages: Iterable[int]) -> None:
        """Take ``pages`` (those the cache holds) and what is cached after them out of the
        cache, whoever uses them (their content is not what the cache says)."""
        cache = self.cache
        if cache is None:
            return
        for pid in pages:
            if pid in cache:
                free, kept = cache.detach(pid)
                self._pools["kv"].release(free + kept)
                self.cache_events["detached"] += len(free) + len(kept)

    def _claim(self, instance: int, pid: int) -> None:
        t0 = time.perf_counter()
        cache, pool = self.cache, self._pools["kv"]
        referenced, pins = cache.detach_scope(pid)
        mine = Counter(self._handles["kv"][instance].values())
        others = [p for p in referenced if pool.refcount(p) != mine[p]]
        if pins or others:
            self.cache_seconds += time.perf_counter() - t0
            raise ResourceError(
                f"KV page {pid} is shared through the prefix cache with other inferlets "
                "(it holds canonical K/V they read), so it cannot be written. Copy its "
                "slots into a page of your own (copy_kvpage) and write that one"
            )
        free, kept = cache.detach(pid)
        pool.release(free + kept)
        self.cache_events["detached"] += len(free) + len(kept)
        self.cache_seconds += time.perf_counter() - t0

    def _take(self, kind: Kind, ids: Sequence[int]) -> None:
        """Add one reference per id (cached pages become borrowed: their node is in use)."""
        pool = self._pools[kind]
        cache = self.cache if kind == "kv" else None
        if cache is None or not cache.cached_pages:
            pool.incref(ids)
            return
        newly = {p for p in ids if p in cache and pool.refcount(p) == 0}
        pool.incref(ids)
        if newly:
            cache.ref_pages(newly)

    def _drop(
        self, kind: Kind, ids: Sequence[int], user: object = None, offer: bool = True
    ) -> None:
        """Drop one reference per device id. KV pages that lose their last reference and
        hold certified K/V are offered to ``user``'s prefix cache first (unless not
        ``offer``); the others are freed."""
        pool = self._pools[kind]
        cache = self.cache if kind == "kv" else None
        if cache is None or not ids:
            pool.decref(ids)
            return
        t0 = time.perf_counter()
        drops = Counter(ids)
        if offer:
            self._offer(drops, user)
        pool.decref(ids)
        zero = [p for p in drops if p in cache and pool.refcount(p) == 0]
        if zero:
            cache.unref_pages(zero)
        self.cache_seconds += time.perf_counter() - t0

    def _offer(self, drops: Counter[int], user: object) -> None:
        """Insert into ``user``'s cache the certified sequences that end in pages losing
        their last reference (``drops``: references about to be dropped per page)."""
        cache, pool, recs = self.cache, self._pools["kv"], self.provenance.records
        ending = [
            p
            for p, k in drops.items()
            if recs[p] is not None and p not in cache and pool.refcount(p) == k
        ]
        if not ending:
            return
        exported: set[int] | None = None
        done: set[int] = set()
        for p in sorted(ending, key=lambda p: recs[p].index, reverse=True):
            if p in done:
                continue
            chain = self.provenance.chain(p)
            done.update(r.page for r in chain)
            if exported is None:
                exported = {i for e in self._exports.values() if e.kind == "kv" for i in e.ids}
            self._insert_chain(chain, drops, exported, user)

    def offer(self, instance: int, pages: Iterable[int]) -> None:
        """Insert the certified sequences ending in ``pages`` (that ``instance`` still
        references, e.g. a prompt just prefilled) into its user's cache, so that others can
        reuse them now. Pages another inferlet or an export also references are not
        taken."""
        if self.cache is None or instance not in self._users:  # (it ended: nothing to do)
            return
        t0 = time.perf_counter()
        user = self._users[instance]
        exported = {i for e in self._exports.values() if e.kind == "kv" for i in e.ids}
        for p in pages:
            if p not in self.cache and self.provenance.records[p] is not None:
                self._insert_chain(self.provenance.chain(p), Counter(), exported, user)
        self.cache_seconds += time.perf_counter() - t0

    def _insert_chain(
        self, chain: list[PageRecord], drops: Counter[int], exported: set[int], user: object
    ) -> None:
        """Insert the tokens of ``chain`` with the pages that still hold them, as far as
        each page can be taken: it must still hold its record's content, be in use (not
        freed already), not be cached already, and have at most one reference left (not an
        export's) after ``drops``."""
        cache, pool, recs = self.cache, self._pools["kv"], self.provenance.records
        ps = cache.page_size
        tokens: list[int] = []
        for r in chain:
            tokens.extend(r.tokens)
        match = cache.match(tokens, touch=False, namespace=user)
        cached, mine = match.length, match.pages
        end = len(tokens)
        for i in range(cached // ps, len(chain)):
            r = chain[i]
            p = r.page
            cur = recs[p]
            rc = pool.refcount(p)
            left = rc - drops.get(p, 0)
            if (
                cur is None
                or not cur.holds(r)
                # a cached page may only be the partial last page of what this tree has
                or (p in cache and (i > cached // ps or i >= len(mine) or mine[i] != p))
                or (p not in cache and (rc == 0 or left > 1 or (left == 1 and p in exported)))
            ):
                end = i * ps
                break
        if end <= cached:
            return
        pages = [r.page for r in chain[: -(-end // ps)]]
        try:
            done = cache.insert(tokens[:end], pages, namespace=user)
        except ValueError as e:  # an invariant the tree checks: keep the pages out
            log.warning("prefix cache: not inserting %d tokens: %s", end, e)
            return
        if done.adopted:
            pool.hold(done.adopted)
            cache.ref_pages(done.adopted)  # all still referenced until the drop
            self.cache_events["adopted"] += len(done.adopted)

    def _evict(self, n: int) -> int:
        """Evict at least ``n`` cached pages nobody uses (fewer if there are not that many)."""
        t0 = time.perf_counter()
        freed = self.cache.evict(n)
        self._pools["kv"].release(freed)
        self.cache_events["evicted"] += len(freed)
        self.cache_seconds += time.perf_counter() - t0
        return len(freed)

    # ------------------------------------------------------------------ accounting

    def flush_cache(self) -> int:
        """Evict every page of the prefix cache that nothing uses (SGLang's
        ``/flush_cache``); returns how many were freed."""
        return self._evict(self.cache.cached_pages) if self.cache is not None else 0

    # ------------------------------------------------------------------ a lost device

    def holders(self) -> list[int]:
        """Instances whose handles or non-persistent exports name any page or embedding of
        this pool (device or host): what a restarted engine takes from them."""
        out = []
        for inst in self._instances:
            if self._instances[inst] or any(self._handles[k][inst] for k in KINDS):
                out.append(inst)
        return out

    def device_lost(self) -> None:
        """The engine's memory is gone (its process died and was restarted): every id of
        the pools is free again. Call it once the :meth:`holders` have been removed: what
        is left are the persistent exports, the prefix cache and what provenance
        certifies, all of which named the lost memory, and are dropped."""
        assert not self.holders(), f"instances still hold ids: {self.holders()}"
        for key in list(self._exports):
            self._drop_export(key)
        if self.cache is not None:
            self._evict(self.cache.cached_pages)
        if self.provenance is not None:
            self.provenance.forget(range(self._pools["kv"].size))
        self._moves_out.clear()
        self._moves_in.clear()
        self._arriving.clear()
        self._release_host(list(self._held))
        self._held.clear()

    def held(self, instance: int, kind: Kind) -> int:
        """Handles of ``kind`` that ``instance`` holds (shared ones included)."""
        return len(self._table(instance, kind))

    def charged(self, instance: int, kind: Kind) -> int:
        """Distinct ids of ``kind`` the instance holds (handles and its non-persistent
        exports): what its limits count."""
        self._table(instance, kind)
        return len(self._charge[kind][instance])

    def user_charged(self, user: object, kind: Kind) -> int:
        """Distinct ids of ``kind`` the user holds (its instances' and its persistent
        exports'): what its limit counts."""
        self._pool(kind)
        return len(self._user_charge[kind].get(user, ()))

    def user_of(self, instance: int) -> object:
        self._require(instance)
        return self._users[instance]

    def usage(self, kind: Kind) -> tuple[int, int, int]:
        """``(free, used, total)`` physical ids of ``kind``."""
        pool = self._pool(kind)
        return pool.free, pool.used, pool.size

    def referenced(self, kind: Kind) -> int:
        """Physical ids of ``kind`` that handles or exports reference (the memory programs
        use: ``usage`` counts cached pages nobody uses as used too)."""
        pool = self._pool(kind)
        idle = pool.held - (self.cache.referenced_pages if kind == "kv" and self.cache else 0)
        return pool.used - idle

    def refcount(self, kind: Kind, pid: int) -> int:
        """References to physical id ``pid`` (handles plus exports)."""
        return self._pool(kind).refcount(pid)

    def reclaimable(self, kind: Kind, instances: Iterable[int]) -> int:
        """How many ids of ``kind`` would return to the free list if all of ``instances``
        ended now (ids referenced only by their handles and non-persistent exports)."""
        refs: Counter[int] = Counter()
        for inst in set(instances):
            names = self._instances.get(inst)
            if names is None:
                continue
            refs.update(pid for pid in self._handles[kind][inst].values() if pid >= 0)
            for key in names:
                exp = self._exports[key]
                if exp.kind == kind:
                    refs.update(exp.ids)
        pool = self._pools[kind]
        return sum(1 for pid, k in refs.items() if pool.refcount(pid) == k)

    def check_integrity(self) -> None:
        """Assert that the pools are consistent, that every physical id's count equals the
        references to it from handles and exports, and that the pages the pool holds for
        the prefix cache are exactly the tree's (borrowed exactly when referenced)."""
        assert self._instances.keys() == self._handles["kv"].keys() == self._handles["embed"].keys()
        for kind in KINDS:
            assert self._reserved[kind].keys() == self._instances.keys(), kind
            for inst, res in self._reserved[kind].items():
                assert not res & self._handles[kind][inst].keys(), (inst, "bound and reserved")
                assert all(self.first_handle <= h < self._next[kind][inst] for h in res), inst
        kv = self._pools["kv"]
        if self.cache is None:
            assert kv.held == 0, "pages held without a prefix cache"
        else:
            self.cache.check_integrity()
            pages = self.cache.page_ids()
            assert kv._held == pages, f"held {sorted(kv._held ^ pages)} disagree with the tree"
            for p in pages:
                assert (kv.refcount(p) > 0) == self.cache.is_referenced(p), f"page {p} borrowed?"
        assert self._pools["embed"].held == 0, "embeds are never held"
        assert self._limits.keys() <= self._instances.keys(), "limits of unknown instances"
        for kind in KINDS:
            pool = self._pools[kind]
            pool.check_integrity()
            assert self._next[kind].keys() == self._instances.keys(), kind
            refs: Counter[int] = Counter()
            for inst, table in self._handles[kind].items():
                nxt = self._next[kind][inst]
                bad = [h for h in table if not self.first_handle <= h < nxt]
                assert not bad, f"inferlet {inst} has {kind} handles {bad} outside [.., {nxt})"
                refs.update(pid for pid in table.values() if pid >= 0)
            for exp in self._exports.values():
                if exp.kind == kind:
                    refs.update(exp.ids)
            wrong = {
                pid: (pool.refcount(pid), refs[pid])
                for pid in range(pool.size)
                if pool.refcount(pid) != refs[pid]
            }
            assert not wrong, f"{kind} ids whose (refcount, references) differ: {wrong}"
        for inst, keys in self._instances.items():
            for key in keys:
                exp = self._exports.get(key)
                assert exp is not None and exp.owner == inst and not exp.persistent, (inst, key)
        for key, exp in self._exports.items():
            assert key[0] == exp.user, (key, exp.user)
            if not exp.persistent:
                assert key in self._instances.get(exp.owner, ()), (key, exp.owner)
                assert self._users[exp.owner] == exp.user, (key, exp.owner)
            assert all(pid >= 0 for pid in exp.ids), f"export {key!r} names host pages"
        assert self._last_import.keys() == {k for k, e in self._exports.items() if e.persistent}
        self._check_charges()
        self._check_swap_integrity()

    def _check_swap_integrity(self) -> None:
        """Host pages: each one's count equals the handles mapped to it plus the references
        held until the pending moves are sent; moves name pages in use."""
        host = self._host
        host.check_integrity()
        refs: Counter[int] = Counter(self._held)
        for inst, table in self._handles["kv"].items():
            mine = [-1 - pid for pid in table.values() if pid < 0]
            refs.update(mine)
            assert self._handles_on_host.get(inst, 0) == len(mine), (
                f"inferlet {inst}: {len(mine)} handles on host, counted "
                f"{self._handles_on_host.get(inst, 0)}"
            )
        assert all(not any(pid < 0 for pid in t.values()) for t in self._handles["embed"].values())
        wrong = {
            h: (host.refcount(h), refs[h]) for h in range(host.size) if host.refcount(h) != refs[h]
        }
        assert not wrong, f"host pages whose (refcount, references) differ: {wrong}"
        assert all(host.refcount(h) > 0 for h in self._unbacked), "unbacked host pages are free"
        assert all(host.refcount(h) > 0 for _, h in self._moves_out), "swap-out into a free page"
        pool = self._pools["kv"]
        assert all(pool.refcount(p) > 0 for _, p in self._moves_in), "swap-in into a free page"
        assert self._arriving == {p for _, p in self._moves_in}, "arriving pages out of date"
        assert not self._held or self._moves_out or self._moves_in, "held without moves"

    # ------------------------------------------------------------------ swap

    def handles_on_host(self, instance: int) -> int:
        """How many of ``instance``'s KV handles map to host pages (0: all resident)."""
        return self._handles_on_host.get(instance, 0)

    def pages_on_host(self, instance: int) -> int:
        """How many distinct host pages ``instance``'s handles map to."""
        if not self._handles_on_host.get(instance):
            return 0
        return len({pid for pid in self._table(instance, "kv").values() if pid < 0})

    def host_usage(self) -> tuple[int, int, int]:
        """``(free, used, total)`` host pages (swap space)."""
        h = self._host
        return h.free, h.used, h.size

    def swappable(self, instance: int) -> int:
        """Device pages that could move to host memory now: referenced by ``instance``'s
        handles alone (not exported, not shared) and not being filled by a pending
        swap-in."""
        return len(self._swappable(instance))

    def swap_out(self, instance: int, max_pages: int | None = None) -> int:
        """Move up to ``max_pages`` of ``instance``'s swappable pages (newest handles first)
        to free host pages; returns how many moved. Bookkeeping only: the copies are
        recorded for :meth:`take_moves`, and the freed device pages may be handed out at
        once (the copies run first in the next batch)."""
        table = self._table(instance, "kv")
        pages = self._swappable(instance)
        n = min(len(pages), self._host.free, len(pages) if max_pages is None else max_pages)
        if n <= 0:
            return 0
        pages = pages[:n]
        hosts = self._host.alloc(n)
        where = dict(zip(pages, hosts, strict=True))
        refs: Counter[int] = Counter()
        moved: list[tuple[int, int]] = []
        for h, pid in table.items():
            if pid in where:
                table[h] = _on_host(where[pid])
                refs[pid] += 1
                moved.append((pid, table[h]))
        self._recharge(instance, moved)
        for pid, host in where.items():
            self._host.incref([host] * (refs[pid] - 1))
            self._drop("kv", [pid] * refs[pid], offer=False)  # its content leaves
        self._handles_on_host[instance] = self._handles_on_host.get(instance, 0) + refs.total()
        self._moves_out.extend(where.items())
        return n

    def swap_in(self, instance: int) -> int:
        """Give every host page of ``instance`` a device page again (its handles keep their
        numbers); returns how many pages. Raises :class:`OutOfResources` (changing nothing)
        when the device has too few free pages: make room first."""
        table = self._table(instance, "kv")
        if not self._handles_on_host.get(instance):
            return 0
        refs = Counter(-1 - pid for pid in table.values() if pid < 0)
        pool = self._pools["kv"]
        if pool.free < len(refs) and self.cache is not None:
            self._evict(len(refs) - pool.free)
        if pool.free < len(refs):
            raise self._out_of(instance, "kv", len(refs), "to bring its swapped pages back")
        where = dict(zip(refs, pool.alloc(len(refs)), strict=True))
        if self.provenance is not None:  # the swap-in overwrites them (observed or not)
            self.provenance.forget(where.values())
        moved: list[tuple[int, int]] = []
        for h, pid in table.items():
            if pid < 0:
                table[h] = where[-1 - pid]
                moved.append((pid, table[h]))
        self._recharge(instance, moved)
        for host, dev in where.items():
            pool.incref([dev] * (refs[host] - 1))
            if host in self._unbacked:
                self._unbacked.discard(host)  # a deferred alloc: nothing to copy
            else:
                self._moves_in.append((host, dev))
                self._arriving.add(dev)
        self._handles_on_host[instance] = 0
        self._release_host(list(refs.elements()))
        return len(where)

    def take_moves(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The recorded copies, ``(device, host)`` out and ``(host, device)`` in, to run
        at the front of the batch about to be dispatched (out before in); forgets them and
        frees the host pages held meanwhile."""
        out, into = self._moves_out, self._moves_in
        self._moves_out, self._moves_in, self._arriving = [], [], set()
        held, self._held = self._held, []
        for h in self._host.decref(held):
            self._unbacked.discard(h)
        return out, into

    def reclaim(self, requester: int, kind: Kind, needed: int) -> None:
        """Terminate the eviction policy's victims until ``needed`` ids of ``kind`` are
        free, or raise :class:`OutOfResources` (the last resort, after swapping)."""
        self._require(requester)
        if self._pools[kind].free < needed:
            self._reclaim(requester, kind, needed)

    def _swappable(self, instance: int) -> list[int]:
        """``instance``'s device pages that only its handles reference (not exported, not
        shared, not held by the prefix cache, not being filled by a pending swap-in),
        newest handles first. Hot (the swapper asks for every program that may give way
        or come in): one pass over the table, counting references only when a page has
        several handles."""
        table = self._handles["kv"][instance]
        rc = self._pools["kv"]._refcount
        pids = [pid for pid in reversed(table.values()) if pid >= 0]  # newest handles first
        cache = self.cache
        if self._arriving or cache is not None:
            arriving = self._arriving
            pids = [p for p in pids if p not in arriving and (cache is None or p not in cache)]
        if len(set(pids)) == len(pids):  # one handle per page (the usual case)
            return [pid for pid in pids if rc[pid] == 1]
        refs = Counter(pids)
        return [pid for pid in dict.fromkeys(pids) if rc[pid] == refs[pid]]

    def _release(self, kind: Kind, ids: Iterable[int], user: object = None) -> None:
        """Drop one reference per id: device ids at once (offered to ``user``'s prefix
        cache), host pages via the hold."""
        ids = list(ids)
        hosts = [-1 - pid for pid in ids if pid < 0]
        self._drop(kind, [pid for pid in ids if pid >= 0] if hosts else ids, user)
        if hosts:
            self._release_host(hosts)

    def _release_host(self, hosts: list[int]) -> None:
        if self._moves_out or self._moves_in:
            self._held.extend(hosts)  # a pending move may still read or write them
            return
        for h in self._host.decref(hosts):
            self._unbacked.discard(h)

    def _check_charges(self) -> None:
        """Every instance's and user's charge equals its references, recounted."""
        assert self._users.keys() == self._instances.keys(), "users of unknown instances"
        for kind in KINDS:
            inst: dict[int, Counter[int]] = {i: Counter() for i in self._instances}
            users: dict[object, Counter[int]] = {}
            for i, table in self._handles[kind].items():
                inst[i].update(table.values())
                users.setdefault(self._users[i], Counter()).update(table.values())
            for exp in self._exports.values():
                if exp.kind != kind:
                    continue
                if not exp.persistent:
                    inst[exp.owner].update(exp.ids)
                users.setdefault(exp.user, Counter()).update(exp.ids)
            users = {u: c for u, c in users.items() if c}
            assert self._charge[kind] == inst, f"{kind}: instance charges differ from references"
            assert self._user_charge[kind] == users, f"{kind}: user charges differ from references"

    # ------------------------------------------------------------------ internals

    def _pool(self, kind: Kind) -> PhysicalPool:
        pool = self._pools.get(kind)
        if pool is None:
            raise ValueError(f"unknown resource kind {kind!r} (one of {', '.join(KINDS)})")
        return pool

    def _require(self, instance: int) -> None:
        if instance not in self._instances:
            raise ResourceError(
                f"inferlet {instance} is not registered (it has ended or was never added)"
            )

    def _table(self, instance: int, kind: Kind) -> dict[int, int]:
        self._pool(kind)
        self._require(instance)
        return self._handles[kind][instance]

    def _bind(self, instance: int, kind: Kind, table: dict[int, int], ids: list[int]) -> list[int]:
        start = self._next[kind][instance]
        handles = list(range(start, start + len(ids)))
        table.update(zip(handles, ids, strict=True))
        self._next[kind][instance] = start + len(ids)
        self._charge_ids(kind, instance, ids)
        return handles

    # -- charges (what each instance and user holds)

    def _charge_ids(self, kind: Kind, instance: int, ids: Iterable[int]) -> None:
        ids = list(ids)
        self._charge[kind][instance].update(ids)
        self._charge_user(kind, self._users[instance], ids)

    def _charge_user(self, kind: Kind, user: object, ids: Sequence[int]) -> None:
        if not ids:
            return
        counter = self._user_charge[kind].get(user)
        if counter is None:
            counter = self._user_charge[kind][user] = Counter()
        counter.update(ids)

    def _uncharge(self, kind: Kind, instance: int, ids: Iterable[int]) -> None:
        ids = list(ids)
        _subtract(self._charge[kind][instance], ids)
        self._uncharge_user(kind, self._users[instance], ids)

    def _recharge(self, instance: int, moved: list[tuple[int, int]]) -> None:
        """KV handles of ``instance`` now map elsewhere (swapped out or in): a page held on
        host memory is still held (charges count table values, device or host)."""
        if moved:
            self._uncharge("kv", instance, [old for old, _ in moved])
            self._charge_ids("kv", instance, [new for _, new in moved])

    def _uncharge_user(self, kind: Kind, user: object, ids: Iterable[int]) -> None:
        counter = self._user_charge[kind].get(user)
        if counter is None:
            return
        _subtract(counter, ids)
        if not counter:
            del self._user_charge[kind][user]

    def _check_limit(
        self, instance: int, kind: Kind, new: int | Sequence[int], keep: object = None
    ) -> None:
        """Raise :class:`QuotaExceeded` if taking ``new`` (a number of fresh ids, or the ids
        of an import) would take the instance or its user over a limit. A user over its
        limit first loses persistent exports (never ``keep``, the one being imported)."""
        held = self._charge[kind][instance]
        n = new if isinstance(new, int) else len(set(new) - held.keys())
        caps = self._limits.get(instance, {}).get(kind)
        if caps:
            source = min(caps, key=caps.__getitem__)
            if len(held) + n > caps[source]:
                raise QuotaExceeded(
                    f"{_QUOTA_NOUN[kind]} quota exceeded: inferlet {instance} holds {len(held)}, "
                    f"asked for {n} more, quota {caps[source]} (set by {source}). Free "
                    f"{_PLURAL[kind]} it no longer needs, or raise {source}"
                )
        user = self._users[instance]
        cap = self._user_limits.get(user, {}).get(kind)
        if cap is None:
            return
        ucharge = self._user_charge[kind].get(user, Counter())
        un = new if isinstance(new, int) else len(set(new) - ucharge.keys())
        over = len(ucharge) + un - cap[0]
        if over > 0 and not self._reclaim_user_exports(user, kind, over, keep):
            raise QuotaExceeded(
                f"{_QUOTA_NOUN[kind]} quota exceeded: user {user} holds {len(ucharge)} (with "
                f"its persistent exports), inferlet {instance} asked for {un} more, quota "
                f"{cap[0]} (set by {cap[1]}). End instances or unexport what the user no "
                f"longer needs, or raise {cap[1]}"
            )

    def _reclaim_user_exports(self, user: object, kind: Kind, over: int, keep: object) -> bool:
        """Drop ``user``'s least recently used persistent exports of ``kind`` until its
        charge falls by ``over``; if even all of them would not do, drop none: False."""
        current = self._user_charge[kind].get(user)
        if not current:
            return False
        counter = Counter(current)
        chosen = []
        for key in self._lru_exports(kind, user):
            if key == keep:
                continue
            before = len(counter)
            _subtract(counter, self._exports[key].ids)
            if len(counter) < before:
                chosen.append(key)
                if len(current) - len(counter) >= over:
                    break
        if len(current) - len(counter) < over:
            return False
        for key in chosen:
            log.info("dropping persistent export %r of user %s: the user is over its quota",
                     key[1], user)  # fmt: skip
            self._drop_export(key)
        return True

    # _export_gain's references of the persistent exports, and the drops that date them
    _export_refs: tuple[tuple, Counter[int]] | None = None
    _export_drops = 0

    def _lru_exports(self, kind: Kind, user: object = _SAME) -> list[tuple[object, str]]:
        """Persistent exports of ``kind`` (of ``user``, or everyone's), least recently
        imported first."""
        keys = [
            k for k, e in self._exports.items()
            if e.persistent and not e.pinned and e.kind == kind
            and (user is _SAME or e.user == user)
        ]  # fmt: skip
        return sorted(keys, key=self._last_import.__getitem__)

    def _drop_export(self, key: tuple[object, str]) -> None:
        exp = self._exports.pop(key)
        self._export_drops += 1  # (exports only join otherwise: see _export_gain)
        if exp.persistent:
            del self._last_import[key]
            self._uncharge_user(exp.kind, exp.user, exp.ids)
        else:
            self._instances[exp.owner].discard(key)
            self._uncharge(exp.kind, exp.owner, exp.ids)
        self._drop(exp.kind, exp.ids, exp.user)

    def _export_gain(self, kind: Kind, wanted: int) -> tuple[int, list[tuple[object, str]]]:
        """Which persistent exports to drop, least recently used first, to free ``wanted``
        ids (all that free anything if that is not enough), and how many ids they free.
        Exports whose ids are all held by something else (or by the prefix cache) are never
        chosen."""
        rc = self._pools[kind]._refcount
        lru = self._lru_exports(kind)
        # The references the persistent exports hold per id: kept while the set of
        # exports is the same (exports only join, so drops and the count identify it);
        # this runs at every allocation short of memory
        stamp = (kind, self._export_drops, len(self._last_import))
        if self._export_refs is None or self._export_refs[0] != stamp:
            total: Counter[int] = Counter()
            for key in lru:
                total.update(self._exports[key].ids)
            self._export_refs = (stamp, total)
        total = self._export_refs[1]
        # (a page the prefix cache holds stays there, maybe in use by what is cached after it)
        cache_only = {pid for pid, k in total.items() if rc[pid] == k}
        if kind == "kv" and self.cache is not None:
            cache_only = {pid for pid in cache_only if pid not in self.cache}
        dropped: Counter[int] = Counter()
        gain, chosen = 0, []
        for key in lru:
            if gain >= wanted or not cache_only:
                break
            mine = [pid for pid in self._exports[key].ids if pid in cache_only]
            if not mine:
                continue
            chosen.append(key)
            dropped.update(mine)
            gain += sum(1 for pid in set(mine) if dropped[pid] == total[pid])
        return gain, chosen

    def _drop_cached(
        self, kind: Kind, needed: int, exports: list[tuple[object, str]] | None = None
    ) -> bool:
        """Persistent exports are a cache: drop those nothing else uses, least recently
        imported first, until ``needed`` ids are free; if even all of them would not do,
        drop none. Returns whether ``needed`` ids are free."""
        pool = self._pools[kind]
        if exports is None:
            if not self._last_import:
                return pool.free >= needed
            gain, exports = self._export_gain(kind, needed - pool.free)
            if pool.free + gain < needed:
                return False
        for key in exports:
            if self.available(kind) >= needed:
                break
            log.info("dropping persistent export %r of user %s to free %s",
                     key[1], key[0], _PLURAL[kind])  # fmt: skip
            self._drop_export(key)
        if pool.free < needed and kind == "kv" and self.cache is not None:
            self._evict(needed - pool.free)  # dropped pages with canonical K/V were cached
        assert pool.free >= needed, "dropping persistent exports freed less than counted"
        return True

    def _reclaim(self, requester: int, kind: Kind, needed: int) -> None:
        """Free ``needed`` ids: evict the prefix cache's unused pages, drop unused
        persistent exports, then terminate the policy's victims, or raise."""
        pool = self._pools[kind]
        cached = kind == "kv" and self.cache is not None
        if cached and pool.free < needed:
            self._evict(needed - pool.free)
            if pool.free >= needed:
                return
        free = pool.free
        gain, exports = self._export_gain(kind, needed - free) if self._last_import else (0, [])
        if free + gain >= needed:
            self._drop_cached(kind, needed, exports)
            return
        if self.on_terminate is None:
            raise self._out_of(requester, kind, needed, "no terminate callback, so nobody can end")
        desc = getattr(self.policy, "description", type(self.policy).__name__)
        victims = list(
            dict.fromkeys(self.policy.choose_victims(self, kind, needed - gain, requester))
        )
        if requester in victims:
            raise self._out_of(
                requester,
                kind,
                needed,
                f"the {desc} chose inferlet {requester} itself to give way",
            )
        if not victims:
            raise self._out_of(requester, kind, needed, f"the {desc} chose no inferlet to end")
        for key in exports:
            self._drop_export(key)
        reason = (
            f"terminated to free {_PLURAL[kind]} for inferlet {requester} ({desc}): "
            f"{needed} {_PLURAL[kind]} needed, {free} free"
        )
        ended = []
        for victim in victims:
            if victim not in self._instances:
                continue
            ended.append(victim)
            try:
                self.on_terminate(victim, reason)
            finally:
                self.remove_instance(victim)
        self._require(requester)
        if cached and pool.free < needed:  # the victims' pages may have gone to the cache
            self._evict(needed - pool.free)
        if pool.free < needed:
            raise self._out_of(
                requester, kind, needed, f"still short after terminating inferlets {ended}"
            )

    def _out_of(self, requester: int, kind: Kind, needed: int, note: str) -> OutOfResources:
        pool = self._pools[kind]
        held = len(self._handles[kind].get(requester, ()))
        return OutOfResources(
            f"cannot allocate {needed} {_PLURAL[kind]} for inferlet {requester}: {pool.free} of "
            f"{pool.size} free, inferlet {requester} holds {held} ({note}). Free "
            f"{_PLURAL[kind]} it no longer needs, or give the server more "
            f"({_SIZE_OPTION[kind]})"
        )

    def _lookup_error(self, instance: int, kind: Kind, handles: Sequence[int]) -> Exception:
        """The error for a failed translate: unknown kind, instance, or handles."""
        try:
            self._table(instance, kind)
        except (ValueError, ResourceError) as e:
            return e
        return self._invalid(instance, kind, handles)

    def _invalid(
        self, instance: int, kind: Kind, handles: Iterable[int], twice_is_bad: bool = False
    ) -> InvalidHandle:
        """An error naming every bad handle of ``handles`` and why it is bad."""
        table = self._handles[kind][instance]
        nxt = self._next[kind][instance]
        other = "embed" if kind == "kv" else "kv"
        problems: dict[str, None] = {}  # ordered set of messages
        seen: set[int] = set()
        for h in handles:
            is_int = isinstance(h, (int, np.integer)) and not isinstance(h, bool)
            what = f"{_NOUN[kind]} handle {int(h) if is_int else repr(h)}"
            if h in table:
                if twice_is_bad and h in seen:
                    problems[f"{what} is listed twice"] = None
                seen.add(h)
            elif h in self._reserved[kind].get(instance, ()):
                problems[
                    f"{what} is not filled yet (a queued prefill fills it: use it on that "
                    f"queue, or synchronize the queue first)"
                ] = None
            elif not is_int:
                problems[f"{what} is not an integer handle"] = None
            elif self.first_handle <= h < nxt:
                problems[f"{what} was freed"] = None
            else:
                hint = ""
                if h in self._handles[other][instance]:
                    hint = f"; it is one of its {_NOUN[other]} handles, wrong kind?"
                problems[f"{what} is not owned by this inferlet (never allocated by it{hint})"] = (
                    None
                )
        return InvalidHandle(f"inferlet {instance}: " + "; ".join(problems))


def _subtract(counter: Counter[int], ids: Iterable[int]) -> None:
    """Drop one reference per listed id; ids that reach 0 leave the counter."""
    for pid in ids:
        k = counter[pid] - 1
        if k:
            counter[pid] = k
        else:
            del counter[pid]


def _check_cap(max_held: object) -> int:
    if not isinstance(max_held, int) or isinstance(max_held, bool) or max_held < 0:
        raise ValueError(f"a limit must be a non-negative integer or None, got {max_held!r}")
    return max_held


__all__ = [
    "KINDS",
    "EvictionPolicy",
    "ExportError",
    "InvalidHandle",
    "Kind",
    "OutOfResources",
    "PhysicalPool",
    "QuotaExceeded",
    "ResourceError",
    "ResourceManager",
    "TerminateNewest",
]
