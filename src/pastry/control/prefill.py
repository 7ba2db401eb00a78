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
   tokens are embedded (each image among them by ``embed_img``) and forwarded on top of
   the shared prefix, in one batch.
5. **Insert** early: the full pages of a fresh context's prompt enter the tree as soon as
   its batch is dispatched (they are certified then; see
   :mod:`pastry.control.provenance`), so prefills admitted in later batches reuse them
   (not a prompt with an image to embed: the engine may still refuse the image, so its
   pages wait for their release).
   The rest (a partial last page, generated tokens) is inserted when the pages are
   released (:meth:`~pastry.control.resources.ResourceManager.free`).

Images are matched like text: the keys of an image's positions come from its SHA-256
(:func:`pastry.wire.images.image_keys`, above every token id), KV provenance certifies an
``embed_img``'s slots with the same keys, so the pages of a prompt with an image enter the
tree like any others and the same image (in the same place, after the same text) is not
encoded again. A match never ends inside an image: the whole image is computed.

The returned awaitable resolves, once the forward has run, to the number of tokens taken
from the cache. Without a prefix cache the same call simply computes everything.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass

from pastry.control.commands import Command, NotAdmitted, Queue
from pastry.control.prefill_plan import Admission, PrefillPlan
from pastry.control.prefix_cache import PrefixCache
from pastry.control.provenance import KvProvenance
from pastry.control.resources import ResourceManager
from pastry.control.scheduler import BatchScheduler
from pastry.wire.calls import Call, CallError, EmbedImg, Forward


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
        self.after: dict[Command, PrefillPlan] = {}  # commands whose dispatch a plan awaits
        self.saving: Admission | None = None  # a starved admission saving up pages
        # (namespace, page index, the next wait_for tokens) -> the admitted prefill
        # computing them
        self.computing: dict[tuple, PrefillPlan] = {}
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
        images: Sequence[tuple[int, int, bytes]] = (),
    ) -> tuple[list[int], asyncio.Future]:
        """Queue a prefill on ``queue`` for ``instance``; arguments as
        :meth:`pastry.api.InferletApi.prefill`, but ``tokens`` are the cache's keys (an
        image's positions keyed by its digest, :func:`pastry.wire.images.image_keys`) and
        ``images`` are ``(first position, embeddings, encoded bytes)`` of the images to
        embed, in order, each at or after ``kv_len``.
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
            namespace=res.user_of(instance), image_spans=tuple((at, k) for at, k, _ in images),
        )  # fmt: skip
        plan = PrefillPlan(self, instance, admission, list(pages), handles, list(out_embeds))
        plan.images = list(images)
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
        after = self.after
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
        failed: set[int] = set()  # the slots of image embeds the engine refused
        for i, (_, call) in enumerate(calls):
            refused = results is None or type(results[i]) is CallError
            if refused and type(call) is EmbedImg:
                failed.update(call.out_embeds.tolist())
                self.provenance.forget_embeds(call.out_embeds)
        for i, (_, call) in enumerate(calls):
            if type(call) is not Forward or not len(call.out_pages):
                continue
            refused = results is None or type(results[i]) is CallError
            # a forward over a refused image's slots read stale embeddings: not the image
            if refused or (failed and not failed.isdisjoint(call.in_embeds.tolist())):
                pages = call.out_pages.tolist()
                self.provenance.forget(pages)
                self.resources.uncache(pages)
        self.stats.seconds += time.perf_counter() - t0

    # ------------------------------------------------------------------ admission

    def admit(self, admission: Admission, need: int, slots: int, queue: Queue) -> None:
        """Raise :class:`NotAdmitted` if ``need`` fresh pages and ``slots`` embedding
        slots should wait (see step 3)."""
        res = self.resources
        hold = self.saving
        if hold is not None and (hold.admitted or not hold.starved):
            hold = self.saving = None
        busy = self.scheduler.busy(besides=queue)
        if hold is not None and hold is not admission and busy:
            self.stats.deferred += 1
            raise NotAdmitted
        if (need > res.available("kv") or slots > res.available("embed")) and busy:
            if admission.starved:
                self.saving = admission
            self.stats.deferred += 1
            raise NotAdmitted


__all__ = ["Admission", "PrefillStats", "Prefiller"]
