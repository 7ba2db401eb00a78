"""The compiled decode step (engine/compiled.py) computes what the eager model computes.

Compiling costs tens of seconds, so the graphs are built once per dtype (the first engine
with ``compile=True`` warms them up; later engines of the same shapes reuse them) and the
tests share one compiled float32 engine per checkpoint.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from engine_util import Pages, Seq, dense, hf_checkpoint, hf_model
from pastry.engine.engine import Engine
from pastry.wire.calls import (
    EmbedTxt,
    Forward,
    MaskKv,
    NextDist,
    Sample,
    SwapIn,
    SwapOut,
    ids,
    mask_words,
)
from pastry.wire.config import EngineConfig

POOLS = dict(num_pages=256, num_embeds=2048, num_host_pages=16, page_size=4)


def load(path, dtype="float32", **kw) -> Engine:
    return Engine.load(path, EngineConfig(dtype=dtype, **{**POOLS, **kw}))


@pytest.fixture(scope="module")
def llama(make_tiny):
    path = make_tiny("llama")
    return path, load(path, compile=True), load(path)


def batch(items: list[tuple[list, int]]) -> tuple[list, list[int]]:
    """One batch of several sequences' ``forward_calls``: all embeds, then all forwards (the
    engine batches runs of consecutive calls of one type)."""
    calls = [c for cs, _ in items for c in cs if isinstance(c, EmbedTxt)]
    calls += [c for cs, _ in items for c in cs if isinstance(c, Forward)]
    return calls, [o for _, o in items]


def prompt(n: int, vocab: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


def test_greedy_and_logits_match_transformers(llama):
    path, eng, _ = llama
    hf = hf_model(path)
    toks = prompt(12, eng.info.vocab_size, seed=1)
    with torch.no_grad():
        ref = hf.generate(
            torch.tensor([toks]), max_new_tokens=24, min_new_tokens=24, do_sample=False
        )[0].tolist()
    steps = eng.compiled.steps
    assert Seq(Pages(eng)).greedy(toks, 24) == ref[len(toks) :]
    assert eng.compiled.steps - steps == 23  # every decode step ran compiled
    # logits of each decode step against transformers' on the same sequence
    seq = Seq(Pages(eng, first_page=100, first_embed=1000))
    with torch.no_grad():
        ref_logits = hf(torch.tensor([ref])).logits[0].double().softmax(-1).numpy()
    ours = [seq.step(ref[:12])]
    ours += [seq.step([t]) for t in ref[12:-1]]
    np.testing.assert_allclose(np.stack(ours), ref_logits[11:-1], atol=1e-5)


def mixed_batches(eng: Engine, steps: int, first_page: int = 0, first_embed: int = 0) -> np.ndarray:
    """Next-token distributions of decode batches of 1, 3 and 5 sequences whose contexts
    have different lengths (3 + 7 i prompt tokens), ``steps`` rounds."""
    vocab = eng.info.vocab_size
    alloc = Pages(eng, first_page=first_page, first_embed=first_embed)
    seqs = [Seq(alloc) for _ in range(5)]
    out = []
    for i, s in enumerate(seqs):
        s.step(prompt(3 + 7 * i, vocab, seed=i))
    for step in range(steps):
        for b in (1, 3, 5):  # a batch of 1 and two symbolic-size batches
            calls, outs = batch(
                [s.forward_calls([(step * 7 + i) % vocab]) for i, s in enumerate(seqs[:b])]
            )
            res = eng.execute([*calls, *(NextDist(o, k=vocab) for o in outs)])
            out += [dense(d, vocab) for d in res[len(calls) :]]
    return np.stack(out)


def test_batches_of_mixed_lengths_equal_eager(llama):
    """Decode batches whose items have different context lengths (padding and masks), at
    several batch sizes, agree with the eager engine to float32 rounding."""
    _, comp, eager = llama
    np.testing.assert_allclose(mixed_batches(comp, 4), mixed_batches(eager, 4), atol=1e-6)


def test_no_recompiles_after_warm_up(llama):
    """Batch sizes and context lengths never seen before reuse the two warmed-up graphs."""
    _, eng, _ = llama
    vocab = eng.info.vocab_size
    alloc = Pages(eng, first_page=100, first_embed=1000)
    seqs = [Seq(alloc) for _ in range(7)]
    for i, s in enumerate(seqs):
        s.step(prompt(4 + 9 * i, vocab, seed=i))
    before = eng.compiled.steps
    with torch._dynamo.config.patch(error_on_recompile=True):
        for b in (7, 1, 4, 2, 6):
            calls, _ = batch([s.forward_calls([5]) for s in seqs[:b]])
            assert eng.execute(calls) == [None] * len(calls)
    assert eng.compiled.steps - before == 5


def test_decode_steps_beside_a_prefill_run_compiled_after_it(llama):
    """A batch of a decode step and a prefill: the prefill runs eagerly, then the decode
    step compiled. Not when the prefill reads the slot the decode step writes (a fork one
    token on): all eagerly, as one. A decode that does not store its K/V runs eagerly.
    Every result equals the eager engine's."""
    _, comp, eager = llama
    vocab = comp.info.vocab_size
    outs, counts = {}, {}
    for name, eng in (("compiled", comp), ("eager", eager)):
        alloc = Pages(eng, first_page=0, first_embed=0)
        a, b = Seq(alloc), Seq(alloc)
        a.step(prompt(9, vocab))
        steps = [eng.compiled.steps if eng.compiled else 0]
        calls, (oa, ob) = batch([a.forward_calls([4]), b.forward_calls(prompt(6, vocab, seed=3))])
        res = eng.execute([*calls, NextDist(oa, k=vocab), NextDist(ob, k=vocab)])
        steps.append(eng.compiled.steps if eng.compiled else 0)
        decode = a.forward_calls([5])
        fork = Seq(alloc, pages=list(a.pages), length=a.length)  # reads a's new slot
        calls, (oa, of) = batch([decode, fork.forward_calls(prompt(3, vocab, seed=4))])
        res += eng.execute([*calls, NextDist(oa, k=vocab), NextDist(of, k=vocab)])
        steps.append(eng.compiled.steps if eng.compiled else 0)
        cc, oc = a.forward_calls([7], store=False)  # a decode that does not store its K/V
        res += eng.execute([*cc, NextDist(oc, k=vocab)])
        steps.append(eng.compiled.steps if eng.compiled else 0)
        counts[name] = np.diff(steps).tolist()
        outs[name] = [dense(d, vocab) for d in res if d is not None]
    assert counts["compiled"] == [1, 0, 0]
    np.testing.assert_allclose(outs["compiled"], outs["eager"], atol=1e-6)


