"""What the ``pastry`` commands share: the --model help, sizes in bytes, the KV memory options."""

from __future__ import annotations

import argparse
import math

MODEL_HELP = (
    "a Hugging Face checkpoint directory or a .gguf file (default: the embedded SmolLM2-135M-"
    "Instruct GGUF)"
)

_SIZE_UNITS = {"": 1 << 30, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """Bytes from a size such as ``4GiB``, ``512M``, ``1.5g`` or ``2`` (a bare number is
    GiB); binary units either way (``4GB`` is 4 GiB), as vLLM's ``VLLM_CPU_KVCACHE_SPACE``."""
    raw = text.strip().lower().removesuffix("b").removesuffix("i")
    unit = raw[-1:] if raw[-1:] in _SIZE_UNITS and not raw[-1:].isdigit() else ""
    try:
        value = float(raw[: len(raw) - len(unit)])
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a size: {text!r} (e.g. 4GiB, 512MiB, or a number of GiB)"
        ) from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"a size must be positive, got {text!r}")
    return int(value * _SIZE_UNITS[unit])


def add_memory_options(p: argparse.ArgumentParser) -> None:
    """``--num-pages`` and ``--kv-memory`` (``pastry serve``, ``pastry engine``)."""
    p.add_argument(
        "--num-pages", type=int, default=0,
        help="KV pages of 16 tokens (default 0: derived, see --kv-memory)",
    )  # fmt: skip
    p.add_argument(
        "--kv-memory", type=parse_size, default=0, metavar="SIZE",
        help="memory for the KV pool, e.g. 2GiB or 512MiB (default: 16 sequences of the "
        "model's full context, within 4 GiB, a quarter of RAM and half of what is free; "
        "the pool's pages are committed as they are used)",
    )  # fmt: skip
