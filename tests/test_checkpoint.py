"""Checkpoint loading: agreement with transformers, sharding, and errors that name the file."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from pastry.engine.checkpoint import load_checkpoint
from pastry.engine.hf_checkpoint import Checkpoint, expected_shapes, load_state_dict, weight_files
from pastry.wire.config import CheckpointError, ModelConfig


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _hf_load(path: Path) -> tuple[torch.nn.Module, dict, list[str]]:
    """transformers' model, its loading info, and the warnings it logged."""
    records = _Records()
    logger = transformers.utils.logging.get_logger("transformers")
    logger.addHandler(records)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.bfloat16, output_loading_info=True
        )
    finally:
        logger.removeHandler(records)
    return model, info, records.messages


def _copy(src: Path, dst: Path, **config_changes) -> Path:
    shutil.copytree(src, dst)
    if config_changes:
        cfg = json.loads((dst / "config.json").read_text())
        cfg.update(config_changes)
        (dst / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v != ...}))
    return dst


def test_transformers_loads_tiny_and_agrees(tiny_ckpt: Path) -> None:
    model, info, warnings = _hf_load(tiny_ckpt)
    assert info["missing_keys"] == set() == info["unexpected_keys"] == info["mismatched_keys"]
    assert info["error_msgs"] == []
    assert warnings == []
    ckpt = load_checkpoint(tiny_ckpt)
    ours = load_state_dict(tiny_ckpt, ckpt.config, torch.bfloat16)
    theirs = model.state_dict()
    assert list(ours) == list(expected_shapes(ckpt.config))
    for name, tensor in ours.items():
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, theirs[name]), name
    assert set(theirs) - set(ours) == (
        {"lm_head.weight"} if ckpt.config.tie_word_embeddings else set()
    )
    logits = model(torch.tensor([ckpt.tokenizer.encode("Hello there")])).logits
    assert logits.shape[-1] == ckpt.config.vocab_size and torch.isfinite(logits).all()


def test_expected_shapes_match_transformers_model(tiny_ckpt: Path) -> None:
    cfg = load_checkpoint(tiny_ckpt).config
    hf = AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(tiny_ckpt))
    theirs = {n: tuple(t.shape) for n, t in hf.state_dict().items()}
    if cfg.tie_word_embeddings:
        del theirs["lm_head.weight"]
    assert expected_shapes(cfg) == theirs


def test_expected_shapes_per_arch(make_tiny) -> None:
    llama = load_checkpoint(make_tiny("llama")).config
    qwen2 = load_checkpoint(make_tiny("qwen2")).config
    qwen3 = load_checkpoint(make_tiny("qwen3")).config
    s = expected_shapes(qwen2)
    assert s["model.layers.1.self_attn.k_proj.bias"] == (2 * 16,)
    assert "lm_head.weight" not in s and "model.layers.0.self_attn.q_norm.weight" not in s
    s = expected_shapes(qwen3)
    assert s["model.layers.0.self_attn.q_norm.weight"] == (32,)
    assert s["model.layers.0.self_attn.q_proj.weight"] == (4 * 32, 64)
    assert s["model.layers.0.self_attn.o_proj.weight"] == (64, 4 * 32)
    assert not any(n.endswith(".bias") for n in s)
    s = expected_shapes(llama)
    assert s["lm_head.weight"] == (llama.vocab_size, 64)
    assert s["model.layers.0.mlp.down_proj.weight"] == (64, 128)


def test_load_casts_dtype(make_tiny) -> None:
    path = make_tiny("qwen2")
    ckpt = load_checkpoint(path)
    bf16 = ckpt.load_state_dict(torch.bfloat16)
    f32 = ckpt.load_state_dict(torch.float32)
    for name in bf16:
        assert f32[name].dtype == torch.float32
        assert torch.equal(f32[name].to(torch.bfloat16), bf16[name])


def test_sharded_round_trip(make_tiny) -> None:
    sharded = make_tiny("qwen3", shards=3)
    single = make_tiny("qwen3")
    files = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert not (sharded / "model.safetensors").exists()
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    cfg = load_checkpoint(sharded).config
    assert set(index["weight_map"]) == set(expected_shapes(cfg))
    assert set(index["weight_map"].values()) == set(files)
    total = sum(
        t.numel() * t.element_size() for f in files for t in load_file(sharded / f).values()
    )
    assert index["metadata"]["total_size"] == total
    a = load_state_dict(sharded, cfg, torch.bfloat16)
    b = load_state_dict(single, cfg, torch.bfloat16)
    assert list(a) == list(b)
    assert all(torch.equal(a[n], b[n]) for n in a)
    model, info, warnings = _hf_load(sharded)
    assert info["missing_keys"] == set() == info["unexpected_keys"] and warnings == []
    assert torch.equal(model.state_dict()["model.norm.weight"], a["model.norm.weight"])
    source, where = weight_files(sharded)
    assert source.name == "model.safetensors.index.json" and len(set(where.values())) == 3


