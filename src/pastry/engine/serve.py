"""The engine server: one engine behind a ZeroMQ ROUTER socket, and its process's CLI.

``python -m pastry.engine.serve --model DIR --endpoint ipc:///PATH`` (or ``tcp://HOST:PORT``)
loads an engine and serves it until a ``SHUTDOWN`` request, SIGTERM, or (with
``--exit-with-parent``, set by :func:`~pastry.wire.spawn.spawn_engine`) the parent's exit.
Wire protocol: :mod:`pastry.wire.protocol`.

The server handles one request at a time, in arrival order. A malformed request gets an
``ERROR`` reply naming the problem; an exception inside ``engine.execute`` (a bug) turns
every call of that batch into a :class:`CallError`; in both cases the server keeps serving.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from pastry.wire.auth import secure_server, start_authenticator
from pastry.wire.calls import Call, CallError
from pastry.wire.codec import CodecError, Frames, decode_batch, encode_info, encode_results
from pastry.wire.config import CheckpointError, EngineConfig
from pastry.wire.handle import EngineLike, run_batch
from pastry.wire.protocol import OPS, Op, Status, parse_header, reply, strings

log = logging.getLogger(__name__)

DEFAULT_ENGINE_FACTORY = "pastry.engine.engine:Engine.load"


def serve(engine: EngineLike, endpoint: str, token: str | None = None) -> None:
    """Serve ``engine`` on ``endpoint`` (binds a ROUTER) until a SHUTDOWN request. With a
    ``token``, only clients holding it can connect (:mod:`pastry.wire.auth`)."""
    ctx = zmq.Context()
    auth = start_authenticator(ctx, token)
    sock = ctx.socket(zmq.ROUTER)
    secure_server(sock, token)
    try:
        sock.bind(endpoint)
        log.info("serving %s on %s", engine.info.model_name, endpoint)
        while True:
            ident, *frames = sock.recv_multipart(copy=False)
            answer, stop = handle_request(engine, frames)
            sock.send_multipart([ident, *answer], copy=False)
            if stop:
                log.info("shutdown requested")
                return
    finally:
        sock.close(linger=1000)
        if auth is not None:
            auth.stop()
        ctx.term()


def handle_request(engine: EngineLike, frames: Sequence[Any]) -> tuple[Frames, bool]:
    """The reply frames to one request, and whether to stop serving after sending them."""
    req_id = None
    try:
        if not frames:
            raise CodecError("empty request")
        op, req_id = parse_header(frames[0], 2)
        if type(op) is not int or op not in OPS:
            known = ", ".join(f"{o.value} ({o.name})" for o in Op)
            raise CodecError(f"unknown op {op!r:.20} (known: {known})")
        op = Op(op)
        if op is Op.EXECUTE:
            payload = _execute(engine, decode_batch(frames[1:]))
        elif op in (Op.LOAD_ADAPTER, Op.UNLOAD_ADAPTER):
            return _adapter_op(engine, op, frames, req_id), False
        elif len(frames) != 1:
            raise CodecError(f"{op.name} takes no payload, got {len(frames) - 1} frame(s)")
        else:
            payload = encode_info(engine.info) if op is Op.INFO else []
        return reply(Status.OK, req_id, None, payload), op is Op.SHUTDOWN
    except CodecError as e:
        log.warning("malformed request %s: %s", req_id, e)
        return reply(Status.ERROR, req_id, f"malformed request: {e}", []), False
    except Exception as e:  # a bug here must not take the server down
        log.exception("failed to handle request %s", req_id)
        return reply(Status.ERROR, req_id, f"internal error: {type(e).__name__}: {e}", []), False


def _adapter_op(engine: EngineLike, op: Op, frames: Sequence[Any], req_id: int) -> Frames:
    """Load or unload a LoRA adapter between batches; the reply is the new info, or the
    reason it could not be done (a bad directory, an unknown name)."""
    if len(frames) != 2:
        raise CodecError(f"{op.name} takes one payload frame, got {len(frames) - 1}")
    args = strings(frames[1], 2 if op is Op.LOAD_ADAPTER else 1)
    try:
        if op is Op.LOAD_ADAPTER:
            engine.load_adapter(args[1], args[0])
        else:
            engine.unload_adapter(args[0])
    except (ValueError, OSError) as e:  # CheckpointError is a ValueError
        return reply(Status.ERROR, req_id, str(e), [])
    return reply(Status.OK, req_id, None, encode_info(engine.info))


def _execute(engine: EngineLike, batch: list[Call]) -> Frames:
    results = run_batch(engine, batch)
    try:
        return encode_results(results)
    except CodecError as e:
        log.error("cannot encode the results of a batch: %s", e)
        return encode_results([CallError(f"engine error: cannot send result: {e}")] * len(batch))


# --- the engine process


def _load_factory(spec: str) -> Callable[[str, EngineConfig], EngineLike]:
    module, _, attr = spec.partition(":")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _parse_bool(text: str) -> bool:
    if text not in ("True", "False"):
        raise argparse.ArgumentTypeError(f"expected True or False, got {text!r}")
    return text == "True"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pastry.engine.serve", description="Serve one engine over ZeroMQ."
    )
    p.add_argument("--model", required=True, help="checkpoint directory")
    p.add_argument("--endpoint", required=True, help="ipc:///path or tcp://host:port to bind")
    for f in dataclasses.fields(EngineConfig):
        flag = f"--{f.name.replace('_', '-')}"
        kind = _parse_bool if isinstance(f.default, bool) else type(f.default)
        p.add_argument(flag, type=kind, default=f.default, help=f"default {f.default}")
    p.add_argument(
        "--engine-factory",
        default=DEFAULT_ENGINE_FACTORY,
        help="module:callable(model_dir, config) that builds the engine (tests)",
    )
    p.add_argument(
        "--exit-with-parent", action="store_true", help="exit when stdin closes (set by spawn)"
    )
    p.add_argument("--log-level", default="INFO")
    p.add_argument(
        "--token-env", default="", metavar="VAR",
        help="read the engine token from this environment variable: only clients holding "
        "it can connect (CURVE); also used to write KV into peer engines",
    )  # fmt: skip
    p.add_argument(
        "--threads", type=int, default=0,
        help="torch threads for this engine (0: torch's default)",
    )  # fmt: skip
    p.add_argument(
        "--cpus", default="", metavar="LIST",
        help="pin the process to these CPUs, e.g. 0 or 0,1 or 2-3 (several engines on one host)",
    )  # fmt: skip
    p.add_argument(
        "--kv-recv", default="", metavar="tcp://HOST:PORT",
        help="also accept KV writes from peer engines on other hosts here (port 0: any)",
    )  # fmt: skip
    p.add_argument(
        "--adapter", action="append", default=[], metavar="NAME=DIR",
        help="load a PEFT LoRA adapter at start (repeatable)",
    )  # fmt: skip
    return p


def main(argv: Sequence[str] | None = None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s engine[%(process)d] %(name)s: %(message)s",
    )
    try:
        config = EngineConfig(
            **{f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)}
        )
    except ValueError as e:
        parser.error(str(e))
    token = _token(args.token_env, parser)
    place(args.threads, args.cpus, parser)
    _handle_signals(args.exit_with_parent)
    engine = _load(args, config, parser)
    transfer = getattr(engine, "transfer", None)
    if transfer is not None:
        transfer.token = token
    receiver = _kv_receiver(engine, args.kv_recv, token) if args.kv_recv else None
    # Objects alive now (model, tokenizer) live forever: keep them out of every future
    # garbage collection, which otherwise rescans them on each full pass.
    gc.collect()
    gc.freeze()
    try:
        serve(engine, args.endpoint, token)
    except zmq.ZMQError as e:
        raise SystemExit(f"engine server on {args.endpoint} failed: {e}") from e
    finally:
        if receiver is not None:
            receiver.close()
        if hasattr(engine, "close"):
            engine.close()


def _token(env: str | None, parser: argparse.ArgumentParser) -> str | None:
    """The shared secret from the variable ``--token-env`` names (None without it)."""
    if not env:
        return None
    token = os.environ.get(env)
    if not token:
        parser.error(f"--token-env {env}: the variable is not set or empty")
    return token


def _handle_signals(exit_with_parent: bool) -> None:
    """SIGTERM exits; with ``--exit-with-parent`` the engine also exits when its stdin
    closes and ignores SIGINT."""
    signal.signal(signal.SIGTERM, _exit_on_signal)
    if exit_with_parent:
        threading.Thread(target=_exit_when_stdin_closes, daemon=True).start()
        # Ctrl-C in a terminal reaches the whole process group; the parent decides when
        # the engine stops (it terminates us, or we exit when it goes away).
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def _load(args: argparse.Namespace, config: EngineConfig, parser: argparse.ArgumentParser):
    """The engine ``--engine-factory`` makes of the model, with every ``--adapter`` loaded;
    a model or adapter that does not load exits with the reason."""
    try:
        engine = _load_factory(args.engine_factory)(args.model, config)
    except CheckpointError as e:
        raise SystemExit(f"cannot load the model: {e}") from e
    for spec in args.adapter:
        name, sep, path = spec.partition("=")
        if not sep:
            parser.error(f"--adapter takes NAME=DIR, got '{spec}'")
        try:
            engine.load_adapter(path, name)
        except (CheckpointError, ValueError) as e:
            raise SystemExit(f"cannot load adapter '{name}': {e}") from e
    return engine


def _kv_receiver(engine, endpoint: str, token: str | None):
    """A receiver of peers' KV writes on ``endpoint``, announced in the engine's info."""
    from pastry.engine.transfer import KvReceiver

    receiver = KvReceiver(engine.kv, endpoint, token)
    engine.info = dataclasses.replace(
        engine.info, kv_peers=(*engine.info.kv_peers, receiver.endpoint)
    )
    log.info("accepting KV writes from peers on %s", receiver.endpoint)
    return receiver


def place(threads: int, cpus: str, parser: argparse.ArgumentParser | None = None) -> None:
    """Pin this process to ``cpus`` ("0", "0,2", "2-3") and give torch ``threads`` threads
    (0: as many as CPUs pinned, else torch's default), so that engines sharing a host do
    not fight over cores."""
    import torch

    if cpus:
        try:
            chosen = parse_cpus(cpus)
            os.sched_setaffinity(0, chosen)
        except (ValueError, OSError) as e:
            msg = f"--cpus {cpus}: {e} (this host has CPUs {sorted(os.sched_getaffinity(0))})"
            if parser is None:
                raise ValueError(msg) from e
            parser.error(msg)
        threads = threads or len(chosen)
    if threads:
        torch.set_num_threads(threads)


def parse_cpus(spec: str) -> set[int]:
    """``"0,2-3"`` -> {0, 2, 3}."""
    out: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.strip().partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    if not out:
        raise ValueError("no CPU given")
    return out


def _exit_on_signal(signum: int, frame: Any) -> None:
    log.info("received signal %d, exiting", signum)
    raise SystemExit(0)


def _exit_when_stdin_closes() -> None:
    sys.stdin.read()
    log.warning("parent process went away, exiting")
    os.kill(os.getpid(), signal.SIGTERM)


if __name__ == "__main__":
    main()
