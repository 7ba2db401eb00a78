"""``pastry generate``: run prompts through an engine process with the fused loop (no server)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pastry.cli_common import MODEL_HELP, Subparsers, add_engine_speed_options


def add_generate(subparsers: Subparsers) -> None:
    """``pastry generate``: run prompts through an engine process with the fused loop."""
    p = subparsers.add_parser(
        "generate",
        help="generate text from prompts with an engine process (no server)",
        description="Start an engine process on the model, tokenize the prompts, generate "
        "with continuous batching over the engine's batch API, and print each completion. "
        "Without --model, uses the embedded default model (SmolLM2-135M-Instruct, see "
        "`pastry model fetch-default`).",
    )
    p.add_argument("prompts", nargs="*", default=["Hello,"], help="prompts (default: 'Hello,')")
    p.add_argument("--model", type=Path, help=MODEL_HELP)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto", help="float32, bfloat16, float16 or auto")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    add_engine_speed_options(p, compile_default=False)
    p.set_defaults(func=_generate)


def _generate(args: argparse.Namespace) -> int:
    import time

    from pastry.engine.default_model import default_model
    from pastry.wire.config import CheckpointError, EngineConfig
    from pastry.wire.handle import EngineError
    from pastry.wire.remote import RemoteEngine
    from pastry.wire.spawn import spawn_engine
    from pastry.wire.tokenizer import Tokenizer

    if args.max_tokens <= 0:
        print("pastry generate: error: --max-tokens must be positive", file=sys.stderr)
        return 2
    model = args.model or default_model()
    config = EngineConfig(
        device=args.device,
        dtype=args.dtype,
        num_pages=4096,
        num_embeds=8192,
        num_host_pages=16,
        quantize=args.quantize,
        compile=args.compile,
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
            _complete(args, tok, info, engine.execute_sync)
        finally:
            engine.close()
    return 0


def _complete(args: argparse.Namespace, tok, info, execute) -> None:
    """Generate for every prompt of ``args`` at once on the engine behind ``execute``; print
    each prompt with its completion (stdout), then the token count and speed (stderr).
    ``tok``: the model's :class:`~pastry.wire.tokenizer.Tokenizer`; ``info``: the engine's."""
    import time

    from pastry.engine.generate import FusedGenerator, Request

    texts = [
        tok.apply_chat_template([{"role": "user", "content": p}]) if args.chat else p
        for p in args.prompts
    ]
    reqs = [
        Request(
            # a chat template writes its own BOS, if the model has one
            prompt=tok.encode(t, add_special_tokens=not args.chat),
            max_new_tokens=args.max_tokens,
            temperature=args.temperature,
            seed=args.seed,
            stop_ids=tuple(info.eos_token_ids),
        )
        for t in texts
    ]
    gen = FusedGenerator(execute, info, max_running=len(reqs))
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
