"""GGUF checkpoints: llama.cpp's single-file format, read through the ``gguf`` package.

A GGUF file holds a model's hyper-parameters and tokenizer as metadata and its tensors,
usually quantized, under llama.cpp's names. :func:`load_gguf` turns one into a
:class:`~pastry.engine.hf_checkpoint.Checkpoint` like a Hugging Face directory's:

- **config**: ``{arch}.block_count``, ``{arch}.attention.head_count``, ... written as an HF
  ``config.json`` and normalised by :class:`~pastry.wire.config.ModelConfig` (llama,
  mistral, qwen2, qwen3; q/k/v biases and q/k norms from the tensors present; tied
  embeddings when there is no ``output.weight``; Llama 3 RoPE scaling from ``rope_freqs``).
- **tokenizer**: a ``tokenizers`` object rebuilt from ``tokenizer.ggml.*``: byte-level BPE
  (``gpt2``) with the file's merges and the pre-tokenizer llama.cpp applies for
  ``tokenizer.ggml.pre``, or SentencePiece-style BPE (``llama``) whose merges follow the
  token scores, with byte fallback; control tokens are special, BOS/EOS as the file says
  (``add_bos_token``, else llama.cpp's default for the vocabulary), and the chat template.
- **weights**: dequantized by ``gguf.quants`` (:data:`SUPPORTED_TYPES`) into the engine's
  dtype, renamed to HF names, with the rotary row permutation that llama.cpp's converter
  applies to the Q and K projections of llama models undone.

Converting takes seconds to minutes (reading the metadata alone takes seconds when the
vocabulary is large), so it happens once: the result is a directory under
``$PASTRY_HOME/models/gguf-cache/<sha256[:16]>-v<CONVERTER_VERSION>/`` with
``config.json``, ``generation_config.json``, ``tokenizer.json``, ``tokenizer_config.json``,
``gguf.json`` (where it came from) and one ``model.<dtype>.safetensors`` per dtype asked
for; later starts read only that (a safetensors load), whatever the file's name or place
(the model is named after the file's stem). The key is the file's SHA-256; hashing a
multi-GB file takes seconds, so the digest is remembered per (path, size, mtime, ctime,
inode) in ``gguf-cache/digests/``: a start with a warm cache only stats the file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import tokenizers
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers

from pastry.engine.hf_checkpoint import (
    Checkpoint,
    expected_shapes,
    load_hf_checkpoint,
    read_weights,
)
from pastry.paths import models_dir, publish_dir
from pastry.wire.config import SUPPORTED_ARCHS, CheckpointError, ModelConfig
from pastry.wire.tokenizer import set_special_post_processor

if TYPE_CHECKING:  # torch and gguf load only when a file is converted (not from the cache)
    import gguf
    import torch

log = logging.getLogger(__name__)

MAGIC = b"GGUF"
CONVERTER_VERSION = 2  # part of the cache key: bump when the conversion's output changes
# Tensor types (GGMLQuantizationType names) the gguf package dequantizes.
SUPPORTED_TYPES = (
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K",
    "Q5_K", "Q6_K", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S",
    "IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0",
)  # fmt: skip
_PERMUTED_ARCHS = ("llama", "mistral")  # llama.cpp rotates their q/k rows pairwise
_TORCH_DTYPES = ("float32", "bfloat16", "float16")
# token_type values of tokenizer.ggml.token_type (llama.cpp's llama_token_type)
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

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
_ROPE_FREQS = "rope_freqs.weight"


def gguf_name(hf_name: str) -> str:
    """llama.cpp's name of the tensor transformers calls ``hf_name``."""
    if hf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)  # model.layers.{i}.{rest}
    return f"blk.{layer}.{_LAYER_TENSORS[rest]}"


