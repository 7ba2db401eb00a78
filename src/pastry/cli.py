"""The ``pastry`` command line.

Commands are grouped (``pastry model create-tiny ...``). To add a command or group, write an
``add_*(subparsers)`` function that registers its parser with ``set_defaults(func=...)``,
where ``func(args) -> int`` is the exit status, and append it to :data:`COMMANDS`. Handlers
import what they need inside, so ``pastry --help`` stays fast.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from pastry import __version__


def add_model(subparsers: argparse._SubParsersAction) -> None:
    """``pastry model ...``: create and inspect checkpoints."""
    model = subparsers.add_parser("model", help="create and inspect checkpoints")
    model.set_defaults(func=lambda args: _usage(model))
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


def _create_tiny(args: argparse.Namespace) -> int:
    import time

    from pastry.engine.checkpoint import load_checkpoint, weight_files
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
            print(f"    {f.name:<36} {_human(f.stat().st_size):>9}")
    return 0


def _count_params(files: dict[str, Path]) -> int:
    """Number of parameters stored in the safetensors ``files`` (by tensor name)."""
    from safetensors import safe_open

    total = 0
    for path in set(files.values()):
        with safe_open(path, framework="pt") as f:
            total += sum(math.prod(f.get_slice(n).get_shape()) for n in f.keys())  # noqa: SIM118
    return total


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError  # unreachable


def add_generate(subparsers: argparse._SubParsersAction) -> None:
    """``pastry generate``: run prompts through an engine process with the fused loop."""
    p = subparsers.add_parser(
        "generate",
        help="generate text from prompts with an engine process (no server)",
        description="Start an engine process on the model, tokenize the prompts, generate "
        "with continuous batching over the engine's batch API, and print each completion. "
        "Without --model, uses the embedded default model (random weights: the text is "
        "gibberish, the machinery is real).",
    )
    p.add_argument("prompts", nargs="*", default=["Hello,"], help="prompts (default: 'Hello,')")
    p.add_argument("--model", type=Path, help="Hugging Face checkpoint directory")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto", help="float32, bfloat16, float16 or auto")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    p.set_defaults(func=_generate)


def _generate(args: argparse.Namespace) -> int:
    import time

    from pastry.engine.config import CheckpointError, EngineConfig
    from pastry.engine.generate import FusedGenerator, Request
    from pastry.engine.process import EngineError, RemoteEngine, spawn_engine
    from pastry.engine.tiny import ensure_default_model
    from pastry.engine.tokenizer import Tokenizer

    if args.max_tokens <= 0:
        print("pastry generate: error: --max-tokens must be positive", file=sys.stderr)
        return 2
    model = args.model or ensure_default_model()
    config = EngineConfig(
        device=args.device, dtype=args.dtype, num_pages=4096, num_embeds=8192, num_host_pages=16
    )
    t0 = time.perf_counter()
    try:
        proc = spawn_engine(model, config)
    except (EngineError, CheckpointError, ValueError) as e:
        print(f"pastry generate: error: {e}", file=sys.stderr)
        return 1
    with proc:
        engine = RemoteEngine.connect_sync(proc.endpoint)
        try:
            info = engine.info
            tok = Tokenizer.from_json(info.tokenizer_json, info.chat_template, info.special_tokens)
            print(
                f"engine: {info.model_name} ({info.arch}, {info.dtype} on {info.device}), "
                f"{info.num_pages} KV pages x {info.page_size} tokens, ready in "
                f"{time.perf_counter() - t0:.1f}s at {proc.endpoint}",
                file=sys.stderr,
            )
            texts = [
                tok.apply_chat_template([{"role": "user", "content": p}]) if args.chat else p
                for p in args.prompts
            ]
            reqs = [
                Request(
                    prompt=tok.encode(t, add_special_tokens=True),
                    max_new_tokens=args.max_tokens,
                    temperature=args.temperature,
                    seed=args.seed,
                    stop_ids=tuple(info.eos_token_ids),
                )
                for t in texts
            ]
            gen = FusedGenerator(engine.execute_sync, info, max_running=len(reqs))
            t1 = time.perf_counter()
            gen.run(reqs)
            secs = time.perf_counter() - t1
            for prompt, req in zip(args.prompts, reqs, strict=True):
                print(f"{prompt}{tok.decode(req.output, skip_special_tokens=True)}")
            n = sum(len(r.output) for r in reqs)
            print(
                f"{n} tokens in {secs:.2f}s ({n / secs:.1f} tok/s, {gen.steps} engine steps)",
                file=sys.stderr,
            )
        finally:
            engine.close()
    return 0


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2


COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [add_model, add_generate]


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every group of :data:`COMMANDS`."""
    parser = argparse.ArgumentParser(
        prog="pastry", description="Pastry: a programmable LLM serving system."
    )
    parser.add_argument("--version", action="version", version=f"pastry {__version__}")
    parser.set_defaults(func=lambda args: _usage(parser))
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
    for add in COMMANDS:
        add(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI on ``argv`` (default ``sys.argv[1:]``) and return the exit status."""
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
