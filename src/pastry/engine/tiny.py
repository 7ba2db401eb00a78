"""Random-weight checkpoints in exact Hugging Face format, for tests and benchmarks.

:func:`create_tiny` writes ``config.json`` (the keys transformers 5 writes for the model
type), ``generation_config.json``, safetensors weights (single file or shards with an index),
and a real byte-level BPE tokenizer (``tokenizer.json`` + ``tokenizer_config.json`` with a
ChatML chat template) trained on ``data/corpus.txt``. Everything is a pure function of the
arguments and the corpus bytes; transformers is not needed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import (
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

from pastry.engine.hf_checkpoint import INDEX_FILE, SINGLE_FILE, expected_shapes
from pastry.paths import models_dir, publish_dir
from pastry.wire.config import ModelConfig

ARCHS = ("llama", "qwen2", "qwen3")
SIZES = ("tiny", "small")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CORPUS = Path(__file__).parent / "data" / "corpus.txt"
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MAX_TOKENIZER_VOCAB = 8192
TRANSFORMERS_VERSION = "5.23.0"  # the version whose file layout this module writes
# Pre-tokenization splits: Llama 3's, and Qwen 2's (digits one at a time, NFC-normalised),
# which transformers' Qwen2Tokenizer rebuilds for qwen2/qwen3 whatever tokenizer.json says.
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CHAT_TEMPLATE = (
    "{%- if bos_token is defined and bos_token %}{{ bos_token }}{% endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if message['role'] not in ['system', 'user', 'assistant'] %}\n"
    "        {{- raise_exception('Unknown role: ' + message['role']) }}\n"
    "    {%- endif %}\n"
    "    {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)
_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


@dataclass(frozen=True)
class _Shape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int | None  # None: the tokenizer's vocabulary size
    max_position: int


def _shape(arch: str, size: str) -> _Shape:
    if size == "tiny":
        # qwen3 gets head_dim 32, so heads * head_dim (128) != hidden (64), as in real Qwen3.
        return _Shape(64, 128, 2, 4, 2, 32 if arch == "qwen3" else 16, None, 2048)
    if arch == "llama":
        return _Shape(768, 2048, 12, 12, 12, 64, 32000, 4096)
    return _Shape(768, 2048, 12, 12, 4, 128 if arch == "qwen3" else 64, 32000, 4096)


# -- tokenizer -----------------------------------------------------------------------------


@lru_cache(maxsize=4)
def _trained_tokenizer_json(corpus: bytes, qwen: bool) -> str:
    tok = Tokenizer(models.BPE())
    if qwen:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(
                Regex(QWEN2_PATTERN if qwen else LLAMA3_PATTERN), behavior="isolated", invert=False
            ),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=MAX_TOKENIZER_VOCAB,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus.decode("utf-8").splitlines(keepends=True), trainer)
    return tok.to_str()


def train_tokenizer(arch: str = "llama") -> Tokenizer:
    """The byte-level BPE tokenizer of tiny checkpoints, trained on ``data/corpus.txt``.

    Deterministic in the corpus bytes (trained once per process and style). Ids 0-2 are
    ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``. ``llama`` gets Llama 3's
    pre-tokenizer and post-processor (which prepends ``<|endoftext|>`` as BOS); ``qwen2`` and
    ``qwen3`` get Qwen 2's (NFC, single digits, no BOS)."""
    _check_arch(arch)
    qwen = arch != "llama"
    tok = Tokenizer.from_str(_trained_tokenizer_json(CORPUS.read_bytes(), qwen))
    byte_level = processors.ByteLevel(trim_offsets=False)
    if qwen:
        tok.post_processor = byte_level
    else:
        bos = SPECIAL_TOKENS[0]
        tok.post_processor = processors.Sequence(
            [
                byte_level,
                processors.TemplateProcessing(
                    single=f"{bos}:0 $A:0",
                    pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
                    special_tokens=[(bos, tok.token_to_id(bos))],
                ),
            ]
        )
    return tok


