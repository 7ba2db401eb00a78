"""``pastry serve``: engine processes, the control layer, the inferlet runner and the client
endpoints (WebSocket /ws, OpenAI /v1), until stopped. :func:`add_serve` registers the flags in
named groups (the model, the HTTP listener, the KV pool, batching, programs, several engines,
users and quotas); :func:`_serve` turns them into a :class:`~pastry.server.service.ServerConfig`."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from pastry.cli_common import (
    MODEL_HELP,
    Subparsers,
    add_engine_speed_options,
    add_memory_options,
    human_size,
)


def add_serve(subparsers: Subparsers) -> None:
    """``pastry serve``: engines + the WebSocket and OpenAI endpoints, until stopped."""
    p = subparsers.add_parser(
        "serve",
        help="run the server: engine processes, inferlets, WebSocket /ws and OpenAI /v1",
        description="Start one engine process per device on the model, the control layer and "
        "the inferlet runner, and serve the client protocol (WebSocket /ws, docs/protocol.md), "
        "the OpenAI-compatible API (/v1) and /health until Ctrl-C or SIGTERM. Without "
        "--model, serves the embedded default model (SmolLM2-135M-Instruct, see `pastry model "
        "fetch-default`).",
    )
    _add_model_options(p)
    add_engine_speed_options(p, compile_default=True)
    _add_extension_options(p)
    _add_http_options(p)
    _add_kv_options(p)
    _add_batch_options(p)
    _add_program_options(p)
    _add_engines_options(p)
    _add_tenancy_options(p)
    p.set_defaults(func=_serve)


def _add_model_options(p: argparse.ArgumentParser) -> None:
    """What is served, on which devices, and how long an engine may hang."""
    p.add_argument("--model", type=Path, help=MODEL_HELP)
    p.add_argument(
        "--engine-devices", nargs="+", default=["cpu"], metavar="DEVICE",
        help="one engine process per device (default: cpu)",
    )  # fmt: skip
    p.add_argument("--dtype", default="auto", help="float32, bfloat16, float16 or auto")
    p.add_argument(
        "--engine-hang-timeout", type=float, default=120.0, metavar="S",
        help="an engine process that leaves a batch (or, idle, a ping) unanswered this many "
        "seconds is killed and restarted, like one that exits (default 120; "
        "docs/operations.md)",
    )  # fmt: skip


def _add_extension_options(p: argparse.ArgumentParser) -> None:
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


def _add_http_options(p: argparse.ArgumentParser) -> None:
    """Where the server listens, the token it asks for, and how much it logs."""
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    p.add_argument(
        "--auth-token", default=os.environ.get("PASTRY_AUTH_TOKEN") or None,
        help="token every request must carry (default: $PASTRY_AUTH_TOKEN); required to "
        "bind a non-loopback address",
    )  # fmt: skip
    p.add_argument(
        "--keep-alive", type=float, default=65.0, metavar="S",
        help="seconds an idle HTTP connection is kept open (default 65: longer than clients "
        "keep theirs, so none reuses one the server is closing)",
    )  # fmt: skip
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))


def _add_kv_options(p: argparse.ArgumentParser) -> None:
    """The engines' KV pool and embedding slots, and the prefix cache over the pool."""
    add_memory_options(p)
    p.add_argument("--num-embeds", type=int, default=0, help="embedding slots (0: derived)")
    p.add_argument(
        "--no-prefix-cache", dest="prefix_cache", action="store_false",
        help="turn off the automatic prefix cache (every prompt is computed in full; for "
        "comparisons)",
    )  # fmt: skip


def _add_batch_options(p: argparse.ArgumentParser) -> None:
    """How batches are formed and who goes first (docs/scheduling.md)."""
    from pastry.control.policies import (
        ADMISSION_POLICIES,
        BATCH_POLICIES,
        DEFAULT_SCHEDULE,
        SCHEDULES,
    )

    p.add_argument(
        "--policy", choices=tuple(BATCH_POLICIES), default="adaptive",
        help="batching policy (default adaptive)",
    )  # fmt: skip
    p.add_argument(
        "--schedule", choices=SCHEDULES, default=DEFAULT_SCHEDULE,
        help=f"who goes first when a batch cannot take everyone, and whose KV is swapped out "
        f"when memory is short (docs/scheduling.md; default {DEFAULT_SCHEDULE})",
    )  # fmt: skip
    p.add_argument(
        "--max-batch", type=int, default=None, metavar="N",
        help="at most N forward calls per batch (default: no cap but the token budget)",
    )  # fmt: skip
    p.add_argument(
        "--admission", choices=tuple(ADMISSION_POLICIES), default="lpm",
        help="order of prefills waiting for a batch or KV pages: lpm (longest cached "
        "prefix first, default), fcfs or random",
    )  # fmt: skip


