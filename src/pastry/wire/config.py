"""Model and engine configuration.

``ModelConfig`` is a Hugging Face ``config.json`` normalised once, for the Llama family
(llama, mistral, qwen2, qwen3); everything else derives from it. ``EngineConfig`` says how
an engine lays out its memory.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

SUPPORTED_ARCHS = ("llama", "mistral", "qwen2", "qwen3")


class CheckpointError(ValueError):
    """A checkpoint directory cannot be loaded; the message names the file and field."""


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. ``kind`` is "default", "linear" (every frequency divided by
    ``factor``), "llama3" (Llama 3.1+), or "freq_factors": frequency ``i`` divided by
    ``freq_factors[i]``, the form GGUF files carry (llama.cpp's ``rope_freqs`` tensor, which
    its converter computes from Llama 3's parameters)."""

    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    freq_factors: tuple[float, ...] = ()


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    max_position: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projection biases (qwen2)
    qk_norm: bool = False  # RMSNorm over head_dim on q and k before RoPE (qwen3)
    sliding_window: int | None = None  # mistral; None = full attention
    torch_dtype: str = "float32"
    # The GGUF block type most weights are stored in when it is a quantized one ("Q4_1"):
    # their values are exact in float32, not in bfloat16 (engine/dtypes.py); "": dense.
    quantized_blocks: str = ""
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = ""

    @cached_property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @cached_property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def num_params(self) -> int:
        per_layer = (
            self.hidden_size * (self.q_size + 2 * self.kv_size)
            + self.q_size * self.hidden_size
            + 3 * self.hidden_size * self.intermediate_size
            + 2 * self.hidden_size
            + (self.q_size + 2 * self.kv_size if self.attention_bias else 0)
            + (2 * self.head_dim if self.qk_norm else 0)
        )
        embed = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else embed
        return self.num_layers * per_layer + embed + head + self.hidden_size

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
        def need(key: str) -> Any:
            if key not in raw:
                raise CheckpointError(f"{source}: missing required field '{key}'")
            return raw[key]

        arch = _arch(raw, need("model_type"), source)
        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        kv_heads = _kv_heads(raw, heads, source)
        head_dim = raw.get("head_dim") or hidden // heads
        theta, scaling = _rope(raw, head_dim, source)
        window = _sliding_window(raw, arch, source)
        eos_ids = _eos_ids(raw)
        return cls(
            arch=arch,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=int(head_dim),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position=int(raw.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", arch == "qwen2")),
            qk_norm=arch == "qwen3",
            sliding_window=int(window) if window else None,
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
            quantized_blocks=str(raw.get("gguf_quantized_blocks", "")),
            bos_token_id=None if raw.get("bos_token_id") is None else int(raw["bos_token_id"]),
            eos_token_ids=eos_ids,
            name=str(raw.get("_name_or_path", "")),
        )

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        if not path.is_file():
            raise CheckpointError(f"{path}: file not found (a checkpoint needs config.json)")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{path}: not valid JSON ({e})") from e
        return cls.from_dict(raw, source=str(path))


def _arch(raw: dict[str, Any], arch: Any, source: str) -> str:
    """``model_type`` (``arch``), one of :data:`SUPPORTED_ARCHS`, with a silu MLP."""
    if arch not in SUPPORTED_ARCHS:
        raise CheckpointError(
            f"{source}: model_type '{arch}' is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHS)})"
        )
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"{source}: hidden_act '{act}' is not supported (only silu)")
    return arch


def _kv_heads(raw: dict[str, Any], heads: int, source: str) -> int:
    """``num_key_value_heads`` (default: ``heads``), which must divide ``heads``."""
    kv_heads = int(raw.get("num_key_value_heads") or heads)
    if heads % kv_heads:
        raise CheckpointError(
            f"{source}: num_attention_heads ({heads}) is not a multiple of "
            f"num_key_value_heads ({kv_heads})"
        )
    return kv_heads


def _rope(raw: dict[str, Any], head_dim: Any, source: str) -> tuple[float, RopeScaling]:
    """RoPE's base frequency and scaling. transformers >= 5 nests theta and scaling in
    ``rope_parameters``; older files use ``rope_theta`` + ``rope_scaling``."""
    rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(rope.get("rope_theta", raw.get("rope_theta", 10000.0)))
    scaling = _rope_scaling(rope, source)
    if scaling.kind == "freq_factors" and len(scaling.freq_factors) != int(head_dim) // 2:
        raise CheckpointError(
            f"{source}: rope freq_factors has {len(scaling.freq_factors)} values, expected "
            f"head_dim / 2 = {int(head_dim) // 2}"
        )
    return theta, scaling