def test_masked_kv_and_item_masks_equal_eager(llama):
    """MaskKv'd slots and per-item masks travel in the decode mask."""
    _, comp, eager = llama
    vocab = comp.info.vocab_size
    outs = {}
    for name, eng in (("compiled", comp), ("eager", eager)):
        alloc = Pages(eng, first_page=0, first_embed=0)
        s = Seq(alloc)
        s.step(prompt(10, vocab, seed=5))
        masked = np.zeros(eng.page_size, dtype=bool)
        masked[1] = True
        assert eng.execute([MaskKv(s.pages[0], masked)]) == [None]
        d1 = s.step([3])
        mask = np.ones((1, s.length + 1), dtype=bool)
        mask[0, 4:7] = False
        d2 = s.step([8], mask=mask)
        outs[name] = np.stack([d1, d2])
    np.testing.assert_allclose(outs["compiled"], outs["eager"], atol=1e-6)


@pytest.fixture(scope="module")
def mistral(make_tiny, tmp_path_factory):
    """llama tiny's shapes (so the graphs are shared) with a sliding window of 8."""
    from transformers import MistralConfig, MistralForCausalLM

    path = tmp_path_factory.mktemp("mistral-window")
    return hf_checkpoint(
        make_tiny("llama"), path, MistralConfig, MistralForCausalLM, sliding_window=8
    )


def test_sliding_window_matches_transformers(mistral, llama):
    """Mistral's window is part of the decode mask: decoding well past the window gives
    transformers' tokens."""
    eng = load(mistral, compile=True)
    toks = prompt(6, eng.info.vocab_size, seed=7)
    with torch.no_grad():
        ref = (
            hf_model(mistral)
            .generate(torch.tensor([toks]), max_new_tokens=20, min_new_tokens=20, do_sample=False)[
                0, len(toks) :
            ]
            .tolist()
        )
    assert Seq(Pages(eng)).greedy(toks, 20) == ref
    assert eng.compiled.steps == 19


