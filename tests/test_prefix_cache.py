"""The radix tree of the prefix cache: exact tree states, pages, counts and LRU order.

Tokens are characters (``ord``) so that edges read as text. ``Runtime`` below is the
memory discipline of SGLang's Algorithm 1 in miniature: match, pin the matched node, evict
least-recently-used leaves when the pool is short, insert the prompt *and* the output,
unpin.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

from pastry.control.prefix_cache import PrefixCache


def toks(s: str) -> list[int]:
    return [ord(c) for c in s]


def text(key) -> str:
    return "".join(map(chr, key))


class Runtime:
    """A pool of ``num_pages`` pages and a tree; ``serve`` runs one request."""

    def __init__(self, num_pages: int, page_size: int = 1) -> None:
        self.tree = PrefixCache(page_size)
        self.free = list(range(num_pages))
        self.evicted: list[str] = []  # edges of the nodes evicted by the last serve

    def serve(self, prompt: str, output: str) -> None:
        tree, ps = self.tree, self.tree.page_size
        seq = toks(prompt + output)
        m = tree.match(toks(prompt))
        tree.lock(m.node)
        full = m.length // ps
        need = -(-len(seq) // ps) - full
        before = {text(x.key) for x in tree.nodes()}
        if len(self.free) < need:
            self.free += tree.evict(need - len(self.free))
        self.evicted = sorted(before - {text(x.key) for x in tree.nodes()})
        new = [self.free.pop(0) for _ in range(need)]
        done = tree.insert(seq, list(m.pages[:full]) + new)
        tree.unlock(m.node)
        self.free += [p for p in new if p not in done.adopted]
        tree.check_integrity()

    def render(self) -> dict:
        return self.tree.render(text)


SYSTEM = "You are a helpful assistant. "
EXAMPLES = "Example: 3+3=6. Example: 4+4=8. "


def test_figure_6_of_the_sglang_paper():
    """The nine time points of Figure 6: two chat sessions, few-shot queries and a
    self-consistency request under a memory limit of 206 one-token pages. Node letters as
    in the caption; c, g, h, i, k and l are evicted exactly where the caption says."""
    rt = Runtime(206)
    # (1) empty
    assert rt.render() == {}
    # (2) a first chat turn: system prompt, user message and the reply as one edge
    turn1 = SYSTEM + "User: Hello! Assistant:"
    rt.serve(turn1, " Hi!")
    a = "You are a helpful assistant. User: Hello! Assistant: Hi!"
    assert rt.render() == {a: {}}
    # (3) the second turn reuses the first and appends one node
    reply = " Sure! Add the two numbers first, then halve it."
    turn2 = turn1 + " Hi!" + " User: Solve this problem. Assistant:"
    rt.serve(turn2, reply)
    c = " User: Solve this problem. Assistant:" + reply
    assert rt.render() == {a: {c: {}}}
    # (4) a second session splits the first turn's node to share the system prompt
    chat2 = SYSTEM + "User: What can you do? Assistant:"
    rt.serve(chat2, " I can help.")
    shared, b, d = (
        SYSTEM + "User: ",
        "Hello! Assistant: Hi!",
        "What can you do? Assistant: I can help.",
    )
    assert rt.render() == {shared: {b: {c: {}}, d: {}}}
    assert rt.evicted == []
    # (5) the second session continues; the memory limit evicts c, the LRU leaf
    rt.serve(chat2 + " I can help." + " User: Write a poem. Assistant:", " Roses.")
    h = " User: Write a poem. Assistant: Roses."
    assert rt.render() == {shared: {b: {}, d: {h: {}}}}
    assert rt.evicted == [c]
    # (6) a few-shot query shares nothing: a new child of the root
    rt.serve(EXAMPLES + "Q: 1+1? A:", " 2")
    e = EXAMPLES + "Q: 1+1? A: 2"
    assert rt.render() == {shared: {b: {}, d: {h: {}}}, e: {}}
    assert rt.evicted == []
    # (7) more few-shot queries split e to share the examples
    for q, ans in [("Q: 2+2? A:", " 4"), ("Q: 5+5? A:", " 10"), ("Q: 6+6? A:", " 12")]:
        rt.serve(EXAMPLES + q, ans)
        assert rt.evicted == []
    f = EXAMPLES + "Q: "
    i, j, k, el = "1+1? A: 2", "2+2? A: 4", "5+5? A: 10", "6+6? A: 12"
    assert rt.render() == {shared: {b: {}, d: {h: {}}}, f: {i: {}, j: {}, k: {}, el: {}}}
    # (8) a new message of the first session evicts the second session, least recently used
    rt.serve(turn1 + " Hi!" + " User: Thanks! What about 7+7? Assistant:", " 14.")
    m = " User: Thanks! What about 7+7? Assistant: 14."
    assert rt.evicted == sorted([d, h])
    assert rt.render() == {shared: {b: {m: {}}}, f: {i: {}, j: {}, k: {}, el: {}}}
    # (9) self-consistency: more answers to j's question; i, k and l (el) make room
    evicted = []
    for ans in [" four, as 2+2=4.", " 4, by counting on fingers.", " IV in Roman."]:
        rt.serve(EXAMPLES + "Q: 2+2? A:", ans)
        evicted += rt.evicted
    assert sorted(evicted) == sorted([i, k, el])
    assert rt.render() == {
        shared: {b: {m: {}}},
        f: {
            "2+2? A: ": {
                "4": {", by counting on fingers.": {}},
                "four, as 2+2=4.": {},
                "IV in Roman.": {},
            }
        },
    }
    assert len(rt.free) + rt.tree.cached_pages == 206


# ------------------------------------------------------------------------------ pages


def test_match_returns_the_pages_of_the_prefix_at_token_granularity():
    t = PrefixCache(4)
    done = t.insert(toks("abcdefghij"), [10, 11, 12])  # pages: abcd efgh ij
    assert done.adopted == (10, 11, 12) and done.start == 0 and done.new_tokens == 10
    m = t.match(toks("abcdefXY"))
    assert (m.length, m.pages) == (6, (10, 11))  # page 11 partially: its first 2 slots
    m = t.match(toks("abcdefgh"))
    assert (m.length, m.pages) == (8, (10, 11))
    m = t.match(toks("abcdefghijk"))
    assert (m.length, m.pages) == (10, (10, 11, 12))
    assert t.match(toks("xyz")).length == 0 and t.match(toks("xyz")).pages == ()
    m = t.match(toks("abcdefghij"), limit=9)
    assert (m.length, m.pages) == (9, (10, 11, 12))
    t.check_integrity()


def test_a_split_inside_a_page_shares_that_page_and_a_diverging_leaf_brings_its_own():
    t = PrefixCache(4)
    t.insert(toks("abcdefghij"), [10, 11, 12])
    # diverges at token 6, inside page 1: the new leaf's first page (20) holds "ef" again
    done = t.insert(toks("abcdefXYZW"), [10, 20, 21])
    assert done.adopted == (20, 21) and done.start == 6
    upper = t.root.children[ord("a")]
    assert (upper.start, upper.end, upper.pages, upper.shares_first) == (0, 6, [10, 11], False)
    old = upper.children[ord("g")]
    new = upper.children[ord("X")]
    assert (old.start, old.pages, old.shares_first, old.own_pages) == (6, [11, 12], True, [12])
    assert (new.start, new.pages, new.shares_first, new.own_pages) == (6, [20, 21], False, [20, 21])
    assert t.owner(11) is upper and t.owner(12) is old and t.owner(20) is new
    assert t.match(toks("abcdefXYZW")).pages == (10, 20, 21)  # the deepest node's page 1
    assert t.match(toks("abcdefgh")).pages == (10, 11)
    assert t.match(toks("abcdef")).pages == (10, 11)
    assert t.cached_pages == 5 == t.evictable_pages
    t.check_integrity()
    # evicting the shared-first leaf frees only its own page
    t.lock(new)
    assert t.evict(10) == [12]
    assert t.render(text) == {"abcdef": {"XYZW": {}}}
    t.unlock(new)
    assert sorted(t.evict(10)) == [10, 11, 20, 21]
    t.check_integrity()


def test_a_leaf_may_share_the_page_its_parent_ends_in():
    t = PrefixCache(4)
    t.insert(toks("abcdefgh"), [10, 11])
    t.insert(toks("abcdefXY"), [10, 12])  # split at 6: "gh" shares page 11
    t.lock(t.root.children[ord("a")].children[ord("X")])
    assert t.evict(1) == []  # "gh" owns no page: freeing it frees nothing
    assert t.render(text) == {"abcdef": {"XY": {}}}
    # a reader that borrowed page 11 (full: "efgh") may insert "abcdefgh..." again: the new
    # leaf starts inside page 11 and shares it with its parent
    done = t.insert(toks("abcdefghij"), [10, 11, 13])
    assert done.adopted == (13,)
    leaf = t.root.children[ord("a")].children[ord("g")]
    assert (leaf.pages, leaf.shares_first) == ([11, 13], True)
    with pytest.raises(ValueError, match="already cached"):
        t.insert(toks("abcdefXYZ"), [10, 12, 13])  # page 13 is the other leaf's
    with pytest.raises(ValueError, match="need 2 pages"):
        t.insert(toks("abcdefgZ"), [10])
    t.check_integrity()


def test_insert_of_a_cached_prefix_takes_nothing():
    t = PrefixCache(2)
    t.insert(toks("abcdef"), [1, 2, 3])
    assert t.insert(toks("abcd"), [7, 8]).adopted == ()
    assert t.insert(toks("abc"), [7, 8]).adopted == ()
    assert t.render(text) == {"abcdef": {}}
    t.check_integrity()


# ------------------------------------------------------------------------------ uses, eviction


def test_references_and_pins_lock_the_path_and_follow_a_split():
    t = PrefixCache(2)
    t.insert(toks("abcdef"), [1, 2, 3])
    node = t.root.children[ord("a")]
    t.ref_pages([3])
    assert node.lock_ref == 1 and t.evictable_pages == 0
    assert t.evict(3) == []
    t.insert(toks("abcdXY"), [1, 2, 9])  # split at 4: page 3 stays below
    upper = t.root.children[ord("a")]
    lower = upper.children[ord("e")]
    assert (upper.lock_ref, upper.refs, lower.lock_ref, lower.refs) == (1, 0, 1, 1)
    assert t.evictable_pages == 1  # page 9 only
    assert t.evict(5) == [9]
    t.unref_pages([3])
    assert t.evictable_pages == 3
    t.ref_pages([1])  # now the upper node is used, the lower one not
    assert (upper.lock_ref, lower.lock_ref, t.evictable_pages) == (1, 0, 1)
    assert t.evict(5) == [3]
    t.unref_pages([1])
    t.lock(upper)
    assert t.evict(5) == []
    with pytest.raises(ValueError, match="not locked"):
        t.unlock(lower)
    t.unlock(upper)
    assert sorted(t.evict(5)) == [1, 2]
    t.check_integrity()


def test_eviction_takes_least_recently_used_leaves_then_their_parents():
    t = PrefixCache(1)
    t.insert(toks("aX"), [1, 2])
    t.insert(toks("aY"), [1, 3])
    t.insert(toks("bZ"), [4, 5])
    t.match(toks("aX"))  # aX is now the most recent
    assert t.evict(1) == [3]  # "Y", used least recently
    assert t.evict(2) == [4, 5]  # "bZ" as one edge
    assert t.render(text) == {"a": {"X": {}}}
    assert t.evict(0) == []
    t.match(toks("aX"), touch=False)
    assert sorted(t.evict(9)) == [1, 2]
    t.check_integrity()


def test_detach_splits_at_the_page_and_hands_back_referenced_pages():
    t = PrefixCache(2)
    t.insert(toks("abcdefgh"), [1, 2, 3, 4])
    t.insert(toks("abcdefXY"), [1, 2, 3, 9])
    t.ref_pages([3, 9])
    assert t.detach_scope(3) == ([3, 9], 0) and t.detach_scope(9) == ([9], 0)
    free, kept = t.detach(3)  # page 3 holds "ef": everything from token 4 on leaves
    assert sorted(free) == [4] and sorted(kept) == [3, 9]
    assert t.render(text) == {"abcd": {}}
    assert t.cached_pages == 2 == t.evictable_pages
    t.check_integrity()


# ------------------------------------------------------------------------------ random workloads


class Model:
    """A pool of pages whose content is tracked exactly: slot ``i`` of a page holds the
    K/V of the whole prefix ``tokens[:index * ps + i + 1]`` of the sequence that wrote it."""

    def __init__(self, num_pages: int, ps: int, seed: int) -> None:
        self.rng = random.Random(seed)
        self.ps = ps
        self.tree = PrefixCache(ps)
        self.free = list(range(num_pages))
        self.content: dict[int, list] = {}
        self.refs: Counter[int] = Counter()  # references held by running requests
        self.running: list[list[int]] = []  # each: the tree pages a request references
        self.num_pages = num_pages

    def write(self, page: int, seq: list[int], index: int, upto: int) -> None:
        ps = self.ps
        self.content[page] = [
            tuple(seq[: index * ps + i + 1]) if index * ps + i < upto else None for i in range(ps)
        ]

    def alloc(self, n: int) -> list[int] | None:
        if len(self.free) < n:
            self.free += self.tree.evict(n - len(self.free))
        if len(self.free) < n:
            return None
        out, self.free = self.free[:n], self.free[n:]
        return out

    def ref(self, pages: list[int]) -> None:
        for p in pages:
            self.refs[p] += 1
            if self.refs[p] == 1 and p in self.tree:
                self.tree.ref_pages([p])

    def unref(self, pages: list[int]) -> None:
        for p in pages:
            self.refs[p] -= 1
            if self.refs[p] == 0:
                del self.refs[p]
                if p in self.tree:
                    self.tree.unref_pages([p])

    def check_match(self, seq: list[int]) -> None:
        m = self.tree.match(seq, touch=self.rng.random() < 0.5)
        ps = self.ps
        for k, page in enumerate(m.pages):
            for i in range(ps):
                if k * ps + i < m.length:
                    assert self.content[page][i] == tuple(seq[: k * ps + i + 1]), (seq, k, i)

    def request(self, seq: list[int]) -> None:
        """Serve ``seq``: share full matched pages, copy a partial one, write the rest,
        insert, and keep referencing the tree pages used for a while."""
        ps = self.ps
        m = self.tree.match(seq[:-1] if self.rng.random() < 0.5 else seq)
        full = m.length // ps
        shared = list(m.pages[:full])
        self.ref(shared)
        need = -(-len(seq) // ps) - full
        fresh = self.alloc(need)
        if fresh is None:
            self.unref(shared)
            return
        for k, page in enumerate(fresh):
            self.write(page, seq, full + k, len(seq))  # a copy of matched slots, then new ones
        done = self.tree.insert(seq, shared + fresh)
        kept = set(done.adopted)
        self.free += [p for p in fresh if p not in kept]
        mine = shared + [p for p in fresh if p in kept]
        self.ref(mine)
        self.unref(shared)
        self.running.append(mine)

    def finish_one(self) -> None:
        if self.running:
            self.unref(self.running.pop(self.rng.randrange(len(self.running))))

    def detach_one(self) -> None:
        sole = [p for p, n in self.refs.items() if n == 1 and p in self.tree]
        if not sole:
            return
        page = self.rng.choice(sole)
        if self.tree.detach_scope(page) != ([page], 0):
            return
        free, kept = self.tree.detach(page)
        assert page in kept and not set(free) & set(self.refs)
        self.free += free
        # the holder now owns ``page`` and the other kept pages: treat them as gone
        for req in self.running:
            for p in kept:
                while p in req:
                    req.remove(p)
                    self.refs[p] -= 1
                    if not self.refs[p]:
                        del self.refs[p]
        self.free += kept

    def check(self) -> None:
        self.tree.check_integrity()
        cached = set(self.tree._owner)
        assert not cached & set(self.free), "a page both free and cached"
        assert len(self.free) + len(cached) == self.num_pages
        assert set(self.refs) <= cached
        assert {p for p in self.refs} == self.tree._referenced


@pytest.mark.parametrize("ps", [1, 2, 4])
@pytest.mark.parametrize("seed", [0, 1])
def test_random_workloads_keep_every_invariant(ps, seed):
    m = Model(num_pages=96, ps=ps, seed=seed)
    rng = m.rng
    stems = [[rng.randrange(6) for _ in range(rng.randrange(1, 12))] for _ in range(8)]
    for step in range(3000):
        r = rng.random()
        seq = rng.choice(stems) + [rng.randrange(6) for _ in range(rng.randrange(1, 14))]
        if r < 0.45:
            m.request(seq)
        elif r < 0.7:
            m.check_match(seq)
        elif r < 0.85:
            m.finish_one()
        elif r < 0.9:
            m.detach_one()
        elif r < 0.95:
            if rng.random() < 0.5:
                freed = m.tree.evict(rng.randrange(1, 8))
                assert not set(freed) & set(m.refs)
                m.free += freed
        else:
            nodes = m.tree.nodes()
            if nodes:
                node = rng.choice(nodes)
                m.tree.lock(node)
                m.check_match(seq)
                m.tree.unlock(node)
        if step % 500 == 0:
            m.check()
    m.check()
    while m.running:
        m.finish_one()
    m.free += m.tree.evict(10**6)
    m.check()
    assert m.tree.render() == {} and len(m.free) == 96