def _tokenizer_config(arch: str, max_position: int) -> dict[str, Any]:
    added = {
        str(i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, t in enumerate(SPECIAL_TOKENS)
    }
    cfg = {
        "added_tokens_decoder": added,
        "bos_token": SPECIAL_TOKENS[0],
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "model_max_length": max_position,
        "pad_token": "<|endoftext|>",
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    if arch != "llama":  # as Qwen 2.5 / Qwen 3 ship it
        cfg |= {
            "add_prefix_space": False,
            "bos_token": None,
            "errors": "replace",
            "split_special_tokens": False,
            "tokenizer_class": "Qwen2Tokenizer",
            "unk_token": None,
        }
    return cfg


# -- config --------------------------------------------------------------------------------


def hf_config(arch: str, size: str, vocab_size: int, dtype: str) -> dict[str, Any]:
    """The ``config.json`` of :func:`create_tiny`, key for key as transformers 5 writes it."""
    s = _shape(arch, size)
    cfg: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[arch]],
        "attention_dropout": 0.0,
        "bos_token_id": 0,
        "dtype": dtype,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": s.hidden,
        "initializer_range": 0.02,
        "intermediate_size": s.intermediate,
        "max_position_embeddings": s.max_position,
        "model_type": arch,
        "num_attention_heads": s.heads,
        "num_hidden_layers": s.layers,
        "num_key_value_heads": s.kv_heads,
        "pad_token_id": None,
        "rms_norm_eps": 1e-06,
        "transformers_version": TRANSFORMERS_VERSION,
        "use_cache": True,
        "vocab_size": vocab_size,
    }
    if arch == "llama":
        cfg |= {
            "attention_bias": False,
            "head_dim": s.head_dim,
            "mlp_bias": False,
            "pretraining_tp": 1,
            # Llama 3.1 style: positions beyond original_max_position_embeddings are scaled.
            "rope_parameters": {
                "factor": 8.0,
                "high_freq_factor": 4.0,
                "low_freq_factor": 1.0,
                "original_max_position_embeddings": s.max_position // 8,
                "rope_theta": 500000.0,
                "rope_type": "llama3",
            },
            "tie_word_embeddings": False,
        }
    else:
        cfg |= {
            "layer_types": ["full_attention"] * s.layers,
            "max_window_layers": s.layers,
            "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
            "sliding_window": None,
            "tie_word_embeddings": True,
            "use_sliding_window": False,
        }
        if arch == "qwen3":
            cfg |= {"attention_bias": False, "head_dim": s.head_dim}
    return dict(sorted(cfg.items()))


# -- weights -------------------------------------------------------------------------------