def test_attention_without_grouped_queries_equals_eager(make_tiny, tmp_path_factory):
    """One query head per KV head (no grouped-query attention): the graph's attention
    products have a single query row, which inductor would lower to a slow multiply-sum;
    the padded form computes the same thing. Mixed lengths, batches of 1, 3 and 5, against
    the eager engine and transformers."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("llama-mha")
    hf_checkpoint(make_tiny("llama"), path, LlamaConfig, LlamaForCausalLM, num_key_value_heads=4)
    comp, eager = load(path, compile=True), load(path)
    toks = prompt(9, comp.info.vocab_size, seed=4)
    with torch.no_grad():
        ref = (
            hf_model(path)
            .generate(torch.tensor([toks]), max_new_tokens=12, min_new_tokens=12, do_sample=False)[
                0, len(toks) :
            ]
            .tolist()
        )
    assert Seq(Pages(comp)).greedy(toks, 12) == ref
    assert comp.compiled.steps == 11
    np.testing.assert_allclose(
        mixed_batches(comp, 3, 100, 1000), mixed_batches(eager, 3, 100, 1000), atol=1e-6
    )
    assert comp.compiled.steps > 11  # the batches ran compiled


def test_adapters_run_eager_and_match(llama, tmp_path):
    """A batch with a LoRA item runs the eager model (the graph has no adapter path)."""
    from peft import LoraConfig, get_peft_model

    path, comp, eager = llama
    torch.manual_seed(0)
    model = get_peft_model(
        hf_model(path), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"])
    )
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)
    model.save_pretrained(tmp_path)
    vocab = comp.info.vocab_size
    outs = {}
    for name, eng in (("compiled", comp), ("eager", eager)):
        aid = eng.load_adapter(tmp_path, name=f"a{len(eng.adapters())}")
        alloc = Pages(eng, first_page=0, first_embed=0)
        s = Seq(alloc)
        s.step(prompt(8, vocab))
        before = eng.compiled.steps if eng.compiled else 0
        calls, out = s.forward_calls([2])
        fwd = calls[1]
        calls[1] = dataclasses.replace(fwd, adapter=aid)
        res = eng.execute([*calls, NextDist(out, k=vocab)])
        if eng.compiled:
            assert eng.compiled.steps == before
        outs[name] = dense(res[-1], vocab)
    np.testing.assert_allclose(outs["compiled"], outs["eager"], atol=1e-6)


def test_accepts_only_decode_batches(llama):
    from pastry.engine.attention import AttnGroup, AttnMetadata

    accepts = llama[1].compiled.accepts
    t = torch.zeros(1, 1, 1, 1, dtype=torch.bool)
    decode = AttnGroup(None, 2, 1, None, torch.zeros(1, 2, 4), t, causal=False)
    prefill = AttnGroup(None, 1, 3, None, torch.zeros(1, 1, 4), t, causal=False)
    store = torch.zeros(1, 2, dtype=torch.int64)
    assert accepts(AttnMetadata([decode], None, store))
    assert not accepts(AttnMetadata([prefill], None, store))
    assert not accepts(AttnMetadata([decode, prefill], None, store))
    assert not accepts(AttnMetadata([decode], torch.zeros(1), store))
    assert not accepts(AttnMetadata([decode], None, None))


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_other_architectures_match_eager(make_tiny, arch):
    """q/k/v biases (qwen2) and q/k norms (qwen3) in the graph."""
    path = make_tiny(arch)
    comp, eager = load(path, compile=True), load(path)
    toks = prompt(10, comp.info.vocab_size, seed=2)
    a = Seq(Pages(comp)).greedy(toks, 12)
    b = Seq(Pages(eager)).greedy(toks, 12)
    assert a == b
    assert comp.compiled.steps == 11


def test_bfloat16_tracks_float32(make_tiny):
    """bf16 compiled decode logits stay close to the float32 model's."""
    path = make_tiny("llama")
    b16, f32 = load(path, dtype="bfloat16", compile=True), load(path)
    vocab = b16.info.vocab_size
    toks = prompt(16, vocab, seed=4)
    sa, sb = Seq(Pages(b16)), Seq(Pages(f32))
    pa, pb = [sa.step(toks)], [sb.step(toks)]
    for t in (5, 9, 11, 2):
        pa.append(sa.step([t]))
        pb.append(sb.step([t]))
    assert b16.compiled.steps == 4
    np.testing.assert_allclose(np.stack(pa), np.stack(pb), atol=2e-2)


