"""The KV layout rule (pastry.wire.kv_layout): one definition that the control layer and
the engine both check, each naming its own fields."""

from __future__ import annotations

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
