"""The KV layout rule (pastry.wire.kv_layout): one definition that the control layer and
the engine both check, each naming its own fields."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from pastry.wire.kv_layout import FORWARD_NAMES, KvNames, kv_write_error

PS = 4
API = KvNames("in_kv", "in_kv_last_len", "out_kv", "out_kv_offset")

GOOD = [
    ([], 0, [], 0, 3),  # no context, not stored
    ([], 0, [7], 0, 4),  # fills a fresh page
    ([1, 2], 3, [2], 3, 1),  # continues the last context page after its 3 tokens
    ([1, 2], 3, [2, 5], 3, 5),  # ... and on into a new page
    ([1], 4, [5], 0, 4),  # a full last page: the new tokens start a fresh one
]
BAD = [
    ([], 2, [], 0, 1, "last", "there is no context"),
    ([1], 0, [], 0, 1, "last", "from 1 to the page size"),
    ([1], 5, [], 0, 1, "last", "from 1 to the page size"),
    ([1], 2.0, [], 0, 1, "last", "from 1 to the page size"),
    ([], 0, [3], 4, 1, "offset", "from 0 to 3"),
    ([], 0, [3], 1, 4, None, "hold 3 tokens, not 4"),
    ([], 0, [3, 3], 0, 5, "out", "repeats a page"),
    ([1, 2], 3, [2], 2, 1, "out", "overlaps the context"),  # would overwrite token 2
    ([1, 2], 3, [1], 0, 1, "out", "overlaps the context"),  # not the last page
    ([1, 2], 3, [5, 2], 0, 5, "out", "overlaps the context"),  # the last page, not first
]


@pytest.mark.parametrize("ctx, last, out, offset, n", GOOD)
def test_layouts_the_rule_admits(ctx, last, out, offset, n):
    assert kv_write_error(PS, ctx, last, out, offset, n) is None


@pytest.mark.parametrize("ctx, last, out, offset, n, field, why", BAD)
@pytest.mark.parametrize("names", [FORWARD_NAMES, API])
def test_layouts_the_rule_refuses_name_the_callers_field(
    ctx, last, out, offset, n, field, why, names
):
    error = kv_write_error(PS, ctx, last, out, offset, n, names=names)
    assert error is not None and why in error
    if field is not None:
        assert getattr(names, field) in error


def test_overlap_check_can_be_left_to_the_engine():
    assert kv_write_error(PS, [1, 2], 3, [2], 2, 1, overlap=False) is None
    assert "overlaps" in kv_write_error(PS, [1, 2], 3, [2], 2, 1)


def test_the_rule_decides_as_spelled_out_on_every_small_layout():
    """Every small layout, the decode step's fast path's shapes among them: the answer is
    the rule written out plainly (``_spelled_out``)."""
    pages = [[], [1], [1, 2]]
    outs = [[], [2], [3], [1], [2, 3], [3, 3]]
    values = [0, 1, 2, PS - 1, PS, PS + 1, -1, True, 2.0, np.int64(2)]
    for ctx, out, last, offset, n, overlap in itertools.product(
        pages, outs, values, values, [0, 1, 2, PS], [True, False]
    ):
        error = kv_write_error(PS, ctx, last, out, offset, n, overlap=overlap)
        valid = _spelled_out(ctx, last, out, offset, n, overlap)
        assert (error is None) == valid, (ctx, last, out, offset, n, overlap, error)


def _spelled_out(ctx, last, out, offset, n, overlap) -> bool:
    """The layout rule written out plainly: whether the write is valid."""

    def is_int(v):
        return (isinstance(v, int) and not isinstance(v, bool)) or isinstance(v, np.integer)

    if not ctx:
        if last != 0:
            return False
    elif not (is_int(last) and 1 <= last <= PS):
        return False
    if not out:
        return True
    if not (is_int(offset) and 0 <= offset < PS):
        return False
    if len(out) * PS - offset < n or len(set(out)) != len(out):
        return False
    if overlap:
        shared = set(out) & set(ctx)
        if shared and (shared != {ctx[-1]} or out[0] != ctx[-1] or offset < last):
            return False
    return True
