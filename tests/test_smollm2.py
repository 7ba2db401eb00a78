"""Parity on real weights: SmolLM2-135M-Instruct (the GGUF scripts/setup.sh fetches) loaded by
Pastry and by transformers' GGUF loader (``from_pretrained(dir, gguf_file=...)``), in float32.

Skipped, saying why, when the file is absent (see the ``smollm2_gguf`` fixture)."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from engine_util import Pages, Seq, every_output, hf_from_gguf
from inferlet_util import result, run_all
from pastry.engine.checkpoint import load_checkpoint
from pastry.engine.engine import Engine
from pastry.wire.config import EngineConfig

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Once upon a time, in a land far away, there lived a small dragon who loved to read",
    "Q: What is 17 + 25?\nA:",
]
CORPUS = Path(__file__).parents[1] / "src" / "pastry" / "engine" / "data" / "prose.txt"


@pytest.fixture(scope="module")
def hf(smollm2_gguf: Path):
    return hf_from_gguf(smollm2_gguf)


@pytest.fixture(scope="module")
def hf_tok(smollm2_gguf: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)


@pytest.fixture(scope="module")
def engine(smollm2_gguf: Path) -> Engine:
    cfg = EngineConfig(dtype="float32", num_pages=512, num_embeds=2048, page_size=16)
    return Engine.load(smollm2_gguf, cfg)


def test_config_and_tokenizer_from_the_metadata(smollm2_gguf, hf, hf_tok):
    ckpt = load_checkpoint(smollm2_gguf)
    c = ckpt.config
    assert (c.arch, c.num_layers, c.hidden_size, c.intermediate_size) == ("llama", 30, 576, 1536)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (9, 3, 64, 49152)
    assert c.tie_word_embeddings and c.rope_theta == 100000.0 and c.max_position == 8192
    assert c.rope_scaling.kind == "default" and abs(c.rms_norm_eps - 1e-5) < 1e-12
    assert (c.bos_token_id, c.eos_token_ids) == (1, (2,))
    assert ckpt.name == "SmolLM2-135M-Instruct.Q4_1"
    tok = ckpt.tokenizer
    assert tok.special_tokens["eos_token"] == "<|im_end|>" and not tok.add_bos_token
    for name in ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size"):
        assert getattr(hf.config, name) == getattr(c, {"num_hidden_layers": "num_layers",
            "num_attention_heads": "num_heads"}.get(name, name))  # fmt: skip
    texts = [*PROMPTS, "The year 2024 had 366 days; 3.14159 and 1,000,000.", "naïve café 東京"]
    for text in texts:
        assert tok.encode(text, True) == hf_tok.encode(text), text
        assert tok.decode(tok.encode(text)) == text
    messages = [{"role": "user", "content": "Hi!"}]
    rendered = tok.apply_chat_template(messages)
    assert rendered == hf_tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert rendered.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert rendered.endswith("<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n")


def test_logits_match_transformers(engine, hf):
    tok = load_checkpoint_tokenizer(engine)
    for text in PROMPTS:
        toks = tok.encode(text, True)
        calls, outs = every_output(Pages(engine), toks)
        assert engine.execute(calls) == [None, None]
        with torch.no_grad():
            ours = engine.model.logits(
                engine.embeds.hidden[torch.from_numpy(outs.astype(np.int64))]
            )
            ref = hf(torch.tensor([toks])).logits[0]
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-5)
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_greedy_64_tokens_match_transformers(engine, hf):
    tok = load_checkpoint_tokenizer(engine)
    for text in PROMPTS[1:3]:  # continuations that run past 64 tokens without an EOS
        toks = tok.encode(text, True)
        with torch.no_grad():
            ref = hf.generate(torch.tensor([toks]), max_new_tokens=64, do_sample=False,
                              pad_token_id=2)[0, len(toks):].tolist()  # fmt: skip
        assert len(ref) == 64
        ours = Seq(Pages(engine)).greedy(toks, 64)
        assert ours == ref, (text, tok.decode(ours), tok.decode(ref))


def test_chat_completion_equals_transformers(smollm2_gguf, hf, hf_tok, tmp_path):
    import openai

    from server_util import running_server

    messages = [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "What is the capital of France? Answer in one sentence."},
    ]
    ids_ = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids_ = ids_["input_ids"] if isinstance(ids_, dict) or hasattr(ids_, "keys") else ids_
    with torch.no_grad():
        out = hf.generate(torch.tensor([list(ids_)]), max_new_tokens=48, do_sample=False,
                          eos_token_id=2, pad_token_id=2)[0, len(ids_):].tolist()  # fmt: skip
    finish = "stop" if out[-1] == 2 else "length"
    expected = hf_tok.decode(out[:-1] if finish == "stop" else out)
    with running_server(smollm2_gguf, tmp_path) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="x")
        r = client.chat.completions.create(
            model=smollm2_gguf.stem, messages=messages, max_tokens=48, temperature=0
        )
    assert r.choices[0].message.content == expected
    assert r.choices[0].finish_reason == finish
    assert r.usage.prompt_tokens == len(ids_)
    assert "Paris" in expected


PERPLEXITY = """
import asyncio, json, math
import pastry.sdk as px

async def main(args):
    text, chunk = args[0], 64
    q = px.create_queue(px.available_models()[0])
    toks = px.tokenize(q, text, True)
    ps, vocab = px.get_kv_page_size(q), px.get_vocab_size(q)
    pages = px.alloc_kvpages(q, -(-len(toks) // ps))
    logps = []
    for start in range(0, len(toks) - 1, chunk):
        part = toks[start : start + chunk]
        ins, outs = px.alloc_embeds(q, len(part)), px.alloc_embeds(q, len(part))
        ctx = pages[: -(-start // ps)]
        last = start - (len(ctx) - 1) * ps if ctx else 0
        out_pages = pages[start // ps : -(-(start + len(part)) // ps)]
        px.embed_txt(q, part, list(range(start, start + len(part))), ins)
        px.forward(q, ctx, last, ins, out_pages, start % ps, outs)
        targets = toks[start + 1 : start + 1 + len(part)]
        dists = await asyncio.gather(*(px.get_next_dist(q, e, 256) for e in outs[: len(targets)]))
        for e, t, (ids, probs) in zip(outs, targets, dists):
            if t not in ids:  # outside the top 256: ask for the whole distribution
                ids, probs = await px.get_next_dist(q, e, vocab)
            logps.append(math.log(probs[ids.index(t)]))
        await px.dealloc_embeds(q, ins + outs)
    return json.dumps({"ppl": math.exp(-sum(logps) / len(logps)), "tokens": toks})
"""


def test_perplexity_through_the_api_matches_transformers(engine, hf):
    text = CORPUS.read_text()[12000:13500]  # a slice no other test reads
    events, _ = asyncio.run(run_all(engine, [(PERPLEXITY, [text])]))
    out = json.loads(result(events[0]))
    toks = out["tokens"]
    assert len(toks) > 250
    with torch.no_grad():
        logp = hf(torch.tensor([toks])).logits[0, :-1].double().log_softmax(-1)
    nll = -logp.gather(1, torch.tensor(toks[1:])[:, None]).mean().item()
    assert out["ppl"] == pytest.approx(math.exp(nll), rel=1e-3)
    assert 2 < out["ppl"] < 100  # English prose to a trained model


def load_checkpoint_tokenizer(engine: Engine):
    from pastry.wire.tokenizer import Tokenizer

    i = engine.info
    return Tokenizer.from_json(i.tokenizer_json, i.chat_template, i.special_tokens)
