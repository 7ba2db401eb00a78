"""Attention metadata of decode batches (one new token per item) on the CPU, checked exactly:
the indices and masks the eager model and the compiled decode step read."""

from __future__ import annotations

import numpy as np
import torch

from pastry.engine.attention import DECODE_PAD, ItemPlan, build_metadata

HKV, SLOTS = 2, 100


def pool(masked=(), positions=None):
    attendable = torch.ones(SLOTS, dtype=torch.bool)
    attendable[list(masked)] = False
    pos = torch.zeros(SLOTS, dtype=torch.int64)
    for slot, p in (positions or {}).items():
        pos[slot] = p
    return attendable, pos


def items(stored=True):
    a = ItemPlan(0, 1, np.array([4, 5, 6]), np.array([3]), None, np.array([7]) if stored else None)
    b_mask = np.array([[True, False, True]])
    b = ItemPlan(
        1, 1, np.array([20, 21]), np.array([2]), b_mask, np.array([22]) if stored else None
    )
    return [a, b]


def test_decode_group_indices_and_mask():
    attendable, pos = pool(masked=[5])
    meta = build_metadata(
        items(), np.array([0, 1]), np.array([7, 22]), 2, attendable, pos, None, HKV
    )
    (g,) = meta.groups
    length = DECODE_PAD - 1  # the longest context (3) padded to a multiple of DECODE_PAD, less 1
    assert (g.rows, g.size, g.n, g.causal) == (None, 2, 1, False)
    slots = np.zeros((2, length + 1), dtype=np.int64)
    slots[0, :3], slots[0, length] = [4, 5, 6], 7
    slots[1, :2], slots[1, length] = [20, 21], 22
    heads = np.array([0, SLOTS]).reshape(2, 1, 1)
    assert np.array_equal(g.kv_slots.numpy(), heads + slots)
    assert np.array_equal(g.ctx_slots.numpy(), heads + slots[:, :length])
    allow = np.zeros((2, length + 1), dtype=bool)
    allow[0, [0, 2, length]] = True  # slot 5 is masked in the pool
    allow[1, [0, length]] = True  # the item's own mask drops slot 21
    assert g.mask.shape == (2, 1, 1, length + 1)
    assert np.array_equal(g.mask.view(2, -1).numpy(), allow)
    assert meta.store_rows is None
    assert np.array_equal(meta.store_slots.numpy(), [[7, 22], [107, 122]])


def test_decode_group_sliding_window():
    attendable, pos = pool(positions={4: 0, 5: 1, 6: 2, 20: 0, 21: 1})
    meta = build_metadata(items(), np.array([0, 1]), np.array([7, 22]), 2, attendable, pos, 2, HKV)
    allow = np.zeros((2, DECODE_PAD), dtype=bool)
    allow[0, [2, DECODE_PAD - 1]] = True  # position 3 sees positions 2 and 3
    allow[1, DECODE_PAD - 1] = True  # position 2 sees 1 (masked by the item) and 2
    assert np.array_equal(meta.groups[0].mask.view(2, -1).numpy(), allow)


def test_decode_group_without_stored_tokens():
    attendable, pos = pool()
    empty = np.zeros(0, dtype=np.int64)
    meta = build_metadata(items(stored=False), empty, empty, 2, attendable, pos, None, HKV)
    (g,) = meta.groups
    assert g.kv_slots is None and meta.store_slots is None
    assert np.array_equal(g.ctx_slots[1, 1, :3].numpy(), [120, 121, 100])
    assert g.mask.view(2, -1)[:, -1].all()