def random_weights(cfg: ModelConfig, seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Deterministic weights for ``cfg``: matrices ~ N(0, 0.02), norm weights 1 + N(0, 0.1),
    biases ~ N(0, 0.02); drawn in float32 in model order from one seeded generator."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in expected_shapes(cfg).items():
        w = torch.randn(shape, generator=g, dtype=torch.float32)
        w = 1.0 + 0.1 * w if name.endswith("norm.weight") else 0.02 * w
        out[name] = w.to(dtype).contiguous()
    return out


def _write_weights(out: Path, weights: dict[str, torch.Tensor], shards: int) -> list[str]:
    for old in [*out.glob("model-*-of-*.safetensors"), out / SINGLE_FILE, out / INDEX_FILE]:
        old.unlink(missing_ok=True)
    if shards == 1:
        save_file(weights, out / SINGLE_FILE, metadata={"format": "pt"})
        return [SINGLE_FILE]
    names = list(weights)
    sizes = [weights[n].numel() * weights[n].element_size() for n in names]
    total = sum(sizes)
    groups: list[list[str]] = [[]]
    done = 0
    for i, (name, size) in enumerate(zip(names, sizes, strict=True)):
        full = done >= total * len(groups) / shards
        must = len(names) - i <= shards - len(groups)  # one tensor left per remaining shard
        if groups[-1] and len(groups) < shards and (full or must):
            groups.append([])
        groups[-1].append(name)
        done += size
    files, weight_map = [], {}
    for k, group in enumerate(groups, 1):
        file = f"model-{k:05d}-of-{shards:05d}.safetensors"
        save_file({n: weights[n] for n in group}, out / file, metadata={"format": "pt"})
        files.append(file)
        weight_map |= dict.fromkeys(group, file)
    index = {
        "metadata": {
            "total_parameters": sum(w.numel() for w in weights.values()),
            "total_size": total,
        },
        "weight_map": dict(sorted(weight_map.items())),
    }
    _write_json(out / INDEX_FILE, index)
    return [*files, INDEX_FILE]


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


# -- public --------------------------------------------------------------------------------


def create_tiny(
    out_dir: str | Path,
    arch: str = "llama",
    size: str = "tiny",
    seed: int = 0,
    dtype: str = "bfloat16",
    shards: int = 1,
) -> Path:
    """Write a random-weight checkpoint of ``arch`` and ``size`` to ``out_dir`` and return it.

    ``tiny`` (~1M params): hidden 64, intermediate 128, 2 layers, 4 heads, 2 KV heads,
    head_dim 16 (qwen3: 32, so heads x head_dim != hidden), vocab = the tokenizer's.
    ``small`` (100-135M params): hidden 768, intermediate 2048, 12 layers, 12 heads (qwen2/3:
    4 KV heads; qwen3 head_dim 128), vocab 32000, padded past the tokenizer's. llama unties
    ``lm_head`` and uses Llama 3.1 RoPE scaling; qwen2 has q/k/v biases; qwen3 has q/k norms.
    ``shards > 1`` splits the weights into that many files with a
    ``model.safetensors.index.json``. Weights already in ``out_dir`` are replaced.
    """
    _check_arch(arch)
    if size not in SIZES:
        raise ValueError(f"size must be one of {', '.join(SIZES)}, got {size!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    tok = train_tokenizer(arch)
    tok_vocab = tok.get_vocab_size(with_added_tokens=True)
    vocab = _shape(arch, size).vocab or tok_vocab
    config = hf_config(arch, size, vocab, dtype)
    cfg = ModelConfig.from_dict(config)
    n_tensors = len(expected_shapes(cfg))
    if not 1 <= shards <= n_tensors:
        raise ValueError(f"shards must be between 1 and {n_tensors} (one per tensor), got {shards}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / "config.json", config)
    _write_json(
        out / "generation_config.json",
        {
            "bos_token_id": 0,
            "eos_token_id": [2, 0],
            "pad_token_id": 0,
            "transformers_version": TRANSFORMERS_VERSION,
        },
    )
    _write_weights(out, random_weights(cfg, seed, DTYPES[dtype]), shards)
    tok.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", _tokenizer_config(arch, cfg.max_position))
    return out


def default_model_dir(arch: str = "llama", size: str = "tiny") -> Path:
    """Where :func:`ensure_default_model` keeps its checkpoint: ``pastry_home()/models/``."""
    return models_dir() / f"default-{arch}-{size}"


def ensure_default_model(arch: str = "llama", size: str = "tiny") -> Path:
    """The default random checkpoint (seed 0, bfloat16), created on first use.

    Creation writes a temporary sibling directory and renames it into place, so concurrent
    callers never see a partial checkpoint."""
    target = default_model_dir(arch, size)
    if (target / "config.json").is_file():
        return target
    publish_dir(target, lambda tmp: create_tiny(tmp, arch=arch, size=size), marker="config.json")
    return target


def _check_arch(arch: str) -> None:
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {', '.join(ARCHS)}, got {arch!r}")
