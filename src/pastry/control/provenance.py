"""Provenance of KV pages: which slots hold canonical K/V, and of which tokens.

The prefix cache (:mod:`pastry.control.prefix_cache`) may share a page only if its content
is exactly what a plain causal prefill of its tokens at positions ``0..`` writes with the
base model. The control layer never reads the engine's memory, so :class:`KvProvenance`
follows every call that writes it, in the order the engine runs them (the batch scheduler
calls :meth:`KvProvenance.observe` when it dispatches a batch), and keeps:

- per embedding slot, the ``(token, position)`` that ``embed_txt`` last wrote to it, or
  nothing once anything else wrote it (a forward's output, say);
- per KV page, a :class:`PageRecord`: the page's index ``i`` in its sequence (slot ``s``
  holds position ``i * page_size + s``), the tokens of its certified slots ``0..len-1``,
  a key naming every token before the page, and the record of page ``i - 1`` the K/V were
  computed on (so the whole token sequence can be read back).

A forward certifies the slots it writes only if all of this holds: no custom mask, no
adapter, no explicit positions; every input is an ``embed_txt`` of a token at position
``L + j`` (``L`` = context length); the context pages are page ``0, 1, ...`` of one
certified sequence (every page but the last full, the last certified up to
``in_kv_last_len``; keys chained); and the new K/V go to slot ``L % page_size`` of the page
after the context, or of the context's own last page. Anything else that writes a slot
(such a forward, ``mask_kvpage`` hiding it, a misaligned ``copy_kvpage``, a swap-in) ends
its page's certification at that slot. ``copy_kvpage`` of certified slots to the same
offsets of a page of the same sequence position carries their certification.

Within one batch the engine runs calls of different queues together (one handler per call
type; every forward of a batch writes its K/V before any reads its context), so a call that
reads or writes memory that *another queue* writes in the same batch is never certified.

A decode step reads the same context as the step before it, one token longer: the walk
over the context's records would cost O(pages) per step. What the last walk certified of a
context's leading *full* pages is kept (a :class:`_Chain`) and forgotten as soon as any of
those pages is written again, so that a step walks only the pages after them (one, or two
when a page has just filled): the same checks, on the same records, as a walk of them all.

Pure Python bookkeeping on the control loop. Nothing here trusts what an inferlet says.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from pastry.engine.calls import CopyKv, EmbedTxt, Forward, MaskKv, SwapIn

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


class _Chain:
    """Pages ``0..m-1`` of a sequence that a walk found certified, *full* and chained (each
    page's record continues the one before it), and the record of the last one. Valid while
    none of these pages is written: :meth:`KvProvenance._set` drops every chain holding a
    page it writes, so a chain that is still known still holds."""

    __slots__ = ("last", "pages")

    def __init__(self, pages: list[int], last: PageRecord) -> None:
        self.pages = pages
        self.last = last


# Contexts of up to this many pages are walked in full (cheaper than looking them up).
_WALKED = 4
_MANY = object()  # written by more than one queue in the batch
# Batches from this many calls on check for races in one vectorised pass first (below it,
# numpy's fixed cost per operation is more than the per-page bookkeeping).
_VECTOR_MIN = 48


class KvProvenance:
    """Certified content of every KV page and embedding slot of one engine."""

    def __init__(
        self,
        page_size: int,
        num_pages: int,
        num_embeds: int,
        vocab_size: int,
        max_position: int,
        max_batch_tokens: int,
    ) -> None:
        self.page_size = page_size
        # What the engine accepts (a call it rejects writes nothing, so it certifies nothing)
        self.vocab_size = vocab_size
        self.max_position = max_position
        self.max_batch_tokens = max_batch_tokens
        self.records: list[PageRecord | None] = [None] * num_pages
        # per embedding slot: the token embed_txt wrote there and its position (-1: none)
        self.embed_token = np.full(num_embeds, -1, dtype=np.int64)
        self.embed_position = np.full(num_embeds, -1, dtype=np.int64)
        # Certified chains of full pages (see _Chain), by their last page, and the chains
        # each page is in (written: they are dropped).
        self._chains: dict[int, _Chain] = {}
        self._watch: dict[int, set[_Chain]] = {}

    # ------------------------------------------------------------------ queries

    def record(self, page: int) -> PageRecord | None:
        return self.records[page]

    def chain(self, page: int) -> list[PageRecord]:
        """The records of page indices ``0..i`` of the sequence ``page`` certifiably
        continues (``[]`` if it holds nothing certified); the last is ``page``'s own."""
        rec = self.records[page]
        out: list[PageRecord] = []
        while rec is not None:
            out.append(rec)
            rec = rec.prev
        out.reverse()
        return out

    def forget(self, pages: Iterable[int]) -> None:
        """Certify nothing in ``pages`` any more (a write to them failed)."""
        for p in pages:
            self._set(p, None)

    # ------------------------------------------------------------------ observing a batch

    def observe(self, calls: Sequence[tuple[Any, Any]]) -> None:
        """Update the records for one dispatched batch: ``(queue, call)`` pairs in the order
        the engine runs them. A queue's ``instance`` attribute (if any) names its owner:
        embedding slots are never shared between instances, so they can only race between
        queues of one instance."""
        if len(calls) >= _VECTOR_MIN and _race_free(calls):  # the common large batch
            self._apply(calls)
            return
        pages: dict[int, object] = {}  # page -> the queue writing it (or _MANY)
        slots: dict[int, object] = {}  # embed slot -> the queue writing it (or _MANY)
        owners: dict[object, object] = {}  # instance -> its queue in this batch (or _MANY)
        for q, _ in calls:
            _mark(owners, getattr(q, "instance", q), q)
        shared_slots = _MANY in owners.values()
        for q, call in calls:
            for p in _written_pages(call):
                _mark(pages, p, q)
            if shared_slots:
                for e in _written_embeds(call):
                    _mark(slots, e, q)
        for q, call in calls:
            t = type(call)
            if t is EmbedTxt:
                self._embed_txt(call, _raced(slots, call.out_embeds.tolist(), q, True))
            elif t is Forward:
                self._forward(call, self._forward_raced(call, q, pages, slots))
            elif t is CopyKv:
                raced = (
                    _raced(pages, (call.src_page,), q, False) or pages.get(call.dst_page) is _MANY
                )
                self._copy(call, raced)
            elif t is MaskKv:
                self._mask(call, pages.get(call.page) is _MANY)
            elif t is SwapIn:
                for p in call.pages.tolist():
                    self._set(p, None)

    def _apply(self, calls: Sequence[tuple[Any, Any]]) -> None:
        """:meth:`observe` for a batch where no call races another queue's; each run of
        ``embed_txt`` calls in one vectorised pass."""
        embeds: list[EmbedTxt] = []
        for _, call in calls:
            t = type(call)
            if t is EmbedTxt:
                embeds.append(call)
                continue
            if embeds:
                self._embed_txts(embeds)
                embeds = []
            if t is Forward:
                self._forward(call, False)
            elif t is CopyKv:
                self._copy(call, False)
            elif t is MaskKv:
                self._mask(call, False)
            elif t is SwapIn:
                for p in call.pages.tolist():
                    self._set(p, None)
        if embeds:
            self._embed_txts(embeds)

    def _embed_txts(self, calls: list[EmbedTxt]) -> None:
        """:meth:`_embed_txt` (not raced) for consecutive calls, in one numpy pass: their
        slots do not overlap (the scheduler never batches overlapping embeds of one queue,
        and slots are per instance)."""
        if len(calls) < _VECTOR_MIN:
            for call in calls:
                self._embed_txt(call, False)
            return
        lengths = [len(c.out_embeds) for c in calls]
        if 0 in lengths or any(
            len(c.tokens) != k or len(c.positions) != k for c, k in zip(calls, lengths, strict=True)
        ):
            for call in calls:  # malformed ones (the engine rejects them): one by one
                self._embed_txt(call, False)
            return
        outs = np.concatenate([c.out_embeds for c in calls])
        toks = np.concatenate([c.tokens for c in calls])
        poss = np.concatenate([c.positions for c in calls])
        valid = (toks >= 0) & (toks < self.vocab_size) & (poss >= 0) & (poss < self.max_position)
        if not valid.all() or len(np.unique(outs)) != len(outs):
            for call in calls:  # out of range (certifies nothing) or overlapping: in order
                self._embed_txt(call, False)
            return
        self.embed_token[outs] = toks
        self.embed_position[outs] = poss

    @staticmethod
    def _forward_raced(call: Forward, q, pages: dict, slots: dict) -> bool:
        if pages:
            if _reads_raced(pages, call.ctx_pages, q):
                return True
            if _raced(pages, call.out_pages.tolist(), q, True):
                return True
        if slots:
            if _raced(slots, call.in_embeds.tolist(), q, False):
                return True
            if _raced(slots, call.out_embeds.tolist(), q, True):
                return True
        return False

    # ------------------------------------------------------------------ per call

    def _embed_txt(self, call: EmbedTxt, raced: bool) -> None:
        outs, tokens, positions = call.out_embeds, call.tokens, call.positions
        if raced or not len(outs) == len(tokens) == len(positions) or not len(outs):
            self.embed_token[outs] = -1
            return
        # Range checks on Python ints: a decode step embeds one token, where numpy's
        # reductions cost more than the rest of this method.
        toks, poss = tokens.tolist(), positions.tolist()
        if (
            min(toks) < 0
            or max(toks) >= self.vocab_size
            or min(poss) < 0
            or max(poss) >= self.max_position
        ):
            self.embed_token[outs] = -1
            return
        if len(toks) == 1:
            e = int(outs[0])
            self.embed_token[e], self.embed_position[e] = toks[0], poss[0]
            return
        self.embed_token[outs] = tokens
        self.embed_position[outs] = positions

    def _forward(self, call: Forward, raced: bool) -> None:
        outs = call.out_pages.tolist()
        if outs:
            done = False
            if not raced and call.mask is None and call.adapter == -1 and call.positions is None:
                done = self._certify(call, outs)
            if not done:
                self._damage(outs, int(call.out_offset), len(call.in_embeds))
        out_embeds = call.out_embeds
        if len(out_embeds) == 1:  # a decode step: a scalar write, not a fancy-index one
            self.embed_token[out_embeds[0]] = -1
        elif len(out_embeds):
            self.embed_token[out_embeds] = -1

    def _certify(self, call: Forward, outs: list[int]) -> bool:
        """Give the out pages records if the forward is a canonical causal prefill step."""
        ps = self.page_size
        recs = self.records
        ctx = call.ctx_pages.tolist()
        last_len = int(call.ctx_last_len)
        n = len(call.in_embeds)
        if (ctx and not 1 <= last_len <= ps) or (not ctx and last_len != 0):
            return False
        length = (len(ctx) - 1) * ps + last_len if ctx else 0
        head = length % ps
        # What the engine would reject (then nothing is written, nothing certified).
        if int(call.out_offset) != head or not 0 < n <= self.max_batch_tokens:
            return False
        if len(outs) * ps - head < n or len(set(outs)) != len(outs):
            return False
        if any(p in ctx for p in outs[1:]) or (
            (head == 0 or outs[0] != ctx[-1]) and outs[0] in ctx
        ):
            return False
        ins = call.in_embeds
        if n == 1:  # a decode step: scalars, not arrays
            e = int(ins[0])
            tokens = [int(self.embed_token[e])]
            if tokens[0] < 0 or self.embed_position[e] != length:
                return False
        else:
            toks = self.embed_token[ins]
            if toks.min() < 0 or not np.array_equal(
                self.embed_position[ins], np.arange(length, length + n)
            ):
                return False
            tokens = toks.tolist()
        # The context: pages 0, 1, ... of one certified sequence, keys chained. Its leading
        # full pages that an earlier walk certified and nothing wrote since are not walked
        # again (the same checks would pass on the same records).
        chain, start = self._known(ctx) if len(ctx) > _WALKED else (None, 0)
        prev = None if chain is None else chain.last
        last = len(ctx) - 1
        for i in range(start, last + 1):
            r = recs[ctx[i]]
            if r is None or r.index != i or len(r.tokens) < (ps if i < last else last_len):
                return False
            if i == 0:
                if r.key != ROOT_KEY:
                    return False
            elif r.prev is not prev and r.key != prev.next_key():
                return False
            prev = r
        full = last + 1 if last_len == ps else last  # pages the walk found full
        if full > start and full >= _WALKED:
            self._remember(ctx, full, chain, start)
        index = length // ps
        if head:
            # The first new token goes into the context's last page (or a copy of it).
            first = recs[outs[0]]  # (the walk checked that prev holds head tokens)
            if first is not prev and (first is None or not first.holds(_prefix(prev, head))):
                return False
            held = prev.tokens[:head]
            key, before = prev.key, prev.prev
        else:
            held = ()
            key = ROOT_KEY if prev is None else prev.next_key()
            before = prev
        pos = 0
        k = 0
        while pos < n:
            take = ps - len(held)
            rec = PageRecord(
                outs[k], index + k, held + tuple(tokens[pos : pos + take]), key, before
            )
            self._set(outs[k], rec)
            pos += take
            k += 1
            held = ()
            if pos < n:
                key, before = rec.next_key(), rec
        return True

    def _damage(self, outs: list[int], offset: int, n: int) -> None:
        """Slots ``offset .. offset + n`` of the concatenated ``outs`` were written with
        uncertified content: each page's certification ends where the write starts."""
        for k, p in enumerate(outs[: -(-(offset + n) // self.page_size)]):
            self._truncate(p, offset if k == 0 else 0)

    def _copy(self, call: CopyKv, raced: bool) -> None:
        recs = self.records
        src, dst = int(call.src_page), int(call.dst_page)
        so, do, n = int(call.src_offset), int(call.dst_offset), int(call.length)
        if n == 0:
            return
        ps = self.page_size
        if not (0 <= so < ps and 0 <= do < ps and 0 <= n <= ps and so + n <= ps >= do + n):
            return  # the engine rejects it: nothing is written
        rs = recs[src]
        if raced or rs is None or so != do or so + n > len(rs.tokens):
            self._truncate(dst, do)
            return
        if do == 0:
            self._set(dst, PageRecord(dst, rs.index, rs.tokens[:n], rs.key, rs.prev))
            return
        rd = recs[dst]
        if rd is not None and len(rd.tokens) >= do and rd.holds(_prefix(rs, do)):
            self._set(dst, PageRecord(dst, rs.index, rs.tokens[: do + n], rs.key, rs.prev))
        else:
            self._truncate(dst, do)

    def _mask(self, call: MaskKv, raced: bool) -> None:
        hidden = np.flatnonzero(call.masked)
        first = int(hidden[0]) if len(hidden) else self.page_size
        self._truncate(int(call.page), 0 if raced else first)

    # ------------------------------------------------------------------ writing records

    def _set(self, page: int, rec: PageRecord | None) -> None:
        """Every write of a record goes here: it drops the chains that hold ``page``."""
        self.records[page] = rec
        if page in self._watch:
            for c in self._watch.pop(page):
                self._unwatch(c)

    # ------------------------------------------------------------------ known chains

    def _known(self, ctx: list[int]) -> tuple[_Chain | None, int]:
        """The known chain that is exactly ``ctx``'s leading pages (all but the last, or
        all), and how many pages it covers; ``(None, 0)`` if none is."""
        n = len(ctx)
        if n >= 2:
            c = self._chains.get(ctx[-2])
            if c is not None and len(c.pages) == n - 1 and c.pages == ctx[:-1]:
                return c, n - 1
        if n:
            c = self._chains.get(ctx[-1])
            if c is not None and len(c.pages) == n and c.pages == ctx:
                return c, n
        return None, 0

    def _remember(self, ctx: list[int], full: int, chain: _Chain | None, start: int) -> None:
        """A walk found ``ctx[:full]`` certified, full and chained (``chain``, if not None,
        being ``ctx[:start]``): know it, by its last page. A known chain grows in place (a
        decode step that filled a page adds that page only)."""
        chains, watch = self._chains, self._watch
        new = ctx[start:full]
        if min(new) < 0:  # (a negative index names a page by another number: not known)
            return
        if chain is None:
            chain = _Chain(new, self.records[ctx[full - 1]])
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

    def _unwatch(self, chain: _Chain) -> None:
        """Forget ``chain`` (one of its pages was written, or another chain ends in the
        same page)."""
        if self._chains.get(chain.pages[-1]) is chain:
            del self._chains[chain.pages[-1]]
        watch = self._watch
        for p in chain.pages:
            s = watch.get(p)
            if s is not None:
                s.discard(chain)
                if not s:
                    del watch[p]

    def check_chains(self) -> None:
        """Assert that every known chain still holds what a walk of its pages certifies,
        and that the index of chains by page is exact (for tests)."""
        ps, recs = self.page_size, self.records
        held: dict[int, set[_Chain]] = {}
        for key, c in self._chains.items():
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
        assert held == self._watch

    def _truncate(self, page: int, n: int) -> None:
        """Keep the certification of slots ``0..n-1`` of ``page`` only."""
        r = self.records[page]
        if r is None or len(r.tokens) <= n:
            return
        self._set(page, PageRecord(page, r.index, r.tokens[:n], r.key, r.prev) if n > 0 else None)

    # ------------------------------------------------------------------ checks

    def certified(self, pages: Iterable[int]) -> list[int]:
        """How many slots of each page are certified (for tests and logs)."""
        return [0 if self.records[p] is None else len(self.records[p].tokens) for p in pages]


def _prefix(rec: PageRecord, n: int) -> PageRecord:
    """A view of ``rec`` certifying only its first ``n`` slots."""
    return PageRecord(rec.page, rec.index, rec.tokens[:n], rec.key, rec.prev)


def _mark(table: dict, key: int, q) -> None:
    prev = table.get(key)
    if prev is None:
        table[key] = q
    elif prev is not q:
        table[key] = _MANY


def _raced(table: dict, keys: Iterable[int], q, writes: bool) -> bool:
    """Whether memory this call touches is written in the batch by another queue (or, for
    what it writes, by several)."""
    for k in keys:
        w = table.get(k)
        if w is not None and (w is _MANY or (not writes and w is not q)):
            return True
    return False


def _reads_raced(table: dict, keys: np.ndarray, q) -> bool:
    """``_raced(table, keys, q, False)``; for a context longer than the pages the batch
    writes, looked up the other way round (those written by another queue, or several)."""
    if len(keys) <= len(table):
        return _raced(table, keys.tolist(), q, False)
    others = [k for k, w in table.items() if w is not q]  # (_MANY is not q either)
    return bool(others) and not set(others).isdisjoint(keys.tolist())


def _race_free(calls: Sequence[tuple[Any, Any]]) -> bool:
    """Whether no call of the batch races another queue's (then :meth:`KvProvenance.observe`
    needs no per-page bookkeeping): every instance has one queue in it (embedding slots are
    per instance), no KV page is written by two queues, and none that a queue reads (a
    forward's context, a copy's source) is written by another. Vectorised: one pass over
    the calls collects their pages, numpy compares them."""
    queues: dict[int, int] = {}  # id(queue) -> its index in the batch
    distinct: list[object] = []
    written: list[np.ndarray] = []  # page arrays, and the queue index of each
    w_queue: list[int] = []
    read: list[np.ndarray] = []
    r_queue: list[int] = []
    last = None
    k = -1
    for q, call in calls:
        if q is not last:
            last = q
            k = queues.setdefault(id(q), len(queues))
            if k == len(distinct):
                distinct.append(q)
        t = type(call)
        if t is Forward:
            if len(call.out_pages):
                written.append(call.out_pages)
                w_queue.append(k)
            if len(call.ctx_pages):
                read.append(call.ctx_pages)
                r_queue.append(k)
        elif t is CopyKv:
            written.append(np.array([call.dst_page], dtype=np.int64))
            w_queue.append(k)
            read.append(np.array([call.src_page], dtype=np.int64))
            r_queue.append(k)
        elif t is MaskKv:
            written.append(np.array([call.page], dtype=np.int64))
            w_queue.append(k)
        elif t is SwapIn:
            written.append(call.pages)
            w_queue.append(k)
    if len({getattr(q, "instance", q) for q in distinct}) < len(distinct):
        return False  # an instance with several queues in the batch: its slots may race
    if not written:
        return True
    wp = np.concatenate(written)
    wq = np.repeat(np.array(w_queue), [len(a) for a in written])
    order = np.argsort(wp, kind="stable")
    wp, wq = wp[order], wq[order]
    same = wp[1:] == wp[:-1]
    if np.any(same & (wq[1:] != wq[:-1])):
        return False  # a page written by two queues
    if not read:
        return True
    rp = np.concatenate(read)
    rq = np.repeat(np.array(r_queue), [len(a) for a in read])
    at = np.minimum(np.searchsorted(wp, rp), len(wp) - 1)
    hit = wp[at] == rp  # read pages that are written (by one queue: checked above)
    return not np.any(hit & (wq[at] != rq))


def _written_pages(call) -> Iterable[int]:
    t = type(call)
    if t is Forward:
        return call.out_pages.tolist()
    if t is CopyKv:
        return (int(call.dst_page),)
    if t is MaskKv:
        return (int(call.page),)
    if t is SwapIn:
        return call.pages.tolist()
    return ()


def _written_embeds(call) -> Iterable[int]:
    t = type(call)
    if t is EmbedTxt or t is Forward:
        return call.out_embeds.tolist()
    return ()


__all__ = ["ROOT_KEY", "KvProvenance", "PageRecord"]
