"""The prefix cache: a radix tree over token ids whose values are KV pages (RadixAttention).

SGLang's runtime (Zheng et al., §5) keeps the KV cache of finished requests — prompts *and*
generated tokens — in a radix tree keyed by token ids, matches every new prompt against it,
evicts least-recently-used leaves under memory pressure, and never evicts a node that a
running request uses. This module is that tree, adapted to Pastry's paged KV cache
(``page_size`` tokens per page, not one):

- **Keys are tokens, values are pages.** A node's edge holds the tokens ``[start, end)`` of
  the sequences through it; ``node.pages`` are the physical pages of the page indices
  ``start // ps .. (end - 1) // ps``, each holding the K/V of its slots as a plain causal
  prefill of the path's tokens from position 0 would write them (the control layer only
  inserts such pages: :mod:`pastry.control.provenance`).
- **Token-granular edges.** An edge may start and end anywhere in a page. Where a node
  starts mid-page, its first page holds the parent's last tokens of that page too (same
  content, since the path is the same). When a split cuts an edge mid-page, both halves
  keep that one page: the lower node *shares its first page* (``shares_first``) with its
  parent, which owns it. Every page of the tree has exactly one owner node: the topmost
  node holding it. A node's own pages are ``pages[1:]`` when it shares its first page,
  else all of ``pages``.
- **Matching** returns the longest cached prefix of a token sequence and the page of each
  page index it covers (the page of the deepest node on the path that covers that index:
  its slots are valid up to the match's end). Full pages can be shared by reference; the
  control layer copies the matched slots of a partial last page into a fresh page, so a
  shared page is never written.
- **Reference counts.** A node is *in use* while one of its own pages is referenced from
  outside the tree (an inferlet holds a handle to it, or an export does: :meth:`ref_pages`)
  or it is pinned (:meth:`lock`, e.g. by a scheduler that admitted a request against it).
  ``lock_ref`` is the number of such uses in the node's subtree (SGLang's
  ``lock_ref``): a node with ``lock_ref > 0`` is never evicted, and neither is any of its
  ancestors.
- **Eviction** removes least-recently-used leaves (``last_access`` ticks once per match or
  insert) whose ``lock_ref`` is 0, recursively (a parent whose last child went becomes a
  leaf), until enough pages are freed. ``evictable_pages`` counts the pages that eviction
  could free now: they count as available memory.
- **Namespaces.** Matches and inserts name a namespace (a user; ``None`` by default), each
  with its own root: what one namespace cached is never matched from another. Eviction is
  one LRU order over all of them (they share the memory).

Pure Python bookkeeping, used from the control loop only (no locks). The tree never frees
memory itself: :meth:`evict` and :meth:`detach` return the pages that left it, and the
caller (:class:`~pastry.control.resources.ResourceManager`) owns the page table.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Sequence

from pastry.control.radix import Insertion, Match, RadixNode, common


class PrefixCache:
    """A radix tree over token ids whose values are KV pages of ``page_size`` tokens.

    Contracts (checked by :meth:`check_integrity`):

    - a page is in the tree at most once as an *own* page, and every page of a node is
      some node's own page (a shared first page is its parent's);
    - ``lock_ref`` of a node = its ``refs`` + ``pins`` + its children's ``lock_ref``;
    - ``evictable_pages`` = the own pages of nodes whose ``lock_ref`` is 0.
    """

    def __init__(self, page_size: int) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self._seq = itertools.count()
        self._roots: dict[object, RadixNode] = {}  # namespace -> its root
        self._owner: dict[int, RadixNode] = {}  # own page -> its node
        self._referenced: set[int] = set()  # own pages referenced from outside
        self.evictable_pages = 0
        self.version = 0  # changes whenever what a match can return may have changed
        self._tick = 0

    # ------------------------------------------------------------------ queries

    @property
    def root(self) -> RadixNode:
        """The root of the default namespace (``None``)."""
        return self.root_of(None)

    def root_of(self, namespace: object) -> RadixNode:
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = RadixNode((), 0, [], None, False, next(self._seq))
        return root

    @property
    def cached_pages(self) -> int:
        """Pages the tree holds."""
        return len(self._owner)

    def __contains__(self, page: int) -> bool:
        return page in self._owner

    @property
    def referenced_pages(self) -> int:
        """Pages of the tree that something outside it references."""
        return len(self._referenced)

    def page_ids(self) -> set[int]:
        """Every page the tree holds."""
        return set(self._owner)

    def owner(self, page: int) -> RadixNode | None:
        """The node that owns ``page`` (``None`` if the tree does not hold it)."""
        return self._owner.get(page)

    def match(
        self,
        tokens: Sequence[int],
        limit: int | None = None,
        touch: bool = True,
        namespace: object = None,
    ) -> Match:
        """The longest prefix of ``tokens[:limit]`` cached in ``namespace``.

        ``touch`` marks the nodes on the path as used now (LRU order); a scheduler that
        only looks (to order waiting requests) passes ``False``.
        """
        tokens = tuple(tokens if limit is None else tokens[: max(0, limit)])
        ps = self.page_size
        pos = 0
        pages: list[int] = []
        tick = self._next_tick() if touch else 0
        n = len(tokens)
        node = self._roots.get(namespace)
        if node is None:
            return Match(0, (), self.root_of(namespace))
        while pos < n:
            child = node.children.get(tokens[pos])
            if child is None:
                break
            key = child.key
            k = common(key, tokens, pos)
            first = child.start // ps
            del pages[first:]  # the deepest node covering an index gives its page
            pages.extend(child.pages[: -(-(child.start + k) // ps) - first])
            if touch:
                child.last_access = tick
            node, pos = child, pos + k
            if k < len(key):
                break
        return Match(pos, tuple(pages[: -(-pos // ps)]), node)

    # ------------------------------------------------------------------ insert

    def insert(
        self, tokens: Sequence[int], pages: Sequence[int], namespace: object = None
    ) -> Insertion:
        """Cache ``tokens`` with ``pages`` in ``namespace`` (``pages[i]`` holds page index
        ``i`` of this sequence; exactly ``ceil(len(tokens) / page_size)`` of them).

        The part already cached is kept as it is (the caller's pages for it are not taken);
        the rest becomes a new leaf that takes the caller's pages from the page holding its
        first token on. Edges split where the sequence diverges. The pages taken must not
        be in the tree already, except the first one when it is the page that the new
        leaf's parent ends in (the leaf then shares it).
        """
        tokens = tuple(tokens)
        ps = self.page_size
        if len(pages) != -(-len(tokens) // ps):
            raise ValueError(
                f"{len(tokens)} tokens need {-(-len(tokens) // ps)} pages of {ps}, got {len(pages)}"
            )
        tick = self._next_tick()
        node, pos, n = self.root_of(namespace), 0, len(tokens)
        while pos < n:
            child = node.children.get(tokens[pos])
            if child is None:
                break
            k = common(child.key, tokens, pos)
            if k < len(child.key):
                if pos + k == n:  # the sequence ends inside this edge: already cached
                    child.last_access = tick
                    return Insertion(n, 0, ())
                child = self._split(child, k)
            child.last_access = tick
            node, pos = child, pos + k
        if pos == n:
            return Insertion(n, 0, ())
        mine = list(pages[pos // ps :])
        shares = False
        if mine[0] in self._owner:
            if pos % ps == 0 or not node.pages or node.pages[-1] != mine[0]:
                raise ValueError(
                    f"page {mine[0]} is already cached elsewhere; it cannot hold tokens "
                    f"from {pos} of this sequence"
                )
            shares = True
        taken = mine[1:] if shares else mine
        clash = [p for p in taken if p in self._owner]
        if clash or len(set(taken)) != len(taken):
            raise ValueError(f"pages {clash or taken} are cached already or repeated")
        self.version += 1
        leaf = RadixNode(tokens[pos:], pos, mine, node, shares, next(self._seq))
        leaf.last_access = tick
        node.children[tokens[pos]] = leaf
        for p in taken:
            self._owner[p] = leaf
        self.evictable_pages += len(taken)
        return Insertion(pos, n - pos, tuple(taken))

    def _split(self, node: RadixNode, k: int) -> RadixNode:
        """Cut ``node``'s edge after ``k`` tokens: a new parent takes ``key[:k]``; returns it."""
        ps = self.page_size
        s = node.start
        cut = s + k
        first = s // ps
        upper_pages = node.pages[: (cut - 1) // ps - first + 1]
        lower_pages = node.pages[cut // ps - first :]
        upper = RadixNode(
            node.key[:k], s, upper_pages, node.parent, node.shares_first, next(self._seq)
        )
        upper.last_access = node.last_access
        assert node.parent is not None
        node.parent.children[node.key[0]] = upper
        node.key = node.key[k:]
        node.start = cut
        node.pages = lower_pages
        node.shares_first = cut % ps != 0
        node.parent = upper
        upper.children[node.key[0]] = node
        moved = upper.own_pages
        for p in moved:
            self._owner[p] = upper
        upper.refs = sum(1 for p in moved if p in self._referenced)
        upper.lock_ref = node.lock_ref  # the same uses, one node higher
        before = node.lock_ref
        node.refs -= upper.refs
        node.lock_ref -= upper.refs
        if before > 0 and node.lock_ref == 0:
            self.evictable_pages += len(node.own_pages)
        return upper

    # ------------------------------------------------------------------ uses

    def lock(self, node: RadixNode) -> None:
        """Pin ``node`` (and so its path): it is not evicted until :meth:`unlock`."""
        node.pins += 1
        self._add_lock(node, 1)

    def unlock(self, node: RadixNode) -> None:
        if node.pins <= 0:
            raise ValueError(f"unlock of a node that is not locked: {node!r}")
        node.pins -= 1
        self._add_lock(node, -1)

    def ref_pages(self, pages: Iterable[int]) -> None:
        """Pages of the tree became referenced from outside (each was not before)."""
        for p in pages:
            node = self._owner[p]
            assert p not in self._referenced, p
            self._referenced.add(p)
            node.refs += 1
            self._add_lock(node, 1)

    def unref_pages(self, pages: Iterable[int]) -> None:
        """Pages of the tree are no longer referenced from outside."""
        for p in pages:
            node = self._owner[p]
            self._referenced.remove(p)
            node.refs -= 1
            self._add_lock(node, -1)

    def is_referenced(self, page: int) -> bool:
        return page in self._referenced

    def _add_lock(self, node: RadixNode, delta: int) -> None:
        if delta == 0:
            return
        x: RadixNode | None = node
        while x is not None and x.key:  # roots have no key
            before = x.lock_ref
            x.lock_ref = before + delta
            if before == 0 and delta > 0:
                self.evictable_pages -= len(x.own_pages)
            elif x.lock_ref == 0:
                self.evictable_pages += len(x.own_pages)
            x = x.parent

    # ------------------------------------------------------------------ eviction

    def evict(self, n: int) -> list[int]:
        """Free at least ``n`` pages by removing least-recently-used leaves that nobody
        uses, recursively; fewer if not enough are evictable. Returns the freed pages."""
        freed: list[int] = []
        if n <= 0:
            return freed
        heap = [(x.last_access, x.seq, x) for x in self._leaves() if x.lock_ref == 0]
        heapq.heapify(heap)
        while heap and len(freed) < n:
            _, _, leaf = heapq.heappop(heap)
            freed += self._remove(leaf)
            parent = leaf.parent
            if parent.key and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, parent.seq, parent))
        return freed

    def _remove(self, leaf: RadixNode) -> list[int]:
        assert not leaf.children and leaf.lock_ref == 0, leaf
        self.version += 1
        own = leaf.own_pages
        del leaf.parent.children[leaf.key[0]]
        for p in own:
            del self._owner[p]
        self.evictable_pages -= len(own)
        return own

    def _leaves(self) -> list[RadixNode]:
        out, stack = [], [c for r in self._roots.values() for c in r.children.values()]
        while stack:
            x = stack.pop()
            if x.children:
                stack.extend(x.children.values())
            else:
                out.append(x)
        return out

    # ------------------------------------------------------------------ detaching

    def detach_scope(self, page: int) -> tuple[list[int], int]:
        """What :meth:`detach` of ``page`` would take out of the tree besides pages nobody
        uses: the referenced pages (of ``page``'s node from ``page`` on, and of its
        subtree) and the number of pins on those nodes."""
        node = self._owner[page]
        own = node.own_pages
        referenced = [p for p in own[own.index(page) :] if p in self._referenced]
        pins = node.pins
        stack = list(node.children.values())
        while stack:
            x = stack.pop()
            stack.extend(x.children.values())
            pins += x.pins
            referenced += [p for p in x.own_pages if p in self._referenced]
        return referenced, pins

    def detach(self, page: int) -> tuple[list[int], list[int]]:
        """Take ``page`` and everything cached after it out of the tree (someone is about
        to write it). Its node is split at the page's first slot when it starts before it,
        then that node's subtree leaves the tree; nodes above keep their tokens. Returns
        (pages nobody references: free them, pages still referenced: their holders own
        them again). Pins in the subtree are dropped: check :meth:`detach_scope` first."""
        ps = self.page_size
        node = self._owner[page]
        page_start = (node.start // ps + node.pages.index(page)) * ps
        if page_start > node.start:
            self._split(node, page_start - node.start)
        assert self._owner[page] is node
        self.version += 1
        self._add_lock(node.parent, -node.lock_ref)
        del node.parent.children[node.key[0]]
        node.parent = None  # a later unlock of a node in it changes nothing in the tree
        free: list[int] = []
        kept: list[int] = []
        stack = [node]
        while stack:
            x = stack.pop()
            stack.extend(x.children.values())
            if x.lock_ref == 0:
                self.evictable_pages -= len(x.own_pages)
            for p in x.own_pages:
                del self._owner[p]
                if p in self._referenced:
                    self._referenced.remove(p)
                    kept.append(p)
                else:
                    free.append(p)
        return free, kept

    # ------------------------------------------------------------------ checks and views

    def nodes(self) -> list[RadixNode]:
        """Every node but the roots, parents before children."""
        out, stack = [], list(self._roots.values())
        while stack:
            x = stack.pop()
            if x.key:
                out.append(x)
            stack.extend(sorted(x.children.values(), key=lambda c: c.key[0], reverse=True))
        return out

    def render(self, decode=lambda key: key, namespace: object = None) -> dict:
        """The tree of ``namespace`` as nested dicts ``{decode(edge key): {...}}`` (for
        tests and logs)."""

        def walk(x: RadixNode) -> dict:
            return {decode(c.key): walk(c) for c in x.children.values()}

        return walk(self.root_of(namespace))

    def check_integrity(self) -> None:
        """Assert the contracts of the class docstring and the shape of every node."""
        ps = self.page_size
        owned: dict[int, RadixNode] = {}
        evictable = 0

        def visit(x: RadixNode) -> int:
            nonlocal evictable
            locks = x.refs + x.pins
            for first, c in x.children.items():
                assert c.parent is x, c
                assert c.key and c.key[0] == first, (first, c)
                assert c.start == x.end, (c, x)
                locks += visit(c)
            if not x.key:  # a root
                return locks
            want = (x.end - 1) // ps - x.start // ps + 1
            assert len(x.pages) == want, f"{x!r} holds {len(x.pages)} pages, not {want}"
            if x.shares_first:
                assert x.start % ps and x.parent.pages and x.parent.pages[-1] == x.pages[0], x
            own = x.own_pages
            for p in own:
                assert p not in owned, f"page {p} is owned by two nodes"
                owned[p] = x
            assert x.refs == sum(1 for p in own if p in self._referenced), x
            assert x.pins >= 0 and x.lock_ref == locks, (x, locks)
            if x.lock_ref == 0:
                evictable += len(own)
            return locks

        for root in self._roots.values():
            assert not root.key and not root.pages and root.parent is None
            assert not root.refs and not root.pins and root.lock_ref == 0
            visit(root)
        for x in self.nodes():
            for p in x.pages:
                assert p in owned, f"page {p} of {x!r} has no owner"
        assert owned == self._owner, "the owner map disagrees with the nodes"
        assert self._referenced <= owned.keys(), "referenced pages that are not cached"
        assert evictable == self.evictable_pages, (evictable, self.evictable_pages)

    def _next_tick(self) -> int:
        self._tick += 1
        return self._tick


__all__ = ["Insertion", "Match", "PrefixCache", "RadixNode"]
