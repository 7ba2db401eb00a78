"""Attention over paged KV cache for a batch of independent forward items.

A batch flattens the new tokens of all items into one ``[N, ...]`` token dimension: every
projection and MLP runs once over all ``N`` tokens. Attention is per item: items with the
same number of new tokens form a *group* whose contexts are gathered from the page pool into
a padded ``[G, L, kv_heads, head_dim]`` tensor and concatenated with the group's new K/V;
one ``scaled_dot_product_attention`` call serves the group, with a boolean mask that encodes
context length, padding, masked KV slots, causality among the new tokens, the item's own
mask and the sliding window. Decode steps (one token per item) are therefore a single
group, whatever their context lengths; a prefill is a group of its own.

Metadata is built once per forward (it is the same for every layer) and travels to the
attention layers in a scoped forward context, not through every ``forward`` signature.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

DECODE_PAD = 32


@dataclass(slots=True)
class ItemPlan:
    """One validated forward item, in flat token and pool-slot coordinates."""

    row0: int  # first row of this item's tokens in the batch
    n: int  # new tokens
    ctx_slots: np.ndarray  # [ctx_len] flat KV slots of the context, in order
    positions: np.ndarray  # [n]
    mask: np.ndarray | None  # [n, ctx_len + n] bool, True = may attend
    out_slots: np.ndarray | None  # [n] where the new K/V are stored, or None


@dataclass(slots=True)
class AttnGroup:
    rows: torch.Tensor | None  # [G, n] query rows; None: the only group, rows 0..N-1 in order
    size: int  # G
    n: int
    # Gather indices into a cache viewed as [Hkv * slots, D] (see head_index):
    ctx_slots: torch.Tensor | None  # [Hkv, G, L] context slots (padding points at slot 0)
    kv_slots: torch.Tensor | None  # [Hkv, G, L + n] context then new slots, when all are stored
    mask: torch.Tensor | None  # [G, 1, n, L + n] bool
    causal: bool  # no context and no mask: plain causal attention
    bias: torch.Tensor | None = None  # additive mask for the decode path, built on first use


@dataclass(slots=True)
class AttnMetadata:
    groups: list[AttnGroup]
    store_rows: torch.Tensor | None  # rows whose K/V are written; None = all rows
    store_slots: torch.Tensor | None  # [Hkv, S] where they go (head_index); None = nothing
    # Called with the layer index after each decoder layer (its K/V are stored): the seam
    # for sending K/V to another engine while later layers compute (engine/transfer.py).
    on_layer: Callable[[int], None] | None = None


class _Local(threading.local):
    # Per thread: engines running in one process (tests, in-process servers) each forward
    # on their own worker thread.
    meta: AttnMetadata | None = None


_local = _Local()


def head_index(slots: torch.Tensor, num_heads: int, num_slots: int) -> torch.Tensor:
    """Indices into a head-major cache viewed as ``[heads * num_slots, D]``: shape
    ``[heads, *slots.shape]``. Gathering along the first dim of a 2-D view is the fastest
    ``index_select`` (2x faster than along dim 1 of the 3-D cache); built once per forward."""
    offsets = torch.arange(num_heads, device=slots.device) * num_slots
    return offsets.view(-1, *([1] * slots.dim())) + slots.unsqueeze(0)


def gather(cache: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``cache [H, slots, D]`` at ``head_index`` positions -> ``[*index.shape, D]``."""
    d = cache.shape[-1]
    return cache.view(-1, d).index_select(0, index.reshape(-1)).view(*index.shape, d)


