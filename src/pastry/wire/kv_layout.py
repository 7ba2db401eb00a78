"""The rule for where a forward's new tokens may go in paged KV memory: one definition.

A forward reads a context of ``ctx_pages`` (all full but the last, which holds ``last``
tokens) and writes the K/V of its ``n`` new tokens into ``out_pages`` from ``offset`` on.
The control layer checks an inferlet's request against this rule where it enters (so the
error names the request's fields) and the engine checks every call it receives against it
again (its wire is a door of its own: any controller, local or remote, may call it);
both call :func:`kv_write_error` with their own field names.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


class KvNames(NamedTuple):
    """How the caller's request names the four layout fields, for its error messages."""

    ctx: str
    last: str
    out: str
    offset: str


#: The engine's call fields (:class:`pastry.wire.calls.Forward`).
FORWARD_NAMES = KvNames("ctx_pages", "ctx_last_len", "out_pages", "out_offset")


def _is_int(value: object) -> bool:
    return (isinstance(value, int) and not isinstance(value, bool)) or _is_numpy_int(value)


def _is_numpy_int(value: object) -> bool:
    kind = getattr(getattr(value, "dtype", None), "kind", "")
    return kind in ("i", "u") and getattr(value, "ndim", 1) == 0


def kv_write_error(
    page_size: int,
    ctx_pages: Sequence[int],
    last: object,
    out_pages: Sequence[int],
    offset: object,
    n: int,
    *,
    names: KvNames = FORWARD_NAMES,
    overlap: bool = True,
) -> str | None:
    """What is wrong with writing ``n`` new tokens after this context, or None.

    The context's last page holds 1 to ``page_size`` tokens (``last`` is 0 without a
    context); the output pages, distinct, hold the ``n`` tokens from ``offset`` (0 to
    ``page_size - 1``) on; and they may share only the context's last page, as its first
    output page, after its ``last`` valid tokens (a token cannot overwrite its own
    context). ``overlap=False`` leaves that last check, a pass over the context, to the
    engine (the control layer's decode step, which builds its pages itself)."""
    ps = page_size
    # The decode step's shape (a context, at most one output page, plain ints), accepted
    # without the general checks' calls; anything else, valid or not, takes the path below.
    if (
        ctx_pages
        and type(last) is int
        and 0 < last <= ps
        and len(out_pages) <= 1
        and (
            not out_pages
            or (
                type(offset) is int
                and 0 <= offset < ps
                and offset + n <= ps
                and not (overlap and out_pages[0] in ctx_pages)
            )
        )
    ):
        return None
    if not ctx_pages:
        if last != 0:
            return f"{names.last} is {last!r} but there is no context ({names.ctx} is empty)"
    elif not (_is_int(last) and 1 <= last <= ps):
        return f"{names.last} must be from 1 to the page size ({ps}), got {last!r}"
    if not out_pages:
        return None
    if not (_is_int(offset) and 0 <= offset < ps):
        return f"{names.offset} must be from 0 to {ps - 1}, got {offset!r}"
    room = len(out_pages) * ps - offset
    if room < n:
        return f"{len(out_pages)} output pages from offset {offset} hold {room} tokens, not {n}"
    if len(out_pages) > 1 and len(set(out_pages)) != len(out_pages):
        return f"{names.out} repeats a page"
    if overlap:
        shared = set(out_pages).intersection(ctx_pages)
        if shared and (shared != {ctx_pages[-1]} or out_pages[0] != ctx_pages[-1] or offset < last):
            return (
                f"{names.out} overlaps the context {names.ctx}: new tokens may only continue "
                f"the last context page, after its {names.last} tokens"
            )
    return None
