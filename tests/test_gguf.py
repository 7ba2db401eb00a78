"""GGUF checkpoints (engine/gguf.py and its gguf_*.py modules) on random weights: files
written here with gguf.GGUFWriter the way llama.cpp's converter writes them
(tests/gguf_util.py), loaded by Pastry and by transformers' own GGUF loader; config,
tokenizer, dequantization, the cache and the errors."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType

from engine_util import Pages, Seq, all_probs, hf_from_gguf, hf_model, load
from gguf_util import hf_weights, write_gguf
from pastry.engine import gguf as pgguf
from pastry.engine.checkpoint import load_checkpoint
from pastry.engine.gguf_file import read_gguf
from pastry.engine.gguf_weights import _unpermute, gguf_name
from pastry.wire.config import CheckpointError

TEXTS = [
    "Hello, world! The year 2024 had 366 days.",
    "def f(x):\n    return x ** 2  # squares\n",
    "  leading spaces, tabs\tand\nnewlines\n\n",
    "Ünïcödé: naïve café, 東京, Привет",
    "<|im_start|>user\nHi there<|im_end|>\n",
    "I'm sure they'll say it's fine; we've done it.",
]
POOLS = dict(num_pages=256, num_embeds=1024, page_size=4, num_host_pages=1)


@pytest.fixture(scope="module", autouse=True)
def pastry_home(tmp_path_factory: pytest.TempPathFactory):
    """Conversion caches of these throwaway files go to a private $PASTRY_HOME."""
    with pytest.MonkeyPatch.context() as mp:
        home = tmp_path_factory.mktemp("home")
        mp.setenv("PASTRY_HOME", str(home))
        yield home


@pytest.fixture(scope="module")
def written(make_tiny, tmp_path_factory):
    """``(arch, qtype) -> (gguf file, the float32 HF checkpoint it was written from)``."""
    out = tmp_path_factory.mktemp("gguf")
    made: dict[tuple[str, QType], tuple[Path, Path]] = {}

    def make(arch: str, qtype: QType) -> tuple[Path, Path]:
        if (arch, qtype) not in made:
            src = make_tiny(arch, dtype="float32")
            config, weights = hf_weights(src)
            f = write_gguf(out / f"{arch}-{qtype.name}.gguf", config, weights, src, qtype)
            made[arch, qtype] = f, src
        return made[arch, qtype]

    return make


# -- parity with transformers ----------------------------------------------------------------


@pytest.mark.parametrize("qtype", [QType.F16, QType.Q8_0], ids=lambda q: q.name)
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_random_qwen_gguf_matches_transformers(written, arch, qtype):
    f, src = written(arch, qtype)
    # transformers' GGUF config mapping drops qwen3's attention.key_length: give it head_dim
    hf = hf_from_gguf(f, **({"head_dim": 32} if arch == "qwen3" else {}))
    ckpt = load_checkpoint(f)
    ours = ckpt.load_state_dict(torch.float32)
    theirs = hf.state_dict()
    for name, w in ours.items():  # the same dequantized weights, bit for bit
        assert torch.equal(w, theirs[name]), name
    eng = load(f, **POOLS)
    toks = ckpt.tokenizer.encode(TEXTS[0] + TEXTS[5], add_special_tokens=True)
    with torch.no_grad():
        ref = hf(torch.tensor([toks])).logits[0].double().softmax(-1).numpy()
        cont = hf.generate(torch.tensor([toks]), max_new_tokens=24, min_new_tokens=24,
                           do_sample=False, pad_token_id=0)[0, len(toks):].tolist()  # fmt: skip
    np.testing.assert_allclose(all_probs(eng, toks), ref, atol=2e-5)
    assert Seq(Pages(eng)).greedy(toks, 24) == cont
    # the original checkpoint's config and tokenizer, recovered from the metadata
    orig = load_checkpoint(src)
    assert ckpt.config.num_params == orig.config.num_params
    assert ckpt.config.qk_norm == (arch == "qwen3") and ckpt.config.attention_bias == (
        arch == "qwen2"
    )
    assert ckpt.config.head_dim == orig.config.head_dim
    assert ckpt.config.tie_word_embeddings and ckpt.config.eos_token_ids == (2,)
    for text in TEXTS:
        assert ckpt.tokenizer.encode(text) == orig.tokenizer.encode(text), text
    assert not ckpt.tokenizer.add_bos_token and ckpt.tokenizer.chat_template


def test_llama_gguf_equals_its_source_checkpoint(written):
    """llama.cpp permutes llama's q/k rows and writes Llama 3 RoPE scaling as rope_freqs: a
    float32 GGUF must run exactly as the HF checkpoint it came from (transformers' GGUF loader
    ignores rope_freqs, so the reference is transformers on the original directory)."""
    f, src = written("llama", QType.F32)
    ckpt = load_checkpoint(f)
    assert ckpt.config.rope_scaling.kind == "freq_factors"
    orig = load_checkpoint(src).load_state_dict(torch.float32)
    for name, w in ckpt.load_state_dict(torch.float32).items():
        assert torch.equal(w, orig[name]), name
    hf = hf_model(src)
    toks = ckpt.tokenizer.encode(TEXTS[1] + TEXTS[3], add_special_tokens=True)
    assert toks == load_checkpoint(src).tokenizer.encode(TEXTS[1] + TEXTS[3], True)
    assert toks[0] == ckpt.config.bos_token_id == 0  # llama-bpe adds BOS
    eng = load(f, **POOLS)
    with torch.no_grad():
        ref = hf(torch.tensor([toks])).logits[0].double().softmax(-1).numpy()
    np.testing.assert_allclose(all_probs(eng, toks), ref, atol=2e-5)
    # positions past original_max_position (256 here), where the scaling matters most
    long = (toks * 20)[:300]
    with torch.no_grad():
        ref = hf(torch.tensor([long])).logits[0, -40:].double().softmax(-1).numpy()
    np.testing.assert_allclose(all_probs(eng, long)[-40:], ref, atol=2e-5)


# Every type the issue names, one per matrix, on a model whose rows are multiples of 256
# (k-quant blocks): 2 layers x 7 matrices + embedding + output head = 16 tensors.
MIXED = [QType.Q4_0, QType.Q4_1, QType.Q8_0, QType.Q4_K, QType.Q5_K, QType.Q6_K, QType.BF16,
         QType.F16, QType.F32, QType.Q5_0, QType.Q5_1]  # fmt: skip


def test_every_quantization_type_dequantizes_as_transformers(make_tiny, tmp_path):
    from transformers.integrations.gguf.dequant import dequantize as hf_dequantize

    src = make_tiny("llama", dtype="float32")
    config = json.loads((src / "config.json").read_text())
    config |= dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                   rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})  # fmt: skip
    from pastry.engine.tiny import random_weights
    from pastry.wire.config import ModelConfig

    weights = random_weights(ModelConfig.from_dict(config), seed=3, dtype=torch.float32)
    order = {n: MIXED[i % len(MIXED)] for i, n in enumerate(gguf_name(h) for h in weights)}
    f = write_gguf(tmp_path / "mixed.gguf", config, weights, src, lambda n: order[n])
    reader = read_gguf(f)
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert set(MIXED) <= set(types.values())
    ckpt = load_checkpoint(f)
    ours = ckpt.load_state_dict(torch.float32)
    by_gguf = {t.name: t for t in reader.tensors}
    for hf_name, w in ours.items():
        t = by_gguf[gguf_name(hf_name)]
        if t.tensor_type in (QType.F32, QType.F16, QType.BF16, QType.Q5_0, QType.Q5_1):
            continue  # plain floats, or types transformers' torch dequantizer lacks
        ref = hf_dequantize(torch.from_numpy(np.array(t.data)).reshape(-1), int(t.tensor_type))
        ref = ref.reshape(w.shape)
        if ".q_proj." in hf_name or ".k_proj." in hf_name:  # we also un-permuted the rows
            heads = 4 if ".q_proj." in hf_name else 2
            ref = _unpermute(ref, heads)
        assert torch.equal(w, ref), (hf_name, t.tensor_type.name)
    # quantization error where the file holds real quantizations of the random weights
    for hf_name, w in ours.items():
        kind = by_gguf[gguf_name(hf_name)].tensor_type
        err = {QType.F32: 0, QType.F16: 1e-3, QType.BF16: 1e-2, QType.Q8_0: 1e-2}.get(kind)
        if err is not None:
            torch.testing.assert_close(w, weights[hf_name], atol=err * 0.1, rtol=err)
    hf = hf_from_gguf(f)
    eng = load(f, **POOLS)
    toks = ckpt.tokenizer.encode(TEXTS[0], add_special_tokens=True)
    with torch.no_grad():
        ref = hf(torch.tensor([toks])).logits[0].double().softmax(-1).numpy()
    np.testing.assert_allclose(all_probs(eng, toks), ref, atol=2e-5)


# -- tokenizers ------------------------------------------------------------------------------


def test_byte_level_tokenizer_matches_transformers_gguf_tokenizer(written):
    from transformers import AutoTokenizer

    for arch in ("llama", "qwen2"):
        f, _ = written(arch, QType.Q8_0)
        ours = load_checkpoint(f).tokenizer
        theirs = AutoTokenizer.from_pretrained(f.parent, gguf_file=f.name)
        for text in TEXTS:
            assert ours.encode(text, True) == theirs.encode(text), (arch, text)
            ids_ = ours.encode(text)
            assert ours.decode(ids_) == theirs.decode(ids_) == text


def test_smollm_pre_tokenizer_splits_digits(written, tmp_path):
    """llama.cpp's 'smollm' (and 'starcoder', ...) splits every digit before GPT-2's regex;
    transformers' GGUF tokenizer does not, so this is checked against the regex itself."""
    _, src = written("llama", QType.F16)  # trained with up to 3 digits per token
    config, weights = hf_weights(src)
    ours = {}
    for pre in ("smollm", "gpt-2"):
        f = write_gguf(tmp_path / f"{pre}.gguf", config, weights, src, QType.F16, pre=pre)
        ours[pre] = load_checkpoint(f).tokenizer
    text = "In 2024, 12345 apples"
    split = [ours["smollm"].decode([i]) for i in ours["smollm"].encode(text)]
    assert "".join(split) == text
    assert [p for p in split if p.strip().isdigit()] == list("202412345")
    plain = [ours["gpt-2"].decode([i]) for i in ours["gpt-2"].encode(text)]
    assert any(len(p.strip()) > 1 and p.strip().isdigit() for p in plain)


