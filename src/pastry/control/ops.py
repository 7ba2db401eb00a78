"""The ops of the queued API calls: what each command does, as data.

A request handler (:mod:`pastry.control.handlers`) checks a request once, snapshots its
handles and queues one of these (:class:`~pastry.control.commands.Op`). When the batch
scheduler takes the command into a batch, ``prepare`` translates the instance's handles
to physical ids (they may have moved since: swapped out and back) and returns the engine
call; control ops act there instead (freeing, exporting) and return None. The decode hot
path's ops, prepared a batch at a time, are in :mod:`pastry.control.steps`.
"""

from __future__ import annotations

import numpy as np

from pastry.api import ApiError
from pastry.control.commands import Op
from pastry.control.resources import Kind, ResourceError, ResourceManager
from pastry.control.sampling import SampleSpec
from pastry.control.steps import claim, sample_call
from pastry.wire.calls import (
    CopyKv,
    Dist,
    EmbedImg,
    Forward,
    Logprobs,
    MaskKv,
    NextDist,
    Sample,
    ids,
)


def translate(res: ResourceManager, instance: int, kind: Kind, handles) -> list[int]:
    """Physical ids of ``instance``'s ``handles``; the error its caller sees if one is
    not (any more) the instance's."""
    try:
        return res.translate(instance, kind, handles)
    except ResourceError as e:
        raise ApiError(str(e)) from None


def claim_pages(res: ResourceManager, instance: int, pages: list[int]) -> None:
    """``instance`` is about to write physical ``pages`` (see ``claim_writes``)."""
    if res.cache is not None:  # every forward passes here
        claim(res, instance, pages)


class Sync(Op):
    """``synchronize``: nothing to do; it resolves once the commands before it have."""

    __slots__ = ()

    def prepare(self) -> None:
        return None


SYNC = Sync()


class Free(Op):
    """``dealloc_*``: drop the handles once the commands queued before have run."""

    __slots__ = ("handles", "instance", "kind", "res")

    def __init__(self, res: ResourceManager, instance: int, kind: Kind, handles: list[int]):
        self.res, self.instance, self.kind, self.handles = res, instance, kind, handles

    def prepare(self) -> None:
        self.res.free(self.instance, self.kind, self.handles)


class Export(Op):
    """``export_kvpages``: publish the pages once the commands queued before have run."""

    __slots__ = ("instance", "name", "pages", "persistent", "res")

    def __init__(self, res, instance: int, pages: list[int], name: str, persistent: bool):
        self.res, self.instance, self.pages = res, instance, pages
        self.name, self.persistent = name, persistent

    def prepare(self) -> None:
        self.res.export(self.instance, "kv", self.pages, self.name, self.persistent)


class CopyPage(Op):
    """``copy_kvpage``: ``size`` slots of K/V from page ``src`` to page ``dst``."""

    __slots__ = ("dst", "dst_offset", "instance", "res", "size", "src", "src_offset")

    def __init__(self, res, instance, src, dst, src_offset, dst_offset, size) -> None:
        self.res, self.instance = res, instance
        self.src, self.dst = src, dst
        self.src_offset, self.dst_offset, self.size = src_offset, dst_offset, size

    def prepare(self) -> CopyKv:
        s, d = translate(self.res, self.instance, "kv", [self.src, self.dst])
        claim_pages(self.res, self.instance, [d])
        return CopyKv(s, d, self.src_offset, self.dst_offset, self.size)


class MaskPage(Op):
    """``mask_kvpage`` (and a new page's hiding): set the page's masked slots."""

    __slots__ = ("claims", "instance", "masked", "page", "res")

    def __init__(self, res, instance: int, page: int, masked: np.ndarray, claims: bool = True):
        self.res, self.instance, self.page, self.masked = res, instance, page, masked
        self.claims = claims  # False: a fresh page of the instance's own (nothing to claim)

    def prepare(self) -> MaskKv:
        (phys,) = translate(self.res, self.instance, "kv", [self.page])
        if self.claims:
            claim_pages(self.res, self.instance, [phys])
        return MaskKv(phys, self.masked)


