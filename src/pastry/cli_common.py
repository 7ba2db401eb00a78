"""What the ``pastry`` commands share: the subparsers type, the --model help, sizes in bytes,
the usage answer, the KV memory and engine speed options."""

from __future__ import annotations

import argparse
import math
import sys

# What ``ArgumentParser.add_subparsers()`` returns, which every ``add_*`` command takes;
# argparse names its type only privately (the one place that names it).
Subparsers = argparse._SubParsersAction

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


def human_size(n: float) -> str:
    """``n`` bytes for people: ``512 B``, ``1.5 KB``, ``3.2 MB``, ``1.0 GB`` (1024 a step)."""
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError  # unreachable


def print_usage(parser: argparse.ArgumentParser) -> int:
    """A command group run without its command: its help on stderr, exit status 2."""
    parser.print_help(sys.stderr)
    return 2


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


def add_engine_speed_options(p: argparse.ArgumentParser, compile_default: bool) -> None:
    """``--quantize`` and ``--compile`` (``pastry generate``, ``pastry serve``)."""
    p.add_argument(
        "--quantize", choices=("auto", "none", "int8", "int4", "int4-hybrid"), default="auto",
        help="weight-only quantized projections on CPU: int8 or int4 for any checkpoint (a "
        "GGUF's Q4 blocks are kept as they are); int4-hybrid: int4 plus a bf16 copy for "
        "batches of 16+ (faster there, more memory); auto (default) and none: dense weights",
    )  # fmt: skip
    p.add_argument(
        "--compile", action=argparse.BooleanOptionalAction, default=compile_default,
        help="run decode steps through the compiled graph on CPU (compiled at start-up, "
        f"cached under $PASTRY_HOME/inductor; default {'on' if compile_default else 'off'})",
    )  # fmt: skip