def test_load_checkpoint_fields(make_tiny) -> None:
    path = make_tiny("llama")
    ckpt = load_checkpoint(path)
    assert isinstance(ckpt, Checkpoint)
    assert ckpt.path == path.absolute()
    assert ckpt.name == path.name == ckpt.config.name
    assert ckpt.config.arch == "llama"
    assert ckpt.config.bos_token_id == 0
    # generation_config.json's eos list wins over config.json's single id
    assert json.loads((path / "config.json").read_text())["eos_token_id"] == 2
    assert ckpt.config.eos_token_ids == (2, 0)
    assert ckpt.tokenizer.vocab_size == ckpt.config.vocab_size
    assert ckpt.config.rope_scaling.kind == "llama3"
    assert ckpt.config.torch_dtype == "bfloat16"


def test_bos_eos_fallbacks(make_tiny, tmp_path: Path) -> None:
    d = _copy(make_tiny("qwen2"), tmp_path / "a", _name_or_path="org/tiny-qwen")
    (d / "generation_config.json").unlink()
    ckpt = load_checkpoint(d)
    assert ckpt.name == ckpt.config.name == "org/tiny-qwen"
    assert ckpt.config.eos_token_ids == (2,) and ckpt.config.bos_token_id == 0  # config.json
    d = _copy(make_tiny("llama"), tmp_path / "b", eos_token_id=..., bos_token_id=...)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": 1}))
    cfg = load_checkpoint(d).config
    assert cfg.eos_token_ids == (1,)  # an int in generation_config
    assert cfg.bos_token_id == 0  # from the tokenizer's bos_token
    (d / "generation_config.json").unlink()
    assert load_checkpoint(d).config.eos_token_ids == (2,)  # the tokenizer's eos_token


