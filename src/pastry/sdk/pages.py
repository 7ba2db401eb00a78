"""KV page handles shared between the contexts of one inferlet.

A forked context reads its parent's full pages by reference; each page handle counts its
holders per instance (a handle no one counted has one). A page goes back to the server
when its last holder lets it go.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Sequence

from pastry.api import InferletApi

# Per-instance reference counts of KV page handles shared between forked contexts.
_page_refs: weakref.WeakKeyDictionary[object, dict[int, int]] = weakref.WeakKeyDictionary()


def page_refs(a: InferletApi) -> dict[int, int]:
    refs = _page_refs.get(a)
    if refs is None:
        refs = _page_refs[a] = {}
    return refs


def share(a: InferletApi, pages: Sequence[int]) -> None:
    """One more holder of each of ``pages``."""
    refs = page_refs(a)
    for p in pages:
        refs[p] = refs.get(p, 1) + 1


def unshare(a: InferletApi, pages: Sequence[int]) -> list[int]:
    """One holder fewer of each of ``pages``; returns those no one holds any more."""
    refs = page_refs(a)
    free = []
    for p in pages:
        left = refs.get(p, 1) - 1
        if left <= 0:
            refs.pop(p, None)
            free.append(p)
        else:
            refs[p] = left
    return free


async def give_back(
    a: InferletApi, queue: int, pages: Sequence[int], embeds: Sequence[int]
) -> None:
    """Let go of ``pages`` (deallocating those no other context holds) and ``embeds``."""
    free = unshare(a, pages)
    futs = [a.dealloc_kvpages(queue, free)] if free else []
    if embeds:
        futs.append(a.dealloc_embeds(queue, list(embeds)))
    await asyncio.gather(*futs)
