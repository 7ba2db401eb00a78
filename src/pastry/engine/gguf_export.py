"""Writing a Llama-family checkpoint as a llama.cpp GGUF file (``gguf.GGUFWriter``).

Used to run llama.cpp on exactly the weights Pastry serves (``benchmarks/vs_llamacpp.py``)
and to make quantized GGUF files for tests. Tensors are named and laid out as llama.cpp's
``convert_hf_to_gguf.py`` does, including its q/k row order for interleaved RoPE. A
checkpoint without a GGUF tokenizer gets a synthetic SentencePiece vocabulary (``<unk>``,
``<s>``, ``</s>``, the 256 byte tokens, fillers): enough for llama.cpp to load the file and
run token ids, which is all a benchmark needs; or the tokenizer of another GGUF is copied.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from pastry.engine.layers import rope_inv_freq
from pastry.wire.config import ModelConfig, RopeScaling

if TYPE_CHECKING:  # gguf loads only when a file is written
    import gguf

# llama.cpp's general.file_type for the types written here
_FILE_TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "BF16": 32}


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF q/k projection rows (rotate-half RoPE) -> llama.cpp's interleaved order."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def export_gguf(
    path: str | Path,
    cfg: ModelConfig,
    weights: Mapping[str, np.ndarray],
    qtype: str = "BF16",
    tokenizer_from: str | Path | None = None,
) -> Path:
    """Write ``weights`` (HF tensor name -> float32 array) as a llama GGUF at ``path``.

    ``qtype`` is the type of the 2-D projections and embeddings: F32, F16, BF16, Q8_0, Q4_0
    or Q4_1 (norms stay F32). ``tokenizer_from``: a GGUF whose ``tokenizer.*`` fields are
    copied; None writes the synthetic vocabulary. Returns ``path``."""
    import gguf

    if qtype not in _FILE_TYPES:
        raise ValueError(f"qtype must be one of {', '.join(_FILE_TYPES)}, got {qtype!r}")
    if cfg.arch != "llama" or cfg.sliding_window is not None:
        raise ValueError(f"only llama models without sliding window are written, not {cfg.arch!r}")
    path = Path(path)
    w = gguf.GGUFWriter(str(path), "llama")
    _add_hparams(w, cfg, qtype)
    _add_tokenizer(w, cfg, tokenizer_from)
    _add_tensors(w, cfg, weights, qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _add_hparams(w: gguf.GGUFWriter, cfg: ModelConfig, qtype: str) -> None:
    """The model's hyper-parameters as llama.cpp's ``llama.*`` fields, and the file type."""
    w.add_context_length(cfg.max_position)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(_FILE_TYPES[qtype])


def _add_tokenizer(w: gguf.GGUFWriter, cfg: ModelConfig, tokenizer_from: str | Path | None) -> None:
    """The ``tokenizer.*`` fields of ``tokenizer_from``, or the synthetic vocabulary."""
    import gguf

    if tokenizer_from is not None:
        reader = gguf.GGUFReader(str(tokenizer_from))
        for key, field in reader.fields.items():
            if key.startswith("tokenizer."):
                w.add_key_value(key, field.contents(), field.types[0], sub_type=field.types[-1])
        return
    n = cfg.vocab_size
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{i:02X}>" for i in range(256))]
    tokens += [f"\u2581t{i}" for i in range(n - len(tokens))]
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * n)
    w.add_token_types([2, 3, 3] + [6] * 256 + [1] * (n - 259))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)


def _add_tensors(
    w: gguf.GGUFWriter, cfg: ModelConfig, weights: Mapping[str, np.ndarray], qtype: str
) -> None:
    """Every tensor under llama.cpp's name, q/k rows permuted, 2-D ones as ``qtype``."""
    import gguf

    Q = gguf.GGMLQuantizationType

    def put(name: str, arr: np.ndarray) -> None:
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        if arr.ndim == 1 or qtype == "F32":
            w.add_tensor(name, arr)
        else:
            w.add_tensor(name, gguf.quants.quantize(arr, Q[qtype]), raw_dtype=Q[qtype])

    def get(name: str) -> np.ndarray:
        if name not in weights:
            raise ValueError(f"weights have no tensor {name!r}")
        return weights[name]

    put("token_embd.weight", get("model.embed_tokens.weight"))
    for i in range(cfg.num_layers):
        p, g = f"model.layers.{i}.", f"blk.{i}."
        put(g + "attn_norm.weight", get(p + "input_layernorm.weight"))
        put(g + "attn_q.weight", permute_qk(get(p + "self_attn.q_proj.weight"), cfg.num_heads))
        put(g + "attn_k.weight", permute_qk(get(p + "self_attn.k_proj.weight"), cfg.num_kv_heads))
        put(g + "attn_v.weight", get(p + "self_attn.v_proj.weight"))
        put(g + "attn_output.weight", get(p + "self_attn.o_proj.weight"))
        put(g + "ffn_norm.weight", get(p + "post_attention_layernorm.weight"))
        put(g + "ffn_gate.weight", get(p + "mlp.gate_proj.weight"))
        put(g + "ffn_up.weight", get(p + "mlp.up_proj.weight"))
        put(g + "ffn_down.weight", get(p + "mlp.down_proj.weight"))
    if cfg.rope_scaling.kind == "llama3":
        # llama.cpp divides each rotary frequency by its factor (convert_hf_to_gguf's tensor)
        scaled = rope_inv_freq(cfg)
        plain = rope_inv_freq(dataclasses.replace(cfg, rope_scaling=RopeScaling()))
        put("rope_freqs.weight", (plain / scaled).numpy())
    put("output_norm.weight", get("model.norm.weight"))
    if not cfg.tie_word_embeddings:
        put("output.weight", get("lm_head.weight"))
