"""KV pages held by the prefix cache, on the page table: :class:`CachedPages`.

With a prefix cache (:mod:`pastry.control.prefix_cache`), a KV page may be *held by the
cache* instead of referenced: it belongs to the radix tree of its user's namespace, and
handles and exports that still reference it *borrow* it read-only (their references are
the tree node's uses: a used node is never evicted). A page whose last reference goes and
whose content is certified canonical (:mod:`pastry.control.provenance`) is offered to the
cache instead of being freed — the prompt *and* the generated tokens of a released
context. A write to a cached page is allowed only to an instance that is its only user (the
page and what the tree holds after it then leave the cache). Cached pages are never
swapped (the cache evicts instead). The resource manager calls this for every reference
it adds or drops on a KV page (:mod:`pastry.control.resources`).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterable, Sequence

from pastry.control.exports import ExportRegistry
from pastry.control.pages import PhysicalPool, ResourceError
from pastry.control.prefix_cache import PrefixCache
from pastry.control.provenance import KvProvenance, PageRecord

log = logging.getLogger(__name__)


class CachedPages:
    """The prefix cache's share of the KV pool. ``seconds`` accumulates the time spent in
    its bookkeeping here; ``events`` counts pages ``adopted``, ``evicted`` and
    ``detached``."""

    def __init__(
        self,
        pool: PhysicalPool,
        cache: PrefixCache,
        provenance: KvProvenance,
        exports: ExportRegistry,
    ) -> None:
        self.pool, self.cache, self.provenance, self.exports = pool, cache, provenance, exports
        self.seconds = 0.0
        self.events: Counter[str] = Counter()

    def take(self, ids: Sequence[int]) -> None:
        """Add one reference per id (cached pages become borrowed: their node is in use)."""
        pool, cache = self.pool, self.cache
        if not cache.cached_pages:
            pool.incref(ids)
            return
        newly = {p for p in ids if p in cache and pool.refcount(p) == 0}
        pool.incref(ids)
        if newly:
            cache.ref_pages(newly)

    def drop(self, ids: Sequence[int], user: object, offer: bool = True) -> None:
        """Drop one reference per id. Pages that lose their last reference and hold
        certified K/V are offered to ``user``'s tree first (unless not ``offer``); the
        others are freed."""
        if not ids:
            self.pool.decref(ids)
            return
        t0 = time.perf_counter()
        drops = Counter(ids)
        if offer:
            self._offer(drops, user)
        self.pool.decref(ids)
        cache = self.cache
        zero = [p for p in drops if p in cache and self.pool.refcount(p) == 0]
        if zero:
            cache.unref_pages(zero)
        self.seconds += time.perf_counter() - t0

    def _offer(self, drops: Counter[int], user: object) -> None:
        """Insert into ``user``'s tree the certified sequences that end in pages losing
        their last reference (``drops``: references about to be dropped per page)."""
        cache, pool, recs = self.cache, self.pool, self.provenance.records
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
                exported = self.exports.kv_ids()
            self.insert_chain(chain, drops, exported, user)

    def offer(self, user: object, pages: Iterable[int]) -> None:
        """Insert the certified sequences ending in ``pages`` (still referenced, e.g. a
        prompt just prefilled) into ``user``'s tree, so that others can reuse them now."""
        t0 = time.perf_counter()
        exported = self.exports.kv_ids()
        for p in pages:
            if p not in self.cache and self.provenance.records[p] is not None:
                self.insert_chain(self.provenance.chain(p), Counter(), exported, user)
        self.seconds += time.perf_counter() - t0

    def insert_chain(
        self, chain: list[PageRecord], drops: Counter[int], exported: set[int], user: object
    ) -> None:
        """Insert the tokens of ``chain`` with the pages that still hold them, as far as
        each page can be taken: it must still hold its record's content, be in use (not
        freed already), not be cached already, and have at most one reference left (not an
        export's) after ``drops``."""
        cache, pool, recs = self.cache, self.pool, self.provenance.records
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
            self.events["adopted"] += len(done.adopted)

    def evict(self, n: int) -> int:
        """Evict at least ``n`` cached pages nobody uses (fewer if there are not that many)."""
        t0 = time.perf_counter()
        freed = self.cache.evict(n)
        self.pool.release(freed)
        self.events["evicted"] += len(freed)
        self.seconds += time.perf_counter() - t0
        return len(freed)

    def claim(self, instance: int, pid: int, table: dict[int, int]) -> None:
        """``instance`` (whose KV handle ``table`` it is) writes cached page ``pid``: allowed
        when every reference to it, and to what the cache holds after it, is its own; the
        page and what follows then leave the cache. Else :class:`ResourceError`."""
        t0 = time.perf_counter()
        cache, pool = self.cache, self.pool
        referenced, pins = cache.detach_scope(pid)
        mine = Counter(table.values())
        others = [p for p in referenced if pool.refcount(p) != mine[p]]
        if pins or others:
            self.seconds += time.perf_counter() - t0
            raise ResourceError(
                f"KV page {pid} is shared through the prefix cache with other inferlets "
                "(it holds canonical K/V they read), so it cannot be written. Copy its "
                "slots into a page of your own (copy_kvpage) and write that one"
            )
        self.detach(pid)
        self.seconds += time.perf_counter() - t0

    def claim_all(self, instance: int, pages: Iterable[int], table: dict[int, int]) -> None:
        """:meth:`claim` every page of ``pages`` the cache holds."""
        cache = self.cache
        for pid in pages:
            if pid in cache:
                self.claim(instance, pid, table)

    def uncache(self, pages: Iterable[int]) -> None:
        """:meth:`detach` every page of ``pages`` the cache holds."""
        for pid in pages:
            if pid in self.cache:
                self.detach(pid)

    def detach(self, pid: int) -> None:
        """Take ``pid`` and what is cached after it out of the cache, whoever uses them."""
        free, kept = self.cache.detach(pid)
        self.pool.release(free + kept)
        self.events["detached"] += len(free) + len(kept)

    def check_integrity(self) -> None:
        """The pages the pool holds are exactly the tree's, borrowed exactly when
        referenced."""
        self.cache.check_integrity()
        pages = self.cache.page_ids()
        held = self.pool.held_ids()
        assert held == pages, f"held {sorted(held ^ pages)} disagree with the tree"
        for p in pages:
            assert (self.pool.refcount(p) > 0) == self.cache.is_referenced(p), f"page {p} borrowed?"