class ImageOp(Op):
    """``embed_img``: an image's encoded bytes into the embedding slots ``embeds``
    (snapshotted at submission) at positions ``position, position + 1, ...``."""

    __slots__ = ("embeds", "image", "instance", "position", "res")

    def __init__(self, res, instance: int, image: bytes, position: int, embeds: list[int]):
        self.res, self.instance, self.image = res, instance, image
        self.position, self.embeds = position, embeds

    def prepare(self) -> EmbedImg:
        phys = translate(self.res, self.instance, "embed", self.embeds)
        n = len(self.embeds)
        data = np.frombuffer(self.image, dtype=np.uint8)
        return EmbedImg(data, ids(range(self.position, self.position + n)), ids(phys))


class ForwardOp(Op):
    """``forward``: the model over the inputs on top of the context (see
    :class:`pastry.api.Forward`), handles snapshotted at submission."""

    __slots__ = (
        "adapter", "in_embeds", "in_kv", "instance", "last_len", "mask", "offset",
        "out_embeds", "out_kv", "res", "targets", "top",
    )  # fmt: skip

    def __init__(
        self, res, instance, in_kv, last_len, in_embeds, out_kv, offset, out_embeds,
        mask, adapter, targets, top,
    ) -> None:  # fmt: skip
        self.res, self.instance = res, instance
        self.in_kv, self.last_len, self.in_embeds = in_kv, last_len, in_embeds
        self.out_kv, self.offset, self.out_embeds = out_kv, offset, out_embeds
        self.mask, self.adapter, self.targets, self.top = mask, adapter, targets, top

    def prepare(self) -> Forward:
        res, inst = self.res, self.instance
        out_pages = translate(res, inst, "kv", self.out_kv)
        claim_pages(res, inst, out_pages)
        n, m = len(self.in_embeds), len(self.out_embeds)
        return Forward(
            in_embeds=ids(translate(res, inst, "embed", self.in_embeds)),
            ctx_pages=ids(translate(res, inst, "kv", self.in_kv)),
            ctx_last_len=self.last_len,
            out_pages=ids(out_pages),
            out_offset=self.offset,
            out_embeds=ids(translate(res, inst, "embed", self.out_embeds)),
            out_indices=ids(range(n - m, n)),
            mask=self.mask,
            adapter=self.adapter,
            logprob_targets=self.targets,
            logprob_top=self.top,
        )


class ScoringForward(ForwardOp):
    """A ``forward`` with ``logprob_targets``: resolves to the prompt log-probabilities."""

    __slots__ = ()

    def finish(self, r: Logprobs) -> tuple[list[float], list[list[int]], list[list[float]]]:
        return r.logprobs.tolist(), r.top_ids.tolist(), r.top_logprobs.tolist()


class NextDistOp(Op):
    """``get_next_dist``: the top-``k`` distribution at an embedding slot."""

    __slots__ = ("embed", "instance", "k", "res", "spec")

    def __init__(self, res, instance: int, embed: int, k: int, spec: SampleSpec | None):
        self.res, self.instance, self.embed, self.k, self.spec = res, instance, embed, k, spec

    def prepare(self) -> NextDist:
        (phys,) = translate(self.res, self.instance, "embed", [self.embed])
        return NextDist(phys, self.k, **(self.spec.proc if self.spec is not None else {}))

    def finish(self, d: Dist) -> tuple[list[int], list[float]]:
        return d.ids.tolist(), d.probs.tolist()


class SampleOp(Op):
    """``sample``: a token from an embedding slot, on the device."""

    __slots__ = ("embed", "instance", "res", "spec")

    def __init__(self, res, instance: int, embed: int, spec: SampleSpec | None) -> None:
        self.res, self.instance, self.embed, self.spec = res, instance, embed, spec

    def prepare(self) -> Sample:
        (phys,) = translate(self.res, self.instance, "embed", [self.embed])
        return sample_call(phys, self.spec)


class SampledOp(SampleOp):
    """A ``sample`` whose value is more than the token (log-probabilities) or that
    advances a grammar."""

    __slots__ = ()

    def finish(self, r):
        return self.spec.finish(r)
