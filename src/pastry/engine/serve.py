"""The engine server: one engine behind a ZeroMQ ROUTER socket, and its process's CLI.

``python -m pastry.engine.serve --model DIR --endpoint ipc:///PATH`` (or ``tcp://HOST:PORT``)
loads an engine and serves it until a ``SHUTDOWN`` request, SIGTERM, or (with
``--exit-with-parent``, set by :func:`~pastry.engine.spawn.spawn_engine`) the parent's exit.
Wire protocol: :mod:`pastry.engine.wire`.

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

from pastry.engine.calls import Call, CallError
from pastry.engine.codec import CodecError, Frames, decode_batch, encode_info, encode_results
from pastry.engine.config import CheckpointError, EngineConfig
from pastry.engine.handle import EngineLike, run_batch
from pastry.engine.wire import OPS, Op, Status, parse_header, reply

log = logging.getLogger(__name__)

DEFAULT_ENGINE_FACTORY = "pastry.engine.engine:Engine.load"


def serve(engine: EngineLike, endpoint: str) -> None:
    """Serve ``engine`` on ``endpoint`` (binds a ROUTER) until a SHUTDOWN request."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
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


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pastry.engine.serve", description="Serve one engine over ZeroMQ."
    )
    p.add_argument("--model", required=True, help="checkpoint directory")
    p.add_argument("--endpoint", required=True, help="ipc:///path or tcp://host:port to bind")
    for f in dataclasses.fields(EngineConfig):
        flag = f"--{f.name.replace('_', '-')}"
        p.add_argument(flag, type=type(f.default), default=f.default, help=f"default {f.default}")
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
    signal.signal(signal.SIGTERM, _exit_on_signal)
    if args.exit_with_parent:
        threading.Thread(target=_exit_when_stdin_closes, daemon=True).start()
        # Ctrl-C in a terminal reaches the whole process group; the parent decides when
        # the engine stops (it terminates us, or we exit when it goes away).
        signal.signal(signal.SIGINT, signal.SIG_IGN)
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
    # Objects alive now (model, tokenizer) live forever: keep them out of every future
    # garbage collection, which otherwise rescans them on each full pass.
    gc.collect()
    gc.freeze()
    try:
        serve(engine, args.endpoint)
    except zmq.ZMQError as e:
        raise SystemExit(f"engine server on {args.endpoint} failed: {e}") from e


def _exit_on_signal(signum: int, frame: Any) -> None:
    log.info("received signal %d, exiting", signum)
    raise SystemExit(0)


def _exit_when_stdin_closes() -> None:
    sys.stdin.read()
    log.warning("parent process went away, exiting")
    os.kill(os.getpid(), signal.SIGTERM)


if __name__ == "__main__":
    main()