def test_checkpoint_module_does_not_import_torch(make_tiny) -> None:
    code = (
        "import sys\n"
        "from pastry.engine.checkpoint import load_checkpoint\n"
        f"ckpt = load_checkpoint({str(make_tiny('llama'))!r})\n"
        "assert ckpt.tokenizer.encode('hi')\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# -- errors ---------------------------------------------------------------------------------


def test_missing_config(make_tiny, tmp_path: Path) -> None:
    d = _copy(make_tiny("llama"), tmp_path / "c")
    (d / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"config\.json: file not found"):
        load_checkpoint(d)
    with pytest.raises(CheckpointError, match="not a directory"):
        load_checkpoint(tmp_path / "nope")


def test_missing_weights(make_tiny, tmp_path: Path) -> None:
    d = _copy(make_tiny("llama"), tmp_path / "c")
    (d / "model.safetensors").unlink()
    ckpt = load_checkpoint(d)  # config and tokenizer need no weights
    with pytest.raises(CheckpointError) as e:
        ckpt.load_state_dict(torch.float32)
    assert str(e.value) == f"{d}: no model.safetensors or model.safetensors.index.json"


def test_unsupported_model_type(make_tiny, tmp_path: Path) -> None:
    d = _copy(make_tiny("llama"), tmp_path / "c", model_type="gpt2")
    with pytest.raises(CheckpointError, match=r"config\.json: model_type 'gpt2' is not supported"):
        load_checkpoint(d)


def test_missing_tokenizer(make_tiny, tmp_path: Path) -> None:
    d = _copy(make_tiny("llama"), tmp_path / "c")
    (d / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match=r"/c/tokenizer\.json: file not found"):
        load_checkpoint(d)


def test_shape_mismatch_names_file_and_tensor(make_tiny, tmp_path: Path) -> None:
    d = _copy(make_tiny("llama"), tmp_path / "c", intermediate_size=256)
    ckpt = load_checkpoint(d)
    with pytest.raises(CheckpointError) as e:
        ckpt.load_state_dict(torch.float32)
    assert str(e.value) == (
        f"{d / 'model.safetensors'}: tensor 'model.layers.0.mlp.gate_proj.weight' has "
        "shape (128, 64), expected (256, 64) from config.json (intermediate_size=256, "
        "hidden_size=64)"
    )


def test_shape_mismatch_in_a_shard(make_tiny, tmp_path: Path) -> None:
    d = _copy(make_tiny("qwen2", shards=2), tmp_path / "c", num_key_value_heads=4)
    cfg = ModelConfig.from_file(d / "config.json")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    shard = index["weight_map"]["model.layers.0.self_attn.k_proj.weight"]
    with pytest.raises(CheckpointError) as e:
        load_state_dict(d, cfg, torch.float32)
    msg = str(e.value)
    assert msg.startswith(f"{d / shard}: tensor 'model.layers.0.self_attn.k_proj.")
    assert "num_key_value_heads=4 x head_dim=16" in msg


def test_missing_tensor(make_tiny, tmp_path: Path) -> None:
    d = _copy(make_tiny("qwen3"), tmp_path / "c")
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    save_file(tensors, d / "model.safetensors")
    cfg = load_checkpoint(d).config
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor 'model\.layers\.1\."):
        load_state_dict(d, cfg, torch.float32)


def test_untied_without_lm_head(make_tiny, tmp_path: Path) -> None:
    d = _copy(make_tiny("qwen2"), tmp_path / "c", tie_word_embeddings=False)
    cfg = load_checkpoint(d).config
    with pytest.raises(
        CheckpointError, match=r"'lm_head\.weight' is missing .*tie_word_embeddings"
    ):
        load_state_dict(d, cfg, torch.float32)


def test_index_naming_a_missing_shard(make_tiny, tmp_path: Path) -> None:
    d = _copy(make_tiny("llama", shards=2), tmp_path / "c")
    (d / "model-00002-of-00002.safetensors").unlink()
    cfg = load_checkpoint(d).config
    with pytest.raises(CheckpointError, match=r"index\.json: weight_map names 'model-00002-of"):
        load_state_dict(d, cfg, torch.float32)
    (d / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"index\.json: not a valid shard index"):
        load_state_dict(d, cfg, torch.float32)


def test_index_entry_missing_from_its_shard(make_tiny, tmp_path: Path) -> None:
    d = _copy(make_tiny("llama", shards=2), tmp_path / "c")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = "model-00001-of-00002.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    first = load_file(d / "model-00001-of-00002.safetensors")
    assert "model.norm.weight" not in first  # the last tensor is in the last shard
    with pytest.raises(CheckpointError, match=r"00001-of-00002\.safetensors: tensor 'model\.norm"):
        load_state_dict(d, load_checkpoint(d).config, torch.float32)


def test_corrupt_safetensors(make_tiny, tmp_path: Path) -> None:
    d = _copy(make_tiny("llama"), tmp_path / "c")
    (d / "model.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(CheckpointError, match=r"model\.safetensors: not a readable safetensors"):
        load_state_dict(d, load_checkpoint(d).config, torch.float32)


def test_extra_tensors_are_ignored(make_tiny, tmp_path: Path, caplog) -> None:
    d = _copy(make_tiny("qwen2"), tmp_path / "c")
    tensors = load_file(d / "model.safetensors")
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()  # tied anyway
    tensors["model.vision_tower.proj.weight"] = torch.ones(2, 2)
    save_file(tensors, d / "model.safetensors")
    cfg = load_checkpoint(d).config
    with caplog.at_level(logging.WARNING, logger="pastry.engine.hf_checkpoint"):
        sd = load_state_dict(d, cfg, torch.float32)
    assert list(sd) == list(expected_shapes(cfg))
    assert [r.getMessage() for r in caplog.records] == [
        f"{d / 'model.safetensors'}: ignoring 1 tensors the config does not use: "
        "model.vision_tower.proj.weight"
    ]


def test_tokenizer_larger_than_model_vocab(make_tiny, tmp_path: Path) -> None:
    d = _copy(make_tiny("llama"), tmp_path / "c", vocab_size=100)
    with pytest.raises(
        CheckpointError, match=r"tokenizer\.json: has token ids up to .*vocab_size=100"
    ):
        load_checkpoint(d)


def test_bad_generation_config(make_tiny, tmp_path: Path) -> None:
    d = _copy(make_tiny("llama"), tmp_path / "c")
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": ["x"]}))
    with pytest.raises(CheckpointError, match=r"generation_config\.json: eos_token_id must be"):
        load_checkpoint(d)
