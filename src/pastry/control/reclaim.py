"""Making room: what gives way when an allocation cannot be met, or a limit is reached.

:class:`Reclaiming` is the resource manager's last resorts, in order: evict the prefix
cache's unused pages; drop persistent exports nothing else uses (they are a cache), least
recently imported first; then ask the eviction policy
(:mod:`pastry.control.policies.eviction`) which instances to terminate. A user over its
limit first loses its own least recently used persistent exports
(:meth:`Reclaiming.check_limit`). It acts on the manager through its public doors only.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence

from pastry.control.accounting import subtract
from pastry.control.pages import PLURAL, Kind

log = logging.getLogger(__name__)


class Reclaiming:
    """The room-making of one resource manager ``m``."""

    def __init__(self, m) -> None:
        self.m = m

    def reclaimable(self, kind: Kind, instances) -> int:
        """How many ids of ``kind`` would return to the free list if all of ``instances``
        ended now (ids referenced only by their handles and non-persistent exports)."""
        m = self.m
        refs: Counter[int] = Counter()
        for inst in set(instances):
            if inst not in m.users:
                continue
            refs.update(pid for pid in m.handles.tables[kind][inst].values() if pid >= 0)
            for exp in m.exports.of_instance(inst):
                if exp.kind == kind:
                    refs.update(exp.ids)
        pool = m.pools[kind]
        return sum(1 for pid, k in refs.items() if pool.refcount(pid) == k)

    def check_limit(
        self, instance: int, kind: Kind, new: int | Sequence[int], keep: object = None
    ) -> None:
        """Raise :class:`QuotaExceeded` if taking ``new`` (a number of fresh ids, or the ids
        of an import) would take the instance or its user over a limit. A user over its
        limit first loses persistent exports (never ``keep``, the one being imported)."""
        user = self.m.users[instance]
        self.m.accounting.check(
            instance, user, kind, new, lambda over: self.drop_user_exports(user, kind, over, keep)
        )

    def drop_user_exports(self, user: object, kind: Kind, over: int, keep: object) -> bool:
        """Drop ``user``'s least recently used persistent exports of ``kind`` until its
        charge falls by ``over``; if even all of them would not do, drop none: False."""
        current = self.m.accounting.user_ids(user, kind)
        if not current:
            return False
        counter = Counter(current)
        chosen = []
        for key in self.m.exports.lru(kind, user):
            if key == keep:
                continue
            before = len(counter)
            subtract(counter, self.m.exports.exports[key].ids)
            if len(counter) < before:
                chosen.append(key)
                if len(current) - len(counter) >= over:
                    break
        if len(current) - len(counter) < over:
            return False
        for key in chosen:
            log.info("dropping persistent export %r of user %s: the user is over its quota",
                     key[1], user)  # fmt: skip
            self.m.drop_export(key)
        return True

    def export_gain(self, kind: Kind, wanted: int) -> tuple[int, list[tuple[object, str]]]:
        cached = self.m.cache if kind == "kv" and self.m.cache is not None else ()
        return self.m.exports.gain(kind, wanted, self.m.pools[kind].counts, cached)

    def drop_cached(
        self, kind: Kind, needed: int, exports: list[tuple[object, str]] | None = None
    ) -> bool:
        """Persistent exports are a cache: drop those nothing else uses, least recently
        imported first, until ``needed`` ids are free; if even all of them would not do,
        drop none. Returns whether ``needed`` ids are free."""
        pool = self.m.pools[kind]
        if exports is None:
            if not self.m.exports.any_persistent:
                return pool.free >= needed
            gain, exports = self.export_gain(kind, needed - pool.free)
            if pool.free + gain < needed:
                return False
        for key in exports:
            if self.m.available(kind) >= needed:
                break
            log.info("dropping persistent export %r of user %s to free %s",
                     key[1], key[0], PLURAL[kind])  # fmt: skip
            self.m.drop_export(key)
        if pool.free < needed and kind == "kv" and self.m.cached is not None:
            self.m.cached.evict(needed - pool.free)  # dropped pages with canonical K/V were cached
        assert pool.free >= needed, "dropping persistent exports freed less than counted"
        return True

    def reclaim(self, requester: int, kind: Kind, needed: int) -> None:
        """Free ``needed`` ids: evict the prefix cache's unused pages, drop unused
        persistent exports, then terminate the policy's victims, or raise."""
        pool = self.m.pools[kind]
        cached = self.m.cached if kind == "kv" else None
        if cached is not None and pool.free < needed:
            cached.evict(needed - pool.free)
            if pool.free >= needed:
                return
        free = pool.free
        gain, exports = (
            self.export_gain(kind, needed - free) if self.m.exports.any_persistent else (0, [])
        )
        if free + gain >= needed:
            self.drop_cached(kind, needed, exports)
            return
        victims = self.victims(requester, kind, needed, gain)
        for key in exports:
            self.m.drop_export(key)
        ended = self.terminate(victims, requester, kind, needed, free)
        self.m.require(requester)
        if cached is not None and pool.free < needed:  # the victims' pages may be cached now
            cached.evict(needed - pool.free)
        if pool.free < needed:
            raise self.m.out_of(
                requester, kind, needed, f"still short after terminating inferlets {ended}"
            )

    def victims(self, requester: int, kind: Kind, needed: int, gain: int) -> list[int]:
        """The eviction policy's victims, or the error the requester gets."""
        if self.m.on_terminate is None:
            raise self.m.out_of(requester, kind, needed, "no terminate callback, so nobody can end")
        desc = self.policy_name()
        victims = list(
            dict.fromkeys(self.m.policy.choose_victims(self.m, kind, needed - gain, requester))
        )
        if requester in victims:
            raise self.m.out_of(
                requester, kind, needed, f"the {desc} chose inferlet {requester} itself to give way"
            )
        if not victims:
            raise self.m.out_of(requester, kind, needed, f"the {desc} chose no inferlet to end")
        return victims

    def terminate(self, victims, requester: int, kind: Kind, needed: int, free: int) -> list[int]:
        reason = (
            f"terminated to free {PLURAL[kind]} for inferlet {requester} "
            f"({self.policy_name()}): {needed} {PLURAL[kind]} needed, {free} free"
        )
        ended = []
        for victim in victims:
            if victim not in self.m.users:
                continue
            ended.append(victim)
            try:
                self.m.on_terminate(victim, reason)
            finally:
                self.m.remove_instance(victim)
        return ended

    def policy_name(self) -> str:
        return getattr(self.m.policy, "description", type(self.m.policy).__name__)

    def device_lost(self) -> None:
        """The engine's memory is gone (its process was restarted): every id is free again.
        Call it once the :meth:`~pastry.control.ledger.PageLedger.holders` are removed; the
        persistent exports, the prefix cache and what provenance certifies named the lost
        memory, and are dropped."""
        m = self.m
        assert not m.holders(), f"instances still hold ids: {m.holders()}"
        for key in list(m.exports.exports):
            m.drop_export(key)
        if m.cached is not None:
            m.cached.evict(m.cache.cached_pages)
        if m.provenance is not None:
            m.provenance.forget(range(m.pools["kv"].size))
        m.host.take_moves()  # (the pending copies are moot; their host pages are freed)
