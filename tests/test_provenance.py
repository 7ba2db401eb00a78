"""Provenance of KV pages: exactly which slots are certified canonical after each call, and
the page ownership table with the prefix cache under random workloads."""

from __future__ import annotations

import contextlib
import random
from collections import Counter

import numpy as np
import pytest

from pastry.control.prefix_cache import PrefixCache
from pastry.control.provenance import ROOT_KEY, KvProvenance
from pastry.control.resources import ResourceError, ResourceManager
from pastry.wire.calls import CallError, CopyKv, EmbedTxt, Forward, MaskKv, SwapIn, ids

PS = 4


class Q:
    """A queue of an instance (the provenance reads only ``instance``)."""

    def __init__(self, instance: int) -> None:
        self.instance = instance


Q1, Q2 = Q(1), Q(1)  # two queues of one inferlet


def prov() -> KvProvenance:
    return KvProvenance(PS, 16, 64, vocab_size=100, max_position=1000, max_batch_tokens=64)


def embed(tokens, start, slots):
    return EmbedTxt(ids(tokens), ids(range(start, start + len(tokens))), ids(slots))


def fwd(ins, ctx=(), last=0, out=(), off=0, outs=(), **kw):
    n = len(ins)
    return Forward(
        in_embeds=ids(ins),
        ctx_pages=ids(ctx),
        ctx_last_len=last,
        out_pages=ids(out),
        out_offset=off,
        out_embeds=ids(outs),
        out_indices=ids(range(n - len(outs), n)),
        **kw,
    )


def tokens_of(p: KvProvenance, page: int):
    r = p.record(page)
    return None if r is None else (r.index, r.tokens)


def prefilled(p: KvProvenance, tokens=(1, 2, 3, 4, 5, 6), pages=(3, 7)) -> None:
    """A canonical prefill of ``tokens`` into ``pages`` (queue Q1)."""
    n = len(tokens)
    p.observe([(Q1, embed(tokens, 0, range(n))), (Q1, fwd(range(n), out=pages))])


def test_a_canonical_prefill_and_decode_certify_their_slots():
    p = prov()
    prefilled(p)
    assert tokens_of(p, 3) == (0, (1, 2, 3, 4)) and tokens_of(p, 7) == (1, (5, 6))
    assert p.record(3).key == ROOT_KEY and p.record(7).key == p.record(3).next_key()
    assert [r.page for r in p.chain(7)] == [3, 7]
    # a decode step appends to the partial page: same page, one more token
    p.observe([(Q1, embed([9], 6, [10])), (Q1, fwd([10], ctx=[3, 7], last=2, out=[7], off=2))])
    assert tokens_of(p, 7) == (1, (5, 6, 9))
    # the next page starts a new record keyed by the full one before it
    p.observe(
        [
            (Q1, embed([8, 7], 7, [11, 12])),
            (Q1, fwd([11, 12], ctx=[3, 7], last=3, out=[7, 2], off=3)),
        ]
    )
    assert tokens_of(p, 7) == (1, (5, 6, 9, 8)) and tokens_of(p, 2) == (2, (7,))
    assert p.record(2).key == p.record(7).next_key() and p.record(2).prev is p.record(7)
    # a chunked prefill in one batch of one queue: the second chunk extends the first
    q = prov()
    q.observe(
        [
            (Q1, embed([1, 2, 3, 4, 5, 6], 0, range(6))),
            (Q1, fwd([0, 1, 2], out=[3])),
            (Q1, fwd([3, 4, 5], ctx=[3], last=3, out=[3, 7], off=3)),
        ]
    )
    assert tokens_of(q, 3) == (0, (1, 2, 3, 4)) and tokens_of(q, 7) == (1, (5, 6))


@pytest.mark.parametrize(
    "why",
    ["mask", "adapter", "positions", "shifted", "non-text", "wrong offset", "unknown token"],
)
def test_what_is_not_a_plain_causal_prefill_certifies_nothing(why):
    p = prov()
    n = 6
    toks = (1, 2, 3, 4, 5, 6)
    calls = [(Q1, embed(toks, 3 if why == "shifted" else 0, range(n)))]
    kw = {}
    if why == "mask":  # even a mask that equals the causal one
        kw["mask"] = np.tril(np.ones((n, n), dtype=np.bool_))
    elif why == "adapter":
        kw["adapter"] = 0
    elif why == "positions":
        kw["positions"] = ids(range(n))
    elif why == "non-text":  # inputs that a forward wrote, not embed_txt
        calls.append((Q1, fwd(range(n), outs=range(20, 26))))
    elif why == "unknown token":
        calls = [(Q1, embed((1, 2, 3, 400, 5, 6), 0, range(n)))]
    ins = range(20, 26) if why == "non-text" else range(n)
    calls.append((Q1, fwd(ins, out=[3, 7], off=1 if why == "wrong offset" else 0, **kw)))
    p.observe(calls)
    assert tokens_of(p, 3) is None and tokens_of(p, 7) is None


