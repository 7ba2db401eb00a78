"""A real server (uvicorn on a free loopback port, engine in-process) for endpoint tests."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import socket
import struct
import threading
import time
from contextlib import contextmanager
from dataclasses import replace

import uvicorn

from pastry.server.app import uvicorn_config
from pastry.server.service import PastryServer, ServerConfig

SMALL = dict(num_pages=1024, num_embeds=4096, dtype="float32", page_size=16)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running_server(model, tmp_path, start_timeout: float = 60, **overrides):
    """Yield ``(base_url, server)``; the server runs in a thread with its own event loop
    (``start_timeout`` seconds to come up: more where it compiles its decode step).

    Inspect server state from the test thread only through ``call(server, fn)``.
    """
    # Bind the listening socket here and hand it to uvicorn: picking a free port and
    # binding it later races with other processes taking the same port.
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    cfg = ServerConfig(
        model=model,
        port=sock.getsockname()[1],
        in_process=True,
        programs_dir=tmp_path / "programs",
        **SMALL,
    )
    cfg = replace(cfg, **overrides)
    server = PastryServer(cfg)
    uv = uvicorn.Server(uvicorn_config(server))
    failure: list[BaseException] = []

    def run() -> None:
        try:
            uv.run(sockets=[sock])
        except BaseException as e:  # SystemExit from a failed start included
            failure.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    deadline = time.time() + start_timeout
    while not uv.started:
        if time.time() > deadline or not thread.is_alive():
            why = repr(failure[0]) if failure else "no exception (see the captured log)"
            raise RuntimeError(f"server did not start: {why}")
        time.sleep(0.02)
    try:
        yield f"http://{cfg.host}:{cfg.port}", server
    finally:
        uv.should_exit = True
        thread.join(timeout=30)


def call(server: PastryServer, fn):
    """Run ``fn()`` on the server's event loop thread and return its result."""

    async def run():
        return fn()

    return asyncio.run_coroutine_threadsafe(run(), server.loop).result(timeout=30)


def integrity(server: PastryServer) -> tuple[int, int]:
    """Check every model's pool integrity; returns (kv pages used, embeds used)."""

    def check():
        used = [0, 0]
        for m in server.controller.models.values():
            m.resources.check_integrity()
            used[0] += m.resources.referenced("kv")
            used[1] += m.resources.referenced("embed")
        return tuple(used)

    return call(server, check)


def raw_ws(url: str, path: str = "/ws") -> socket.socket:
    """A WebSocket connection on a plain socket with a tiny receive buffer: a client that
    reads nothing the server sends unless the test reads it (client libraries read ahead).
    Send with :func:`ws_send`."""
    host, port = url.split("//", 1)[1].split(":")
    s = socket.create_connection((host, int(port)))
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    key = base64.b64encode(os.urandom(16)).decode()
    s.sendall(
        f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\n"
        f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
        .encode()
    )  # fmt: skip
    head = b""
    while b"\r\n\r\n" not in head:
        head += s.recv(1)
    assert b" 101 " in head.split(b"\r\n")[0], head
    return s


def ws_send(s: socket.socket, frame: dict) -> None:
    """Send ``frame`` as a masked text frame (what a client must send)."""
    data = json.dumps(frame).encode()
    n, mask = len(data), os.urandom(4)
    if n < 126:
        head = bytes([0x81, 0x80 | n])
    elif n < 1 << 16:
        head = bytes([0x81, 0x80 | 126]) + struct.pack("!H", n)
    else:
        head = bytes([0x81, 0x80 | 127]) + struct.pack("!Q", n)
    masked = bytes(b ^ mask[i % 4] for i, b in enumerate(data))
    s.sendall(head + mask + masked)
