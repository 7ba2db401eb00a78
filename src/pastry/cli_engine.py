"""``pastry engine``: one engine process for a server on another host to attach."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

from pastry.cli_common import MODEL_HELP, Subparsers, add_memory_options


def add_engine(subparsers: Subparsers) -> None:
    """``pastry engine``: one engine process for a server elsewhere to attach."""
    p = subparsers.add_parser(
        "engine",
        help="run one engine for a server on another host (`pastry serve --engine URL`)",
        description="Load the model and serve it as an engine on --listen until stopped. Only "
        "a control layer holding the token may connect (CURVE, keys derived from the token: "
        "the token never crosses the network). The KV pool is in shared memory, so engines "
        "on this host can write K/V into it; --kv-recv also takes K/V from other hosts.",
    )
    p.add_argument("--listen", required=True, metavar="tcp://HOST:PORT", help="address to bind")
    p.add_argument("--model", type=Path, help=MODEL_HELP)
    p.add_argument(
        "--token", default=os.environ.get("PASTRY_ENGINE_TOKEN") or None,
        help="the token clients must hold (default: $PASTRY_ENGINE_TOKEN; printed when new)",
    )  # fmt: skip
    p.add_argument("--kv-recv", default="", metavar="tcp://HOST:PORT",
                   help="accept K/V writes from engines on other hosts here (port 0: any)")  # fmt: skip
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    p.add_argument("--cpus", default="", help="pin to these CPUs, e.g. 0 or 2-3")
    p.add_argument("--dtype", default="auto", help="float32, bfloat16, float16 or auto")
    add_memory_options(p)
    p.add_argument("--num-embeds", type=int, default=0, help="embedding slots (0: derived)")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    p.set_defaults(func=_engine)


def _engine(args: argparse.Namespace) -> int:
    import secrets

    from pastry.engine import serve
    from pastry.wire.auth import new_token

    host = args.listen.removeprefix("tcp://").rpartition(":")[0].strip("[]")
    if not args.listen.startswith("tcp://") or not host:
        print(f"pastry engine: error: --listen takes tcp://HOST:PORT, got {args.listen}",
              file=sys.stderr)  # fmt: skip
        return 2
    token = args.token
    if not token:  # an engine always wants a token: anyone reaching it could read its KV
        token = new_token()
        print(f"engine token (give it to `pastry serve --engine-token`): {token}",
              file=sys.stderr, flush=True)  # fmt: skip
    if args.model is None:  # the one `pastry serve` would serve (SmolLM2 if fetched)
        from pastry.engine.default_model import default_model

        args.model = default_model()
    shm = f"/dev/shm/pastry-kv-{os.getpid()}-{secrets.token_hex(3)}"
    argv = ["--model", str(args.model), "--endpoint", args.listen, "--dtype", args.dtype,
            "--num-pages", str(args.num_pages), "--kv-memory", str(args.kv_memory),
            "--num-embeds", str(args.num_embeds), "--kv-shm", shm, "--log-level", args.log_level.upper()]  # fmt: skip
    os.environ["PASTRY_ENGINE_TOKEN"] = token
    argv += ["--token-env", "PASTRY_ENGINE_TOKEN"]
    for flag, value in (("--threads", args.threads), ("--cpus", args.cpus),
                        ("--kv-recv", args.kv_recv)):  # fmt: skip
        if value:
            argv += [flag, str(value)]
    try:
        serve.main(argv)
    except KeyboardInterrupt:
        return 130
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(shm)
    return 0
