"""Logit processing and log-probabilities on the device (engine/logits.py, the engine's output
handler): against transformers' log_softmax and a plain numpy reference of each step."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine_util import Pages, Seq, hf_model
from pastry.engine.engine import Engine
from pastry.engine.logits import unpack_mask
from pastry.wire.calls import (
    CallError,
    Forward,
    Logprobs,
    NextDist,
    Sample,
    Sampled,
    ids,
    mask_words,
)
from pastry.wire.config import EngineConfig

POOLS = dict(num_pages=128, num_embeds=512, num_host_pages=0, page_size=4)


@pytest.fixture(scope="module")
def ckpt(make_tiny):
    return make_tiny("llama")


@pytest.fixture(scope="module")
def eng(ckpt):
    return Engine.load(ckpt, EngineConfig(dtype="float32", **POOLS))


def tokens(n: int, vocab: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


def prefill(eng, toks) -> tuple[Seq, int]:
    seq = Seq(Pages(eng))
    calls, out = seq.forward_calls(toks)
    assert eng.execute(calls) == [None, None]
    return seq, out


def raw_logits(eng, slot: int) -> np.ndarray:
    with torch.inference_mode():
        return eng.model.logits(eng.embeds.hidden[slot : slot + 1])[0].double().numpy()


def pack(allowed: np.ndarray) -> np.ndarray:
    """llguidance's layout: bit t % 32 of int32 word t // 32."""
    words = mask_words(len(allowed))
    bits = np.zeros(words * 32, dtype=np.uint8)
    bits[: len(allowed)] = allowed
    return np.packbits(bits, bitorder="little").view(np.int32)


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x[np.isfinite(x)].max())
    return e / e.sum()


def test_unpack_matches_numpy_layout():
    rng = np.random.default_rng(0)
    allowed = rng.random((3, 77)) < 0.3
    words = torch.from_numpy(np.stack([pack(a) for a in allowed]))
    assert (unpack_mask(words, 77).numpy() == allowed).all()


def test_sampled_logprobs_equal_transformers(ckpt, eng):
    vocab = eng.info.vocab_size
    toks = tokens(9, vocab, seed=3)
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(ckpt)(torch.tensor([toks])).logits[0, -1].float(), -1)
    _, out = prefill(eng, toks)
    greedy, sampled, plain = eng.execute(
        [Sample(out, logprobs=20), Sample(out, temperature=1.0, seed=5, logprobs=0), Sample(out)]
    )
    assert isinstance(greedy, Sampled) and isinstance(sampled, Sampled) and plain == greedy.token
    top_v, top_i = ref.topk(20)
    assert greedy.top_ids.tolist() == top_i.tolist() and greedy.token == int(top_i[0])
    np.testing.assert_allclose(greedy.top_logprobs, top_v.numpy(), atol=1e-5)
    assert greedy.logprob == greedy.top_logprobs[0]  # the same number, bit for bit
    assert len(sampled.top_ids) == 0
    assert abs(sampled.logprob - float(ref[sampled.token])) < 1e-5


def test_prompt_logprobs_equal_transformers(ckpt, eng):
    vocab = eng.info.vocab_size
    toks = tokens(300, vocab, seed=4)  # more rows than one chunk of the head
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(ckpt)(torch.tensor([toks])).logits[0].float(), -1)
    seq = Seq(Pages(eng))
    (embed, fwd), _ = seq.forward_calls(toks)
    targets = ids([*toks[1:], -1])
    fwd = Forward(
        in_embeds=fwd.in_embeds,
        out_pages=fwd.out_pages,
        positions=fwd.positions,
        logprob_targets=targets,
        logprob_top=3,
    )
    _, lp = eng.execute([embed, fwd])
    assert isinstance(lp, Logprobs)
    want = ref[torch.arange(len(toks) - 1), torch.tensor(toks[1:])].numpy()
    np.testing.assert_allclose(lp.logprobs[:-1], want, atol=2e-5)
    assert np.isnan(lp.logprobs[-1])
    top_v, top_i = ref.topk(3)
    assert (lp.top_ids == top_i.numpy()).mean() > 0.99  # near-ties may swap
    np.testing.assert_allclose(lp.top_logprobs, top_v.numpy(), atol=2e-5)


