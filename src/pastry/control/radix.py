"""The radix tree's parts: its nodes, and what a match or an insert returns.

The tree itself (matching, inserting, locking, eviction) is
:class:`~pastry.control.prefix_cache.PrefixCache`.
"""

from __future__ import annotations

from dataclasses import dataclass

Tokens = tuple[int, ...]


class RadixNode:
    """One node of the tree: the edge from its parent (``key``) and its pages."""

    __slots__ = (
        "children",
        "key",
        "last_access",
        "lock_ref",
        "pages",
        "parent",
        "pins",
        "refs",
        "seq",
        "shares_first",
        "start",
    )

    def __init__(
        self,
        key: Tokens,
        start: int,
        pages: list[int],
        parent: RadixNode | None,
        shares_first: bool,
        seq: int,
    ) -> None:
        self.key = key  # the tokens on the edge into this node
        self.start = start  # the position of key[0] in every sequence through the node
        self.pages = pages  # physical pages of page indices start // ps .. (end - 1) // ps
        self.parent = parent
        self.shares_first = shares_first  # pages[0] is the parent's last page (it owns it)
        self.children: dict[int, RadixNode] = {}  # first token of the child's key -> child
        self.refs = 0  # own pages referenced from outside the tree
        self.pins = 0  # explicit locks (lock/unlock)
        self.lock_ref = 0  # refs + pins summed over the subtree
        self.last_access = 0
        self.seq = seq  # creation order: ties in LRU order go to the older node

    @property
    def end(self) -> int:
        return self.start + len(self.key)

    @property
    def own_pages(self) -> list[int]:
        return self.pages[1:] if self.shares_first else self.pages

    def __repr__(self) -> str:
        return (
            f"RadixNode([{self.start}, {self.end}), pages={self.pages}, "
            f"lock_ref={self.lock_ref}, children={len(self.children)})"
        )


@dataclass(frozen=True, slots=True)
class Match:
    """The longest cached prefix of a sequence.

    ``length`` tokens are cached; ``pages[i]`` is the page of page index ``i`` for
    ``i < ceil(length / page_size)`` (the last one is partial when ``length`` is not a
    multiple of the page size: only its first ``length % page_size`` slots belong to the
    prefix). ``node`` is the deepest node the prefix reaches (the root when nothing
    matched); the prefix may end inside its edge.
    """

    length: int
    pages: tuple[int, ...]
    node: RadixNode


@dataclass(frozen=True, slots=True)
class Insertion:
    """What :meth:`PrefixCache.insert` did: the tokens newly cached (``new_tokens``, from
    position ``start``) and the pages the tree took (``adopted``); the caller's other pages
    duplicate what the tree already held."""

    start: int
    new_tokens: int
    adopted: tuple[int, ...]


def common(key: Tokens, tokens: Tokens, pos: int) -> int:
    """Length of the common prefix of ``key`` and ``tokens[pos:]``."""
    n = min(len(key), len(tokens) - pos)
    if tokens[pos : pos + n] == key[:n]:
        return n
    lo, hi = 0, n  # binary search on slice equality: C-speed comparisons
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if tokens[pos : pos + mid] == key[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
