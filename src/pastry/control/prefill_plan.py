"""One cache-aware prefill's plan: its commands, and what is decided at admission.

:class:`PrefillPlan` is what :meth:`Prefiller.submit <pastry.control.prefill.Prefiller.submit>`
queues: a KV command that admits the prefill (:class:`_Admit`; the steps of
:mod:`pastry.control.prefill`'s docstring happen in :meth:`PrefillPlan._decide`), KV calls
it decided (a copy, masks), an ``embed_txt`` and a forward. Each command's op is the plan
(and which of its calls): data, prepared when its batch is formed. A prefill with images
has one embed per run of text and per image (``embed_img``).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pastry.control.commands import Command, CommandError, NotAdmitted, Op, Queue, Stage
from pastry.control.prefix_cache import Match, RadixNode
from pastry.control.resources import ResourceError
from pastry.wire.calls import Call, CopyKv, EmbedImg, EmbedTxt, Forward, MaskKv, ids


@dataclass(eq=False)
class Admission:
    """A prefill waiting to be admitted, as ordering policies see it (read only for them,
    but ``seen`` and ``starved``, which the scheduling policy keeps)."""

    tokens: tuple[int, ...]  # the whole sequence: the context's tokens, then the new ones
    kv_len: int  # tokens already in the context's pages
    arrived: float  # time.perf_counter() when it was asked for
    prefiller: Any  # the pastry.control.prefill.Prefiller that admits it
    reusable_from: int  # the first position the cache may supply (-1: none)
    limit: int  # the last position + 1 the cache may supply
    namespace: object = None  # whose cache it may match (its user's: docs/security.md)
    image_spans: tuple[tuple[int, int], ...] = ()  # (first position, embeddings) of new images
    seen: int | None = None  # the scheduling policy's batch count when it first saw it
    starved: bool = False  # waited too long: served first, pages saved up for it
    admitted: bool = False
    _match: tuple[int, Match | None] = (-1, None)  # (tree version, match then)

    @property
    def new_tokens(self) -> int:
        return len(self.tokens) - self.kv_len

    def match(self) -> Match:
        """The cache's longest prefix of ``tokens[:limit]`` now (recomputed only when the
        tree changed; does not count as a use for the LRU order)."""
        cache = self.prefiller.cache
        version, m = self._match
        if version != cache.version or m is None:
            t0 = time.perf_counter()
            m = cache.match(self.tokens, self.limit, touch=False, namespace=self.namespace)
            self._match = (cache.version, m)
            self.prefiller.stats.seconds += time.perf_counter() - t0
        return m

    def cached(self) -> int:
        """Tokens the cache would supply if admitted now."""
        if self.prefiller.cache is None or self.reusable_from < 0:
            return 0
        m = self.match().length
        for at, k in self.image_spans:  # a match inside a new image computes it whole
            if at < m < at + k:
                m = at
        return max(0, m - self.reusable_from)


@dataclass(frozen=True, slots=True)
class _Reuse:
    """What admission found in the cache (:meth:`PrefillPlan._choose`)."""

    match: Match | None
    m: int  # tokens supplied: the first position computed
    full: int  # page indices [first_new, full) come from the cache by reference
    partial: int  # matched slots of page ``full`` to copy (0: none)
    shared: int  # new handles bound to cached pages
    first_new: int  # page index of the first new handle
    last: int  # index of the sequence's last page
    fresh_prompt: bool
    key: tuple | None  # what another prefill may be computing for us
    queue: Queue


@dataclass(eq=False)
class PrefillPlan:
    """One prefill: its commands, and the decisions taken when it is admitted."""

    prefiller: Any  # the pastry.control.prefill.Prefiller running it
    instance: int
    admission: Admission
    pages: list[int]  # the context's handles
    new: list[int]  # reserved handles for the page indices after them
    out_embeds: list[int]
    embeds: list[int] = field(default_factory=list)  # input slots, ours while admitted
    commands: list[Command] = field(default_factory=list)
    calls: list[tuple | None] | None = None  # the KV calls decided at admission (_kv_call)
    start: int = 0  # the first position computed (the rest came from the cache)
    pinned: RadixNode | None = None  # the match node, pinned until the copy is dispatched
    fresh_prompt: bool = False
    computing: tuple | None = None  # our key in Prefiller.computing while we compute it
    error: str = ""  # why admission failed
    # the images to embed: (first position, embeddings, encoded bytes), in order
    images: list[tuple[int, int, bytes]] = field(default_factory=list)
    # what the embed commands embed: (first position, end, an image's bytes or None: text)
    segments: list[tuple[int, int, bytes | None]] = field(default_factory=list)

    @property
    def reused(self) -> int:
        return self.start - self.admission.kv_len

    def submit(self, queue: Queue) -> asyncio.Future:
        sched, ps = self.prefiller.scheduler, self.prefiller.page_size
        n = len(self.admission.tokens)
        # KV calls: a copy and/or a mask of the sequence's last page, then one mask per
        # page reserved after it (their stale slots must never be readable)
        extra = max(0, len(self.pages) + len(self.new) - max(len(self.pages), -(-n // ps)))
        kv = [Command(Stage.KV, _Admit(self), admission=self.admission)]
        kv += [Command(Stage.KV, _KvCall(self, i)) for i in range(1, 2 + extra)]
        self.segments = _segments(self.admission.kv_len, n, self.images)
        embeds = [Command(Stage.EMBED, _Embed(self, i)) for i in range(len(self.segments))]
        fwd = Command(Stage.FORWARD, _Forward(self), tokens=self.admission.new_tokens)
        self.commands = [*kv, *embeds, fwd]
        for c in self.commands:
            sched.submit(queue, c)
            if c is not fwd:  # their failures reach the caller through the forward's
                c.future.add_done_callback(_retrieve)
        kv[0].future.add_done_callback(self._admit_done)
        fwd.future.add_done_callback(self._forward_done)
        return fwd.future

    # ------------------------------------------------------------------ admission

    def _admitted(self) -> list[tuple | None]:
        if self.calls is None:
            raise CommandError(f"the prefill was not admitted: {self.error or 'cancelled'}")
        return self.calls

    def _phys(self) -> list[int]:
        """The physical page of every page index now (translated when each call is
        prepared: the pages may have moved, swapped out and back, since admission)."""
        return self.prefiller.resources.translate(self.instance, "kv", self.pages + self.new)

    def _kv_call(self, i: int) -> Call | None:
        """The ``i``-th KV call decided at admission: ``("copy", index, (src, n))`` copies
        ``n`` slots of cached page ``src`` into page index ``index``; ``("mask", index,
        masked)`` masks it."""
        spec = self._admitted()[i]
        if spec is None:
            return None
        what, index, arg = spec
        page = self._phys()[index]
        if what == "copy":
            return CopyKv(arg[0], page, 0, 0, arg[1])
        return MaskKv(page, arg)

    def _admit(self) -> Call | None:
        if self.calls is not None:  # prepared again after a conflict: same decision
            return self._kv_call(0)
        try:
            return self._decide()
        except NotAdmitted:
            raise
        except Exception as e:
            self.error = str(e)
            raise

    def _decide(self) -> Call | None:
        """Admit the prefill now (or raise :class:`NotAdmitted`): what comes from the cache,
        the memory it takes, and the KV calls; returns the first of them."""
        d = self._choose()
        pf = self.prefiller
        if d.key is not None and d.key in pf.computing and pf.scheduler.busy(besides=d.queue):
            pf.stats.waited_for_prefix += 1
            raise NotAdmitted
        pin = self._take_memory(d)
        self._commit(d, pin)
        return self._kv_call(0)

    def _choose(self) -> _Reuse:
        """What the cache supplies (step 1 of the module docstring)."""
        pf, adm = self.prefiller, self.admission
        ps, cache = pf.page_size, pf.cache
        t0 = time.perf_counter()
        n, kv_len = len(adm.tokens), adm.kv_len
        first_new = len(self.pages)  # page index of self.new[0]
        last = -(-n // ps) - 1  # index of the sequence's last page
        match: Match | None = None
        m = kv_len
        if cache is not None and adm.reusable_from >= 0:
            match = adm.match()
            if match.length > kv_len:
                m = match.length
        while True:
            m = self._outside_images(m)  # never part of an image: the whole is computed
            full = m // ps  # indices [first_new, full) come from the cache by reference
            partial = m % ps if m > kv_len else 0
            if not (partial and full == last and n % ps):
                break
            if self._outside_images(full * ps) < full * ps:
                break  # rather a copy and a mask of one page (two batches) than the image again
            m = full * ps  # copy + mask of one page: compute its slots instead
        shared = max(0, full - first_new) if m > kv_len else 0
        fresh_prompt = cache is not None and kv_len == 0
        key = None
        if fresh_prompt and n - full * ps >= pf.wait_for:
            # Another prefill admitted just now computes the same next tokens: wait for its
            # pages (inserted when its batch is dispatched) instead of computing them too.
            key = (adm.namespace, full, adm.tokens[full * ps : full * ps + pf.wait_for])
        pf.stats.seconds += time.perf_counter() - t0
        return _Reuse(match, m, full, partial, shared, first_new, last, fresh_prompt, key,
                      self.commands[0].queue)  # fmt: skip

    def _outside_images(self, m: int) -> int:
        """``m``, or the start of the image it falls inside."""
        for at, k, _ in self.images:
            if at < m < at + k:
                return max(at, self.admission.kv_len)
        return m

    def _take_memory(self, d: _Reuse) -> RadixNode | None:
        """Admit against free memory, share and pin the prefix, allocate the rest (steps
        2-3); returns the pinned node of a page to copy from."""
        pf, res, adm = self.prefiller, self.prefiller.resources, self.admission
        n, ps, kv_len = len(adm.tokens), pf.page_size, adm.kv_len
        match, m, shared = d.match, d.m, d.shared
        need = len(self.new) - shared
        swapper = pf.scheduler.swapper
        if swapper is not None and need > res.available("kv"):
            # programs ranked after this one move to host memory first (control/swap.py)
            swapper.make_room(self.instance, need - res.available("kv"))
        pf.admit(adm, need, n - m, d.queue)  # cheap first (pinning the prefix lowers supply)
        # Pin the prefix (the shared pages, and the node of a page to copy from): it is not
        # evictable any more, so check memory again with the exact supply.
        pin = match.node if d.partial else None
        if match is not None and shared:
            res.bind_cached(self.instance, self.new[:shared], match.pages[d.first_new : d.full])
        if pin is not None:
            pf.cache.lock(pin)

        def unpin() -> None:
            if pin is not None:
                pf.cache.unlock(pin)
            if match is not None and shared:
                res.unbind(self.instance, "kv", self.new[:shared])

        try:
            pf.admit(adm, need, n - m, d.queue)
        except NotAdmitted:
            unpin()
            raise
        written = self.pages[kv_len // ps :]  # the context's own pages the forward writes
        try:
            if written:
                res.claim_writes(self.instance, res.translate(self.instance, "kv", written))
            self.embeds = res.alloc(self.instance, "embed", n - m)
            res.bind_fresh(self.instance, "kv", self.new[shared:])
        except ResourceError:  # give back what was taken
            if self.embeds:
                res.free(self.instance, "embed", self.embeds)
                self.embeds = []
            unpin()
            raise
        return pin

    def _commit(self, d: _Reuse, pin: RadixNode | None) -> None:
        """The prefill is admitted: its KV calls (a copy of a partial cached page, masks of
        stale slots), what it waits for, the statistics (step 4)."""
        pf, adm = self.prefiller, self.admission
        n, ps, kv_len, m = len(adm.tokens), pf.page_size, adm.kv_len, d.m
        adm.admitted = True
        if d.match is not None:
            pf.cache.match(adm.tokens, adm.limit, namespace=adm.namespace)  # used now (LRU)
        self.start = m
        copy = mask = None
        if d.partial:  # (the cached source page is pinned: it never moves)
            copy = ("copy", d.full, (d.match.pages[d.full], d.partial))
            self.pinned = pin  # the source page must outlive the copy: unlocked at dispatch
        if n % ps and d.last >= d.first_new:
            mask = ("mask", d.last, np.arange(ps) >= n % ps)
        hidden = np.ones(ps, dtype=np.bool_)
        total = len(self.pages) + len(self.new)
        extra = [("mask", i, hidden) for i in range(max(d.last + 1, d.first_new), total)]
        self.calls = [copy, mask, *extra] if copy is not None else [mask, None, *extra]
        self.fresh_prompt = d.fresh_prompt
        fwd = self.commands[-1]
        fwd.tokens = n - m
        if d.key is not None and n > m and not self.images:  # (inserted at release)
            self.computing = d.key
            pf.computing.setdefault(d.key, self)
        if self.pinned is not None or self.fresh_prompt or self.computing:
            pf.after[fwd if n > m else self.commands[0]] = self
        pf.stats.prefills += 1
        pf.stats.tokens += n - kv_len
        pf.stats.cached_tokens += m - kv_len

    def _admit_done(self, fut: asyncio.Future) -> None:
        pf = self.prefiller
        if not self.admission.admitted:  # failed or cancelled before admission: the new
            # handles stay reserved (never filled) until the inferlet frees them or ends
            for c in self.commands:
                pf.after.pop(c, None)
            if pf.saving is self.admission:
                pf.saving = None

    # ------------------------------------------------------------------ computing

    def _embed(self, i: int) -> Call | None:
        """The ``i``-th embed: its segment's text or image, but what the cache supplied."""
        self._admitted()
        lo, hi, image = self.segments[i]
        m = self.start
        lo = max(lo, m)
        if lo >= hi:
            return None
        slots = self.prefiller.resources.translate(self.instance, "embed", self.embeds)
        slots = ids(slots[lo - m : hi - m])
        if image is not None:  # (a match never ends inside an image: lo is its start)
            return EmbedImg(np.frombuffer(image, np.uint8), ids(range(lo, hi)), slots)
        return EmbedTxt(ids(self.admission.tokens[lo:hi]), ids(range(lo, hi)), slots)

    def _forward(self) -> Call | None:
        self._admitted()
        n, m, ps = len(self.admission.tokens), self.start, self.prefiller.page_size
        if m >= n:
            return None
        failed = self._failed_embed()  # an image embed refused in an earlier batch
        if failed is not None:
            raise CommandError(f"the prefill's image embed failed: {failed}")
        res = self.prefiller.resources
        k = n - m
        ins = res.translate(self.instance, "embed", self.embeds)
        outs = res.translate(self.instance, "embed", self.out_embeds)
        phys = self._phys()
        ctx = phys[: -(-m // ps)]
        out_pages = phys[m // ps : -(-n // ps)]
        return Forward(
            in_embeds=ids(ins),
            ctx_pages=ids(ctx),
            ctx_last_len=m - (len(ctx) - 1) * ps if ctx else 0,
            out_pages=ids(out_pages),
            out_offset=m % ps,
            out_embeds=ids(outs),
            out_indices=ids(range(k - len(outs), k)),
        )

    def _finish(self, _result) -> int:
        # An image refused in this batch (its embed resolved just before): the forward ran
        # on embeddings that are not the image's, so the prefill fails with the refusal.
        failed = self._failed_embed()
        if failed is not None:
            raise failed
        return self.reused

    def _failed_embed(self) -> BaseException | None:
        """The failure of the first of this prefill's embeds that failed (None: none)."""
        for c in self.commands:
            f = c.future
            if type(c.op) is _Embed and f.done() and not f.cancelled() and f.exception():
                return f.exception()
        return None

    def _forward_done(self, fut: asyncio.Future) -> None:
        pf = self.prefiller
        for c in self.commands:
            pf.after.pop(c, None)
        self._unpin()
        self._computed()
        if self.embeds and self.instance in pf.resources.instances():
            pf.resources.free(self.instance, "embed", self.embeds)
        self.embeds = []

    def dispatched(self, cmd: Command) -> None:
        """The batch holding ``cmd`` (the forward, or the admission when nothing is
        computed) is dispatched: the copy has been sent, the prompt pages are certified."""
        self._unpin()
        # A prompt with an image to embed enters the tree when its pages are released, not
        # now: the engine may yet refuse the image (its pages are then uncertified).
        if self.fresh_prompt and not self.images:
            ps = self.prefiller.page_size
            full = len(self.admission.tokens) // ps
            res = self.prefiller.resources
            handle = (self.pages + self.new)[full - 1] if full else None
            if handle is not None and self.instance in res.instances():
                page = res.translate(self.instance, "kv", [handle])[0]
                res.offer(self.instance, [page])
        self._computed()

    def _computed(self) -> None:
        pf = self.prefiller
        if self.computing is not None:
            if pf.computing.get(self.computing) is self:
                del pf.computing[self.computing]
                pf.scheduler.wake()  # prefills waiting for these pages may go now
            self.computing = None

    def _unpin(self) -> None:
        if self.pinned is not None:
            self.prefiller.cache.unlock(self.pinned)
            self.pinned = None


# The ops of a prefill's commands: each is its plan (and which of its KV calls), as data.


class _Admit(Op):
    """The admission (the first KV command): decides what comes from the cache."""

    __slots__ = ("plan",)

    def __init__(self, plan: PrefillPlan) -> None:
        self.plan = plan

    def prepare(self) -> Call | None:
        return self.plan._admit()


class _KvCall(Op):
    """The ``i``-th KV call decided at admission."""

    __slots__ = ("i", "plan")

    def __init__(self, plan: PrefillPlan, i: int) -> None:
        self.plan, self.i = plan, i

    def prepare(self) -> Call | None:
        return self.plan._kv_call(self.i)


class _Embed(Op):
    """The ``i``-th embed of a prefill (a run of text, or an image)."""

    __slots__ = ("i", "plan")

    def __init__(self, plan: PrefillPlan, i: int) -> None:
        self.plan, self.i = plan, i

    def prepare(self) -> Call | None:
        return self.plan._embed(self.i)


class _Forward(Op):
    __slots__ = ("plan",)

    def __init__(self, plan: PrefillPlan) -> None:
        self.plan = plan

    def prepare(self) -> Call | None:
        return self.plan._forward()

    def finish(self, result) -> int:
        return self.plan._finish(result)


def _segments(kv_len: int, n: int, images) -> list[tuple[int, int, bytes | None]]:
    """Positions ``kv_len..n`` as runs of text and images (``(first position,
    embeddings, bytes)``, in order), each ``(first, end, bytes or None)``."""
    out: list[tuple[int, int, bytes | None]] = []
    lo = kv_len
    for at, k, data in images:
        if at > lo:
            out.append((lo, at, None))
        out.append((at, at + k, data))
        lo = at + k
    if lo < n:
        out.append((lo, n, None))
    return out


def _retrieve(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()
