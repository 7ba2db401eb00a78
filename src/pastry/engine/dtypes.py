"""The engine's dtype from a config's name and the CPU it runs on."""

from __future__ import annotations

import logging

import torch

from pastry.engine import native
from pastry.wire.config import ModelConfig

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, model: ModelConfig, device: torch.device) -> torch.dtype:
    """The engine's dtype: ``name``, or for "auto" the checkpoint's, except that a CPU
    without bfloat16 arithmetic (AVX2 only: oneDNN has no bf16 kernels for it, and PyTorch's
    generic bf16 products are 3-5x slower than float32 from 16 rows) computes in float32."""
    if name == "auto":
        name = model.torch_dtype if model.torch_dtype in DTYPES else "bfloat16"
        if name in ("bfloat16", "float16") and device.type == "cpu" and not native.cpu_bf16():
            log.info("this CPU has no bfloat16 arithmetic (%s): float32", native.cpu_isa())
            name = "float32"
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)} or auto, got '{name}'")
    return DTYPES[name]
