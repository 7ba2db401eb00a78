"""Writing GGUF files for tests, the way llama.cpp's converter (convert_hf_to_gguf.py) does.

:func:`write_gguf` takes a Hugging Face checkpoint (config.json, float32 weights by HF name,
tokenizer files) and writes it with ``gguf.GGUFWriter``: hyper-parameters under
``{arch}.*``, tensors under llama.cpp's names with the rows of llama's q/k projections
permuted for GPT-J style rotary, Llama 3 RoPE scaling as a ``rope_freqs`` tensor, and the
byte-level BPE tokenizer as ``tokenizer.ggml.*`` metadata. ``qtype`` picks each tensor's
type: real quantization where ``gguf.quants`` implements it, random valid blocks for types
it only dequantizes (the k-quants), so that both dequantizers can be compared.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QType

from pastry.engine.gguf_weights import gguf_name

# byte layout of the k-quant blocks: (offset of the float16 scale d, of dmin or None)
_K_SCALES = {QType.Q4_K: (0, 2), QType.Q5_K: (0, 2), QType.Q6_K: (208, None)}
_K_D = {QType.Q4_K: 1e-4, QType.Q5_K: 5e-5, QType.Q6_K: 1e-5}  # keeps |w| below ~0.1


def permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's ``LlamaModel.permute``: each head's rows from halves to interleaved pairs."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def llama3_rope_factors(rope: dict[str, Any], head_dim: int) -> np.ndarray:
    """What llama.cpp's converter writes as ``rope_freqs.weight`` for Llama 3 scaling."""
    base = rope["rope_theta"]
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def encode(
    w: np.ndarray, qtype: QType, rng: np.random.Generator
) -> tuple[np.ndarray, QType | None]:
    """``w`` (float32) as the data of a ``qtype`` tensor: (array, raw dtype for GGUFWriter)."""
    if qtype == QType.F32:
        return w.astype(np.float32), None
    if qtype == QType.F16:
        return w.astype(np.float16), None
    if qtype in _K_SCALES:  # gguf.quants only dequantizes these: random valid blocks
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        rows, cols = w.shape
        data = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
        for off in (o for o in _K_SCALES[qtype] if o is not None):
            d = rng.uniform(0.2, 1.0, (rows, cols // block)) * _K_D[qtype]
            data[..., off : off + 2] = d.astype(np.float16)[..., None].view(np.uint8)
        return data.reshape(rows, -1), qtype
    return gguf.quants.quantize(w.astype(np.float32), qtype), qtype


def write_gguf(
    out: Path,
    config: dict[str, Any],
    weights: dict[str, torch.Tensor],
    tokenizer_dir: Path,
    qtype: QType | Callable[[str], QType] = QType.F32,
    *,
    arch: str | None = None,
    pre: str | None = None,
    add_bos: bool | None = None,
    seed: int = 0,
) -> Path:
    """Write ``weights`` (HF names, float32) of the model ``config`` describes to ``out``."""
    arch = arch or config["model_type"]
    rng = np.random.default_rng(seed)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    rope = config.get("rope_parameters") or {"rope_theta": config.get("rope_theta", 10000.0)}
    w = gguf.GGUFWriter(out, arch)
    w.add_name(out.stem)
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if arch in ("llama", "mistral"):
        w.add_rope_dimension_count(head_dim)
        w.add_vocab_size(config["vocab_size"])
    if config.get("head_dim"):
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    _add_tokenizer(w, tokenizer_dir, arch, pre, add_bos)
    pick = qtype if callable(qtype) else (lambda name: qtype)
    if rope.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(rope, head_dim))
    for hf, t in weights.items():
        if hf == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue
        t = t.float()
        if arch in ("llama", "mistral") and ".q_proj." in hf:
            t = permute(t, heads)
        elif arch in ("llama", "mistral") and ".k_proj." in hf:
            t = permute(t, kv_heads)
        name = gguf_name(hf)
        kind = pick(name) if t.dim() > 1 else QType.F32  # llama.cpp keeps 1-d tensors F32
        data, raw = encode(t.numpy(), kind, rng)
        w.add_tensor(name, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _add_tokenizer(
    w: gguf.GGUFWriter, d: Path, arch: str, pre: str | None, add_bos: bool | None
) -> None:
    tj = json.loads((d / "tokenizer.json").read_text())
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    vocab: dict[str, int] = tj["model"]["vocab"]
    added = {a["id"]: a for a in tj["added_tokens"]}
    n = max([*vocab.values(), *added]) + 1
    tokens = [f"[PAD{i}]" for i in range(n)]
    types = [gguf.TokenType.UNUSED] * n
    for token, i in vocab.items():
        tokens[i], types[i] = token, gguf.TokenType.NORMAL
    for i, a in added.items():
        tokens[i] = a["content"]
        types[i] = gguf.TokenType.CONTROL if a["special"] else gguf.TokenType.USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre or ("llama-bpe" if arch == "llama" else "qwen2"))
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    ids = {t: i for i, t in enumerate(tokens)}
    if cfg.get("bos_token"):
        w.add_bos_token_id(ids[cfg["bos_token"]])
    w.add_eos_token_id(ids[cfg["eos_token"]])
    if cfg.get("pad_token"):
        w.add_pad_token_id(ids[cfg["pad_token"]])
    w.add_add_bos_token(arch == "llama" if add_bos is None else add_bos)
    if cfg.get("chat_template"):
        w.add_chat_template(cfg["chat_template"])


def hf_weights(model_dir: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """config.json and the float32 weights of a checkpoint directory."""
    from safetensors.torch import load_file

    config = json.loads((model_dir / "config.json").read_text())
    return config, {k: v.float() for k, v in load_file(model_dir / "model.safetensors").items()}
