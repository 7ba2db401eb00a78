"""The Hugging Face ``config.json`` a GGUF file's metadata describes.

:func:`hf_config` maps ``{arch}.block_count``, ``{arch}.attention.head_count``, ... to the
fields :class:`~pastry.wire.config.ModelConfig` normalises (llama, mistral, qwen2, qwen3):
q/k/v biases from the tensors present, tied embeddings when there is no ``output.weight``,
RoPE scaling (linear, or Llama 3's from the ``rope_freqs`` tensor), BOS/EOS ids, the sliding
window and the dtype of the file's main tensors.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from pastry.engine.gguf_file import Metadata
from pastry.engine.gguf_weights import ROPE_FREQS, dequantize
from pastry.wire.config import SUPPORTED_ARCHS, CheckpointError


def hf_config(meta: Metadata, tensors: dict[str, Any], name: str) -> dict[str, Any]:
    """The HF ``config.json`` the metadata describes (see the module docstring)."""
    arch = _architecture(meta)

    def key(k: str) -> str:
        return f"{arch}.{k}"

    hidden = meta.integer(key("embedding_length"))
    heads = meta.integer(key("attention.head_count"))
    kv_heads = meta.integer(key("attention.head_count_kv"), heads)
    head_dim = _head_dim(meta, key, hidden // heads)
    embed = tensors.get("token_embd.weight")
    if embed is None:
        raise CheckpointError(f"{meta.path}: tensor 'token_embd.weight' is missing")
    vocab = meta.integer(key("vocab_size"), int(embed.shape[-1]))
    rope: dict[str, Any] = {"rope_theta": meta.number(key("rope.freq_base"), 10000.0)}
    rope |= _rope_scaling(meta, tensors, key, head_dim)
    window = meta.get(key("attention.sliding_window"))
    main = _main_type(tensors)
    cfg = {
        "architectures": [
            {"qwen2": "Qwen2", "qwen3": "Qwen3"}.get(arch, arch.title()) + "ForCausalLM"
        ],
        "model_type": arch,
        "gguf_quantized_blocks": "" if main in ("F32", "F16", "BF16") else main,
        "hidden_act": "silu",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": meta.integer(key("feed_forward_length")),
        "num_hidden_layers": meta.integer(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": meta.number(key("attention.layer_norm_rms_epsilon"), 1e-6),
        "rope_parameters": rope,
        "max_position_embeddings": meta.integer(key("context_length"), 4096),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "sliding_window": int(window) if window and arch in ("llama", "mistral") else None,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": _eos_token_id(meta),
        "dtype": {"F32": "float32", "F16": "float16"}.get(main, "bfloat16"),
        "_name_or_path": name,
    }
    return cfg


def _architecture(meta: Metadata) -> str:
    """``general.architecture``, which must be one of :data:`SUPPORTED_ARCHS`."""
    arch = meta.need("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise CheckpointError(
            f"{meta.path}: general.architecture is '{arch}', which is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHS)})"
        )
    return arch


def _head_dim(meta: Metadata, key: Callable[[str], str], default: int) -> int:
    """The head size (``attention.key_length``, else ``default``), which the value size and
    the rotary dimension must equal."""
    head_dim = meta.integer(key("attention.key_length"), default)
    for k in ("attention.value_length", "rope.dimension_count"):
        if meta.integer(key(k), head_dim) != head_dim:
            raise CheckpointError(
                f"{meta.path}: {key(k)} is {meta.integer(key(k))}, but the head size is "
                f"{head_dim} (partial rotary embeddings and distinct value sizes are not "
                "supported)"
            )
    return head_dim


def _eos_token_id(meta: Metadata) -> int | list[int] | None:
    """``eos_token_id``: the file's EOS, EOT and EOM ids, one as an int, several as a list."""
    eos = [
        i
        for k in ("eos_token_id", "eot_token_id", "eom_token_id")
        if (i := meta.get(f"tokenizer.ggml.{k}")) is not None
    ]
    return eos[0] if len(eos) == 1 else (list(dict.fromkeys(eos)) or None)


def _main_type(tensors: dict[str, Any]) -> str:
    """The tensor type most of the file's matrices have (``F32`` when it has none)."""
    big = Counter(t.tensor_type for t in tensors.values() if len(t.shape) > 1)
    return big.most_common(1)[0][0].name if big else "F32"


def _rope_scaling(
    meta: Metadata, tensors: dict[str, Any], key: Callable[[str], str], head_dim: int
) -> dict[str, Any]:
    """The ``rope_parameters`` entries besides ``rope_theta``."""
    kind = meta.get(key("rope.scaling.type"), "none")
    linear = meta.number(key("rope.scale_linear"), 1.0)  # older files
    if kind == "none" and linear != 1.0:
        return {"rope_type": "linear", "factor": linear}
    freqs = tensors.get(ROPE_FREQS)
    if freqs is not None:
        if kind != "none":
            raise CheckpointError(
                f"{meta.path}: both tensor '{ROPE_FREQS}' and {key('rope.scaling.type')}="
                f"'{kind}' scale the rotary frequencies; only one is supported"
            )
        factors = dequantize(freqs, meta.path).reshape(-1)
        if factors.size != head_dim // 2:
            raise CheckpointError(
                f"{meta.path}: tensor '{ROPE_FREQS}' has {factors.size} values, expected "
                f"head size / 2 = {head_dim // 2}"
            )
        return {"rope_type": "freq_factors", "freq_factors": [float(f) for f in factors]}
    if kind == "linear":
        return {"rope_type": "linear", "factor": meta.number(key("rope.scaling.factor"), 1.0)}
    if kind != "none":
        raise CheckpointError(
            f"{meta.path}: {key('rope.scaling.type')} is '{kind}', which is not supported "
            f"(supported: none, linear, and Llama 3 scaling as tensor '{ROPE_FREQS}')"
        )
    return {"rope_type": "default"}
