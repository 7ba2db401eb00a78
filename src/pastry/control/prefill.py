"""The cache-aware prefill: how text gets into KV pages through the prefix cache.

``prefill(q, tokens, kv_len, pages, out_embeds)`` (:mod:`pastry.api`) asks for the
K/V of ``tokens`` at positions ``0..`` in a context whose ``pages`` hold the first
``kv_len`` of them. It returns the handles of the pages the rest needs at once and queues
the work; the prefix cache is consulted when the work is *admitted* (taken into a batch),
not when it is asked for, so that the freshest tree decides and a scheduling policy can
order the waiting prefills (:mod:`pastry.control.policies.admission`). At admission
(SGLang's Algorithm 1, adapted to explicit pages):

1. **Match** the longest cached prefix that can be used (in the tree of the instance's
   user: users never share cached K/V, see ``docs/security.md``): pages of the context's own are
   never replaced, so reuse starts at the context's page boundary (a fresh context, or one
   whose pages are all full), and the last ``len(out_embeds)`` tokens are always computed
   (their outputs are asked for).
2. **Share** the full matched pages by reference (the new handles borrow them: their tree
   nodes stay in use, which pins the prefix) and **copy** the matched slots of a partial
   last page into a fresh page, so nobody writes a shared page. (When that page is also the
   last page the prefill writes, its matched slots are computed again instead: a copy and
   a mask of one page would take two engine batches.)
3. **Admit** against free + evictable pages: the fresh pages are allocated (evicting
   least-recently-used cached pages first), and embedding slots for the tokens to compute
   (the prefill's own: taken here, given back when its forward has run). When they cannot
   be had, programs that rank after this one are swapped to host memory first (when the
   engine has swap space, :mod:`pastry.control.swap`); if that is not enough and other work
   is running, the prefill is *not admitted* and waits at the head of its queue; when
   nothing else runs, the allocation goes ahead and the eviction policy may end inferlets
   (or the prefill fails with the reason).
4. **Compute** the rest: the stale tail of the last fresh page is masked, the remaining
   tokens are embedded and forwarded on top of the shared prefix, in one batch.
5. **Insert** early: the full pages of a fresh context's prompt enter the tree as soon as
   its batch is dispatched (they are certified then; see
   :mod:`pastry.control.provenance`), so prefills admitted in later batches reuse them.
   The rest (a partial last page, generated tokens) is inserted when the pages are
   released (:meth:`~pastry.control.resources.ResourceManager.free`).

The returned awaitable resolves, once the forward has run, to the number of tokens taken
from the cache. Without a prefix cache the same call simply computes everything.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from pastry.control.prefix_cache import Match, PrefixCache, RadixNode
from pastry.control.provenance import KvProvenance
from pastry.control.resources import ResourceError, ResourceManager
from pastry.control.scheduler import (
    BatchScheduler,
    Command,
    CommandError,
    NotAdmitted,
    Op,
    Queue,
    Stage,
)
from pastry.engine.calls import Call, CallError, CopyKv, EmbedTxt, Forward, MaskKv, ids


@dataclass(eq=False)
class Admission:
    """A prefill waiting to be admitted, as ordering policies see it (read only for them,
    but ``seen`` and ``starved``, which the scheduling policy keeps)."""

    tokens: tuple[int, ...]  # the whole sequence: the context's tokens, then the new ones
    kv_len: int  # tokens already in the context's pages
    arrived: float  # time.perf_counter() when it was asked for
    prefiller: Prefiller
    reusable_from: int  # the first position the cache may supply (-1: none)
    limit: int  # the last position + 1 the cache may supply
    namespace: object = None  # whose cache it may match (its user's: docs/security.md)
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
        return max(0, self.match().length - self.reusable_from)


@dataclass
class PrefillStats:
    """Counters of one model's prefills (tokens asked for, taken from the cache)."""

    prefills: int = 0
    tokens: int = 0  # new tokens asked for
    cached_tokens: int = 0  # of which taken from the cache
    deferred: int = 0  # admissions put off for want of KV pages
    waited_for_prefix: int = 0  # ... because another prefill was computing their prefix
    seconds: float = 0.0  # spent in cache bookkeeping here (matching, provenance)

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.tokens if self.tokens else 0.0


