"""Provenance of KV pages: which slots hold canonical K/V, and of which tokens.

The prefix cache (:mod:`pastry.control.prefix_cache`) may share a page only if its content
is exactly what a plain causal prefill of its tokens at positions ``0..`` writes with the
base model. The control layer never reads the engine's memory, so :class:`KvProvenance`
follows every call that writes it, in the order the engine runs them (the batch scheduler
calls :meth:`KvProvenance.observe` when it dispatches a batch), and keeps:

- per embedding slot, the ``(token, position)`` that ``embed_txt`` last wrote to it (for
  an ``embed_img``, the image's key at that position: :func:`pastry.wire.images.image_keys`
  of the SHA-256 of its bytes, above every token id), or nothing once anything else wrote
  it (a forward's output; an image embed the engine refused, :meth:`forget_embeds`);
- per KV page, a :class:`PageRecord`: the page's index ``i`` in its sequence (slot ``s``
  holds position ``i * page_size + s``), the tokens of its certified slots ``0..len-1``,
  a key naming every token before the page, and the record of page ``i - 1`` the K/V were
  computed on (so the whole token sequence can be read back).

A forward certifies the slots it writes only if all of this holds: no custom mask, no
adapter, no explicit positions; every input is an ``embed_txt`` of a token (or an
``embed_img`` of an image) at position
``L + j`` (``L`` = context length); the context pages are page ``0, 1, ...`` of one
certified sequence (every page but the last full, the last certified up to
``in_kv_last_len``; keys chained); and the new K/V go to slot ``L % page_size`` of the page
after the context, or of the context's own last page. Anything else that writes a slot
(such a forward, ``mask_kvpage`` hiding it, a misaligned ``copy_kvpage``, a swap-in) ends
its page's certification at that slot. ``copy_kvpage`` of certified slots to the same
offsets of a page of the same sequence position carries their certification.

A call that reads or writes memory *another queue* writes in the same batch is never
certified (:mod:`pastry.control.races`).

A decode step reads the same context as the step before it, one token longer: the walk
over the context's records would cost O(pages) per step. What the last walk certified of a
context's leading *full* pages is kept (:mod:`pastry.control.page_records`) and forgotten as soon as any of
those pages is written again, so that a step walks only the pages after them (one, or two
when a page has just filled): the same checks, on the same records, as a walk of them all.

Pure Python bookkeeping on the control loop. Nothing here trusts what an inferlet says.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from pastry.control import races
from pastry.control.page_records import ROOT_KEY, KnownChains, PageRecord
from pastry.control.races import MANY
from pastry.wire.calls import CopyKv, EmbedImg, EmbedTxt, Forward, MaskKv, SwapIn
from pastry.wire.images import MAX_KEYED, image_digest, image_keys

# Contexts of up to this many pages are walked in full (cheaper than looking them up).
_WALKED = 4
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
        self.chains = KnownChains(self.records, page_size)  # what walks certified

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

    def forget_embeds(self, slots) -> None:
        """The embeddings in ``slots`` are no one's any more (their embed failed)."""
        self.embed_token[slots] = -1

    # ------------------------------------------------------------------ observing a batch

    def observe(self, calls: Sequence[tuple[Any, Any]]) -> None:
        """Update the records for one dispatched batch: ``(queue, call)`` pairs in the order
        the engine runs them. A queue's ``instance`` attribute (if any) names its owner:
        embedding slots are never shared between instances, so they can only race between
        queues of one instance."""
        if len(calls) >= _VECTOR_MIN and races.race_free(calls):  # the common large batch
            self._apply(calls)
            return
        pages, slots = races.writers(calls)
        for q, call in calls:
            t = type(call)
            if t is EmbedTxt:
                self._embed_txt(call, races.raced(slots, call.out_embeds.tolist(), q, True))
            elif t is Forward:
                self._forward(call, races.forward_raced(call, q, pages, slots))
            elif t is CopyKv:
                raced = (
                    races.raced(pages, (call.src_page,), q, False)
                    or pages.get(call.dst_page) is MANY
                )
                self._copy(call, raced)
            elif t is MaskKv:
                self._mask(call, pages.get(call.page) is MANY)
            elif t is SwapIn:
                for p in call.pages.tolist():
                    self._set(p, None)
            elif t is EmbedImg:
                self._embed_img(call, races.raced(slots, call.out_embeds.tolist(), q, True))

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
            elif t is EmbedImg:
                self._embed_img(call, False)
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

    def _embed_img(self, call: EmbedImg, raced: bool) -> None:
        """An image's slots hold the image's keys (:func:`pastry.wire.images.image_keys`, from
        the SHA-256 of its bytes) at its positions: a forward over them certifies its pages
        as that image, as one over ``embed_txt`` slots certifies text."""
        outs, positions = call.out_embeds, call.positions
        n = len(outs)
        if raced or not n or n != len(positions) or n > MAX_KEYED:
            self.embed_token[outs] = -1
            return
        poss = positions.tolist()
        if min(poss) < 0 or max(poss) >= self.max_position:
            self.embed_token[outs] = -1
            return
        self.embed_token[outs] = image_keys(image_digest(call.image.tobytes()), n)
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
        shape = self._step_shape(call, outs)
        if shape is None:
            return False
        ctx, last_len, length, tokens = shape
        ok, prev = self._walk(ctx, last_len)
        if not ok:
            return False
        ps = self.page_size
        head = length % ps
        if head:
            # The first new token goes into the context's last page (or a copy of it).
            first = self.records[outs[0]]  # (the walk checked that prev holds head tokens)
            if first is not prev and (first is None or not first.holds(_prefix(prev, head))):
                return False
            held = prev.tokens[:head]
            key, before = prev.key, prev.prev
        else:
            held = ()
            key = ROOT_KEY if prev is None else prev.next_key()
            before = prev
        index, n, pos, k = length // ps, len(tokens), 0, 0
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

    def _step_shape(self, call: Forward, outs: list[int]) -> tuple | None:
        """``(context pages, last page's length, context length, input tokens)`` of a
        forward whose inputs are ``embed_txt`` tokens at the positions after its context,
        written right after it; None for anything else (or what the engine rejects)."""
        ps = self.page_size
        ctx = call.ctx_pages.tolist()
        last_len = int(call.ctx_last_len)
        n = len(call.in_embeds)
        if (ctx and not 1 <= last_len <= ps) or (not ctx and last_len != 0):
            return None
        length = (len(ctx) - 1) * ps + last_len if ctx else 0
        head = length % ps
        # What the engine would reject (then nothing is written, nothing certified).
        if int(call.out_offset) != head or not 0 < n <= self.max_batch_tokens:
            return None
        if len(outs) * ps - head < n or len(set(outs)) != len(outs):
            return None
        if any(p in ctx for p in outs[1:]) or (
            (head == 0 or outs[0] != ctx[-1]) and outs[0] in ctx
        ):
            return None
        ins = call.in_embeds
        if n == 1:  # a decode step: scalars, not arrays
            e = int(ins[0])
            tokens = [int(self.embed_token[e])]
            if tokens[0] < 0 or self.embed_position[e] != length:
                return None
        else:
            toks = self.embed_token[ins]
            if toks.min() < 0 or not np.array_equal(
                self.embed_position[ins], np.arange(length, length + n)
            ):
                return None
            tokens = toks.tolist()
        return ctx, last_len, length, tokens

    def _walk(self, ctx: list[int], last_len: int) -> tuple[bool, PageRecord | None]:
        """Whether ``ctx`` is pages 0, 1, ... of one certified sequence (keys chained, the
        last holding ``last_len`` certified slots), and its last record. Its leading full
        pages that an earlier walk certified and nothing wrote since are not walked again
        (the same checks would pass on the same records)."""
        ps, recs = self.page_size, self.records
        chain, start = self.chains.known(ctx) if len(ctx) > _WALKED else (None, 0)
        prev = None if chain is None else chain.last
        last = len(ctx) - 1
        for i in range(start, last + 1):
            r = recs[ctx[i]]
            if r is None or r.index != i or len(r.tokens) < (ps if i < last else last_len):
                return False, None
            if i == 0:
                if r.key != ROOT_KEY:
                    return False, None
            elif r.prev is not prev and r.key != prev.next_key():
                return False, None
            prev = r
        full = last + 1 if last_len == ps else last  # pages the walk found full
        if full > start and full >= _WALKED:
            self.chains.remember(ctx, full, chain, start)
        return True, prev

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
        if page in self.chains.watch:
            self.chains.written(page)

    def check_chains(self) -> None:
        """Assert that the known chains hold what walks of their pages certify (tests)."""
        self.chains.check()

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


__all__ = ["ROOT_KEY", "KvProvenance", "PageRecord"]
