"""The client commands: ``pastry run`` (an inferlet, against a server or an embedded one),
``pastry attach`` (a detached instance) and ``pastry ls`` (a server's programs and instances)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from pastry.cli_common import MODEL_HELP, Subparsers, human_size


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


def add_run(subparsers: Subparsers) -> None:
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
    inner.add_argument("program")
    inner.add_argument("args", nargs="*")
    # parsed into a copy of the outer options: argparse sets a default only where the
    # namespace has no value, so only the options given here override the outer ones
    parsed = inner.parse_intermixed_args(rest, namespace=argparse.Namespace(**vars(args)))
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


def add_attach(subparsers: Subparsers) -> None:
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


def add_ls(subparsers: Subparsers) -> None:
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
        rows = [(p.name, p.hash[:12], human_size(p.size), "built-in" if p.builtin else "uploaded")
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
