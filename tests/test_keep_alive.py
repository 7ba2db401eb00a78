"""Idle HTTP connections: the server keeps them longer than clients do (docs/operations.md).

A server that closes an idle keep-alive connection while a client still counts it as
reusable races that client: under load its next request meets a reset (httpx's
``ReadError``), which the hour-long soak saw 9 times in 680k requests with uvicorn's 5 s
default against httpx's own 5 s expiry.
"""

from __future__ import annotations

import re
import socket
import time

import pytest

from pastry.server.service import ConfigError, ServerConfig
from server_util import running_server

HTTPX_KEEPALIVE_EXPIRY_S = 5.0  # httpx.Limits' default, the OpenAI and Anthropic SDKs' too
REQUEST = b"GET /health HTTP/1.1\r\nHost: test\r\n\r\n"


def _exchange(sock: socket.socket) -> bytes:
    """Send one request on ``sock`` and read its whole answer (b"" when it was closed)."""
    sock.sendall(REQUEST)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(re.search(rb"(?i)content-length: *(\d+)", head)[1])
    while len(body) < length:
        chunk = sock.recv(4096)
        if not chunk:
            return b""
        body += chunk
    return head


def _open(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def test_an_idle_connection_outlives_the_clients_expiry(make_tiny, tmp_path):
    with running_server(make_tiny("llama"), tmp_path) as (url, srv):
        assert srv.config.keep_alive > 15  # aiohttp's expiry, the longest common one
        with _open(url) as sock:
            assert _exchange(sock).startswith(b"HTTP/1.1 200")
            time.sleep(HTTPX_KEEPALIVE_EXPIRY_S + 0.5)
            assert _exchange(sock).startswith(b"HTTP/1.1 200"), "the server closed it"


def test_keep_alive_is_the_operators_to_set(make_tiny, tmp_path):
    server = running_server(make_tiny("llama"), tmp_path, keep_alive=0.5)
    with server as (url, _srv), _open(url) as sock:
        assert _exchange(sock).startswith(b"HTTP/1.1 200")
        time.sleep(1.5)
        sock.settimeout(5)
        try:
            closed = sock.recv(1) == b""
        except ConnectionResetError:
            closed = True
        assert closed, "an idle connection outlived --keep-alive"


def test_keep_alive_flag_reaches_the_config_and_must_be_positive(monkeypatch):
    import pastry.server.app
    from pastry.cli import main

    seen = []

    async def fake_serve(config, log_level="info"):
        seen.append(config)

    monkeypatch.setattr(pastry.server.app, "serve", fake_serve)
    assert main(["serve", "--keep-alive", "30"]) == 0
    assert seen[0].keep_alive == 30.0
    assert main(["serve", "--keep-alive", "0"]) == 2
    with pytest.raises(ConfigError, match="--keep-alive"):
        ServerConfig(keep_alive=-1)
