"""Resource bookkeeping: the page-ownership table over the engine's physical memory.

The engine owns the memory (KV pages, embedding slots, host pages); the control layer owns
who holds which (Pie §4.1, §5.2). Each physical KV page is free, referenced by inferlets
(handles and exports, ref-counted), held by the prefix cache (maybe borrowed), or — for the
handles' view — swapped to a host page. :class:`ResourceManager` is the one table of those
states, with one :meth:`~ResourceManager.check_integrity` over all of it, built of rooms:
the pools (:mod:`~pastry.control.pages`), the per-instance handle tables
(:mod:`~pastry.control.handles`), exports between inferlets (:mod:`~pastry.control.exports`),
what each instance and user holds and may hold (:mod:`~pastry.control.accounting`), swap
space (:mod:`~pastry.control.host_pages`), the prefix cache's pages
(:mod:`~pastry.control.cached_pages`) and what gives way when memory is short
(:mod:`~pastry.control.reclaim`: the cache's unused pages, then unused persistent exports,
then the :class:`~pastry.control.policies.eviction.EvictionPolicy`'s victims; default
:class:`~pastry.control.policies.eviction.TerminateNewest`, the paper's FCFS).

Handles are ``first_handle, first_handle + 1, ...`` per instance and kind, never reused;
several handles and exports may reference one id, which is freed with its last reference.
Used from the control loop only (no locks). Pure Python; numpy only for ``translate_array``.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from pastry.control.accounting import Accounting
from pastry.control.cached_pages import CachedPages
from pastry.control.exports import UNSET, ExportRegistry, Hold, Sharing
from pastry.control.handles import HandleTables, Reservations
from pastry.control.host_pages import HostPages, Swapping
from pastry.control.ledger import PageLedger
from pastry.control.pages import (
    KINDS,
    PLURAL,
    SIZE_OPTION,
    ExportError,
    InvalidHandle,
    Kind,
    OutOfResources,
    PhysicalPool,
    QuotaExceeded,
    ResourceError,
)
from pastry.control.policies.eviction import EvictionPolicy, TerminateNewest, only_needed
from pastry.control.prefix_cache import PrefixCache
from pastry.control.provenance import KvProvenance
from pastry.control.reclaim import Reclaiming

log = logging.getLogger(__name__)


class ResourceManager(PageLedger):
    """Virtual handles of every inferlet instance over the engine's KV pages and embeds.

    ``on_terminate(instance_id, reason)`` ends an instance chosen by ``policy``; it must call
    :meth:`remove_instance` before returning (the manager calls it afterwards anyway, so the
    memory is reclaimed even if the callback does not). Without ``on_terminate`` nobody can
    be terminated and contention raises :class:`OutOfResources` at once.

    Instances are ``int`` ids, in creation order; naming one not registered raises
    :class:`ResourceError`, an unknown kind ``ValueError``.

    With a ``cache`` (and the ``provenance`` that certifies page contents), KV pages can be
    held by the prefix cache (its time here: ``cache_seconds``; pages ``cache_events``).
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
        self.pools: dict[Kind, PhysicalPool] = {
            "kv": PhysicalPool(num_pages),
            "embed": PhysicalPool(num_embeds),
        }
        self.policy: EvictionPolicy = policy if policy is not None else TerminateNewest()
        self.on_terminate = on_terminate
        self.handles = HandleTables(first_handle)
        self.exports = ExportRegistry()
        self.accounting = Accounting()
        self.host = HostPages(num_host_pages)
        self.users: dict[int, object] = {}  # instance -> its user; in creation order
        self.cache = cache
        self.provenance = provenance
        self.cached: CachedPages | None = None
        if cache is not None:
            self.cached = CachedPages(self.pools["kv"], cache, provenance, self.exports)
        self.sharing = Sharing(self)
        self.reservations = Reservations(self)
        self.swapping = Swapping(self)
        self.reclaiming = Reclaiming(self)

    @property
    def first_handle(self) -> int:
        return self.handles.first

    @property
    def defer_when_short(self) -> bool:
        """Set by the swapper: an allocation the device cannot meet starts on host pages."""
        return self.host.defer_when_short

    @defer_when_short.setter
    def defer_when_short(self, value: bool) -> None:
        self.host.defer_when_short = value

    @property
    def cache_seconds(self) -> float:  # the prefix cache's bookkeeping here
        return self.cached.seconds if self.cached is not None else 0.0

    @property
    def cache_events(self) -> Counter[str]:  # pages adopted, evicted and detached
        return self.cached.events if self.cached is not None else Counter()

    # ------------------------------------------------------------------ instances

    def add_instance(self, instance_id: int, user: object = None) -> None:
        """Register an instance of ``user`` (its export namespace and quota)."""
        if instance_id in self.users:
            raise ValueError(f"inferlet {instance_id} is already registered")
        self.users[instance_id] = user
        self.handles.add(instance_id)
        self.exports.add_instance(instance_id)
        self.accounting.add_instance(instance_id)

    def remove_instance(self, instance_id: int) -> None:
        """Release everything the instance holds: its handles' references and its
        non-persistent exports. Idempotent (an unknown id is a no-op)."""
        user = self.users.pop(instance_id, UNSET)
        if user is UNSET:
            return
        for exp in self.exports.remove_instance(instance_id):
            self.accounting.remove_user(exp.kind, user, exp.ids)
            self.drop_refs(exp.kind, exp.ids, user)
        self.accounting.remove_instance(instance_id)
        for kind, table in self.handles.remove(instance_id).items():
            self.accounting.remove_user(kind, user, table.values())
            self.release_refs(kind, table.values(), user)
        self.host.forget(instance_id)

    # ------------------------------------------------------------------ limits (accounting.py)

    def set_limit(
        self, instance: int, kind: Kind, max_held: int | None, source: str = "set_limit"
    ) -> None:
        """Let ``instance`` hold at most ``max_held`` ids of ``kind`` at once (``None``:
        lift the limit ``source`` set; the smallest limit applies). ``alloc`` and
        ``import_`` over it raise :class:`QuotaExceeded` naming ``source`` (what to raise,
        e.g. ``"SandboxLimits.max_kv_pages"``); ids held are kept. Limits end with it."""
        self.table(instance, kind)
        self.accounting.set_limit(instance, kind, max_held, source)

    def limit(self, instance: int, kind: Kind) -> int | None:
        """The most ids of ``kind`` that ``instance`` may hold (``None``: no limit)."""
        self.table(instance, kind)
        return self.accounting.limit(instance, kind)

    def set_user_limit(
        self, user: object, kind: Kind, max_held: int | None, source: str = "set_user_limit"
    ) -> None:
        """Let ``user`` hold at most ``max_held`` ids of ``kind``, its instances' and its
        persistent exports' (over it, its least recently used persistent exports go first,
        then :class:`QuotaExceeded`); it outlives the user's instances."""
        self.pool(kind)
        self.accounting.set_user_limit(user, kind, max_held, source)

    def user_limit(self, user: object, kind: Kind) -> int | None:
        return self.accounting.user_limit(user, kind)

    # ------------------------------------------------------------------ alloc / free

    def alloc(self, instance: int, kind: Kind, n: int) -> list[int]:
        """``n`` new handles of ``kind`` for ``instance`` (all or nothing).

        Over the instance's limit (:meth:`set_limit`) raises :class:`QuotaExceeded`. When
        fewer than ``n`` ids are free, the policy's victims are terminated first; if that is
        refused, chooses the requester, or frees too little, raises :class:`OutOfResources`.
        """
        self.table(instance, kind)
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of {PLURAL[kind]} ({n})")
        self.reclaiming.check_limit(instance, kind, n + len(self.handles.reserved[kind][instance]))
        pool, host = self.pools[kind], self.host
        if pool.free < n and kind == "kv" and self.cached is not None:
            self.cached.evict(n - pool.free)  # the prefix cache's unused pages go first
        if pool.free < n and self.exports.any_persistent:
            self.reclaiming.drop_cached(kind, n)  # before swapping anyone: stale caches go first
        if pool.free < n and kind == "kv" and host.defer_when_short and host.pool.free >= n:
            # deferred: device pages come with the next swap-in
            return self.bind(instance, kind, host.deferred(instance, n))
        if pool.free < n:
            self.reclaiming.reclaim(instance, kind, n)
        return self.bind(instance, kind, pool.alloc(n))

    def free(self, instance: int, kind: Kind, handles: Iterable[int]) -> None:
        """Drop the handles (a reserved one that was never bound just stops being
        reserved). Any bad handle (or one listed twice) raises :class:`InvalidHandle` and
        nothing changes."""
        table = self.table(instance, kind)
        handles = list(handles)
        if len(set(handles)) != len(handles) or not self.handles.holds(instance, kind, handles):
            raise self.handles.invalid(instance, kind, handles, twice_is_bad=True)
        self.handles.reserved[kind][instance].difference_update(handles)
        ids = [table.pop(h) for h in handles if h in table]
        on_host_ = sum(1 for pid in ids if pid < 0)
        if on_host_:
            self.host.count(instance, -on_host_)
        self.accounting.remove(kind, instance, self.users[instance], ids)
        self.release_refs(kind, ids, self.users[instance])

    def check(self, instance: int, kind: Kind, handles: Sequence[int]) -> None:
        """Raise :class:`InvalidHandle` unless every handle is the instance's (bound or
        reserved)."""
        self.table(instance, kind)
        if not self.handles.holds(instance, kind, handles):
            raise self.handles.invalid(instance, kind, handles)

    def translate(self, instance: int, kind: Kind, handles: Sequence[int]) -> list[int]:
        """Physical ids of ``handles`` (hot path: one dict lookup per handle)."""
        try:
            table = self.handles.tables[kind][instance]
            return [table[h] for h in handles]
        except KeyError:
            raise self._lookup_error(instance, kind, handles) from None

    def tables(self, instance: int) -> tuple[dict[int, int], dict[int, int]]:
        """The instance's KV and embedding handle tables (handle -> physical id), for the
        batch scheduler's one-pass translation of a batch (:mod:`pastry.control.steps`):
        read them, never change them. A missing handle is a ``KeyError`` (:meth:`translate`
        names what is wrong with it); an unknown instance raises :class:`ResourceError`."""
        tables = self.handles.tables
        try:
            return tables["kv"][instance], tables["embed"][instance]
        except KeyError:
            raise self._lookup_error(instance, "kv", ()) from None

    def translate_array(self, instance: int, kind: Kind, handles: np.ndarray) -> np.ndarray:
        """:meth:`translate` for an integer array of any shape; returns int64 of that shape."""
        try:
            return self.handles.translate_array(instance, kind, handles)
        except KeyError:
            raise self._lookup_error(instance, kind, np.asarray(handles).ravel().tolist()) from None

    # ------------------------------------------------------------------ export / import (exports.py)

    def export(
        self,
        instance: int,
        kind: Kind,
        handles: Iterable[int],
        name: str,
        persistent: bool = False,
    ) -> None:
        """Publish the ids of ``handles`` under ``name`` (:meth:`Sharing.export`)."""
        self.sharing.export(instance, kind, handles, name, persistent)

    def hold(self, instance: int, kind: Kind, handles: Iterable[int]) -> Hold:
        """Keep the ids of ``handles`` allocated until :meth:`release` (:meth:`Sharing.hold`)."""
        return self.sharing.hold(instance, kind, handles)

    def claim(self, instance: int, kind: Kind, hold: Hold, user: object) -> list[int]:
        """New handles of ``instance`` for the ids of a :meth:`hold` (:meth:`Sharing.claim`)."""
        return self.sharing.claim(instance, kind, hold, user)

    def release(self, hold: Hold, user: object) -> None:
        """Drop a :meth:`hold` of ``user``'s."""
        self.sharing.release(hold, user)

    def import_(self, instance: int, kind: Kind, name: str, owner: object = UNSET) -> list[int]:
        """New handles for the ids exported as ``name`` (:meth:`Sharing.import_`)."""
        return self.sharing.import_(instance, kind, name, owner)

    def unexport(self, instance: int | None, name: str, owner: object = None) -> None:
        """Drop the export ``name`` (:meth:`Sharing.unexport`)."""
        self.sharing.unexport(instance, name, owner)

    def list_exports(self, owner: object = UNSET) -> list[tuple[str, str, int]]:
        """``(name, kind, count)`` of every export in ``owner``'s namespace (default: every
        user's), oldest first."""
        return self.exports.listing(owner)

    # ------------------------------------------------------------------ reserved handles (handles.py)

    def reserve(self, instance: int, kind: Kind, n: int) -> list[int]:
        """``n`` handles bound later (:meth:`Reservations.reserve`)."""
        return self.reservations.reserve(instance, kind, n)

    def unreserve(self, instance: int, kind: Kind, handles: Iterable[int]) -> None:
        """Give up reserved handles that were never bound (a no-op for any other)."""
        self.reservations.unreserve(instance, kind, handles)

    def bind_cached(self, instance: int, handles: Sequence[int], pages: Sequence[int]) -> None:
        """Bind reserved KV handles to cached pages (:meth:`Reservations.bind_cached`)."""
        self.reservations.bind_cached(instance, handles, pages)

    def bind_fresh(self, instance: int, kind: Kind, handles: Sequence[int]) -> list[int]:
        """Bind reserved handles to new ids (:meth:`Reservations.bind_fresh`)."""
        return self.reservations.bind_fresh(instance, kind, handles)

    def unbind(self, instance: int, kind: Kind, handles: Sequence[int]) -> None:
        """Make bound handles reserved again (their references are dropped)."""
        self.reservations.unbind(instance, kind, handles)

    def available(self, kind: Kind) -> int:
        """Ids of ``kind`` an allocation could get now: free ones plus cached pages that
        eviction could free."""
        free = self.pool(kind).free
        if kind == "kv" and self.cache is not None:
            free += self.cache.evictable_pages
        return free

    def claim_writes(self, instance: int, pages: Iterable[int]) -> None:
        """Check that ``instance`` may write the physical KV ``pages`` (a forward's output
        pages, a mask, a copy's destination): a page the prefix cache holds only when every
        reference to it and to what is cached after it is this instance's (they then leave
        the cache); else :class:`ResourceError` (other inferlets read it)."""
        if self.cached is not None:
            self.cached.claim_all(instance, pages, self.handles.tables["kv"][instance])

    def uncache(self, pages: Iterable[int]) -> None:
        """Take ``pages`` (those the cache holds) and what is cached after them out of the
        cache, whoever uses them (their content is not what the cache says)."""
        if self.cached is not None:
            self.cached.uncache(pages)

    def offer(self, instance: int, pages: Iterable[int]) -> None:
        """Offer the certified sequences ending in ``pages`` (that ``instance`` still
        references, e.g. a prompt just prefilled) to its user's cache now, for others."""
        if self.cached is not None and instance in self.users:  # (ended: nothing to do)
            self.cached.offer(self.users[instance], pages)

    def flush_cache(self) -> int:
        """Evict every page of the prefix cache that no inferlet holds (what the server's
        ``/flush_cache`` asks for); pages in use stay. Returns how many were freed."""
        if self.cached is None:
            return 0
        return self.cached.evict(self.cache.evictable_pages)

    def device_lost(self) -> None:
        """The engine's memory is gone: every id is free again (``Reclaiming.device_lost``)."""
        self.reclaiming.device_lost()

    def check_integrity(self) -> None:
        """Assert that the pools are consistent, that every physical id's count equals the
        references to it from handles and exports, that each party's charge equals what
        it references, that the host pages and pending moves agree with the handles, and
        that the pages the pool holds for the prefix cache are exactly the tree's."""
        self.handles.check_integrity(self.users)
        self.exports.check_integrity(self.users)
        kv = self.pools["kv"]
        if self.cached is None:
            assert kv.held == 0, "pages held without a prefix cache"
        else:
            self.cached.check_integrity()
        assert self.pools["embed"].held == 0, "embeds are never held"
        assert self.accounting.limits.keys() <= self.users.keys(), "limits of unknown instances"
        for kind in KINDS:
            pool = self.pools[kind]
            pool.check_integrity()
            refs = self.handles.references(kind) + self.exports.references(kind)
            wrong = {
                pid: (pool.refcount(pid), refs[pid])
                for pid in range(pool.size)
                if pool.refcount(pid) != refs[pid]
            }
            assert not wrong, f"{kind} ids whose (refcount, references) differ: {wrong}"
        self.accounting.check_integrity(self.handles.tables, self.exports.exports, self.users)
        embed_tables = self.handles.tables["embed"].values()
        assert all(not any(pid < 0 for pid in t.values()) for t in embed_tables)
        self.host.check_integrity(self.handles.tables["kv"], kv)

    # ------------------------------------------------------------------ swap (host_pages.py)

    def swappable(self, instance: int) -> int:
        """Device pages that could move to host memory now (:meth:`Swapping.swappable`)."""
        return len(self.swapping.swappable(instance))

    def swap_out(self, instance: int, max_pages: int | None = None) -> int:
        """:meth:`Swapping.swap_out`: how many of its pages moved to host memory."""
        return self.swapping.swap_out(instance, max_pages)

    def swap_in(self, instance: int) -> int:
        """:meth:`Swapping.swap_in`: how many of its host pages came back."""
        return self.swapping.swap_in(instance)

    def take_moves(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The recorded copies for the next batch (:meth:`HostPages.take_moves`)."""
        return self.host.take_moves()

    def reclaim(self, requester: int, kind: Kind, needed: int) -> None:
        """Terminate the eviction policy's victims until ``needed`` ids of ``kind`` are
        free, or raise :class:`OutOfResources` (the last resort, after swapping)."""
        self.require(requester)
        if self.pools[kind].free < needed:
            self.reclaiming.reclaim(requester, kind, needed)

    # ------------------------------------------------------------------ references

    def bind(self, instance: int, kind: Kind, ids: list[int]) -> list[int]:
        """New handles of ``instance`` for ``ids`` (their references taken already)."""
        handles = self.handles.bind(instance, kind, ids)
        self.accounting.add(kind, instance, self.users[instance], ids)
        return handles

    def take_refs(self, kind: Kind, ids: Sequence[int]) -> None:
        """Add one reference per id (cached pages become borrowed: their node is in use)."""
        if kind == "kv" and self.cached is not None:
            self.cached.take(ids)
        else:
            self.pools[kind].incref(ids)

    def drop_refs(self, kind: Kind, ids: Sequence[int], user: object = None, offer: bool = True):
        """Drop one reference per device id; with a prefix cache, KV pages losing their last
        reference with certified K/V are offered to ``user``'s tree first (unless not
        ``offer``)."""
        if kind == "kv" and self.cached is not None and ids:
            self.cached.drop(ids, user, offer)
        else:
            self.pools[kind].decref(ids)

    def release_refs(self, kind: Kind, ids: Iterable[int], user: object = None) -> None:
        """Drop one reference per id: device ids at once (offered to ``user``'s prefix
        cache), host pages via the hold."""
        ids = list(ids)
        hosts = [-1 - pid for pid in ids if pid < 0]
        self.drop_refs(kind, [pid for pid in ids if pid >= 0] if hosts else ids, user)
        if hosts:
            self.host.release(hosts)

    def drop_export(self, key: tuple[object, str]) -> None:
        exp = self.exports.pop(key)
        if exp.persistent:
            self.accounting.remove_user(exp.kind, exp.user, exp.ids)
        else:
            self.accounting.remove(exp.kind, exp.owner, self.users[exp.owner], exp.ids)
        self.drop_refs(exp.kind, exp.ids, exp.user)

    # ------------------------------------------------------------------ errors

    def pool(self, kind: Kind) -> PhysicalPool:
        pool = self.pools.get(kind)
        if pool is None:
            raise ValueError(f"unknown resource kind {kind!r} (one of {', '.join(KINDS)})")
        return pool

    def require(self, instance: int) -> None:
        if instance not in self.users:
            raise ResourceError(
                f"inferlet {instance} is not registered (it has ended or was never added)"
            )

    def table(self, instance: int, kind: Kind) -> dict[int, int]:
        self.pool(kind)
        self.require(instance)
        return self.handles.tables[kind][instance]

    def out_of(self, requester: int, kind: Kind, needed: int, note: str) -> OutOfResources:
        pool = self.pools[kind]
        held = len(self.handles.tables[kind].get(requester, ()))
        return OutOfResources(
            f"cannot allocate {needed} {PLURAL[kind]} for inferlet {requester}: {pool.free} of "
            f"{pool.size} free, inferlet {requester} holds {held} ({note}). Free "
            f"{PLURAL[kind]} it no longer needs, or give the server more "
            f"({SIZE_OPTION[kind]})"
        )

    def _lookup_error(self, instance: int, kind: Kind, handles: Sequence[int]) -> Exception:
        """The error for a failed translate: unknown kind, instance, or handles."""
        try:
            self.table(instance, kind)
        except (ValueError, ResourceError) as e:
            return e
        return self.handles.invalid(instance, kind, handles)


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
    "only_needed",
]