# -- pre-tokenizers ----------------------------------------------------------------------------
# llama.cpp splits text with a list of regexes per `tokenizer.ggml.pre` (llama-vocab.cpp), each
# applied to the pieces of the previous one, matches and the text between them kept: a
# sequence of `Split(..., "isolated")` pre-tokenizers. Where llama.cpp spells a tokenizer.json
# regex differently for its own regex engine, the tokenizer.json spelling is used.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class PreTokenizer:
    """How llama.cpp splits text for a ``tokenizer.ggml.pre`` value: the regexes in order,
    whether whole words found in the vocabulary skip the merges, and whether a sequence
    starts with BOS when the file does not say (``tokenizer.ggml.add_bos_token``)."""

    regexes: tuple[str, ...]
    ignore_merges: bool = False
    add_bos: bool = False


def _pre(names: str, pre: PreTokenizer) -> dict[str, PreTokenizer]:
    return dict.fromkeys(names.split(), pre)


PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    **_pre(
        "default",
        PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")),
    ),
    **_pre(
        "llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 jina-v5-nano",
        PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True),
    ),
    **_pre("dbrx smaug-bpe", PreTokenizer((_LLAMA3,))),
    **_pre(
        "qwen2 deepseek-r1-qwen kormo f2llmv2 megrez stablelm2 hunyuan solar-open",
        PreTokenizer((_QWEN2,)),
    ),
    **_pre("qwen35", PreTokenizer((_QWEN35,))),
    **_pre(
        "smollm starcoder refact command-r codeshell exaone minerva-7b mellum2",
        PreTokenizer((r"\p{N}", _GPT2)),
    ),
    **_pre(
        "gpt-2 phi-2 jina-es jina-de gigachat jina-v2-es jina-v2-de a.x-4.0 mellum modern-bert "
        "mpt olmo jais trillion granite-docling exaone4",
        PreTokenizer((_GPT2,)),
    ),
    **_pre("falcon", PreTokenizer((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"))),
    **_pre("tekken", PreTokenizer((_TEKKEN,), ignore_merges=True, add_bos=True)),
    **_pre("gpt-4o llama4 kanana2 talkie minimax-m2", PreTokenizer((_GPT4O,))),
    **_pre(
        "deepseek-coder",
        PreTokenizer(("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", "[一-龥ࠀ-一가-퟿]+", r"\p{N}")),
    ),
}


# -- reading the file --------------------------------------------------------------------------


def is_gguf(path: str | Path) -> bool:
    """Whether ``path`` is a file that starts with the GGUF magic."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == MAGIC
    except OSError:
        return False


class _Metadata:
    """The key-value metadata of a GGUF file, with errors that name the file and the key."""

    def __init__(self, reader: gguf.GGUFReader, path: Path) -> None:
        self.fields = reader.fields
        self.path = path

    def get(self, key: str, default: Any = None) -> Any:
        field = self.fields.get(key)
        return default if field is None else field.contents()

    def need(self, key: str, why: str = "") -> Any:
        if key not in self.fields:
            raise CheckpointError(
                f"{self.path}: metadata field '{key}' is missing" + (f" ({why})" if why else "")
            )
        return self.get(key)

    def integer(self, key: str, default: int | None = None) -> int:
        value = self.need(key) if default is None else self.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int | np.integer):
            raise CheckpointError(
                f"{self.path}: metadata field '{key}' is {value!r:.60}, expected an integer"
                + (" (per-layer values are not supported)" if isinstance(value, list) else "")
            )
        return int(value)

    def number(self, key: str, default: float) -> float:
        value = self.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float | np.number):
            raise CheckpointError(f"{self.path}: metadata field '{key}' is {value!r:.60}, "
                                  "expected a number")  # fmt: skip
        return float(value)


def _read(path: Path) -> gguf.GGUFReader:
    """The parsed file; :class:`CheckpointError` for a file that is not (all) there."""
    _read_magic(path)
    size = path.stat().st_size
    try:
        import gguf

        reader = gguf.GGUFReader(path, "r")
    except (ValueError, IndexError, KeyError, OSError, UnicodeDecodeError) as e:
        raise CheckpointError(
            f"{path}: truncated or corrupt GGUF file ({size:,} bytes; the reader failed with "
            f"{type(e).__name__}: {e}); an interrupted download is the usual cause: download "
            "it again"
        ) from e
    for t in reader.tensors:  # the reader maps the file; a short tensor means a short file
        if t.data.nbytes != t.n_bytes or t.data_offset + t.n_bytes > size:
            raise CheckpointError(
                f"{path}: truncated: tensor '{t.name}' needs bytes {t.data_offset:,} to "
                f"{t.data_offset + t.n_bytes:,} but the file has {size:,}; download it again"
            )
    return reader


# -- config ------------------------------------------------------------------------------------


def hf_config(meta: _Metadata, tensors: dict[str, Any], name: str) -> dict[str, Any]:
    """The HF ``config.json`` the metadata describes (see the module docstring)."""
    path = meta.path
    arch = meta.need("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise CheckpointError(
            f"{path}: general.architecture is '{arch}', which is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHS)})"
        )

    def key(k: str) -> str:
        return f"{arch}.{k}"

    hidden = meta.integer(key("embedding_length"))
    heads = meta.integer(key("attention.head_count"))
    kv_heads = meta.integer(key("attention.head_count_kv"), heads)
    head_dim = meta.integer(key("attention.key_length"), hidden // heads)
    for k in ("attention.value_length", "rope.dimension_count"):
        if meta.integer(key(k), head_dim) != head_dim:
            raise CheckpointError(
                f"{path}: {key(k)} is {meta.integer(key(k))}, but the head size is {head_dim} "
                "(partial rotary embeddings and distinct value sizes are not supported)"
            )
    embed = tensors.get("token_embd.weight")
    if embed is None:
        raise CheckpointError(f"{path}: tensor 'token_embd.weight' is missing")
    vocab = meta.integer(key("vocab_size"), int(embed.shape[-1]))
    rope: dict[str, Any] = {"rope_theta": meta.number(key("rope.freq_base"), 10000.0)}
    rope |= _rope_scaling(meta, tensors, key, head_dim)
    bos = meta.get("tokenizer.ggml.bos_token_id")
    eos = [
        i
        for k in ("eos_token_id", "eot_token_id", "eom_token_id")
        if (i := meta.get(f"tokenizer.ggml.{k}")) is not None
    ]
    window = meta.get(key("attention.sliding_window"))
    big = Counter(t.tensor_type for t in tensors.values() if len(t.shape) > 1)
    main = big.most_common(1)[0][0].name if big else "F32"
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
        "bos_token_id": bos,
        "eos_token_id": eos[0] if len(eos) == 1 else (list(dict.fromkeys(eos)) or None),
        "dtype": {"F32": "float32", "F16": "float16"}.get(main, "bfloat16"),
        "_name_or_path": name,
    }
    return cfg


def _rope_scaling(
    meta: _Metadata, tensors: dict[str, Any], key: Callable[[str], str], head_dim: int
) -> dict[str, Any]:
    """The ``rope_parameters`` entries besides ``rope_theta``."""
    kind = meta.get(key("rope.scaling.type"), "none")
    linear = meta.number(key("rope.scale_linear"), 1.0)  # older files
    if kind == "none" and linear != 1.0:
        return {"rope_type": "linear", "factor": linear}
    freqs = tensors.get(_ROPE_FREQS)
    if freqs is not None:
        if kind != "none":
            raise CheckpointError(
                f"{meta.path}: both tensor '{_ROPE_FREQS}' and {key('rope.scaling.type')}="
                f"'{kind}' scale the rotary frequencies; only one is supported"
            )
        factors = _dequantize(freqs, meta.path).reshape(-1)
        if factors.size != head_dim // 2:
            raise CheckpointError(
                f"{meta.path}: tensor '{_ROPE_FREQS}' has {factors.size} values, expected "
                f"head size / 2 = {head_dim // 2}"
            )
        return {"rope_type": "freq_factors", "freq_factors": [float(f) for f in factors]}
    if kind == "linear":
        return {"rope_type": "linear", "factor": meta.number(key("rope.scaling.factor"), 1.0)}
    if kind != "none":
        raise CheckpointError(
            f"{meta.path}: {key('rope.scaling.type')} is '{kind}', which is not supported "
            f"(supported: none, linear, and Llama 3 scaling as tensor '{_ROPE_FREQS}')"
        )
    return {"rope_type": "default"}


# -- tokenizer ---------------------------------------------------------------------------------


def build_tokenizer(meta: _Metadata) -> tuple[tokenizers.Tokenizer, dict[str, Any]]:
    """The ``tokenizers`` object and the ``tokenizer_config.json`` the metadata describes."""
    path = meta.path
    model = meta.need("tokenizer.ggml.model", "the tokenizer")
    tokens = meta.need("tokenizer.ggml.tokens", "the vocabulary")
    types = meta.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise CheckpointError(
            f"{path}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens"
        )
    if model == "gpt2":
        tok, default_bos = _byte_level_bpe(meta, tokens)
    elif model == "llama":
        tok, default_bos = _sentencepiece_bpe(meta, tokens, types), True
    else:
        raise CheckpointError(
            f"{path}: tokenizer.ggml.model is '{model}', which is not supported "
            "(supported: gpt2 (byte-level BPE), llama (SentencePiece-style BPE))"
        )
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types, strict=True)
         if k == _CONTROL]
    )  # fmt: skip
    tok.add_tokens(
        [AddedToken(t, special=False, normalized=False)
         for t, k in zip(tokens, types, strict=True) if k == _USER_DEFINED]
    )  # fmt: skip
    special = {}
    for name, k in (
        ("bos_token", "bos_token_id"),
        ("eos_token", "eos_token_id"),
        ("unk_token", "unknown_token_id"),
        ("sep_token", "seperator_token_id"),  # sic: llama.cpp's spelling
        ("pad_token", "padding_token_id"),
        ("cls_token", "cls_token_id"),
        ("mask_token", "mask_token_id"),
    ):
        i = meta.get(f"tokenizer.ggml.{k}")
        if i is None:
            continue
        if not 0 <= int(i) < len(tokens):
            raise CheckpointError(
                f"{path}: tokenizer.ggml.{k} is {i}, not a token id (the vocabulary has "
                f"{len(tokens)} tokens)"
            )
        special[name] = tokens[int(i)]
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", default_bos))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    add_bos, add_eos = add_bos and "bos_token" in special, add_eos and "eos_token" in special
    set_special_post_processor(
        tok, special["bos_token"] if add_bos else None, special["eos_token"] if add_eos else None
    )
    config = {
        **special,
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "chat_template": meta.get("tokenizer.chat_template"),
        "clean_up_tokenization_spaces": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    return tok, config


def _byte_level_bpe(meta: _Metadata, tokens: list[str]) -> tuple[tokenizers.Tokenizer, bool]:
    pre_name = meta.get("tokenizer.ggml.pre")
    if pre_name is None:
        log.warning(
            "%s: no tokenizer.ggml.pre; splitting text as llama.cpp's 'default' (generation "
            "quality may suffer; a newer conversion of the model names its pre-tokenizer)",
            meta.path,
        )
        pre_name = "default"
    pre = PRE_TOKENIZERS.get(pre_name)
    if pre is None:
        raise CheckpointError(
            f"{meta.path}: tokenizer.ggml.pre is '{pre_name}', a pre-tokenizer Pastry does not "
            f"know (known: {', '.join(sorted(PRE_TOKENIZERS))})"
        )
    merges = meta.need("tokenizer.ggml.merges", "byte-level BPE needs its merges")
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = []
    for m in merges:
        cut = m.find(" ", 1)  # llama.cpp's split: a piece may itself start with a space
        if cut < 0:
            raise CheckpointError(f"{meta.path}: tokenizer.ggml.merges has a malformed merge {m!r}")
        pairs.append((m[:cut], m[cut + 1 :]))
    tok = tokenizers.Tokenizer(
        tokenizers.models.BPE(vocab=vocab, merges=pairs, ignore_merges=pre.ignore_merges)
    )
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    return tok, pre.add_bos


def _sentencepiece_bpe(
    meta: _Metadata, tokens: list[str], types: list[int]
) -> tokenizers.Tokenizer:
    """SentencePiece BPE as llama.cpp runs it: the adjacent pair whose concatenation is the
    best-scored token merges first, i.e. BPE with merges ranked by the merged token's score."""
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = meta.get("tokenizer.ggml.merges")
    if merges is not None:
        pairs = [tuple(m.split(" ", 1)) for m in merges]
    else:
        scores = meta.need("tokenizer.ggml.scores", "SentencePiece merges follow the scores")
        ranked = []
        for token, i in vocab.items():
            if types[i] not in (_NORMAL, _USER_DEFINED):
                continue
            for cut in range(1, len(token)):
                a, b = token[:cut], token[cut:]
                if a in vocab and b in vocab:
                    ranked.append((-scores[i], i, vocab[a], (a, b)))
        pairs = [pair for *_, pair in sorted(ranked)]
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    tok = tokenizers.Tokenizer(
        tokenizers.models.BPE(
            vocab=vocab,
            merges=pairs,
            unk_token=None if unk_id is None else tokens[int(unk_id)],
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    spaces = normalizers.Replace(" ", "▁")
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), spaces]) if prefix else spaces
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence([*steps, decoders.Strip(" ", 1, 0)] if prefix else steps)
    return tok


# -- weights -----------------------------------------------------------------------------------


def _dequantize(t: Any, path: Path) -> np.ndarray:
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
    used = {name for _, name, _ in plan} | {_ROPE_FREQS}
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
            values = _dequantize(t, path)
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
        _dequantize(t, path)  # raises, naming the tensor and its type


# -- the cache ---------------------------------------------------------------------------------


def cache_root() -> Path:
    """Where converted GGUF files are kept: ``$PASTRY_HOME/models/gguf-cache``."""
    return models_dir() / "gguf-cache"


def file_digest(path: Path) -> str:
    """The SHA-256 of ``path``'s content, hashed once per (path, size, mtime, ctime, inode)
    and remembered under ``gguf-cache/digests/``."""
    st = path.stat()
    ident = f"{path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ctime_ns}\0{st.st_ino}"
    memo = cache_root() / "digests" / hashlib.sha256(ident.encode()).hexdigest()[:32]
    try:
        digest = memo.read_text().strip()
        if len(digest) == 64:
            return digest
    except OSError:
        pass
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    try:
        _write_text(memo, digest + "\n")
    except OSError as e:
        log.warning("cannot remember the digest of %s in %s: %s", path, memo, e)
    return digest


def cache_dir(path: Path) -> Path:
    """The conversion cache directory of the GGUF file ``path``."""
    return cache_root() / f"{file_digest(path)[:16]}-v{CONVERTER_VERSION}"


def _write_text(target: Path, text: str) -> None:
    """Write ``target`` atomically (a temporary sibling renamed into place)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}-", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)  # $PASTRY_HOME may be shared
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@lru_cache(maxsize=1)
def _reader(path: Path, digest: str) -> gguf.GGUFReader:
    """The parsed file, kept between reading the metadata and converting the weights of one
    first start (parsing takes seconds); ``digest`` keys out a changed file."""
    return _read(path)


def _write_metadata(path: Path, target: Path) -> None:
    """Write the config, tokenizer and provenance files of ``path`` into ``target``."""
    t0 = time.perf_counter()
    print(f"reading {path.name} (GGUF) once; later starts use {target}", file=sys.stderr)
    reader = _reader(path, file_digest(path))
    meta = _Metadata(reader, path)
    tensors = {t.name: t for t in reader.tensors}
    tok, tok_config = build_tokenizer(meta)
    config = hf_config(meta, tensors, path.stem)
    ModelConfig.from_dict(config, source=str(path))  # fail here, before anything is written
    tok_config["model_max_length"] = config["max_position_embeddings"]
    eos = config["eos_token_id"]
    files = {
        "config.json": config,
        "generation_config.json": {"bos_token_id": config["bos_token_id"], "eos_token_id": eos},
        "tokenizer_config.json": tok_config,
        "gguf.json": {
            "source": str(path),
            "sha256": file_digest(path),
            "converter_version": CONVERTER_VERSION,
            "general.name": meta.get("general.name"),
            "tensor_types": dict(Counter(t.tensor_type.name for t in reader.tensors)),
        },
    }

    def fill(tmp: Path) -> None:
        for name, data in files.items():
            (tmp / name).write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
        tok.save(str(tmp / "tokenizer.json"))

    publish_dir(target, fill, marker="gguf.json")
    log.info("read the metadata of %s in %.1fs", path, time.perf_counter() - t0)


@dataclass(frozen=True, eq=False)
class GgufCheckpoint(Checkpoint):
    """A GGUF file (``path``) and its conversion cache directory (``cache``)."""

    cache: Path

    def load_state_dict(
        self, dtype: torch.dtype, device: str | torch.device = "cpu"
    ) -> dict[str, torch.Tensor]:
        """The weights in ``dtype`` on ``device``: read from the cache, or converted from the
        file (and cached) on first use."""
        import torch
        from safetensors.torch import save_file

        name = str(dtype).removeprefix("torch.")
        if name not in _TORCH_DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(_TORCH_DTYPES)}, got {name}")
        file = self.cache / f"model.{name}.safetensors"
        if file.is_file():
            return read_weights(file, dict.fromkeys(expected_shapes(self.config), file),
                                self.config, dtype, device)  # fmt: skip
        t0 = time.perf_counter()
        reader = _reader(self.path, file_digest(self.path))
        weights = convert_weights(reader, self.path, self.config, dtype)
        secs = time.perf_counter() - t0
        tmp = self.cache / f".{file.name}-{os.getpid()}"
        try:
            save_file(weights, tmp, metadata={"format": "pt", "source": self.path.name})
            tmp.chmod(0o644)
            os.replace(tmp, file)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            log.warning("cannot cache the converted weights in %s (%s); the next start "
                        "converts again", file, e)  # fmt: skip
        _reader.cache_clear()  # the conversion is done: unmap the file
        print(f"converted {self.path.name} to {name} in {secs:.1f}s (cached: {file})",
              file=sys.stderr)  # fmt: skip
        if torch.device(device).type != "cpu":
            weights = {k: v.to(device) for k, v in weights.items()}
        return weights


def load_gguf(path: str | Path) -> GgufCheckpoint:
    """The checkpoint of a GGUF file: config and tokenizer now (from the cache, written on
    first use), weights when asked (:meth:`GgufCheckpoint.load_state_dict`). The model's
    name is the file's stem."""
    path = Path(os.path.abspath(path))
    if not path.is_file():
        raise CheckpointError(f"{path}: file not found")
    _read_magic(path)
    target = cache_dir(path)
    if not (target / "gguf.json").is_file():
        _write_metadata(path, target)
    ckpt = load_hf_checkpoint(target)
    config = dataclasses.replace(ckpt.config, name=path.stem)  # copies share the cache
    return GgufCheckpoint(
        path=path, config=config, tokenizer=ckpt.tokenizer, name=path.stem, cache=target
    )


def _read_magic(path: Path) -> None:
    if not is_gguf(path):
        with open(path, "rb") as f:
            head = f.read(4)
        raise CheckpointError(f"{path}: not a GGUF file (it starts with {head!r}, not {MAGIC!r})")