def _add_program_options(p: argparse.ArgumentParser) -> None:
    """What inferlets may reach, and how uploaded programs are run and stored."""
    p.add_argument(
        "--http-allow", nargs="+", default=[], metavar="HOST",
        help="hosts inferlets may reach over HTTP (default: none)",
    )  # fmt: skip
    p.add_argument(
        "--image-url-allow", nargs="+", default=[], metavar="HOST",
        help="hosts the server fetches images from when a request names one by URL "
        "(image_url, input_image, an Anthropic url source; default: none, inline images only)",
    )  # fmt: skip
    p.add_argument(
        "--trusted-uploads",
        action="store_true",
        help="run programs that operators upload from now on in the server process instead "
        "of the WebAssembly sandbox (only for programs you trust; logged as a warning)",
    )
    p.add_argument(
        "--programs-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="where uploaded programs are stored (default: $PASTRY_HOME/programs)",
    )
    p.add_argument(
        "--responses-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="where stored /v1/responses are kept, so that they survive a restart (default: "
        "$PASTRY_HOME/responses; 'none': in memory only)",
    )
    p.add_argument(
        "--store-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="where the inferlets' key-value store (store_set / store_get) is kept, so that it "
        "survives a restart (default: $PASTRY_HOME/store; 'none': in memory only)",
    )


def _add_engines_options(p: argparse.ArgumentParser) -> None:
    """Several engines: local ones, attached ones, Ray actors, and the routing program."""
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
        help="place the --engines as Ray actors of the cluster at ADDRESS (HEAD_IP:6379; "
        "'auto': the one this host belongs to; 'local': a new one in this process); needs "
        "the `ray` extra",
    )  # fmt: skip
    m.add_argument(
        "--ray-engine-resources", action="append", default=[], metavar="JSON",
        help="with --ray: the Ray resources one engine reserves, as JSON, e.g. "
        "'{\"CPU\": 2, \"pastry_host_a\": 1}': CPU is its cores (torch threads; default 1), "
        "a custom resource that only some nodes have (ray start --resources) or Ray's "
        "'node:IP' picks the host. Once: every engine's; repeated: one per engine, in rank "
        "order (default {\"CPU\": 1} each)",
    )  # fmt: skip
    m.add_argument(
        "--ray-placement", default="SPREAD", metavar="STRATEGY",
        help="with --ray: how the engines' resources are laid out over the nodes (a Ray "
        "placement group): SPREAD (default: distinct nodes where they fit), STRICT_SPREAD "
        "(distinct nodes or fail), PACK (few nodes), STRICT_PACK (one node)",
    )  # fmt: skip
    m.add_argument(
        "--router", default="",
        help="routing program: round-robin (default), least-loaded, pd[:P], pd-balance:RATIO[,P], "
        "locality[:THRESHOLD], migrate, or an uploaded program's name[:ARGS]",
    )  # fmt: skip


def _add_tenancy_options(p: argparse.ArgumentParser) -> None:
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
        shown = human_size(default) if f.name.endswith("bytes") or "bytes_" in f.name else default
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


def _reach(args: argparse.Namespace) -> dict:
    """What inferlets and requests may reach outside the server."""
    return {
        "http_allow": tuple(args.http_allow),
        "image_url_allow": tuple(args.image_url_allow),
        "mcp_servers": tuple(args.mcp),
    }


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
            trusted_uploads=args.trusted_uploads,
            adapters=tuple(_adapter_spec(a) for a in args.adapter),
            **_reach(args),
            schedule=args.schedule,
            max_batch=args.max_batch,
            **_placement(args),
            users=read_users_file(args.users) if args.users else (),
            grants=tuple(parse_grant(g) for g in args.grant),
            quotas=_quotas(args),
            engine_kwargs={
                "quantize": args.quantize,
                "compile": args.compile,
                "kv_memory": args.kv_memory,
                "compile_background": args.compile,  # ready once loaded (EngineConfig)
            },
            prefix_cache=args.prefix_cache,
            admission=args.admission,
            engine_hang_timeout=args.engine_hang_timeout,
            keep_alive=args.keep_alive,
            **_storage(args),
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


def _placement(args: argparse.Namespace) -> dict:
    """Where the engines run (local processes, ``--engine`` servers, a Ray cluster) and
    the router in front of them, as ``ServerConfig`` fields."""
    from pastry.server.ray_placement import parse_engine_resources

    return {
        "engines": args.engines if args.engines is not None else (0 if args.engine else 1),
        "remote_engines": tuple(args.engine),
        "engine_token": args.engine_token,
        "ray_address": args.ray,
        "ray_engine_resources": tuple(map(parse_engine_resources, args.ray_engine_resources)),
        "ray_placement": args.ray_placement,
        "router": args.router,
    }


def _storage(args: argparse.Namespace) -> dict:
    """What the server keeps on disk: uploads (and their size limit), stored responses and
    the key-value store (``--responses-dir``, ``--store-dir``: a directory, ``none`` for
    memory only, or the default)."""
    from pastry.paths import responses_dir, store_dir

    def where(value: Path | None, default: Path) -> Path | None:
        if value is None:
            return default
        return None if str(value).lower() == "none" else value

    return {
        "programs_dir": args.programs_dir,
        "max_upload_bytes": args.max_upload_bytes,
        "responses_dir": where(args.responses_dir, responses_dir()),
        "store_dir": where(args.store_dir, store_dir()),
    }