def test_masking_copying_and_swapping_keep_only_what_still_holds():
    p = prov()
    prefilled(p)
    # a mask hides slot 2: the page is certified up to it
    p.observe([(Q1, MaskKv(3, np.arange(PS) == 2))])
    assert tokens_of(p, 3) == (0, (1, 2))
    # so a forward over it is not canonical any more
    p.observe([(Q1, embed([9], 6, [10])), (Q1, fwd([10], ctx=[3, 7], last=2, out=[7], off=2))])
    assert tokens_of(p, 7) == (1, (5,)) or tokens_of(p, 7) == (1, (5, 6))
    assert tokens_of(p, 7) == (1, (5, 6))  # the slots before the write keep their tokens
    q = prov()
    prefilled(q)
    q.observe([(Q1, CopyKv(7, 9, 0, 0, 2))])  # to the same offsets: carried
    assert tokens_of(q, 9) == (1, (5, 6))
    q.observe([(Q1, CopyKv(3, 10, 0, 1, 2))])  # shifted by a slot: not
    assert tokens_of(q, 10) is None
    q.observe([(Q1, CopyKv(3, 9, 2, 2, 2))])  # slots 2-3 of page 0 into page 1: not
    assert tokens_of(q, 9) == (1, (5, 6))
    q.observe([(Q1, SwapIn(ids([9]), ids([9])))])
    assert tokens_of(q, 9) is None
    # a forward writing over certified slots with uncertified content ends them there
    q.observe([(Q1, fwd([30], ctx=[3], last=4, out=[7], off=1, mask=np.ones((1, 5), bool)))])
    assert tokens_of(q, 7) == (1, (5,))


def test_calls_of_other_queues_in_the_same_batch_certify_nothing_they_share():
    p = prov()
    prefilled(p)
    # Q2 writes the embedding slot Q1 reads: the engine embeds both before Q1's forward
    p.observe(
        [
            (Q1, embed([9], 6, [10])),
            (Q2, embed([8], 6, [10])),
            (Q1, fwd([10], ctx=[3, 7], last=2, out=[7], off=2)),
        ]
    )
    assert tokens_of(p, 7) == (1, (5, 6))
    # Q2 writes a page Q1's forward reads in the same batch
    p.observe(
        [
            (Q1, embed([9], 6, [11])),
            (Q2, embed([4], 0, [12])),
            (Q1, fwd([11], ctx=[3, 7], last=2, out=[7], off=2)),
            (Q2, fwd([12], out=[3])),
        ]
    )
    assert tokens_of(p, 7) == (1, (5, 6)) and tokens_of(p, 3) == (0, (4,))


def test_what_the_engine_would_reject_certifies_nothing():
    p = prov()
    prefilled(p)
    p.observe(
        [(Q1, embed([9, 8], 6, [10, 11])), (Q1, fwd([10, 11], ctx=[3, 7], last=2, out=[7], off=2))]
    )
    assert tokens_of(p, 7) == (1, (5, 6, 9, 8))
    for bad in [
        fwd([10], ctx=[3, 7], last=2, out=[3], off=2),  # overwrites its own context
        fwd([10], ctx=[3, 7], last=5, out=[7], off=2),  # ctx_last_len > page size
        fwd([], ctx=[3, 7], last=2, out=[7], off=2),  # no input
        fwd([10, 11, 12], ctx=[3], last=4, out=[7], off=0),  # not room for three
    ]:
        q = prov()
        prefilled(q)
        q.observe([(Q1, embed([9, 8, 7], 6, [10, 11, 12])), (Q1, bad)])
        assert tokens_of(q, 9) is None
        assert tokens_of(q, 7) in ((1, (5, 6)), None)


# ------------------------------------------------------------------------------ ownership


