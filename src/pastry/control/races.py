"""Which calls of a batch race another queue's: read or write memory another writes.

Within one batch the engine runs calls of different queues together (one handler per call
type; every forward of a batch writes its K/V before any reads its context), so the
provenance of KV pages (:mod:`pastry.control.provenance`) never certifies a call that
reads or writes memory that *another queue* writes in the same batch. :func:`race_free`
says, in one vectorised pass, that no call of a batch races (the common large batch);
otherwise :func:`writers` maps each page and embedding slot to the queue writing it
(:data:`MANY`: several), which :func:`raced` and :func:`forward_raced` consult per call.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from pastry.wire.calls import CopyKv, EmbedImg, EmbedTxt, Forward, MaskKv, SwapIn

MANY = object()  # written by more than one queue in the batch


def writers(calls: Sequence[tuple[Any, Any]]) -> tuple[dict, dict]:
    """``(pages, slots)``: the queue writing each KV page and embedding slot in the batch
    (or :data:`MANY`). Slots only race between queues of one instance (a queue's
    ``instance`` attribute, if any, names its owner): with no instance holding several
    queues in the batch, ``slots`` is empty."""
    pages: dict[int, object] = {}  # page -> the queue writing it (or MANY)
    slots: dict[int, object] = {}  # embed slot -> the queue writing it (or MANY)
    owners: dict[object, object] = {}  # instance -> its queue in this batch (or MANY)
    for q, _ in calls:
        _mark(owners, getattr(q, "instance", q), q)
    shared_slots = MANY in owners.values()
    for q, call in calls:
        for p in written_pages(call):
            _mark(pages, p, q)
        if shared_slots:
            for e in written_embeds(call):
                _mark(slots, e, q)
    return pages, slots


def forward_raced(call: Forward, q, pages: dict, slots: dict) -> bool:
    """Whether a forward reads or writes memory another queue writes in the batch."""
    if pages:
        if reads_raced(pages, call.ctx_pages, q):
            return True
        if raced(pages, call.out_pages.tolist(), q, True):
            return True
    if slots:
        if raced(slots, call.in_embeds.tolist(), q, False):
            return True
        if raced(slots, call.out_embeds.tolist(), q, True):
            return True
    return False


def _mark(table: dict, key: int, q) -> None:
    prev = table.get(key)
    if prev is None:
        table[key] = q
    elif prev is not q:
        table[key] = MANY


def raced(table: dict, keys: Iterable[int], q, writes: bool) -> bool:
    """Whether memory this call touches is written in the batch by another queue (or, for
    what it writes, by several)."""
    for k in keys:
        w = table.get(k)
        if w is not None and (w is MANY or (not writes and w is not q)):
            return True
    return False


def reads_raced(table: dict, keys: np.ndarray, q) -> bool:
    """``raced(table, keys, q, False)``; for a context longer than the pages the batch
    writes, looked up the other way round (those written by another queue, or several)."""
    if len(keys) <= len(table):
        return raced(table, keys.tolist(), q, False)
    others = [k for k, w in table.items() if w is not q]  # (MANY is not q either)
    return bool(others) and not set(others).isdisjoint(keys.tolist())


def race_free(calls: Sequence[tuple[Any, Any]]) -> bool:
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


def written_pages(call) -> Iterable[int]:
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


def written_embeds(call) -> Iterable[int]:
    t = type(call)
    if t is EmbedTxt or t is Forward or t is EmbedImg:
        return call.out_embeds.tolist()
    return ()