class Prefiller:
    """Runs the cache-aware prefills of one model (see the module docstring).

    ``cache`` and ``provenance`` are ``None`` when the prefix cache is off; prefills then
    compute everything. :meth:`on_dispatch` and :meth:`on_complete` must be the
    scheduler's hooks of those names when the cache is on.
    """

    def __init__(
        self,
        resources: ResourceManager,
        scheduler: BatchScheduler,
        page_size: int,
        cache: PrefixCache | None = None,
        provenance: KvProvenance | None = None,
    ) -> None:
        self.resources = resources
        self.scheduler = scheduler
        self.page_size = page_size
        self.cache = cache
        self.provenance = provenance
        self.stats = PrefillStats()
        self._after: dict[Command, _Plan] = {}  # commands whose dispatch the plan awaits
        self._hold: Admission | None = None  # a starved admission saving up pages
        # (namespace, page index, the next wait_for tokens) -> the admitted prefill
        # computing them
        self._computing: dict[tuple, _Plan] = {}
        self.wait_for = max(32, 2 * page_size)

    # ------------------------------------------------------------------ submit

    def submit(
        self,
        instance: int,
        queue: Queue,
        tokens: Sequence[int],
        kv_len: int,
        pages: Sequence[int],
        out_embeds: Sequence[int],
        reserve: int = 0,
    ) -> tuple[list[int], asyncio.Future]:
        """Queue a prefill on ``queue`` for ``instance``; arguments as
        :meth:`pastry.api.InferletApi.prefill`.
        Returns the new page handles and the future of the number of cached tokens.
        Raises ``ValueError`` (bad arguments) or a :class:`~pastry.control.resources
        .ResourceError` (handles)."""
        ps = self.page_size
        tokens = tuple(int(t) for t in tokens)
        n = len(tokens)
        if not 0 <= kv_len < n:
            raise ValueError(
                f"prefill needs 0 <= kv_len < len(tokens): {kv_len} tokens are in the "
                f"pages and {n} given, so nothing is new"
            )
        new = n - kv_len
        if len(out_embeds) > new:
            raise ValueError(f"{len(out_embeds)} output embeds for {new} new tokens")
        if len(pages) * ps < kv_len:
            raise ValueError(
                f"{len(pages)} pages of {ps} cannot hold the context's {kv_len} tokens"
            )
        res = self.resources
        res.translate(instance, "kv", list(pages))  # fail now on a bad handle
        res.translate(instance, "embed", list(out_embeds))
        handles = res.reserve(instance, "kv", max(0, -(-(n + reserve) // ps) - len(pages)))
        reusable = kv_len if kv_len == len(pages) * ps else -1
        admission = Admission(
            tokens, kv_len, time.perf_counter(), self, reusable, n - len(out_embeds),
            namespace=res.user_of(instance),
        )  # fmt: skip
        plan = _Plan(self, instance, admission, list(pages), handles, list(out_embeds))
        return handles, plan.submit(queue)

    # ------------------------------------------------------------------ dispatch

    def on_dispatch(self, calls: list[tuple[Command, Call]]) -> None:
        """The scheduler dispatches a batch, ``(command, engine call)`` pairs in the order
        the engine runs them (a fused command has several): update page provenance, then
        do what plans wait for (insert a prompt's pages, release the pin on a copied
        page)."""
        t0 = time.perf_counter()
        if self.provenance is not None:
            # it assumes they run: on_complete checks that they did
            self.provenance.observe([(c.queue, call) for c, call in calls])
        after = self._after
        if after:
            for c, _ in calls:
                plan = after.pop(c, None)
                if plan is not None:
                    plan.dispatched(c)
        self.stats.seconds += time.perf_counter() - t0

    def on_complete(self, calls: list[tuple[Command, Call]], results: list | None) -> None:
        """A batch's results are back (``None``: the engine failed, nothing is known to
        have run). A forward the engine refused wrote nothing: forget what its pages were
        certified to hold, and take any that the cache holds out of it."""
        if self.provenance is None:
            return
        t0 = time.perf_counter()
        for i, (_, call) in enumerate(calls):
            refused = results is None or type(results[i]) is CallError
            if refused and type(call) is Forward and len(call.out_pages):
                pages = call.out_pages.tolist()
                self.provenance.forget(pages)
                self.resources.uncache(pages)
        self.stats.seconds += time.perf_counter() - t0

    # ------------------------------------------------------------------ admission

    def admit(self, admission: Admission, need: int, slots: int, queue: Queue) -> None:
        """Raise :class:`NotAdmitted` if ``need`` fresh pages and ``slots`` embedding
        slots should wait (see step 3)."""
        res = self.resources
        hold = self._hold
        if hold is not None and (hold.admitted or not hold.starved):
            hold = self._hold = None
        busy = self.scheduler.busy(besides=queue)
        if hold is not None and hold is not admission and busy:
            self.stats.deferred += 1
            raise NotAdmitted
        if (need > res.available("kv") or slots > res.available("embed")) and busy:
            if admission.starved:
                self._hold = admission
            self.stats.deferred += 1
            raise NotAdmitted


@dataclass(eq=False)
class _Plan:
    """One prefill: its commands, and the decisions taken when it is admitted."""

    prefiller: Prefiller
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
    computing: tuple | None = None  # our key in Prefiller._computing while we compute it
    error: str = ""  # why admission failed

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
        embed = Command(Stage.EMBED, _Embed(self))
        fwd = Command(Stage.FORWARD, _Forward(self), tokens=self.admission.new_tokens)
        self.commands = [*kv, embed, fwd]
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
        pf, res, adm = self.prefiller, self.prefiller.resources, self.admission
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
        full = m // ps  # indices [first_new, full) come from the cache by reference
        partial = m % ps if m > kv_len else 0
        if partial and full == last and n % ps:
            m, partial = full * ps, 0  # copy + mask of one page: compute its slots instead
        shared = max(0, full - first_new) if m > kv_len else 0
        fresh_prompt = cache is not None and kv_len == 0
        key = None
        if fresh_prompt and n - full * ps >= pf.wait_for:
            # Another prefill admitted just now computes the same next tokens: wait for its
            # pages (inserted when its batch is dispatched) instead of computing them too.
            key = (adm.namespace, full, adm.tokens[full * ps : full * ps + pf.wait_for])
        pf.stats.seconds += time.perf_counter() - t0
        queue = self.commands[0].queue
        if key is not None and key in pf._computing and pf.scheduler.busy(besides=queue):
            pf.stats.waited_for_prefix += 1
            raise NotAdmitted
        need = len(self.new) - shared
        swapper = pf.scheduler.swapper
        if swapper is not None and need > res.available("kv"):
            # programs ranked after this one move to host memory first (control/swap.py)
            swapper.make_room(self.instance, need - res.available("kv"))
        pf.admit(adm, need, n - m, queue)  # cheap first (pinning the prefix lowers supply)
        # Pin the prefix (the shared pages, and the node of a page to copy from): it is not
        # evictable any more, so check memory again with the exact supply.
        pin = match.node if partial else None
        if match is not None and shared:
            res.bind_cached(self.instance, self.new[:shared], match.pages[first_new:full])
        if pin is not None:
            cache.lock(pin)

        def unpin() -> None:
            if pin is not None:
                cache.unlock(pin)
            if match is not None and shared:
                res.unbind(self.instance, "kv", self.new[:shared])

        try:
            pf.admit(adm, need, n - m, queue)
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
        adm.admitted = True
        if match is not None:
            cache.match(adm.tokens, adm.limit, namespace=adm.namespace)  # used now (LRU)
        self.start = m
        copy = mask = None
        if partial:  # (the cached source page is pinned: it never moves)
            copy = ("copy", full, (match.pages[full], partial))
            self.pinned = pin  # the source page must outlive the copy: unlocked at dispatch
        if n % ps and last >= first_new:
            mask = ("mask", last, np.arange(ps) >= n % ps)
        hidden = np.ones(ps, dtype=np.bool_)
        total = len(self.pages) + len(self.new)
        extra = [("mask", i, hidden) for i in range(max(last + 1, first_new), total)]
        self.calls = [copy, mask, *extra] if copy is not None else [mask, None, *extra]
        self.fresh_prompt = fresh_prompt
        fwd = self.commands[-1]
        fwd.tokens = n - m
        if key is not None and n > m:
            self.computing = key
            pf._computing.setdefault(key, self)
        if self.pinned is not None or self.fresh_prompt or self.computing:
            pf._after[fwd if n > m else self.commands[0]] = self
        pf.stats.prefills += 1
        pf.stats.tokens += n - kv_len
        pf.stats.cached_tokens += m - kv_len
        return self._kv_call(0)

    def _admit_done(self, fut: asyncio.Future) -> None:
        pf = self.prefiller
        if not self.admission.admitted:  # failed or cancelled before admission: the new
            # handles stay reserved (never filled) until the inferlet frees them or ends
            for c in self.commands:
                pf._after.pop(c, None)
            if pf._hold is self.admission:
                pf._hold = None

    # ------------------------------------------------------------------ computing

    def _embed(self) -> Call | None:
        self._admitted()
        n, m = len(self.admission.tokens), self.start
        if m >= n:
            return None
        slots = self.prefiller.resources.translate(self.instance, "embed", self.embeds)
        return EmbedTxt(ids(self.admission.tokens[m:]), ids(range(m, n)), ids(slots))

    def _forward(self) -> Call | None:
        self._admitted()
        n, m, ps = len(self.admission.tokens), self.start, self.prefiller.page_size
        if m >= n:
            return None
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
        return self.reused

    def _forward_done(self, fut: asyncio.Future) -> None:
        pf = self.prefiller
        for c in self.commands:
            pf._after.pop(c, None)
        self._unpin()
        self._computed()
        if self.embeds and self.instance in pf.resources.instances():
            pf.resources.free(self.instance, "embed", self.embeds)
        self.embeds = []

    def dispatched(self, cmd: Command) -> None:
        """The batch holding ``cmd`` (the forward, or the admission when nothing is
        computed) is dispatched: the copy has been sent, the prompt pages are certified."""
        self._unpin()
        if self.fresh_prompt:
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
            if pf._computing.get(self.computing) is self:
                del pf._computing[self.computing]
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

    def __init__(self, plan: _Plan) -> None:
        self.plan = plan

    def prepare(self) -> Call | None:
        return self.plan._admit()


class _KvCall(Op):
    """The ``i``-th KV call decided at admission."""

    __slots__ = ("i", "plan")

    def __init__(self, plan: _Plan, i: int) -> None:
        self.plan, self.i = plan, i

    def prepare(self) -> Call | None:
        return self.plan._kv_call(self.i)


class _Embed(Op):
    __slots__ = ("plan",)

    def __init__(self, plan: _Plan) -> None:
        self.plan = plan

    def prepare(self) -> Call | None:
        return self.plan._embed()


class _Forward(Op):
    __slots__ = ("plan",)

    def __init__(self, plan: _Plan) -> None:
        self.plan = plan

    def prepare(self) -> Call | None:
        return self.plan._forward()

    def finish(self, result) -> int:
        return self.plan._finish(result)


def _retrieve(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()


__all__ = ["Admission", "PrefillStats", "Prefiller"]