def test_a_failed_compile_falls_back_to_eager(make_tiny, monkeypatch, caplog):
    """Without a working compiler (here: inductor raising), the engine logs why and decodes
    eagerly, with the eager engine's results."""
    from pastry.engine import compiled

    def broken(*args, **kwargs):
        raise torch._dynamo.exc.TorchDynamoException("no C++ compiler")

    monkeypatch.setattr(compiled, "_compiled", lambda one: broken)
    path = make_tiny("llama")
    eng, eager = load(path, compile=True), load(path)
    assert not eng.compiled.enabled and "no C++ compiler" in eng.compiled.error
    assert "decode steps run eagerly" in caplog.text
    toks = prompt(9, eng.info.vocab_size, seed=3)
    assert Seq(Pages(eng)).greedy(toks, 6) == Seq(Pages(eager)).greedy(toks, 6)
    assert eng.compiled.steps == 0


def test_generate_with_compile_and_quantize_flags(make_tiny, capfd):
    """`pastry generate --compile --quantize int4` reaches the engine process (booleans and
    the mode survive the spawn's command line) and gives the in-process engine's text."""
    from pastry.cli import main
    from pastry.engine.checkpoint import load_checkpoint
    from pastry.engine.generate import FusedGenerator, Request

    path = make_tiny("llama")
    argv = ["generate", "--model", str(path), "--dtype", "float32", "--max-tokens", "5"]
    assert main([*argv, "--compile", "--quantize", "int4", "Hello,"]) == 0
    out, err = capfd.readouterr()
    assert "compiled the decode step for batch 1" in err
    line = out.splitlines()[-1]
    tok = load_checkpoint(path).tokenizer
    eng = load(path, quantize="int4")
    req = Request(tok.encode("Hello,", add_special_tokens=True), 5, stop_ids=eng.info.eos_token_ids)
    FusedGenerator(eng.execute, eng.info, max_running=1).run([req])
    assert line == "Hello," + tok.decode(req.output, skip_special_tokens=True)


def test_kv_sent_from_a_compiled_decode_step_continues_exactly(make_tiny):
    """A SendKv in a batch whose forward runs compiled: every layer's K/V reach the peer
    (the per-layer hook runs after the graph) and the peer continues exactly."""
    import uuid

    from pastry.wire.calls import Sample, SendKv, ids

    path = make_tiny("llama")

    def shm_engine(**kw) -> Engine:
        shm = f"/dev/shm/pastry-kv-test-{uuid.uuid4().hex[:10]}"
        return load(path, kv_shm=shm, **kw)

    a, b = shm_engine(compile=True), shm_engine()
    try:
        vocab = a.info.vocab_size
        toks = prompt(11, vocab, seed=8)
        want = Seq(Pages(load(path))).greedy(toks, 6)
        sa = Seq(Pages(a))
        calls, out = sa.forward_calls(toks)
        first = a.execute([*calls, Sample(out)])[-1]
        assert first == want[0]
        calls, out = sa.forward_calls([first])  # a decode step: compiled
        n = sa.length
        send = SendKv(ids(sa.pages), ids(range(100, 100 + len(sa.pages))), n, b.info.kv_peers[0])
        steps = a.compiled.steps
        res = a.execute([*calls, send, Sample(out)])
        assert a.compiled.steps == steps + 1 and res[2] is None and res[3] == want[1]
        # b continues from the sent pages
        sb = Seq(Pages(b, first_page=100 + len(sa.pages)))
        sb.pages, sb.length = list(range(100, 100 + len(sa.pages))), n
        assert sb.greedy([want[1]], 4) == want[2:]
    finally:
        a.close()
        b.close()


