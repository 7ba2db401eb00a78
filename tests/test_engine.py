"""The engine against transformers on random checkpoints of each architecture."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine_util import Pages, Seq, dense, hf_checkpoint, hf_model
from pastry.engine.calls import (
    CopyKv,
    EmbedTxt,
    Forward,
    MaskKv,
    NextDist,
    Sample,
    SwapIn,
    SwapOut,
    ids,
)
from pastry.engine.config import EngineConfig
from pastry.engine.engine import Engine

ARCHS = ["llama", "qwen2", "qwen3", "mistral"]
SMALL_POOLS = dict(num_pages=256, num_embeds=2048, num_host_pages=16, page_size=4)


@pytest.fixture(scope="session")
def make_mistral(make_tiny, tmp_path_factory):
    """A mistral checkpoint written by transformers itself, with a short sliding window."""
    from transformers import MistralConfig, MistralForCausalLM

    path = tmp_path_factory.mktemp("mistral")

    def make():
        if (path / "config.json").exists():
            return path
        return hf_checkpoint(
            make_tiny("llama"), path, MistralConfig, MistralForCausalLM, sliding_window=8
        )

    return make


@pytest.fixture(scope="module", params=ARCHS)
def arch_ckpt(request, make_tiny, make_mistral):
    if request.param == "mistral":
        return request.param, make_mistral()
    return request.param, make_tiny(request.param)


def load(path, dtype="float32", **kw) -> Engine:
    return Engine.load(path, EngineConfig(dtype=dtype, **{**SMALL_POOLS, **kw}))


def prompt(n: int, vocab: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


def test_prefill_logits_match_transformers(arch_ckpt):
    arch, path = arch_ckpt
    eng, hf = load(path), hf_model(path)
    toks = prompt(23, eng.info.vocab_size)
    with torch.no_grad():
        ref = hf(torch.tensor([toks])).logits[0].double().softmax(-1).numpy()
    alloc = Pages(eng)
    seq = Seq(alloc)
    calls, _ = seq.forward_calls(toks)
    # ask for every position's output
    fwd = calls[1]
    outs = alloc.embeds(len(toks))
    calls[1] = Forward(
        in_embeds=fwd.in_embeds,
        out_pages=fwd.out_pages,
        out_embeds=outs,
        out_indices=ids(range(len(toks))),
        positions=fwd.positions,
    )
    v = eng.info.vocab_size
    res = eng.execute([*calls, *[NextDist(int(o), k=v) for o in outs]])
    ours = np.stack([dense(d, v) for d in res[2:]])
    np.testing.assert_allclose(ours, ref, atol=2e-5)
    assert (ours.argmax(-1) == ref.argmax(-1)).all(), arch


def test_greedy_continuation_matches_transformers(arch_ckpt):
    _, path = arch_ckpt
    eng, hf = load(path), hf_model(path)
    toks = prompt(12, eng.info.vocab_size, seed=1)
    with torch.no_grad():
        ref = hf.generate(
            torch.tensor([toks]),
            max_new_tokens=32,
            do_sample=False,
            min_new_tokens=32,
            pad_token_id=0,
        )[0, len(toks) :].tolist()
    assert Seq(Pages(eng)).greedy(toks, 32) == ref


def test_split_prefill_equals_single_call(make_tiny):
    """Pie §4.2: 9 tokens in one forward == 8 tokens into KV pages, then 1 on top."""
    eng = load(make_tiny("llama"))
    toks = prompt(9, eng.info.vocab_size, seed=2)
    whole = Seq(Pages(eng)).step(toks)
    split = Seq(Pages(eng, first_page=100, first_embed=1000))
    split.step(toks[:8])
    np.testing.assert_allclose(split.step(toks[8:]), whole, atol=1e-6)


def test_dependent_forwards_in_one_batch(make_tiny):
    """Vertical batching: a forward on top of another forward of the same batch sees its KV
    (the paper's split prefill, both calls in one batch)."""
    eng = load(make_tiny("llama"))
    v = eng.info.vocab_size
    toks = prompt(9, v, 14)
    whole = Seq(Pages(eng)).step(toks)
    seq = Seq(Pages(eng, first_page=100, first_embed=1000))
    first, _ = seq.forward_calls(toks[:6])
    second, out = seq.forward_calls(toks[6:])
    res = eng.execute([first[0], second[0], first[1], second[1], NextDist(out, k=v)])
    np.testing.assert_allclose(dense(res[-1], v), whole, atol=1e-6)


def run_alone(path, item):
    eng = load(path)
    seq = Seq(Pages(eng))
    return item(seq)


def test_mixed_batch_equals_each_item_alone(make_tiny):
    path = make_tiny("qwen3")
    eng = load(path)
    v = eng.info.vocab_size
    alloc = Pages(eng)
    p_long, p_short, p_dec = prompt(13, v, 3), prompt(5, v, 4), prompt(7, v, 5)
    # set up a decoding sequence and a sequence with a masked-out token
    dec = Seq(alloc)
    dec.step(p_dec)
    masked = Seq(alloc)
    masked.step(p_short)
    eng.execute([MaskKv(masked.pages[0], np.array([False, True, False, False]))])

    a, b = Seq(alloc), Seq(alloc)
    calls_a, out_a = a.forward_calls(p_long)  # prefill
    calls_b, out_b = b.forward_calls(p_short[:3], mask=np.tri(3, dtype=bool))  # explicit mask
    calls_d, out_d = dec.forward_calls([p_dec[0]])  # decode on 7 tokens of context
    calls_m, out_m = masked.forward_calls([p_short[0], p_short[1]])  # 2 tokens over masked ctx
    batch = [
        calls_a[0],
        calls_b[0],
        calls_d[0],
        calls_m[0],
        calls_a[1],
        calls_b[1],
        calls_d[1],
        calls_m[1],
        *[NextDist(o, k=v) for o in (out_a, out_b, out_d, out_m)],
    ]
    res = eng.execute(batch)
    assert res[:8] == [None] * 8
    together = [dense(d, v) for d in res[8:]]

    def alone_a(s):
        return s.step(p_long)

    def alone_b(s):
        return s.step(p_short[:3], mask=np.tri(3, dtype=bool))

    def alone_d(s):
        s.step(p_dec)
        return s.step([p_dec[0]])

    def alone_m(s):
        s.step(p_short)
        s.alloc.engine.execute([MaskKv(s.pages[0], np.array([False, True, False, False]))])
        return s.step([p_short[0], p_short[1]])

    for got, fn in zip(together, (alone_a, alone_b, alone_d, alone_m), strict=True):
        np.testing.assert_allclose(got, run_alone(path, fn), atol=1e-6)


def test_masking_a_token_equals_deleting_it(make_tiny):
    eng = load(make_tiny("llama"))
    v = eng.info.vocab_size
    toks = prompt(10, v, 6)
    # A: t0..t3 into pages, mask t3, then t4..t9 and the query on top
    a = Seq(Pages(eng))
    a.step(toks[:4])
    eng.execute([MaskKv(a.pages[0], np.array([False, False, False, True]))])
    a.step(toks[4:9])
    got = a.step([toks[9]])
    # B: the same positions without t3
    b = Seq(Pages(eng, first_page=100, first_embed=1000))
    keep = [0, 1, 2, 4, 5, 6, 7, 8]
    b.step([toks[i] for i in keep], positions=keep)
    want = b.step([toks[9]], positions=[9])
    np.testing.assert_allclose(got, want, atol=1e-6)
    # and masking through the forward's own mask gives the same
    c = Seq(Pages(eng, first_page=200, first_embed=1500))
    mask = np.tri(9, dtype=bool)
    mask[4:, 3] = False
    c.step(toks[:9], mask=mask)
    c_mask = np.ones((1, 10), dtype=bool)
    c_mask[0, 3] = False
    np.testing.assert_allclose(c.step([toks[9]], mask=c_mask), want, atol=1e-6)


def test_omitting_a_page_masks_its_tokens(make_tiny):
    eng = load(make_tiny("llama"))
    v = eng.info.vocab_size
    toks = prompt(9, v, 7)
    a = Seq(Pages(eng))
    a.step(toks[:8])  # pages p0, p1 (4 tokens each)
    calls, out = a.forward_calls([toks[8]])
    fwd = calls[1]
    skip = Forward(
        in_embeds=fwd.in_embeds,
        ctx_pages=ids([a.pages[1]]),
        ctx_last_len=4,
        out_pages=ids([]),
        out_embeds=fwd.out_embeds,
        out_indices=fwd.out_indices,
        positions=fwd.positions,
    )
    got = dense(eng.execute([calls[0], skip, NextDist(out, k=v)])[2], v)
    b = Seq(Pages(eng, first_page=100, first_embed=1000))
    b.step(toks[:4])  # computes p0's tokens
    eng.execute([MaskKv(a.pages[0], np.ones(4, dtype=bool))])
    want = a.step([toks[8]])
    np.testing.assert_allclose(got, want, atol=1e-6)


def test_sampling_is_seeded_and_batch_independent(make_tiny):
    eng = load(make_tiny("llama"))
    v = eng.info.vocab_size
    seq = Seq(Pages(eng))
    calls, out = seq.forward_calls(prompt(6, v, 8))
    eng.execute(calls)
    params = dict(temperature=1.0, top_k=50, top_p=0.9, min_p=0.01)
    alone = [eng.execute([Sample(out, seed=s, **params)])[0] for s in range(20)]
    batched = eng.execute([Sample(out, seed=s, **params) for s in range(20)])
    assert alone == batched
    assert len(set(alone)) > 1  # different seeds, different draws
    dist = dense(eng.execute([NextDist(out, k=v)])[0], v)
    greedy = eng.execute([Sample(out)])[0]
    assert greedy == int(dist.argmax())
    top5 = set(np.argsort(-dist)[:5].tolist())
    draws = eng.execute([Sample(out, temperature=1.0, top_k=5, seed=s) for s in range(200)])
    assert set(draws) <= top5
    tiny_p = eng.execute([Sample(out, temperature=1.0, top_p=1e-6, seed=s) for s in range(20)])
    assert set(tiny_p) == {greedy}


def test_sampling_follows_the_distribution(make_tiny):
    """Seeded draws follow softmax(logits / T): each of the top tokens, and the rest as one
    bin, is drawn within 5 standard deviations of its expected count."""
    eng = load(make_tiny("llama"))
    v = eng.info.vocab_size
    seq = Seq(Pages(eng))
    calls, out = seq.forward_calls(prompt(3, v, 9))
    eng.execute(calls)
    dist = dense(eng.execute([NextDist(out, k=v)])[0], v)
    temp, draws_n = 0.05, 4000
    logp = np.log(np.maximum(dist, 1e-30)) / temp
    want = np.exp(logp - logp.max())
    want /= want.sum()
    draws = eng.execute([Sample(out, temperature=temp, seed=s) for s in range(draws_n)])
    got = np.bincount(draws, minlength=v)
    top = np.argsort(-want)[:8]
    bins = [(got[t], want[t]) for t in top]
    bins.append((draws_n - got[top].sum(), 1 - want[top].sum()))
    assert want[top[0]] < 0.9  # the test is not vacuous: the draws are spread
    for count, p in bins:
        sigma = np.sqrt(draws_n * p * (1 - p))
        assert abs(count - draws_n * p) <= 5 * sigma + 1, (count, draws_n * p)


def test_copy_mask_and_swap_pages(make_tiny):
    eng = load(make_tiny("llama"))
    v = eng.info.vocab_size
    toks = prompt(8, v, 10)
    a = Seq(Pages(eng))
    a.step(toks)
    want = a.step([toks[0]])
    # copy both pages token by token into fresh pages; same result on top of the copy
    b = Seq(Pages(eng, first_page=100, first_embed=1000))
    b.pages, b.length = b.alloc.pages(2).tolist(), 8
    res = eng.execute(
        [
            CopyKv(a.pages[0], 100, 0, 0, 4),
            CopyKv(a.pages[1], 101, 0, 0, 2),
            CopyKv(a.pages[1], 101, 2, 2, 2),
        ]
    )
    assert res == [None] * 3
    b_calls, out = b.forward_calls([toks[0]])
    got = dense(eng.execute([*b_calls, NextDist(out, k=v)])[2], v)
    np.testing.assert_allclose(got, want, atol=1e-6)
    # swap out, clobber, swap in
    snapshot = [t[:, 400:408].clone() for t in eng.kv.k]
    assert eng.execute([SwapOut(ids([100, 101]), ids([3, 4]))]) == [None]
    eng.execute([MaskKv(100, np.ones(4, dtype=bool))])
    for t in eng.kv.k:
        t[:, 400:408] = 0
    assert eng.execute([SwapIn(ids([3, 4]), ids([100, 101]))]) == [None]
    for t, s in zip(eng.kv.k, snapshot, strict=True):
        assert torch.equal(t[:, 400:408], s)
    assert bool(eng.kv.attendable[400:408].all())


BAD_CALLS = {
    "page out of range": lambda e: Forward(
        in_embeds=ids([0]), ctx_pages=ids([e.info.num_pages]), ctx_last_len=1
    ),
    "negative page": lambda e: Forward(in_embeds=ids([0]), out_pages=ids([-1])),
    "embed out of range": lambda e: Forward(in_embeds=ids([e.info.num_embeds])),
    "position too large": lambda e: EmbedTxt(ids([1]), ids([e.info.max_position]), ids([0])),
    "token >= vocab": lambda e: EmbedTxt(ids([e.info.vocab_size]), ids([0]), ids([0])),
    "lengths differ": lambda e: EmbedTxt(ids([1, 2]), ids([0]), ids([0, 1])),
    "too few output slots": lambda e: Forward(in_embeds=ids([0] * 5), out_pages=ids([7])),
    "last_len > page": lambda e: Forward(in_embeds=ids([0]), ctx_pages=ids([1]), ctx_last_len=5),
    "bad mask shape": lambda e: Forward(in_embeds=ids([0]), mask=np.ones((2, 2), dtype=bool)),
    "empty mask row": lambda e: Forward(in_embeds=ids([0]), mask=np.zeros((1, 1), dtype=bool)),
    "output index >= n": lambda e: Forward(
        in_embeds=ids([0]), out_embeds=ids([3]), out_indices=ids([1])
    ),
    "dist k = 0": lambda e: NextDist(0, k=0),
    "negative temperature": lambda e: Sample(0, temperature=-1.0),
    "top_p > 1": lambda e: Sample(0, top_p=1.5),
    "copy crosses page": lambda e: CopyKv(0, 1, 2, 0, 3),
    "mask wrong size": lambda e: MaskKv(0, np.ones(3, dtype=bool)),
    "swap to missing host page": lambda e: SwapOut(ids([0]), ids([e.info.num_host_pages])),
    "output overwrites context": lambda e: Forward(
        in_embeds=ids([0]), ctx_pages=ids([1]), ctx_last_len=3, out_pages=ids([1]), out_offset=2
    ),
    "output page repeats": lambda e: Forward(in_embeds=ids([0] * 5), out_pages=ids([7, 7])),
    "float ids": lambda e: Forward(in_embeds=np.array([0.5])),
}


@pytest.mark.parametrize("name", list(BAD_CALLS))
def test_bad_call_fails_alone(make_tiny, name):
    """A bad call gets a clear error; the rest of the batch runs and no other page changes."""
    eng = load(make_tiny("llama"))
    v = eng.info.vocab_size
    toks = prompt(6, v, 11)
    victim = Seq(Pages(eng, first_page=50, first_embed=500))
    victim.step(toks)
    before = [t.clone() for t in (*eng.kv.k, *eng.kv.v, eng.kv.attendable)]
    good = Seq(Pages(eng, first_page=10, first_embed=100))
    calls, out = good.forward_calls(toks)
    bad = BAD_CALLS[name](eng)
    res = eng.execute([calls[0], bad, calls[1], bad, Sample(out)])
    assert res[0] is None and res[2] is None
    assert type(res[1]).__name__ == "CallError" and res[1].message, res[1]
    assert isinstance(res[4], int)
    alone = Seq(Pages(load(make_tiny("llama")), first_page=10, first_embed=100)).greedy(toks, 1)
    assert res[4] == alone[0]
    # the victim's pages (50, 51) are untouched
    ps = eng.page_size
    sl = slice(50 * ps, 52 * ps)
    for t, b in zip((*eng.kv.k, *eng.kv.v, eng.kv.attendable), before, strict=True):
        assert torch.equal(
            t[..., sl, :] if t.dim() == 3 else t[sl], b[..., sl, :] if b.dim() == 3 else b[sl]
        )


def test_bfloat16_engine_tracks_float32(make_tiny):
    path = make_tiny("qwen2")
    toks = prompt(16, 10_000, 12)
    f32 = load(path, dtype="float32")
    b16 = load(path, dtype="bfloat16")
    toks = [t % f32.info.vocab_size for t in toks]
    p32 = Seq(Pages(f32)).step(toks)
    p16 = Seq(Pages(b16)).step(toks)
    assert b16.info.dtype == "bfloat16"
    assert np.abs(p32 - p16).max() < 0.05


def test_pool_sizes_from_memory(make_tiny):
    eng = Engine.load(
        make_tiny("llama"), EngineConfig(dtype="float32", kv_memory_fraction=0.01, max_kv_pages=512)
    )
    assert 0 < eng.info.num_pages <= 512
    assert eng.info.num_embeds > 0 and eng.info.num_host_pages > 0
    info = eng.info
    assert info.arch == "llama" and info.page_size == 16 and info.vocab_size > 0
    assert "forward" in info.traits and info.tokenizer_json


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_matches_cpu(make_tiny, dtype):
    path = make_tiny("llama")
    cpu, gpu = load(path, dtype=dtype), load(path, dtype=dtype, device="cuda")
    toks = prompt(20, cpu.info.vocab_size, 13)
    p_cpu = Seq(Pages(cpu)).step(toks)
    p_gpu = Seq(Pages(gpu)).step(toks)
    assert np.abs(p_cpu - p_gpu).max() < (1e-4 if dtype == "float32" else 0.05)
    if dtype == "float32":
        assert Seq(Pages(gpu)).greedy(toks, 16) == Seq(Pages(cpu)).greedy(toks, 16)


def test_single_token_items_without_context_or_storage(make_tiny):
    """Decode-shaped items (one token) whose K/V are not stored take the cat path; a
    batch of them equals each alone (regression: a view of a permuted tensor)."""
    eng = load(make_tiny("llama"))
    v = eng.info.vocab_size
    calls = []
    for i, t in enumerate([5, 9, 13]):
        calls += [
            EmbedTxt(ids([t]), ids([0]), ids([i])),
            Forward(in_embeds=ids([i]), out_embeds=ids([10 + i]), out_indices=ids([0])),
        ]
    res = eng.execute([*calls[0::2], *calls[1::2], *[NextDist(10 + i, k=v) for i in range(3)]])
    for i, t in enumerate([5, 9, 13]):
        alone = Seq(Pages(eng, first_page=100, first_embed=500 + 10 * i)).step([t])
        np.testing.assert_allclose(dense(res[6 + i], v), alone, atol=1e-6)


def test_sampling_noise_is_finite_and_never_picks_a_masked_token(make_tiny):
    """The hash noise stays inside (0, 1): seed 28 with a 49152-token vocabulary once gave
    token 33574 u = 1.0 (24 bits of hash, rounded up in float32), so its Gumbel noise was
    +inf and a masked token came out of a constrained draw as NaN (-inf + inf)."""
    from pastry.engine.calls import mask_words
    from pastry.engine.sampling import hash_uniform

    u = hash_uniform(torch.arange(64).unsqueeze(1), torch.arange(49152).unsqueeze(0))
    assert float(u.max()) < 1.0 and float(u.min()) > 0.0
    eng = load(make_tiny("llama"))
    v = eng.info.vocab_size
    seq = Seq(Pages(eng))
    calls, out = seq.forward_calls(prompt(6, v, 8))
    eng.execute(calls)
    allowed = [3, 70]
    mask = np.zeros(mask_words(v), np.uint32)
    for t in allowed:
        mask[t >> 5] |= np.uint32(1 << (t & 31))
    mask = mask.view(np.int32)
    draws = eng.execute([Sample(out, temperature=1.0, seed=s, mask=mask) for s in range(300)])
    assert set(draws) <= set(allowed)
    draws = eng.execute(
        [Sample(out, temperature=1.0, top_p=0.95, seed=s, mask=mask) for s in range(300)]
    )
    assert set(draws) <= set(allowed)