def test_sentencepiece_vocabulary(make_tiny, tmp_path):
    """A ``llama`` (SentencePiece-style) vocabulary: scores become merge ranks, unknown
    bytes fall back to <0xNN> tokens, a space is prefixed, BOS is added by default. The
    reference is the same model built directly with ``tokenizers``."""
    import gguf
    import tokenizers
    from tokenizers import SentencePieceBPETokenizer

    from pastry.engine.tiny import CORPUS

    spm = SentencePieceBPETokenizer(add_prefix_space=True)
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    spm.train_from_iterator(
        CORPUS.read_text().splitlines()[:3000], vocab_size=1500, min_frequency=2,
        special_tokens=["<unk>", "<s>", "</s>", *byte_tokens], show_progress=False,
    )  # fmt: skip
    vocab = spm.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    merges = json.loads(spm.to_str())["model"]["merges"]
    ranks = {"".join(m if isinstance(m, list) else m.split(" ")): r for r, m in enumerate(merges)}
    # SentencePiece scores: the earlier a piece is merged, the higher its score
    scores = [-float(ranks.get(t, 0)) if t in ranks else 0.0 for t in tokens]
    types = [3 if t in ("<unk>", "<s>", "</s>") else 6 if t in byte_tokens else 1 for t in tokens]
    types[0] = 2
    src = make_tiny("llama", dtype="float32")
    _, weights = hf_weights(src)
    f = tmp_path / "spm.gguf"
    w = gguf.GGUFWriter(f, "llama")
    for k, v in (("block_count", 2), ("context_length", 2048), ("embedding_length", 64),
                 ("feed_forward_length", 128), ("attention.head_count", 4),
                 ("attention.head_count_kv", 2)):  # fmt: skip
        w.add_uint32(f"llama.{k}", v)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(vocab["<s>"])
    w.add_eos_token_id(vocab["</s>"])
    w.add_unk_token_id(vocab["<unk>"])
    n = len(tokens)
    rng = np.random.default_rng(0)
    w.add_tensor("token_embd.weight", (0.02 * rng.standard_normal((n, 64))).astype(np.float32))
    for hf_name, t in weights.items():
        if hf_name not in ("model.embed_tokens.weight", "lm_head.weight"):
            w.add_tensor(gguf_name(hf_name), t.numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tok = load_checkpoint(f).tokenizer
    assert tok.add_bos_token and tok.bos_token_id == vocab["<s>"]
    ref_json = json.loads(spm.to_str())
    ref_json["model"]["byte_fallback"] = True  # as llama.cpp's SentencePiece vocabularies
    reference = tokenizers.Tokenizer.from_str(json.dumps(ref_json))
    # (the reference splits at every space first; SentencePiece does not, so runs of spaces
    # are only checked to round-trip)
    single_spaced = [TEXTS[0], TEXTS[3], TEXTS[5], "plain words", "x"]
    for text in TEXTS + single_spaced:
        ids_ = tok.encode(text)
        if text in single_spaced:
            assert ids_ == reference.encode(text, add_special_tokens=False).ids, text
        assert tok.encode(text, True) == [vocab["<s>"], *ids_]
        assert tok.decode(ids_) == text, text
    rare = "ꙮ"  # not in the vocabulary: its utf-8 bytes
    assert not any(rare in t for t in vocab)
    assert tok.encode(rare)[1:] == [vocab[f"<0x{b:02X}>"] for b in rare.encode()]
    assert tok.decode(tok.encode(rare)) == rare


# -- the cache -------------------------------------------------------------------------------


def test_second_start_reads_only_the_cache(written, pastry_home, monkeypatch, tmp_path, capfd):
    _, src = written("qwen2", QType.Q8_0)
    config, weights = hf_weights(src)
    f = write_gguf(tmp_path / "fresh.gguf", config, weights, src, QType.Q4_0)
    first = load_checkpoint(f)
    w16 = first.load_state_dict(torch.bfloat16)
    cache = first.cache
    err = capfd.readouterr().err  # a progress bar, then where the result went
    assert "converting fresh.gguf to bfloat16" in err and f"cached: {cache}" in err
    assert cache.parent == pastry_home / "models" / "gguf-cache"
    assert sorted(p.name for p in cache.iterdir()) == sorted(
        ["config.json", "generation_config.json", "gguf.json", "model.bfloat16.safetensors",
         "tokenizer.json", "tokenizer_config.json"]
    )  # fmt: skip
    assert json.loads((cache / "gguf.json").read_text())["source"] == str(f)
    copy = tmp_path / "elsewhere" / "renamed.gguf"  # the same content shares the entry...
    copy.parent.mkdir()
    shutil.copy(f, copy)
    renamed = load_checkpoint(copy)
    assert renamed.cache == cache and renamed.name == "renamed"

    def no_parsing(*a, **kw):
        raise AssertionError("the GGUF file was parsed again")

    def no_hashing(*a, **kw):
        raise AssertionError("the GGUF file was hashed again")

    monkeypatch.setattr(pgguf, "read_gguf", no_parsing)
    monkeypatch.setattr(pgguf.hashlib, "file_digest", no_hashing)
    pgguf._reader.cache_clear()
    second = load_checkpoint(f)
    assert second.cache == cache and second.config == first.config
    for name, w in second.load_state_dict(torch.bfloat16).items():
        assert torch.equal(w, w16[name]) and w.dtype == torch.bfloat16
    monkeypatch.undo()
    # float32 is converted once more, into its own file; bfloat16 is its rounding
    w32 = second.load_state_dict(torch.float32)
    assert (cache / "model.float32.safetensors").is_file()
    assert all(torch.equal(w32[n].bfloat16(), w) for n, w in w16.items())
    # ...a changed file is a new one
    with open(f, "r+b") as fh:
        fh.seek(-4, os.SEEK_END)
        fh.write(b"\x01\x02\x03\x04")
    assert load_checkpoint(f).cache != cache


def test_engine_load_and_serve_take_a_gguf_file(written, tmp_path):
    from server_util import running_server

    f, _ = written("qwen2", QType.Q8_0)
    with running_server(f, tmp_path) as (url, _):
        import openai

        client = openai.OpenAI(base_url=url + "/v1", api_key="x")
        [card] = client.models.list().data
        assert card.id == "qwen2-Q8_0"  # the file's stem
        r = client.chat.completions.create(
            model=card.id, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
            temperature=0,
        )  # fmt: skip
        assert r.usage.completion_tokens == 4


# -- errors name the file and the field ------------------------------------------------------


def _rewrite(reader, out: Path, drop: set[str] = frozenset(), **override) -> Path:
    """A copy of the GGUF file ``reader`` read with metadata keys dropped or overridden."""
    import gguf

    arch = (
        override.pop("general.architecture", None)
        or reader.fields["general.architecture"].contents()
    )
    w = gguf.GGUFWriter(out, arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in drop or key == "general.architecture":
            continue
        value = override.pop(key, field.contents())
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, value, vtype, sub_type=sub)
    for key, value in override.items():
        w.add_key_value(key, value, gguf.GGUFValueType.STRING)
    for t in reader.tensors:
        w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def test_errors_name_the_file_and_the_field(written, tmp_path):
    f, _ = written("qwen2", QType.Q8_0)
    reader = read_gguf(f)
    cases = [
        (dict(**{"general.architecture": "phi3"}), r"general\.architecture is 'phi3'.*supported: llama, mistral, qwen2, qwen3"),
        (dict(drop={"qwen2.block_count"}), r"metadata field 'qwen2\.block_count' is missing"),
        (dict(**{"tokenizer.ggml.pre": "klingon"}), r"tokenizer\.ggml\.pre is 'klingon'"),
        (dict(**{"tokenizer.ggml.model": "bert"}), r"tokenizer\.ggml\.model is 'bert'"),
        (dict(**{"qwen2.rope.scaling.type": "yarn"}), r"qwen2\.rope\.scaling\.type is 'yarn'"),
        (dict(drop={"tokenizer.ggml.merges"}), r"'tokenizer\.ggml\.merges' is missing"),
    ]  # fmt: skip
    for i, (kw, match) in enumerate(cases):
        bad = _rewrite(reader, tmp_path / f"bad{i}.gguf", **kw)
        with pytest.raises(CheckpointError, match=match) as e:
            load_checkpoint(bad)
        assert str(bad) in str(e.value)


def test_unsupported_quantization_type_is_named(written, tmp_path):
    import gguf

    f, _ = written("qwen2", QType.Q8_0)
    reader = read_gguf(f)
    out = tmp_path / "q8_1.gguf"
    w = gguf.GGUFWriter(out, "qwen2")
    for key, field in reader.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture":
            sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    for t in reader.tensors:
        if t.name == "blk.1.ffn_up.weight":  # same shape, as Q8_1 blocks (36 bytes per 32)
            block, size = gguf.GGML_QUANT_SIZES[QType.Q8_1]
            shape = (int(t.shape[1]), int(t.shape[0]) // block * size)
            w.add_tensor(t.name, np.zeros(shape, np.uint8), raw_dtype=QType.Q8_1)
        else:
            w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ckpt = load_checkpoint(out)  # the metadata is fine
    with pytest.raises(
        CheckpointError, match=r"tensor 'blk\.1\.ffn_up\.weight' has type Q8_1"
    ) as e:
        ckpt.load_state_dict(torch.float32)
    assert str(out) in str(e.value)


def test_truncated_and_foreign_files(written, tmp_path):
    f, _ = written("qwen2", QType.Q8_0)
    data = f.read_bytes()
    for n in (10, 1000, len(data) // 2, len(data) - 7):
        cut = tmp_path / f"cut{n}.gguf"
        cut.write_bytes(data[:n])
        with pytest.raises(CheckpointError, match="truncated") as e:
            load_checkpoint(cut)
        assert str(cut) in str(e.value)
    other = tmp_path / "model.gguf"
    other.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(CheckpointError, match=r"model\.gguf: not a GGUF file \(it starts with"):
        load_checkpoint(other)
    other = other.rename(tmp_path / "model.bin")
    with pytest.raises(CheckpointError, match=r"model\.bin: not a checkpoint"):
        load_checkpoint(other)


def test_generate_cli_takes_a_gguf_file(written, capsys):
    from pastry.cli import main

    f, _ = written("qwen2", QType.F16)
    assert main(["generate", "--model", str(f), "--max-tokens", "5", "Hello,"]) == 0
    out = capsys.readouterr()
    assert out.out.startswith("Hello,") and "engine: qwen2-F16 (qwen2" in out.err