def _rope_scaling(rope: dict[str, Any], source: str) -> RopeScaling:
    """The :class:`RopeScaling` of a ``rope_parameters`` (or ``rope_scaling``) object."""
    kind = rope.get("rope_type", rope.get("type", "default")) or "default"
    if kind == "llama3":
        if "factor" not in rope:
            raise CheckpointError(f"{source}: llama3 rope scaling has no 'factor'")
        return RopeScaling(
            kind="llama3",
            factor=float(rope["factor"]),
            low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
            high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
            original_max_position=int(rope.get("original_max_position_embeddings", 8192)),
        )
    if kind == "linear":
        if "factor" not in rope:
            raise CheckpointError(f"{source}: linear rope scaling has no 'factor'")
        return RopeScaling(kind="linear", factor=float(rope["factor"]))
    if kind == "freq_factors":
        factors = rope.get("freq_factors")
        if not isinstance(factors, list) or not all(
            isinstance(f, int | float) and f > 0 for f in factors
        ):
            raise CheckpointError(
                f"{source}: rope type 'freq_factors' needs 'freq_factors', a list of "
                "positive numbers (one per frequency, head_dim / 2 of them)"
            )
        return RopeScaling(kind="freq_factors", freq_factors=tuple(map(float, factors)))
    if kind == "default":
        return RopeScaling()
    raise CheckpointError(
        f"{source}: rope type '{kind}' is not supported "
        "(supported: default, linear, llama3, freq_factors)"
    )


def _sliding_window(raw: dict[str, Any], arch: str, source: str) -> Any:
    """``sliding_window`` as the file has it; qwen2/qwen3 files carry one they do not use
    (None), and their per-layer windows (``use_sliding_window``) are not supported."""
    if arch in ("qwen2", "qwen3"):
        if raw.get("use_sliding_window", False):
            raise CheckpointError(
                f"{source}: use_sliding_window=true is not supported for {arch} "
                "(per-layer windows via max_window_layers)"
            )
        return None
    return raw.get("sliding_window")


def _eos_ids(raw: dict[str, Any]) -> tuple[int, ...]:
    """``eos_token_id``, an int or a list of them, as a tuple."""
    eos = raw.get("eos_token_id")
    if isinstance(eos, list):
        return tuple(int(e) for e in eos)
    return (int(eos),) if eos is not None else ()


# The default KV pool: this many sequences of the model's full context, within at most
# DEFAULT_KV_BUDGET bytes (vLLM's CPU backend reserves a fixed 4 GiB by default; llama.cpp
# sizes its cache by context x slots).
DEFAULT_KV_SEQUENCES = 16
DEFAULT_KV_BUDGET = 4 << 30


@dataclass(frozen=True)
class EngineConfig:
    """Memory layout and limits of one engine.

    Pool sizes left at 0 are derived (engine/pool.py, ``PoolSizes.resolve``): the KV pool
    holds ``kv_sequences`` sequences of the model's full context, within ``kv_memory`` bytes
    (0: the default budget, :data:`DEFAULT_KV_BUDGET` capped at a quarter of the host's
    memory and half of what is free; on CUDA ``kv_memory_fraction`` of free device memory).
    """

    device: str = "cpu"
    dtype: str = "bfloat16"  # "float32" | "bfloat16" | "float16" | "auto" (checkpoint's)
    page_size: int = 16
    num_pages: int = 0
    num_embeds: int = 0
    num_host_pages: int = 0
    kv_memory: int = 0  # bytes of KV pages (0: the default budget, see above)
    kv_sequences: int = DEFAULT_KV_SEQUENCES  # full-context sequences a derived pool holds
    kv_memory_fraction: float = 0.3  # CUDA: share of free device memory for derived pools
    max_kv_pages: int = 1 << 16  # cap on derived page counts (CPU memory is shared)
    max_batch_tokens: int = 8192
    seed: int = 0
    # A path (under /dev/shm) for a KV pool in shared memory, which peer engines on this
    # host write into directly (engine/transfer.py); empty: private memory.
    kv_shm: str = ""
    # Weight-only quantization (engine/quant.py), CPU only: "int8"/"int4" serve a GGUF's
    # quantized blocks as they are (Q4 blocks stay int4) and quantize the other projections;
    # "auto" and "none" serve dense weights (a GGUF's blocks expanded: faster from batch ~8).
    # "int4-hybrid": int4, plus a bf16 copy of the int4 projections for batches of 16+ rows.
    quantize: str = "auto"
    # Run decode steps through the compiled graph (engine/compiled.py); compiles at start-up.
    compile: bool = False
    # Compile on a thread while the engine already serves eagerly (pastry serve); False:
    # the engine is ready once compiled (benchmarks, tests that count compiled steps).
    compile_background: bool = False

    def __post_init__(self) -> None:
        if self.page_size <= 0 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {self.page_size}")
        if self.kv_memory < 0:
            raise ValueError(f"kv_memory must be >= 0 bytes, got {self.kv_memory}")
        if self.kv_sequences <= 0:
            raise ValueError(f"kv_sequences must be positive, got {self.kv_sequences}")
        if not 0 < self.kv_memory_fraction < 1:
            raise ValueError(f"kv_memory_fraction must be in (0, 1), got {self.kv_memory_fraction}")
        if self.max_batch_tokens <= 0:
            raise ValueError(f"max_batch_tokens must be positive, got {self.max_batch_tokens}")
        if self.quantize not in ("auto", "none", "int8", "int4", "int4-hybrid"):
            raise ValueError(
                "quantize must be one of auto, none, int8, int4, int4-hybrid, got "
                f"{self.quantize!r}"
            )


def round_up(x: int, multiple: int) -> int:
    return math.ceil(x / multiple) * multiple
