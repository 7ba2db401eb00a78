"""Building a model for an engine: construct it in its dtype on its device, load the
weights, quantize as configured and prepack for the CPU kernels."""

from __future__ import annotations

import contextlib

import torch

from pastry.engine import native
from pastry.engine.hugepages import huge_pages
from pastry.engine.model import LlamaModel
from pastry.engine.quant import Codes, Int4Codes, Int8Codes
from pastry.wire.config import ModelConfig


def build_model(
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    weights: dict[str, torch.Tensor | Codes],
    quantize: str = "auto",
) -> LlamaModel:
    """Construct the model on ``device`` in ``dtype``, load weights, quantize (see
    ``EngineConfig.quantize``) and prepack for CPU."""
    quantized = any(isinstance(w, Int4Codes | Int8Codes) for w in weights.values())
    if quantize == "none" and quantized:
        weights = {
            k: w.dequantize().to(dtype) if isinstance(w, Int4Codes | Int8Codes) else w
            for k, w in weights.items()
        }
    if device.type != "cpu" and (
        quantize in ("int8", "int4", "int4-hybrid") or (quantized and quantize == "auto")
    ):
        raise ValueError(
            f"quantized weights run on the CPU only (device is {device}); use --quantize none "
            "to expand them"
        )
    if device.type == "cpu" and dtype in (torch.bfloat16, torch.float32):
        # bf16 products of few rows over the packed weights, int4 expanded for many rows,
        # float32 products over panels (engine/native.py; built once, before the weights
        # are packed, which checks them)
        native.load()
    # the weights stream once per decode step: on huge pages, fewer TLB misses (hugepages.py)
    with huge_pages() if device.type == "cpu" else contextlib.nullcontext():
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)  # allocate parameters directly in the target dtype
        try:
            with torch.device(device):
                model = LlamaModel(cfg)
        finally:
            torch.set_default_dtype(previous)
        model.load_hf_state_dict(weights)
        if device.type == "cpu" and dtype == torch.bfloat16:
            model.set_act_dtype(torch.float32)  # bf16 weights and K/V, float32 in between
        if quantize in ("int8", "int4", "int4-hybrid"):
            model.quantize(quantize)
        model.eval()
        model.prepack()
    return model
