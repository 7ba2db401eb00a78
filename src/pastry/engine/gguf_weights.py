"""A GGUF file's weights as the engine's: dequantized, renamed to HF names, unpermuted.

:func:`convert_weights` dequantizes every tensor the model needs with ``gguf.quants``
(:data:`SUPPORTED_TYPES`) into the engine's dtype, under the name transformers gives it
(:func:`gguf_name` maps back), and undoes the rotary row permutation that llama.cpp's
converter applies to the Q and K projections of llama models. torch and ``gguf`` are
imported only when weights are converted.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from pastry.engine.hf_checkpoint import expected_shapes
from pastry.wire.config import CheckpointError, ModelConfig

if TYPE_CHECKING:
    import gguf
    import torch

log = logging.getLogger(__name__)

# Tensor types (GGMLQuantizationType names) the gguf package dequantizes.
SUPPORTED_TYPES = (
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K",
    "Q5_K", "Q6_K", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S",
    "IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0",
)  # fmt: skip
_PERMUTED_ARCHS = ("llama", "mistral")  # llama.cpp rotates their q/k rows pairwise

_GLOBAL_TENSORS = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER_TENSORS = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
ROPE_FREQS = "rope_freqs.weight"  # Llama 3 RoPE scaling as frequency factors (gguf_config)


def gguf_name(hf_name: str) -> str:
    """llama.cpp's name of the tensor transformers calls ``hf_name``."""
    if hf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)  # model.layers.{i}.{rest}
    return f"blk.{layer}.{_LAYER_TENSORS[rest]}"


def dequantize(t: Any, path: Path) -> np.ndarray:
    """float32 values of a reader tensor, shaped (rows, columns) as transformers has them."""
    import gguf.quants

    if t.tensor_type.name not in SUPPORTED_TYPES:
        raise CheckpointError(
            f"{path}: tensor '{t.name}' has type {t.tensor_type.name}, which cannot be "
            f"dequantized (supported: {', '.join(SUPPORTED_TYPES)})"
        )
    return np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's ``permute``: rows of each head go from interleaved pairs (GPT-J style
    rotary) back to halves (the rotate-half style transformers and this engine use)."""
    pairs = w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:])
    return pairs.transpose(1, 2).reshape(w.shape)


def convert_weights(
    reader: gguf.GGUFReader, path: Path, cfg: ModelConfig, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Every tensor the model needs, by HF name, dequantized and cast to ``dtype`` (CPU), with
    a progress bar on stderr."""
    import torch
    from tqdm import tqdm

    tensors = {t.name: t for t in reader.tensors}
    plan = [(hf, gguf_name(hf), shape) for hf, shape in expected_shapes(cfg).items()]
    for hf, name, _ in plan:
        if name not in tensors:
            raise CheckpointError(f"{path}: tensor '{name}' is missing (the model's {hf})")
        _check_type(tensors[name], path)
    used = {name for _, name, _ in plan} | {ROPE_FREQS}
    if extra := sorted(set(tensors) - used):
        log.warning("%s: ignoring %d tensors the model does not use: %s", path, len(extra),
                    ", ".join(extra[:5]) + (", ..." if len(extra) > 5 else ""))  # fmt: skip
    permute = cfg.arch in _PERMUTED_ARCHS
    out: dict[str, torch.Tensor] = {}
    total = sum(int(tensors[name].n_elements) for _, name, _ in plan)
    with tqdm(
        total=total, unit="param", unit_scale=True, file=sys.stderr, mininterval=0.5,
        desc=f"converting {path.name} to {str(dtype).removeprefix('torch.')}", leave=False,
    ) as bar:  # fmt: skip
        for hf, name, shape in plan:
            t = tensors[name]
            values = dequantize(t, path)
            if not values.flags.writeable:  # F32: a view of the read-only mapped file
                values = values.copy()
            w = torch.from_numpy(values)
            if tuple(w.shape) != shape:
                raise CheckpointError(
                    f"{path}: tensor '{name}' has shape {tuple(w.shape)}, expected {shape} from "
                    "the metadata (embedding_length, attention.head_count[_kv], "
                    "feed_forward_length, vocabulary size)"
                )
            if permute and ".q_proj." in hf:
                w = _unpermute(w, cfg.num_heads)
            elif permute and ".k_proj." in hf:
                w = _unpermute(w, cfg.num_kv_heads)
            out[hf] = w.to(dtype).contiguous()
            bar.update(int(t.n_elements))
    return out


def _check_type(t: Any, path: Path) -> None:
    if t.tensor_type.name not in SUPPORTED_TYPES:
        dequantize(t, path)  # raises, naming the tensor and its type
