"""What KV provenance records per page, and the chains of pages a walk certified.

A :class:`PageRecord` is what one KV page certifiably holds (:mod:`pastry.control.provenance`).
A decode step reads the same context as the step before it, one token longer: the walk over
the context's records would cost O(pages) per step. :class:`KnownChains` keeps what the last
walk certified of a context's leading *full* pages (a :class:`Chain`), forgotten as soon as
any of those pages is written again (:meth:`KnownChains.written`), so that a step walks only
the pages after them.
"""

from __future__ import annotations

import hashlib
from array import array

ROOT_KEY = b""  # the key of the first page of a sequence: no token before it


class PageRecord:
    """What a page certifiably holds (immutable; a write makes a new record)."""

    __slots__ = ("_next", "index", "key", "page", "prev", "tokens")

    def __init__(
        self,
        page: int,
        index: int,
        tokens: tuple[int, ...],
        key: bytes,
        prev: PageRecord | None,
    ) -> None:
        self.page = page  # the physical page this record was made for
        self.index = index  # page index in its sequence
        self.tokens = tokens  # tokens of slots 0..len-1
        self.key = key  # names the tokens before this page (ROOT_KEY for index 0)
        self.prev = prev  # the record of page index - 1 that the K/V were computed on
        self._next: bytes | None = None

    def next_key(self) -> bytes:
        """The key of the page after this one (only meaningful when this one is full)."""
        if self._next is None:
            h = hashlib.blake2b(self.key, digest_size=16)
            h.update(array("q", self.tokens).tobytes())
            self._next = h.digest()
        return self._next

    def holds(self, other: PageRecord) -> bool:
        """Whether this record certifies at least ``other``'s content."""
        return self is other or (
            self.index == other.index
            and self.key == other.key
            and self.tokens[: len(other.tokens)] == other.tokens
        )

    def __repr__(self) -> str:
        return f"PageRecord(page={self.page}, index={self.index}, tokens={len(self.tokens)})"


class Chain:
    """Pages ``0..m-1`` of a sequence that a walk found certified, *full* and chained (each
    page's record continues the one before it), and the record of the last one. Valid while
    none of these pages is written: :meth:`KnownChains.written` drops every chain holding a
    page written, so a chain that is still known still holds."""

    __slots__ = ("last", "pages")

    def __init__(self, pages: list[int], last: PageRecord) -> None:
        self.pages = pages
        self.last = last


class KnownChains:
    """Certified chains of full pages (:class:`Chain`), by their last page, and the chains
    each page is in (a write drops them). ``records`` is the provenance's own list."""

    def __init__(self, records: list[PageRecord | None], page_size: int) -> None:
        self.records = records
        self.page_size = page_size
        self.chains: dict[int, Chain] = {}
        self.watch: dict[int, set[Chain]] = {}

    def written(self, page: int) -> None:
        """``page`` got a new record: drop every chain holding it."""
        for c in self.watch.pop(page, ()):
            self._unwatch(c)

    def known(self, ctx: list[int]) -> tuple[Chain | None, int]:
        """The known chain that is exactly ``ctx``'s leading pages (all but the last, or
        all), and how many pages it covers; ``(None, 0)`` if none is."""
        n = len(ctx)
        if n >= 2:
            c = self.chains.get(ctx[-2])
            if c is not None and len(c.pages) == n - 1 and c.pages == ctx[:-1]:
                return c, n - 1
        if n:
            c = self.chains.get(ctx[-1])
            if c is not None and len(c.pages) == n and c.pages == ctx:
                return c, n
        return None, 0

    def remember(self, ctx: list[int], full: int, chain: Chain | None, start: int) -> None:
        """A walk found ``ctx[:full]`` certified, full and chained (``chain``, if not None,
        being ``ctx[:start]``): know it, by its last page. A known chain grows in place (a
        decode step that filled a page adds that page only)."""
        chains, watch = self.chains, self.watch
        new = ctx[start:full]
        if min(new) < 0:  # (a negative index names a page by another number: not known)
            return
        if chain is None:
            chain = Chain(new, self.records[ctx[full - 1]])
        else:
            del chains[chain.pages[-1]]
            chain.pages.extend(new)
            chain.last = self.records[ctx[full - 1]]
        for p in new:
            s = watch.get(p)
            if s is None:
                watch[p] = {chain}
            else:
                s.add(chain)
        old = chains.get(ctx[full - 1])
        if old is not None:
            self._unwatch(old)
        chains[ctx[full - 1]] = chain

    def _unwatch(self, chain: Chain) -> None:
        """Forget ``chain`` (one of its pages was written, or another chain ends in the
        same page)."""
        if self.chains.get(chain.pages[-1]) is chain:
            del self.chains[chain.pages[-1]]
        watch = self.watch
        for p in chain.pages:
            s = watch.get(p)
            if s is not None:
                s.discard(chain)
                if not s:
                    del watch[p]

    def check(self) -> None:
        """Assert that every known chain still holds what a walk of its pages certifies,
        and that the index of chains by page is exact (for tests)."""
        ps, recs = self.page_size, self.records
        held: dict[int, set[Chain]] = {}
        for key, c in self.chains.items():
            assert c.pages and c.pages[-1] == key and recs[key] is c.last, key
            prev = None
            for i, p in enumerate(c.pages):
                r = recs[p]
                assert r is not None and r.index == i and len(r.tokens) >= ps, (key, p)
                if i == 0:
                    assert r.key == ROOT_KEY, (key, p)
                else:
                    assert r.prev is prev or r.key == prev.next_key(), (key, p)
                prev = r
                held.setdefault(p, set()).add(c)
        assert held == self.watch