class Workload:
    """A ResourceManager with a prefix cache, driven like the control layer drives it:
    prefills that match, borrow and fill pages; canonical and other writes seen by the
    provenance; releases, exports, imports, evictions and write claims."""

    def __init__(self, seed: int, num_pages: int = 48) -> None:
        self.rng = random.Random(seed)
        self.cache = PrefixCache(PS)
        self.prov = KvProvenance(PS, num_pages, 256, 50, 1000, 64)
        self.res = ResourceManager(
            num_pages, 256, on_terminate=self.end, cache=self.cache, provenance=self.prov
        )
        self.live: dict[int, list[tuple[list[int], list[int]]]] = {}  # inst -> (tokens, handles)
        self.ids = iter(range(10**9))
        self.ended: list[int] = []
        self.exports: list[str] = []

    def end(self, inst: int, reason: str) -> None:
        self.ended.append(inst)
        self.res.remove_instance(inst)
        self.live.pop(inst, None)

    def start(self) -> int:
        inst = next(self.ids)
        self.res.add_instance(inst, self.rng.choice(USERS))
        self.live[inst] = []
        return inst

    def prefill(self, inst: int, tokens: list[int]) -> None:
        res, n = self.res, len(tokens)
        user = res.user_of(inst)
        m = self.cache.match(tokens, n - 1, namespace=user)
        root = m.node
        while root.parent is not None:
            root = root.parent
        assert root is self.cache.root_of(user), "a match from another user's tree"
        full = m.length // PS
        handles = res.reserve(inst, "kv", -(-n // PS))
        res.bind_cached(inst, handles[:full], m.pages[:full])
        try:
            res.bind_fresh(inst, "kv", handles[full:])
        except ResourceError:
            res.free(inst, "kv", handles[:full])
            res.unreserve(inst, "kv", handles[full:])
            return
        phys = res.translate(inst, "kv", handles)
        start = full * PS
        slots = list(range(n - start))
        calls = []
        if m.length % PS and full < len(phys):
            calls.append((inst, CopyKv(m.pages[full], phys[full], 0, 0, m.length % PS)))
            start = m.length
            slots = list(range(n - start))
        calls.append((inst, embed(tokens[start:], start, slots)))
        calls.append(
            (
                inst,
                fwd(
                    slots,
                    ctx=phys[: -(-start // PS)],
                    last=start - (-(-start // PS) - 1) * PS if start else 0,
                    out=phys[start // PS :],
                    off=start % PS,
                ),
            )
        )
        self.prov.observe(calls)
        self.live[inst].append((tokens, handles))
        if self.rng.random() < 0.5:
            res.offer(inst, [phys[-1]])

    def scribble(self, inst: int) -> None:
        """A write that is not canonical, to a page the instance holds."""
        if not self.live.get(inst):
            return
        _, handles = self.rng.choice(self.live[inst])
        h = self.rng.choice(handles)
        pid = self.res.translate(inst, "kv", [h])[0]
        try:
            self.res.claim_writes(inst, [pid])
        except ResourceError:
            return
        self.prov.observe([(inst, MaskKv(pid, np.arange(PS) == self.rng.randrange(PS)))])

    def release(self, inst: int) -> None:
        if self.live.get(inst):
            _, handles = self.live[inst].pop(self.rng.randrange(len(self.live[inst])))
            self.res.free(inst, "kv", handles)

    def check(self) -> None:
        self.res.check_integrity()
        # every cached page holds what the tree says: its record certifies the path's tokens
        for node in self.cache.nodes():
            path = []
            x = node
            while x.parent is not None:
                path = list(x.key) + path
                x = x.parent
            first = node.start // PS
            for k, page in enumerate(node.pages):
                idx = first + k
                want = tuple(path[idx * PS : min(len(path), (idx + 1) * PS)])
                rec = self.prov.record(page)
                got = rec.tokens[: len(want)]
                assert rec.index == idx and got == want, (page, rec, want)


USERS = (None, "alice", "bob")  # each user's prefills match only its own tree


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_workloads_keep_the_page_table_consistent(seed):
    w = Workload(seed)
    rng = w.rng
    stems = [[rng.randrange(1, 50) for _ in range(rng.randrange(2, 14))] for _ in range(6)]
    for _ in range(3000):
        r = rng.random()
        insts = list(w.live)
        if r < 0.1 or not insts:
            w.start()
        elif r < 0.45:
            seq = rng.choice(stems) + [rng.randrange(1, 50) for _ in range(rng.randrange(1, 10))]
            w.prefill(rng.choice(insts), seq)
        elif r < 0.65:
            w.release(rng.choice(insts))
        elif r < 0.72:
            w.scribble(rng.choice(insts))
        elif r < 0.8:
            inst = rng.choice(insts)
            if w.live[inst]:
                _, handles = rng.choice(w.live[inst])
                name = f"e{next(w.ids)}"
                w.res.export(inst, "kv", handles, name, persistent=rng.random() < 0.5)
                w.exports.append((name, w.res.user_of(inst)))
        elif r < 0.86 and w.exports:
            name, owner = rng.choice(w.exports)
            if name in dict((n, k) for n, k, _ in w.res.list_exports(owner)):
                if rng.random() < 0.5:
                    w.res.unexport(None, name, owner)
                else:  # maybe another user's (the server checks grants, not this layer)
                    inst = rng.choice(insts)
                    w.live[inst].append(([], w.res.import_(inst, "kv", name, owner)))
        elif r < 0.93:
            inst = rng.choice(insts)
            with contextlib.suppress(ResourceError):
                w.live[inst].append(([], w.res.alloc(inst, "kv", rng.randrange(1, 12))))
        else:
            w.end(rng.choice(insts), "done")
    w.check()
    for inst in list(w.live):
        w.end(inst, "done")
    for name, owner in w.exports:
        if name in dict((n, k) for n, k, _ in w.res.list_exports(owner)):
            w.res.unexport(None, name, owner)
    w.check()
    assert w.res.referenced("kv") == 0
    assert w.res.usage("kv")[0] + w.cache.cached_pages == 48
    assert w.cache.evictable_pages == w.cache.cached_pages
    assert Counter(w.res.cache_events)["adopted"] > 0


def test_reserved_handles_are_bound_later_and_freed_like_any_other():
    from pastry.control.resources import InvalidHandle, QuotaExceeded

    res = ResourceManager(8, 8, cache=PrefixCache(PS), provenance=prov())
    res.add_instance(1)
    res.set_limit(1, "kv", 4)
    h = res.reserve(1, "kv", 3)
    assert h == [0, 1, 2] and res.usage("kv") == (8, 0, 8)
    with pytest.raises(InvalidHandle, match="not filled yet"):
        res.translate(1, "kv", h)
    with pytest.raises(QuotaExceeded):  # reserved handles count against the limit
        res.alloc(1, "kv", 2)
    assert res.bind_fresh(1, "kv", h[:2]) == [0, 1]
    res.free(1, "kv", [h[2]])  # never bound: it just stops being reserved
    with pytest.raises(InvalidHandle):
        res.free(1, "kv", [h[2]])
    res.unbind(1, "kv", [h[1]])  # back to reserved, its page freed
    assert res.usage("kv") == (7, 1, 8)
    res.check(1, "kv", [h[0], h[1]])
    res.check_integrity()
    res.remove_instance(1)
    assert res.usage("kv") == (8, 0, 8)


def test_a_cached_page_is_written_only_by_its_only_user():
    cache, p = PrefixCache(PS), prov()
    res = ResourceManager(16, 64, cache=cache, provenance=p)
    for inst in (1, 2):
        res.add_instance(inst)
    pages = res.alloc(1, "kv", 2)
    p.observe([(Q1, embed([1, 2, 3, 4, 5, 6], 0, range(6))), (Q1, fwd(range(6), out=pages))])
    res.offer(1, [pages[1]])  # the prompt goes to the cache while instance 1 holds it
    assert cache.match([1, 2, 3, 4, 5, 6], touch=False).length == 6
    other = res.reserve(2, "kv", 1)
    res.bind_cached(2, other, [pages[0]])  # instance 2 shares page 0
    with pytest.raises(ResourceError, match="shared through the prefix cache"):
        res.claim_writes(1, [pages[0]])
    res.claim_writes(1, [pages[1]])  # page 1 is instance 1's alone: it leaves the cache
    assert cache.match([1, 2, 3, 4, 5, 6], touch=False).length == 4
    res.free(2, "kv", other)
    res.claim_writes(1, [pages[0]])  # now page 0 too
    assert cache.cached_pages == 0 and res.referenced("kv") == 2
    res.check_integrity()


def test_a_forward_the_engine_refused_is_forgotten_and_leaves_the_cache():
    from pastry.control.prefill import Prefiller

    cache, p = PrefixCache(PS), prov()
    res = ResourceManager(16, 64, cache=cache, provenance=p)
    res.add_instance(1)
    pages = res.alloc(1, "kv", 2)
    call = fwd(range(6), out=pages)
    p.observe([(Q1, embed([1, 2, 3, 4, 5, 6], 0, range(6))), (Q1, call)])
    res.offer(1, [pages[1]])
    assert cache.cached_pages == 2

    pf = Prefiller(res, scheduler=None, page_size=PS, cache=cache, provenance=p)
    pf.on_complete([(None, call)], [CallError("the engine refused the call")])
    assert p.record(pages[0]) is None and p.record(pages[1]) is None
    assert cache.cached_pages == 0 and res.referenced("kv") == 2
    res.check_integrity()


@pytest.mark.parametrize("seed", range(6))
def test_the_race_free_shortcut_changes_nothing(seed, monkeypatch):
    """Batches of random calls on a few queues (some sharing an instance) give the same
    records and embedding slots through the vectorised race check as through the
    per-page bookkeeping alone; and the check is taken for most of them."""
    import pastry.control.provenance as provenance
    import pastry.control.races as races

    monkeypatch.setattr(provenance, "_VECTOR_MIN", 1)
    rng = random.Random(seed)
    queues = [Q(1), Q(1), Q(2), Q(3), Q(4)]
    fast, slow = prov(), prov()
    taken = 0
    real = races.race_free
    for _ in range(300):
        calls = []
        for q in rng.sample(queues, rng.randint(1, 4)):
            for _ in range(rng.randint(1, 3)):
                kind = rng.random()
                if kind < 0.35:
                    n = rng.randint(1, 3)
                    start = rng.choice([0, 2, 4, 6])
                    calls.append((q, embed([rng.randrange(101) for _ in range(n)], start,
                                           rng.sample(range(64), n))))  # fmt: skip
                elif kind < 0.8:
                    n = rng.randint(1, 3)
                    ctx = rng.sample(range(16), rng.randint(0, 3))
                    out = rng.sample(range(16), rng.randint(0, 2))
                    calls.append((q, fwd(rng.sample(range(64), n), ctx=ctx,
                                         last=rng.randint(1, PS) if ctx else 0, out=out,
                                         off=rng.randrange(PS),
                                         outs=rng.sample(range(64), rng.randint(0, 1)))))  # fmt: skip
                elif kind < 0.9:
                    calls.append((q, CopyKv(rng.randrange(16), rng.randrange(16), 0, 0, 2)))
                else:
                    masked = np.zeros(PS, dtype=np.bool_)
                    masked[rng.randrange(PS)] = True
                    calls.append((q, MaskKv(rng.randrange(16), masked)))
        taken += real(calls)
        fast.observe(calls)
        monkeypatch.setattr(races, "race_free", lambda calls: False)
        slow.observe(calls)
        monkeypatch.setattr(races, "race_free", real)
        assert [tokens_of(fast, p) for p in range(16)] == [tokens_of(slow, p) for p in range(16)]
        assert np.array_equal(fast.embed_token, slow.embed_token)
        assert np.array_equal(fast.embed_position, slow.embed_position)
    assert taken > 50


def test_the_race_free_check_sees_every_kind_of_race():
    from pastry.control.races import race_free

    a, b = Q(1), Q(2)
    assert race_free([(a, fwd([1], ctx=[3], last=2, out=[3], off=2)), (b, fwd([2], out=[4]))])
    assert not race_free([(a, fwd([1], out=[3])), (b, fwd([2], out=[3]))])  # both write 3
    assert not race_free([(a, fwd([1], ctx=[3], last=1, out=[5])), (b, fwd([2], out=[3]))])
    assert not race_free([(a, CopyKv(3, 5, 0, 0, 1)), (b, fwd([2], out=[3]))])  # copy source
    masked = np.ones(PS, dtype=np.bool_)
    assert not race_free([(a, MaskKv(3, masked)), (b, CopyKv(4, 3, 0, 0, 1))])
    assert not race_free([(Q1, embed([1], 0, [4])), (Q2, embed([2], 0, [5]))])  # one instance


# ------------------------------------------------------------------------------ known chains


def full_walk(num_pages: int = 40) -> KvProvenance:
    """A provenance that knows no chain: every step walks its whole context (as before)."""
    p = prov_n(num_pages)
    p.chains.known = lambda ctx: (None, 0)  # type: ignore[method-assign]
    p.chains.remember = lambda *args: None  # type: ignore[method-assign]
    return p


def prov_n(num_pages: int) -> KvProvenance:
    return KvProvenance(PS, num_pages, 64, vocab_size=100, max_position=1000, max_batch_tokens=64)


def snapshot(p: KvProvenance) -> list:
    """Every page's record as values (index, tokens, key, the page and length of the record
    it continues), and the embedding slots."""
    out = []
    for r in p.records:
        if r is None:
            out.append(None)
            continue
        prev = None if r.prev is None else (r.prev.page, r.prev.index, r.prev.tokens)
        out.append((r.page, r.index, r.tokens, r.key, prev))
    return [out, p.embed_token.tolist(), p.embed_position.tolist()]


def decode(p: KvProvenance, pages: list[int], length: int, token: int, slot: int, q=Q1):
    """One decode step of a sequence of ``length`` tokens in ``pages`` (a new page appended
    by the caller when ``length`` fills the last one)."""
    ctx = pages[: -(-length // PS)]
    head = length % PS
    out = [ctx[-1]] if head else [pages[len(ctx)]]
    last = PS if ctx and not head else head
    p.observe([(q, embed([token], length, [slot])), (q, fwd([slot], ctx, last, out, head))])


def test_a_write_in_the_middle_of_a_known_chain_is_caught():
    """After decode steps that know the chain of full pages, any write to one of them (or a
    context that differs there) stops the next step's certification, as a full walk does."""
    writes = {
        "mask": lambda p: [(Q1, MaskKv(2, np.arange(PS) == 3))],
        "masked forward": lambda p: [
            (Q1, fwd([40], ctx=[1], last=4, out=[2], off=3, mask=np.ones((1, 8), bool)))
        ],
        "misaligned copy": lambda p: [(Q1, CopyKv(1, 2, 0, 1, 2))],
        "swap-in": lambda p: [(Q1, SwapIn(ids([0]), ids([2])))],
        "prefill of another sequence": lambda p: [
            (Q(5), embed([7, 7, 7, 7], 0, range(40, 44))),
            (Q(5), fwd(range(40, 44), out=[2])),
        ],
        "forgotten": lambda p: p.forget([2]) or [],
    }
    toks = list(range(1, 26))  # 25 tokens: pages 0..5 full, page 6 holds one
    pages = list(range(8))
    for name, write in writes.items():
        for p, known in ((prov_n(16), True), (full_walk(16), False)):
            p.observe([(Q1, embed(toks, 0, range(25))), (Q1, fwd(range(25), out=pages[:7]))])
            for n in range(25, 27):
                decode(p, pages, n, 50 + n, 30)
            assert p.certified([6]) == [3]
            assert not known or p.chains.chains[5].pages == [
                0,
                1,
                2,
                3,
                4,
                5,
            ]  # the steps know them
            p.observe(write(p))
            decode(p, pages, 27, 65, 30)
            assert p.certified([6]) == [3], name  # the step is not certified
            assert p.record(0).tokens == (1, 2, 3, 4)
            assert 5 not in p.chains.chains
            p.check_chains()
    # a context that names another page in the middle: not certified, even after a known
    # chain of the right one
    p = prov_n(16)
    p.observe([(Q1, embed(toks, 0, range(25))), (Q1, fwd(range(25), out=pages[:7]))])
    decode(p, pages, 25, 9, 30)
    assert p.chains.chains[5].pages == [0, 1, 2, 3, 4, 5]
    other = [0, 1, 10, 3, 4, 5, 6]
    p.observe([(Q1, embed([8], 26, [31])), (Q1, fwd([31], other, 2, [6], 2))])
    assert p.certified([6]) == [2]
    # a certified copy of the middle page is a valid context (keys chain), a misplaced one not
    p.observe([(Q1, CopyKv(2, 10, 0, 0, PS))])
    p.observe([(Q1, embed([8], 26, [31])), (Q1, fwd([31], other, 2, [6], 2))])
    assert p.certified([6]) == [3]
    misplaced = [0, 1, 3, 10, 4, 5, 6]
    p.observe([(Q1, embed([7], 27, [31])), (Q1, fwd([31], misplaced, 3, [6], 3))])
    assert p.certified([6]) == [3]
    p.check_chains()


def test_a_page_named_by_a_negative_index_is_never_known():
    """``records[-1]`` is the last page's record: a context naming it so is walked each time
    (a known chain would miss writes to it under its own number)."""
    toks = list(range(1, 26))
    pages = [0, 1, 2, 3, 4, 15, 6, 7]
    results = []
    for p in (prov_n(16), full_walk(16)):
        p.observe([(Q1, embed(toks, 0, range(25))), (Q1, fwd(range(25), out=pages[:7]))])
        aliased = [0, 1, 2, 3, 4, -1, 6, 7]
        decode(p, aliased, 25, 9, 30)
        p.observe([(Q1, MaskKv(15, np.arange(PS) == 3))])
        decode(p, aliased, 26, 9, 30)
        results.append(p.certified([6]))
        p.check_chains()
    assert results == [[2], [2]]


class Sequences:
    """Random decode workloads over a small page pool: sequences prefill, decode, fork
    (sharing their full pages, copying the partial one), roll back, end (their pages are
    reused by others), and meanwhile pages get masked, overwritten, copied over, swapped in
    and forgotten; some batches race (another instance writes a page one reads)."""

    def __init__(self, seed: int, num_pages: int = 40) -> None:
        self.rng = random.Random(seed)
        self.free = list(range(num_pages))
        self.rng.shuffle(self.free)
        self.refs: Counter[int] = Counter()
        self.seqs: dict[int, tuple[list[int], int]] = {}  # instance -> (pages, length)
        self.next = 1
        self.q = {i: Q(i) for i in range(1, 9)}  # one queue per instance (8: a disturber)

    def take(self) -> int | None:
        if not self.free:
            return None
        p = self.free.pop()
        self.refs[p] += 1
        return p

    def drop(self, pages: list[int]) -> None:
        for p in pages:
            self.refs[p] -= 1
            if not self.refs[p]:
                del self.refs[p]
                self.free.insert(self.rng.randrange(len(self.free) + 1), p)

    def batch(self) -> list:
        rng, calls = self.rng, []
        for inst in rng.sample(sorted(self.seqs), min(len(self.seqs), rng.randint(1, 3))):
            calls += self.step(inst)
        kind = rng.random()
        if kind < 0.15 or not self.seqs:
            calls += self.prefill()
        elif kind < 0.22:
            self.fork(rng.choice(sorted(self.seqs)), calls)
        elif kind < 0.28:
            inst = rng.choice(sorted(self.seqs))
            self.drop(self.seqs.pop(inst)[0])
        elif kind < 0.45:
            calls += self.disturb()
        return calls

    def prefill(self) -> list:
        n = self.rng.randint(1, 14)
        pages = [self.take() for _ in range(-(-n // PS) + 1)]
        if None in pages:
            self.drop([p for p in pages if p is not None])
            return []
        inst, self.next = self.next, self.next % 7 + 1
        if inst in self.seqs:
            self.drop(self.seqs.pop(inst)[0])
        self.seqs[inst] = (pages, n)
        slots = range(inst * 8, inst * 8 + n) if n <= 8 else range(inst * 8, inst * 8 + 8)
        toks = [self.rng.randrange(100) for _ in range(n)]
        if n > 8:  # two chunks: the second continues the first
            return [
                (self.q[inst], embed(toks[:8], 0, slots)),
                (self.q[inst], fwd(slots, out=pages[:2])),
                (self.q[inst], embed(toks[8:], 8, range(inst * 8, inst * 8 + n - 8))),
                (self.q[inst], fwd(range(inst * 8, inst * 8 + n - 8), pages[:2], 4, pages[2:], 0)),
            ]
        return [
            (self.q[inst], embed(toks, 0, slots)),
            (self.q[inst], fwd(slots, out=pages[:-1] or pages)),
        ]

    def step(self, inst: int) -> list:
        """A decode step (sometimes two tokens, a rollback first, or an odd context)."""
        rng = self.rng
        pages, n = self.seqs[inst]
        if rng.random() < 0.05 and n > 1:  # roll back
            n = rng.randint(1, n - 1)
            keep = -(-n // PS) + 1
            self.drop(pages[keep:])
            pages = pages[:keep]
        k = 2 if rng.random() < 0.1 else 1
        while len(pages) * PS < n + k:
            p = self.take()
            if p is None:
                return []
            pages.append(p)
        self.seqs[inst] = (pages, n + k)
        ctx = pages[: -(-n // PS)]
        head = n % PS
        out = [ctx[-1], *pages[len(ctx) : len(ctx) + 1]] if head else pages[len(ctx) :][:2]
        last = head or PS
        odd = rng.random()
        if odd < 0.03 and len(ctx) > 2:  # two pages swapped
            i, j = rng.sample(range(len(ctx) - 1), 2)
            ctx = list(ctx)
            ctx[i], ctx[j] = ctx[j], ctx[i]
        elif odd < 0.06 and len(ctx) > 1:  # a page of someone else's
            ctx = list(ctx)
            ctx[rng.randrange(len(ctx) - 1)] = rng.randrange(40)
        slots = list(range(inst * 8, inst * 8 + k))
        toks = [rng.randrange(100) for _ in range(k)]
        return [
            (self.q[inst], embed(toks, n, slots)),
            (self.q[inst], fwd(slots, ctx, last, out, head)),
        ]

    def fork(self, inst: int, calls: list) -> None:
        pages, n = self.seqs[inst]
        full = n // PS
        new = self.take()
        spare = self.take()
        if new is None or spare is None:
            self.drop([p for p in (new, spare) if p is not None])
            return
        child = max(self.seqs) + 1 if len(self.seqs) < 7 else None
        if child is None or child > 7:
            self.drop([new, spare])
            return
        for p in pages[:full]:
            self.refs[p] += 1
        if n % PS:
            calls.append((self.q[inst], CopyKv(pages[full], new, 0, 0, n % PS)))
        self.seqs[child] = ([*pages[:full], new, spare], n)

    def disturb(self) -> list:
        rng = self.rng
        page = rng.choice(sorted(self.refs)) if self.refs else 0
        q = self.q[rng.choice([8, *self.seqs])]
        kind = rng.randrange(6)
        if kind == 0:
            return [(q, MaskKv(page, np.arange(PS) == rng.randrange(PS)))]
        if kind == 1:
            return [(q, fwd([0], ctx=[page], last=PS, out=[page], off=rng.randrange(PS),
                            mask=np.ones((1, 2 * PS), bool)))]  # fmt: skip
        if kind == 2:  # a copy: aligned (may carry certification) or not
            src = rng.choice(sorted(self.refs))
            so = rng.randrange(PS)
            do = so if rng.random() < 0.6 else rng.randrange(PS)
            n = rng.randint(1, PS - max(so, do))
            return [(q, CopyKv(src, page, so, do, n))]
        if kind == 3:
            return [(q, SwapIn(ids([0]), ids([page])))]
        if kind == 4:  # a prefill of another instance into a page in use (a race, or after)
            return [(self.q[8], embed([1, 2], 0, [1, 2])), (self.q[8], fwd([1, 2], out=[page]))]
        return [("forget", [page])]


@pytest.mark.parametrize("walked", [1, 4])
@pytest.mark.parametrize("seed", range(3))
def test_known_chains_certify_exactly_what_a_full_walk_does(seed, walked, monkeypatch):
    """The same random batches into a provenance that reuses known chains and one that
    walks every context in full leave identical records (tokens, keys, chains) and
    embedding slots after every batch; the known chains are exact; and they are used
    (also for contexts shorter than those walked in full by default: ``walked``)."""
    import pastry.control.provenance as provenance

    monkeypatch.setattr(provenance, "_WALKED", walked)
    fast, slow = prov_n(40), full_walk()
    work = Sequences(seed)
    real, reused = fast.chains.known, []

    def known(ctx):
        c, start = real(ctx)
        reused.append((start, len(ctx)))
        return c, start

    fast.chains.known = known  # type: ignore[method-assign]
    for _ in range(1500):
        calls = work.batch()
        for p in (fast, slow):
            if calls and calls[0][0] == "forget":
                p.forget(calls[0][1])
            else:
                p.observe(calls)
        assert snapshot(fast) == snapshot(slow)
        fast.check_chains()
    assert sum(start >= 4 for start, _ in reused) > 100  # known chains of 4+ pages used
    assert sum(start >= 1 for start, _ in reused) > (1000 if walked == 1 else 100)
    assert sum(n - start >= 3 for start, n in reused) > 100  # and long walks after writes


def test_the_race_lookup_for_long_contexts_is_the_plain_one():
    """``reads_raced`` looks a long context up the other way round (the few pages a batch
    writes in it): the same answer as asking page by page."""
    from pastry.control.races import MANY, reads_raced

    rng = random.Random(0)
    q, other = Q(1), Q(2)
    for _ in range(3000):
        table = {rng.randrange(40): rng.choice([q, other, MANY]) for _ in range(rng.randint(0, 6))}
        keys = rng.sample(range(40), rng.randint(0, 30))
        plain = any(table.get(k) is not None and table[k] is not q for k in keys)
        assert reads_raced(table, ids(keys), q) == plain
