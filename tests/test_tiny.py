"""Random-weight checkpoints: HF file format, determinism, default model and the CLI."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from pastry.cli import main
from pastry.engine import tiny
from pastry.engine.checkpoint import load_checkpoint
from pastry.engine.hf_checkpoint import expected_shapes
from pastry.engine.tiny import (
    MAX_TOKENIZER_VOCAB,
    create_tiny,
    default_model_dir,
    ensure_default_model,
    hf_config,
    train_tokenizer,
)
from pastry.wire.config import ModelConfig


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_config_json_is_what_transformers_writes(tiny_ckpt: Path, tmp_path: Path) -> None:
    ours = json.loads((tiny_ckpt / "config.json").read_text())
    transformers.AutoConfig.from_pretrained(tiny_ckpt).save_pretrained(tmp_path)
    theirs = json.loads((tmp_path / "config.json").read_text())
    # transformers stamps its own version; everything else must be what it writes.
    ours.pop("transformers_version"), theirs.pop("transformers_version")
    assert ours == theirs


def test_tiny_shapes(tiny_ckpt: Path) -> None:
    cfg = load_checkpoint(tiny_ckpt).config
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_layers) == (64, 128, 2)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.max_position) == (4, 2, 2048)
    assert cfg.vocab_size == train_tokenizer(cfg.arch).get_vocab_size() <= MAX_TOKENIZER_VOCAB
    assert cfg.vocab_size > 4096  # the corpus supports a real vocabulary
    assert cfg.tie_word_embeddings == (cfg.arch != "llama")
    assert cfg.attention_bias == (cfg.arch == "qwen2")
    assert cfg.qk_norm == (cfg.arch == "qwen3")
    assert cfg.head_dim == (32 if cfg.arch == "qwen3" else 16)
    assert 0.3e6 < cfg.num_params < 5e6


def test_small_config() -> None:
    for arch in tiny.ARCHS:
        cfg = ModelConfig.from_dict(hf_config(arch, "small", 32000, "bfloat16"))
        assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_layers) == (768, 2048, 12)
        assert cfg.vocab_size == 32000 and cfg.max_position == 4096
        assert 100e6 < cfg.num_params < 160e6, (arch, cfg.num_params)


@pytest.mark.slow
def test_small_checkpoint_loads_in_transformers(tmp_path: Path) -> None:
    path = create_tiny(tmp_path, arch="llama", size="small")
    _, info = transformers.AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert info["missing_keys"] == set() == info["unexpected_keys"]
    ckpt = load_checkpoint(path)
    assert ckpt.tokenizer.vocab_size < ckpt.config.vocab_size == 32000  # padded embedding
    assert ckpt.tokenizer.decode([5, 31999, 6]) == ckpt.tokenizer.decode([5, 6])


def test_weights_statistics(make_tiny) -> None:
    path = make_tiny("qwen2", dtype="float32")
    sd = load_file(path / "model.safetensors")
    cfg = load_checkpoint(path).config
    assert {n: tuple(t.shape) for n, t in sd.items()} == expected_shapes(cfg)
    assert all(t.dtype == torch.float32 for t in sd.values())
    embed = sd["model.embed_tokens.weight"]
    assert abs(embed.std().item() - 0.02) < 0.002 and abs(embed.mean().item()) < 0.002
    norm = sd["model.layers.0.input_layernorm.weight"]
    assert abs(norm.mean().item() - 1) < 0.05 and 0.05 < norm.std().item() < 0.15
    bias = sd["model.layers.1.self_attn.q_proj.bias"]
    assert bias.abs().max() > 0 and bias.std().item() < 0.05
    assert not torch.equal(
        sd["model.layers.0.mlp.up_proj.weight"], sd["model.layers.1.mlp.up_proj.weight"]
    )


def test_dtype_option(make_tiny) -> None:
    bf16 = load_file(make_tiny("llama") / "model.safetensors")
    f32 = load_file(make_tiny("llama", dtype="float32") / "model.safetensors")
    assert all(t.dtype == torch.bfloat16 for t in bf16.values())
    assert all(torch.equal(f32[n].to(torch.bfloat16), bf16[n]) for n in bf16)
    assert (
        json.loads((make_tiny("llama", dtype="float32") / "config.json").read_text())["dtype"]
        == "float32"
    )


def test_same_seed_same_bytes_other_seed_differs(make_tiny, tmp_path: Path) -> None:
    first = make_tiny("qwen3")
    again = create_tiny(tmp_path / "again", arch="qwen3")
    for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"):
        assert _sha(first / name) == _sha(again / name), name
    other = create_tiny(tmp_path / "other", arch="qwen3", seed=1)
    assert _sha(first / "model.safetensors") != _sha(other / "model.safetensors")
    assert _sha(first / "tokenizer.json") == _sha(other / "tokenizer.json")


def test_tokenizer_training_is_deterministic() -> None:
    tiny._trained_tokenizer_json.cache_clear()
    first = train_tokenizer("llama").to_str()
    tiny._trained_tokenizer_json.cache_clear()
    assert train_tokenizer("llama").to_str() == first
    assert train_tokenizer("qwen2").to_str() != first  # Qwen 2's pre-tokenizer and NFC


def test_tokenizer_is_byte_level_bpe() -> None:
    tok = json.loads(train_tokenizer("qwen3").to_str())
    assert tok["model"]["type"] == "BPE"
    assert tok["decoder"]["type"] == "ByteLevel"
    assert [p["type"] for p in tok["pre_tokenizer"]["pretokenizers"]] == ["Split", "ByteLevel"]
    assert [(t["id"], t["content"], t["special"]) for t in tok["added_tokens"]] == [
        (0, "<|endoftext|>", True),
        (1, "<|im_start|>", True),
        (2, "<|im_end|>", True),
    ]


def test_create_tiny_is_fast(tmp_path: Path) -> None:
    tiny._trained_tokenizer_json.cache_clear()
    start = time.perf_counter()
    create_tiny(tmp_path / "t", arch="llama")
    assert time.perf_counter() - start < 3.0


def test_shards_rewrite_replaces_old_weights(tmp_path: Path) -> None:
    d = create_tiny(tmp_path, arch="llama", shards=4)
    assert len(list(d.glob("model-*-of-00004.safetensors"))) == 4
    create_tiny(d, arch="llama")
    assert sorted(p.name for p in d.glob("model*")) == ["model.safetensors"]


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="arch must be one of llama, qwen2, qwen3, got 'gpt2'"):
        create_tiny(tmp_path, arch="gpt2")
    with pytest.raises(ValueError, match="size must be"):
        create_tiny(tmp_path, size="huge")
    with pytest.raises(ValueError, match="dtype must be"):
        create_tiny(tmp_path, dtype="int8")
    with pytest.raises(
        ValueError, match=r"shards must be between 1 and 21 \(one per tensor\), got 0"
    ):
        create_tiny(tmp_path, shards=0)
    with pytest.raises(ValueError, match="shards must be between 1 and 21"):
        create_tiny(tmp_path, shards=22)
    assert not list(tmp_path.iterdir())  # nothing written


def test_default_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PASTRY_HOME", str(tmp_path / "home"))
    assert default_model_dir("qwen2") == tmp_path / "home" / "models" / "default-qwen2-tiny"
    path = ensure_default_model("qwen2")
    assert path == default_model_dir("qwen2")
    assert load_checkpoint(path).config.arch == "qwen2"
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_default_model("qwen2") == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp  # not rewritten
    assert [p.name for p in path.parent.iterdir()] == ["default-qwen2-tiny"]  # no temp dirs
    monkeypatch.delenv("PASTRY_HOME")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_model_dir() == tmp_path / "xdg" / "pastry" / "models" / "default-llama-tiny"


def test_cli_create_tiny(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "cli"
    argv = ["model", "create-tiny", str(d), "--arch", "qwen2", "--dtype", "float32"]
    assert main([*argv, "--shards", "2", "--seed", "3"]) == 0
    out = capsys.readouterr().out
    ckpt = load_checkpoint(d)
    params = sum(t.numel() for f in d.glob("*.safetensors") for t in load_file(f).values())
    assert f"wrote {d}" in out
    assert f"params:    {params:,}" in out
    assert f"vocab:     {ckpt.config.vocab_size}" in out
    for name in ("config.json", "model-00001-of-00002.safetensors", "tokenizer.json"):
        assert name in out
    assert ckpt.config.torch_dtype == "float32"
    assert main([*argv, "--shards", "0"]) == 2
    assert "shards must be between" in capsys.readouterr().err


def test_cli_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "model" in capsys.readouterr().err
    assert main(["model"]) == 2
    assert "create-tiny" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["model", "create-tiny", "x", "--arch", "gpt2"])
    assert e.value.code == 2


def test_tiny_does_not_need_transformers(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "from pastry.engine.tiny import create_tiny\n"
        f"create_tiny({str(tmp_path)!r}, arch='qwen3')\n"
        "assert 'transformers' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_python_dash_m(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")}
    out = subprocess.run(
        [sys.executable, "-m", "pastry", "--version"], capture_output=True, text=True, env=env
    )
    assert out.returncode == 0 and out.stdout.startswith("pastry ")