def test_mask_restricts_greedy_sampling_and_dist(eng):
    vocab = eng.info.vocab_size
    _, out = prefill(eng, tokens(7, vocab, seed=5))
    logits = raw_logits(eng, out)
    rng = np.random.default_rng(1)
    allowed = rng.random(vocab) < 0.05
    allowed[int(logits.argmax())] = False  # the unconstrained choice is forbidden
    mask = pack(allowed)
    greedy, hot, dist = eng.execute(
        [
            Sample(out, mask=mask),
            Sample(out, temperature=5.0, seed=2, mask=mask),
            NextDist(out, k=vocab, mask=mask),
        ]
    )
    assert greedy == int(np.where(allowed, logits, -np.inf).argmax())
    assert allowed[hot]
    dense = np.zeros(vocab)
    dense[dist.ids] = dist.probs
    assert dense[~allowed].max() == 0
    np.testing.assert_allclose(dense, softmax(np.where(allowed, logits, -np.inf)), atol=1e-6)
    # many seeds: every draw allowed
    draws = eng.execute([Sample(out, temperature=3.0, seed=s, mask=mask) for s in range(200)])
    assert all(allowed[t] for t in draws)


def reference(logits, bias=None, out=(), prompt=(), rep=1.0, freq=0.0, pres=0.0):
    x = logits.copy()
    if bias:
        for t, b in bias.items():
            x[t] += b
    counts = np.bincount(np.asarray(out, dtype=np.int64), minlength=len(x)).astype(float)
    seen = counts > 0
    seen[list(prompt)] = True
    x = np.where(seen, np.where(x > 0, x / rep, x * rep), x)
    return x - freq * counts - pres * (counts > 0)


def test_bias_and_penalties_match_a_reference(eng):
    vocab = eng.info.vocab_size
    _, out = prefill(eng, tokens(11, vocab, seed=6))
    logits = raw_logits(eng, out)
    order = np.argsort(-logits)
    hist = [int(order[0])] * 3 + [int(order[1]), int(order[5])]
    prompt = [int(order[2]), int(order[7])]
    bias = {int(order[40]): 3.5, int(order[0]): -1.25}
    cases = [
        dict(bias=bias),
        dict(out=hist, rep=1.3),
        dict(out=hist, prompt=prompt, rep=0.7),
        dict(out=hist, freq=0.4),
        dict(out=hist, pres=-0.6),
        dict(bias=bias, out=hist, prompt=prompt, rep=1.2, freq=0.3, pres=0.5),
    ]
    calls = []
    for c in cases:
        b = c.get("bias") or {}
        kw = dict(
            bias_ids=ids(list(b)),
            bias_values=np.array(list(b.values()), dtype=np.float32),
            penalty_tokens=ids(c.get("out", ())),
            penalty_prompt=ids(c.get("prompt", ())),
            repetition_penalty=c.get("rep", 1.0),
            frequency_penalty=c.get("freq", 0.0),
            presence_penalty=c.get("pres", 0.0),
        )
        calls += [NextDist(out, k=vocab, **kw), Sample(out, **kw)]
    calls.append(NextDist(out, k=vocab))  # an unprocessed row in the same batch
    res = eng.execute(calls)
    for i, c in enumerate(cases):
        want = reference(logits, **c)
        dist, greedy = res[2 * i], res[2 * i + 1]
        dense = np.zeros(vocab)
        dense[dist.ids] = dist.probs
        np.testing.assert_allclose(dense, softmax(want), atol=1e-6, err_msg=str(c))
        assert greedy == int(want.argmax()), c
    plain = np.zeros(vocab)
    plain[res[-1].ids] = res[-1].probs
    np.testing.assert_allclose(plain, softmax(logits), atol=1e-6)


