"""Handlers of the requests that allocate: KV pages, embedding slots, exports."""

from __future__ import annotations

import asyncio

import numpy as np

from pastry import api
from pastry.api import ApiError
from pastry.control.commands import Stage
from pastry.control.handlers.caller import Caller, resource_call
from pastry.control.handlers.registry import handles
from pastry.control.ops import CopyPage, Export, Free, MaskPage
from pastry.control.resources import Kind


def _consume(fut: asyncio.Future) -> None:
    """Retrieve a fire-and-forget command's outcome (failures surface on later calls)."""
    if not fut.cancelled():
        fut.exception()


@handles(api.GetKvPageSize)
def get_kv_page_size(s: Caller, r: api.GetKvPageSize) -> int:
    return s.queue(r.q).model.info.page_size


def _alloc(s: Caller, q: int, kind: Kind, n: object) -> list[int]:
    ref = s.queue(q)
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ApiError(f"allocation size must be a non-negative integer, got {n!r}")
    return resource_call(ref.model.resources.alloc, s.instance, kind, n)


@handles(api.AllocKvpages)
def alloc_kvpages(s: Caller, r: api.AllocKvpages) -> list[int]:
    """New pages, every slot not attendable until this inferlet writes it: a page may
    hold another inferlet's stale K/V, which must never be visible."""
    pages = _alloc(s, r.q, "kv", r.n)
    if pages:
        ref = s.queue(r.q)
        res = ref.model.resources
        hidden = np.ones(ref.model.info.page_size, dtype=np.bool_)
        for h in pages:  # translated when run: the page may move (swap) meanwhile
            op = MaskPage(res, s.instance, h, hidden, claims=False)
            s.submit(ref, Stage.KV, op).add_done_callback(_consume)
    return pages


@handles(api.AllocEmbeds)
def alloc_embeds(s: Caller, r: api.AllocEmbeds) -> list[int]:
    return _alloc(s, r.q, "embed", r.n)


def _dealloc(s: Caller, q: int, kind: Kind, handles: list[int]) -> asyncio.Future:
    ref = s.queue(q)
    handles = list(handles)
    res = ref.model.resources
    resource_call(res.check, s.instance, kind, handles)  # fail fast
    return s.submit(ref, Stage.CONTROL, Free(res, s.instance, kind, handles))


@handles(api.DeallocKvpages)
def dealloc_kvpages(s: Caller, r: api.DeallocKvpages) -> asyncio.Future:
    return _dealloc(s, r.q, "kv", r.pages)


@handles(api.DeallocEmbeds)
def dealloc_embeds(s: Caller, r: api.DeallocEmbeds) -> asyncio.Future:
    return _dealloc(s, r.q, "embed", r.embeds)


@handles(api.CopyKvpage)
def copy_kvpage(s: Caller, r: api.CopyKvpage) -> asyncio.Future:
    ref = s.queue(r.q)
    try:
        args = (int(r.src), int(r.dst), int(r.src_offset), int(r.dst_offset), int(r.size))
    except (TypeError, ValueError):
        raise ApiError("copy_kvpage takes integer pages, offsets and size") from None
    op = CopyPage(ref.model.resources, s.instance, *args)
    return s.submit(ref, Stage.KV, op)


@handles(api.ExportKvpages)
def export_kvpages(s: Caller, r: api.ExportKvpages) -> asyncio.Future:
    """Publish pages under ``name`` once the commands queued before have run."""
    ref = s.queue(r.q)
    res = ref.model.resources
    pages = list(r.pages)
    resource_call(res.translate, s.instance, "kv", pages)
    _, name = s.scoped(r.name, write=True)
    op = Export(res, s.instance, pages, name, bool(r.persistent))
    return s.submit(ref, Stage.CONTROL, op)


@handles(api.ImportKvpages)
def import_kvpages(s: Caller, r: api.ImportKvpages) -> list[int]:
    ref = s.queue(r.q)
    owner, name = s.scoped(r.name, write=False)
    return resource_call(ref.model.resources.import_, s.instance, "kv", name, owner)


@handles(api.UnexportKvpages)
def unexport_kvpages(s: Caller, r: api.UnexportKvpages) -> None:
    ref = s.queue(r.q)
    _, name = s.scoped(r.name, write=True)
    resource_call(ref.model.resources.unexport, s.instance, name)
    ref.model.scheduler.wake()  # prefills may wait for its pages


@handles(api.ListExportedKvpages)
def list_exported_kvpages(s: Caller, r: api.ListExportedKvpages) -> list[tuple[str, int]]:
    """This user's KV exports (another user's are imported by name, ``~OWNER/NAME``)."""
    res = s.queue(r.q).model.resources
    return [(name, n) for name, kind, n in res.list_exports(s.user) if kind == "kv"]
