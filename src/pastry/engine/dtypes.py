"""The engine's dtype from a config's name and the CPU it runs on."""

from __future__ import annotations

import logging

import torch

from pastry.engine import native
from pastry.wire.config import ModelConfig

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, model: ModelConfig, device: torch.device) -> torch.dtype:
    """The engine's dtype: ``name``, or for "auto" the checkpoint's, except that on a CPU
    float32 is chosen (a) for a GGUF of quantized blocks (Q4_1, Q8_0...: their values are
    exact in float32; rounded to bfloat16 on top of the quantization, SmolLM2 answered the
    demo's first question wrongly on an AVX512_BF16 Xeon, and 1.6% of first tokens where
    transformers' own bf16 keeps its float32 answer differed: benchmarks/bf16_agreement.py)
    and (b) without bfloat16 arithmetic (AVX2 only: oneDNN has no bf16 kernels for it, and
    PyTorch's generic bf16 products are 3-5x slower than float32 from 16 rows)."""
    if name == "auto":
        name = model.torch_dtype if model.torch_dtype in DTYPES else "bfloat16"
        if name in ("bfloat16", "float16") and device.type == "cpu":
            if model.quantized_blocks:
                log.info(
                    "%s blocks expand exactly into float32, not %s: float32 (--dtype %s "
                    "for speed)", model.quantized_blocks, name, name,
                )  # fmt: skip
                name = "float32"
            elif not native.cpu_bf16():
                log.info("this CPU has no bfloat16 arithmetic (%s): float32", native.cpu_isa())
                name = "float32"
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)} or auto, got '{name}'")
    return DTYPES[name]