def test_rows_of_a_batch_are_independent(eng):
    vocab = eng.info.vocab_size
    _, a = prefill(eng, tokens(5, vocab, seed=7))
    _, b = prefill(eng, tokens(6, vocab, seed=8))
    allowed = np.random.default_rng(2).random(vocab) < 0.2
    calls = [
        Sample(a, temperature=0.9, seed=1, mask=pack(allowed), logprobs=2),
        NextDist(b, k=5, penalty_tokens=ids([1, 2, 2]), frequency_penalty=1.0),
        Sample(
            b,
            temperature=1.1,
            top_k=7,
            seed=3,
            bias_ids=ids([4]),
            bias_values=np.ones(1, np.float32),
        ),
        NextDist(a, k=4),
        Sample(a, logprobs=5),
    ]
    together = eng.execute(calls)
    for call, got in zip(calls, together, strict=True):
        [alone] = eng.execute([call])
        if isinstance(got, int):
            assert got == alone
        elif isinstance(got, Sampled):
            assert (got.token, got.top_ids.tolist()) == (alone.token, alone.top_ids.tolist())
            np.testing.assert_allclose(got.top_logprobs, alone.top_logprobs, atol=1e-6)
        else:
            assert got.ids.tolist() == alone.ids.tolist()
            np.testing.assert_allclose(got.probs, alone.probs, atol=1e-6)


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(mask=np.ones(3, np.int32)), "mask must be int32 of shape"),
        (dict(mask=np.ones(10**4, np.int64)), "mask must be int32"),
        ("nothing", "mask allows no token"),
        (dict(bias_ids=ids([1, 2]), bias_values=np.ones(1, np.float32)), "one per bias id"),
        (dict(bias_ids=ids([10**9]), bias_values=np.ones(1, np.float32)), "bias token id"),
        (dict(bias_ids=ids([1]), bias_values=np.full(1, np.nan, np.float32)), "NaN"),
        (dict(penalty_tokens=ids([-1]), frequency_penalty=1.0), "penalty token id"),
        (dict(repetition_penalty=0.0), "repetition_penalty must be"),
        (dict(presence_penalty=float("inf")), "presence_penalty must be"),
        (dict(logprobs=21), "logprobs 21 is out of range"),
    ],
)
def test_bad_processing_fails_alone(eng, kw, message):
    vocab = eng.info.vocab_size
    _, out = prefill(eng, tokens(3, vocab))
    if kw == "nothing":
        kw = dict(mask=np.zeros(mask_words(vocab), np.int32))
    bad, good = eng.execute([Sample(out, **kw), Sample(out)])
    assert isinstance(bad, CallError) and message in bad.message, bad
    assert isinstance(good, int)


def test_logprobs_equal_transformers_on_real_weights(smollm2_gguf):
    """SmolLM2-135M-Instruct: sampled and prompt log-probabilities against transformers
    reading the same GGUF (dequantized to float32 on both sides)."""
    pytest.importorskip("gguf", reason="transformers reads GGUF through the gguf package")
    from transformers import AutoModelForCausalLM

    from pastry.wire.tokenizer import Tokenizer

    eng = Engine.load(smollm2_gguf, EngineConfig(dtype="float32", **POOLS))
    hf = AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32
    ).eval()
    tok = Tokenizer.from_json(eng.info.tokenizer_json, eng.info.chat_template)
    toks = tok.encode("The capital of France is Paris, and the capital of Italy is")
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([toks])).logits[0].float(), -1)
    seq = Seq(Pages(eng))
    (embed, fwd), out = seq.forward_calls(toks)
    fwd = Forward(
        in_embeds=fwd.in_embeds,
        out_pages=fwd.out_pages,
        out_embeds=fwd.out_embeds,
        out_indices=fwd.out_indices,
        positions=fwd.positions,
        logprob_targets=ids([*toks[1:], -1]),
        logprob_top=5,
    )
    _, lp, sampled = eng.execute([embed, fwd, Sample(out, logprobs=20)])
    want = ref[torch.arange(len(toks) - 1), torch.tensor(toks[1:])].numpy()
    np.testing.assert_allclose(lp.logprobs[:-1], want, atol=1e-3)
    top_v, top_i = ref[-1].topk(20)
    assert sampled.token == int(top_i[0])
    np.testing.assert_allclose(sampled.top_logprobs, top_v.numpy(), atol=1e-3)