def test_logit_processing_and_logprobs_after_a_compiled_step(llama):
    """Output calls read the hidden states a compiled decode step wrote: logit processing
    (mask, bias, penalties), seeded sampling with log-probabilities and a decode item's
    prompt log-probabilities equal the eager engine's."""
    import dataclasses

    _, comp, eager = llama
    vocab = comp.info.vocab_size
    allowed = np.zeros(mask_words(vocab), dtype=np.int32)
    allowed[:2] = -1  # tokens 0..63
    processing = dict(
        mask=allowed,
        bias_ids=np.array([3, 40], dtype=np.int64),
        bias_values=np.array([2.5, -1.0], dtype=np.float32),
        penalty_tokens=np.array([3, 3, 7], dtype=np.int64),
        penalty_prompt=np.array([9], dtype=np.int64),
        repetition_penalty=1.3,
        frequency_penalty=0.4,
        presence_penalty=0.2,
    )
    outs = {}
    for name, eng in (("compiled", comp), ("eager", eager)):
        alloc = Pages(eng, first_page=0, first_embed=0)
        a, b = Seq(alloc), Seq(alloc)
        a.step(prompt(7, vocab, seed=11))
        b.step(prompt(12, vocab, seed=12))
        before = eng.compiled.steps if eng.compiled else 0
        (ea, fa, *_), oa = a.forward_calls([5])
        (eb, fb, *_), ob = b.forward_calls([6])
        fb = dataclasses.replace(fb, logprob_targets=np.array([2], np.int64), logprob_top=3)
        res = eng.execute(
            [
                ea,
                eb,
                fa,
                fb,
                NextDist(oa, k=vocab, **processing),
                Sample(oa, temperature=0.8, top_k=20, seed=5, logprobs=4, **processing),
                Sample(ob, temperature=1.1, top_p=0.9, seed=6, logprobs=2),
            ]
        )
        if eng.compiled:
            assert eng.compiled.steps == before + 1  # the decode batch ran compiled
        assert res[2] is None
        lp, dist, sa, sb = res[3:]
        assert dense(dist, vocab)[64:].sum() == 0  # the mask held
        assert sa.token < 64
        outs[name] = (lp, dense(dist, vocab), sa, sb)
    (lp, dist, sa, sb), (lp_e, dist_e, sa_e, sb_e) = outs["compiled"], outs["eager"]
    np.testing.assert_allclose(dist, dist_e, atol=1e-6)
    np.testing.assert_allclose(lp.logprobs, lp_e.logprobs, atol=1e-5)
    np.testing.assert_array_equal(lp.top_ids, lp_e.top_ids)
    for s, e in ((sa, sa_e), (sb, sb_e)):
        assert s.token == e.token
        assert s.logprob == pytest.approx(e.logprob, abs=1e-5)
        np.testing.assert_array_equal(s.top_ids, e.top_ids)


def test_kv_swapped_out_and_back_decodes_compiled_as_eager(llama):
    """KV swap (issue 13) copies pages of the pool tensor the graph reads in place: a context
    swapped to host, the device pages overwritten, and swapped back into other pages
    decodes compiled exactly as the eager engine without any swap."""
    path, comp, _ = llama
    vocab = comp.info.vocab_size
    toks = prompt(13, vocab, seed=21)
    want = Seq(Pages(load(path))).greedy(toks, 8)
    s = Seq(Pages(comp, first_page=10, first_embed=0))
    calls, out = s.forward_calls(toks)
    got = [comp.execute([*calls, Sample(out)])[-1]]
    for _ in range(3):  # s holds the K/V of every token but the last one sampled
        calls, out = s.forward_calls([got[-1]])
        got.append(comp.execute([*calls, Sample(out)])[-1])
    assert got == want[:4]
    old = list(s.pages)
    host = ids(range(len(old)))
    assert comp.execute([SwapOut(ids(old), host)]) == [None]
    other = Seq(Pages(comp, first_page=10, first_embed=500))  # reuses the same pages
    other.step(prompt(len(old) * comp.page_size, vocab, seed=22))
    new = list(range(60, 60 + len(old)))
    assert comp.execute([SwapIn(host, ids(new))]) == [None]
    s.pages = new
    steps = comp.compiled.steps
    for _ in range(4):
        calls, out = s.forward_calls([got[-1]])
        got.append(comp.execute([*calls, Sample(out)])[-1])
    assert got == want
    assert comp.compiled.steps - steps == 4