def take(t: torch.Tensor, index: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """``t`` indexed along ``dim`` by an integer tensor of any shape (``index_select``, which
    on CPU is 3-7x faster than advanced indexing for these gathers)."""
    out = t.index_select(dim, index.reshape(-1))
    return out.view(*t.shape[:dim], *index.shape, *t.shape[dim + 1 :])


@contextmanager
def forward_context(meta: AttnMetadata) -> Iterator[None]:
    _local.meta = meta
    try:
        yield
    finally:
        _local.meta = None


def layer_done(layer: int) -> None:
    """The model ran decoder layer ``layer``: run the forward context's per-layer hook."""
    meta = _local.meta
    if meta is not None and meta.on_layer is not None:
        meta.on_layer(layer)


def current_metadata() -> AttnMetadata:
    meta = _local.meta
    assert meta is not None, "attention called outside forward_context()"
    return meta


def build_metadata(
    items: list[ItemPlan],
    store_rows: np.ndarray,
    store_slots: np.ndarray,
    num_tokens: int,
    attendable: torch.Tensor,
    kv_positions: torch.Tensor,
    sliding_window: int | None,
    num_kv_heads: int,
) -> AttnMetadata:
    """Group items by length and build per-group gather indices and masks (on device)."""
    device = attendable.device
    by_n: dict[int, list[ItemPlan]] = {}
    for it in items:
        by_n.setdefault(it.n, []).append(it)
    groups = []
    for n, members in by_n.items():
        groups.append(
            _build_group(members, n, attendable, kv_positions, sliding_window, num_kv_heads, device)
        )
    if len(groups) == 1 and groups[0].size * groups[0].n == num_tokens:
        groups[0].rows = None  # items were concatenated in order: no gather/scatter needed
    if len(store_slots) == 0:
        rows_t = slots_t = None
    else:
        heads = np.arange(num_kv_heads, dtype=np.int64).reshape(-1, 1) * len(attendable)
        slots_t = torch.from_numpy(heads + store_slots).to(device)  # head_index, in numpy
        rows_t = None if len(store_rows) == num_tokens else torch.from_numpy(store_rows).to(device)
    return AttnMetadata(groups=groups, store_rows=rows_t, store_slots=slots_t)


def _build_group(
    members: list[ItemPlan],
    n: int,
    attendable: torch.Tensor,
    kv_positions: torch.Tensor,
    window: int | None,
    num_kv_heads: int,
    device: torch.device,
) -> AttnGroup:
    g = len(members)
    rows = np.empty((g, n), dtype=np.int64)
    for i, it in enumerate(members):
        rows[i] = np.arange(it.row0, it.row0 + n)
    rows_t = torch.from_numpy(rows).to(device)
    lens = [len(it.ctx_slots) for it in members]
    ctx_len = max(lens)
    has_user_mask = any(it.mask is not None for it in members)
    if ctx_len == 0 and not has_user_mask and (window is None or n <= window):
        return AttnGroup(rows_t, g, n, None, None, None, causal=True)
    if n == 1 and device.type == "cpu":
        # oneDNN builds a kernel per matrix shape (~1 ms each): pad decode lengths to a
        # multiple of DECODE_PAD so the shape changes every DECODE_PAD steps, not every step.
        ctx_len = -(-(ctx_len + 1) // DECODE_PAD) * DECODE_PAD - 1
        return _decode_group_cpu(
            members, lens, ctx_len, rows_t, attendable, kv_positions, window, num_kv_heads
        )

    slots = np.zeros((g, ctx_len), dtype=np.int64)
    allow = np.zeros((g, n, ctx_len + n), dtype=np.bool_)
    causal = np.tri(n, dtype=np.bool_)
    for i, it in enumerate(members):
        c = lens[i]
        slots[i, :c] = it.ctx_slots
        if it.mask is None:
            allow[i, :, :c] = True
            allow[i, :, ctx_len:] = causal
        else:
            allow[i, :, :c] = it.mask[:, :c]
            allow[i, :, ctx_len:] = it.mask[:, c:]
    slots_t = torch.from_numpy(slots).to(device) if ctx_len else None
    mask = torch.from_numpy(allow).to(device)
    if ctx_len:
        mask[:, :, :ctx_len] &= take(attendable, slots_t).unsqueeze(1)
    if window is not None:
        qpos = torch.from_numpy(np.stack([it.positions for it in members])).to(device)
        kpos = torch.cat([take(kv_positions, slots_t), qpos], dim=1) if ctx_len else qpos
        mask &= kpos.unsqueeze(1) > (qpos.unsqueeze(2) - window)
    kv_slots_t = None
    if all(it.out_slots is not None for it in members):
        kv = np.concatenate((slots, np.stack([it.out_slots for it in members])), axis=1)
        kv_slots_t = head_index(torch.from_numpy(kv).to(device), num_kv_heads, len(attendable))
    ctx_index = head_index(slots_t, num_kv_heads, len(attendable)) if ctx_len else None
    return AttnGroup(rows_t, g, n, ctx_index, kv_slots_t, mask.unsqueeze(1), causal=False)


def _decode_group_cpu(
    members: list[ItemPlan],
    lens: list[int],
    ctx_len: int,
    rows_t: torch.Tensor,
    attendable: torch.Tensor,
    kv_positions: torch.Tensor,
    window: int | None,
    num_kv_heads: int,
) -> AttnGroup:
    """:func:`_build_group` for one-token items on the CPU, where the pool's attendable bits
    and positions are readable as numpy arrays: the same group, its indices and mask built
    in numpy with one tensor per result instead of some twenty small tensor operations
    (the decode step at batch 1 is ~10 ms; the general build took ~0.2 ms of it)."""
    g, num_slots = len(members), len(attendable)
    # column ctx_len is each item's own new token; the context is left-aligned, then padding
    slots = np.zeros((g, ctx_len + 1), dtype=np.int64)
    allow = np.zeros((g, ctx_len + 1), dtype=np.bool_)
    stored = all(it.out_slots is not None for it in members)
    for i, it in enumerate(members):
        c = lens[i]
        slots[i, :c] = it.ctx_slots
        if stored:
            slots[i, ctx_len] = it.out_slots[0]
        if it.mask is None:
            allow[i, :c] = True
            allow[i, ctx_len] = True
        else:
            allow[i, :c] = it.mask[0, :c]
            allow[i, ctx_len] = it.mask[0, c]
    allow[:, :ctx_len] &= attendable.numpy()[slots[:, :ctx_len]]
    if window is not None:
        qpos = np.array([it.positions[0] for it in members], dtype=np.int64)
        kpos = kv_positions.numpy()[slots]
        kpos[:, ctx_len] = qpos
        allow &= kpos > (qpos[:, None] - window)
    heads = (np.arange(num_kv_heads, dtype=np.int64) * num_slots).reshape(-1, 1, 1)
    kv_slots_t = torch.from_numpy(heads + slots) if stored else None
    ctx_index = torch.from_numpy(heads + slots[:, :ctx_len])
    mask = torch.from_numpy(allow).view(g, 1, 1, ctx_len + 1)
    return AttnGroup(rows_t, g, 1, ctx_index, kv_slots_t, mask, causal=False)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of ``q [N, Hq, D]`` over each item's context plus its new ``k, v [N, Hkv, D]``.

    The caches are head-major, ``[Hkv, slots, D]``, so that gathering a group's tokens
    yields ``[Hkv, G, L, D]``: contiguous matrices per (head, item), ready for batched
    matrix products without a transposing copy.

    The new K/V are written to the pool first; groups whose tokens are all stored then read
    context and new tokens in one gather. Items of one batch must not write slots that
    another item of the same batch reads (the control layer never batches such calls).
    Returns ``[N, Hq, D]``.
    """
    meta = current_metadata()
    if meta.store_slots is not None:
        _store(meta, k, v, k_cache, v_cache)
    out = None
    for grp in meta.groups:
        qg = q.view(grp.size, grp.n, *q.shape[1:]) if grp.rows is None else take(q, grp.rows)
        kg, vg = _group_kv(grp, k, v, k_cache, v_cache, q.dtype)
        if grp.n == 1 and q.device.type == "cpu":
            if grp.bias is None:
                grp.bias = _decode_bias(grp.mask, kg.shape[0], kg.shape[2], q.dtype)
            og = _decode_attention(qg, kg, vg, grp.bias, scale)
        else:
            og = F.scaled_dot_product_attention(
                qg.transpose(1, 2),
                kg.transpose(0, 1),
                vg.transpose(0, 1),
                attn_mask=grp.mask,
                is_causal=grp.causal,
                scale=scale,
                enable_gqa=True,
            ).transpose(1, 2)
        if grp.rows is None:
            out = og.reshape(q.shape)
        else:
            if out is None:
                out = torch.empty_like(q)
            out.index_copy_(0, grp.rows.view(-1), og.reshape(-1, *og.shape[2:]))
    return out


def _store(meta: AttnMetadata, k, v, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Write the new ``k, v [N, Hkv, D]`` rows ``meta.store_rows`` (all when None) to the
    pool's slots ``meta.store_slots``, in the pool's dtype."""
    ks = k if meta.store_rows is None else take(k, meta.store_rows)
    vs = v if meta.store_rows is None else take(v, meta.store_rows)
    d, kvd = k_cache.shape[-1], k_cache.dtype
    idx = meta.store_slots.view(-1)
    k_cache.view(-1, d).index_copy_(0, idx, ks.transpose(0, 1).reshape(-1, d).to(kvd))
    v_cache.view(-1, d).index_copy_(0, idx, vs.transpose(0, 1).reshape(-1, d).to(kvd))


def _group_kv(grp: AttnGroup, k, v, k_cache, v_cache, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A group's keys and values ``[Hkv, G, L, D]`` in ``dtype``: gathered from the pool
    when all its tokens are stored, else its context's (if any) followed by its new ones."""
    if grp.kv_slots is not None:
        return tuple(gather(c, grp.kv_slots).to(dtype) for c in (k_cache, v_cache))  # widened
    if grp.rows is None:
        kg, vg = (t.view(grp.size, grp.n, *t.shape[1:]) for t in (k, v))
    else:
        kg, vg = take(k, grp.rows), take(v, grp.rows)
    kg, vg = kg.permute(2, 0, 1, 3), vg.permute(2, 0, 1, 3)
    if grp.ctx_slots is not None:
        kg = torch.cat((gather(k_cache, grp.ctx_slots).to(kg.dtype), kg), dim=2)
        vg = torch.cat((gather(v_cache, grp.ctx_slots).to(vg.dtype), vg), dim=2)
    return kg, vg


def _decode_bias(mask: torch.Tensor | None, hkv: int, length: int, dtype) -> torch.Tensor:
    """``[Hkv * G, 1, L]`` additive mask (0 or -inf) from a ``[G, 1, 1, L]`` boolean one."""
    if mask is None:
        return torch.zeros(1, 1, length, dtype=dtype, device="cpu")
    bias = torch.zeros(mask.shape[0], length, dtype=dtype).masked_fill_(
        ~mask.view(-1, length), float("-inf")
    )
    return bias.expand(hkv, -1, -1).reshape(-1, 1, length)


def _decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float
) -> torch.Tensor:
    """One query per item: ``q [G, 1, Hq, D]``, ``k/v [Hkv, G, L, D]`` -> ``[G, 1, Hq, D]``.

    Batched matrix products over (head, item), with scale and mask fused into the first
    (``baddbmm``); scores are in the model dtype, as in HF's eager attention, and the softmax
    in float32. On CPU this is several times faster than ``scaled_dot_product_attention``
    for single-token queries.
    """
    hkv, g, length, d = k.shape
    hq = q.shape[2]
    rep = hq // hkv
    qq = q.view(g, hkv, rep, d).transpose(0, 1).reshape(hkv * g, rep, d)
    # k/v are contiguous when gathered from the pool, permuted views when the group's new
    # tokens are not stored (reshape copies only then).
    scores = torch.baddbmm(bias, qq, k.reshape(hkv * g, length, d).transpose(1, 2), alpha=scale)
    probs = scores.softmax(dim=-1, dtype=torch.float32).to(v.dtype)
    out = torch.bmm(probs, v.reshape(hkv * g, length, d)).view(hkv, g, rep, d)
    return out.transpose(0, 1).reshape(g, 1, hq, d)
