"""Engines on separate hosts: ``pastry engine --listen`` on two hosts made as network
namespaces (own address, hostname and ``/dev/shm``: KV moves between them over TCP only),
``pastry serve --engine ... --engine ...`` on a third; greedy outputs equal one engine's,
and a host that is lost (its processes killed, or its link cut) fails only what was on
it, then rejoins and is used again."""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
import threading
import time

import pytest

from netns_util import hosts_or_skip
from test_multi_engine import PROMPTS, ROUTERS, single_engine_texts  # noqa: F401 (a fixture)

TOKEN = "hosts-test-token"
ENGINE_PORT, KV_PORT, HTTP_PORT = 7000, 7001, 8080
SERVER = 2  # the host the server runs on; engines on 0 and 1


@pytest.fixture
def hosts():
    made = hosts_or_skip(3)
    try:
        yield made
    finally:
        made.close()


def _engine(hosts, i: int, model, tmp_path) -> subprocess.Popen:
    addr = hosts.address(i)
    argv = [sys.executable, "-m", "pastry.cli", "engine", "--listen", f"tcp://{addr}:{ENGINE_PORT}",
            "--kv-recv", f"tcp://{addr}:{KV_PORT}", "--model", str(model), "--dtype", "float32",
            "--num-pages", "256", "--num-embeds", "1024", "--threads", "1"]  # fmt: skip
    env = {**os.environ, "PASTRY_ENGINE_TOKEN": TOKEN}  # the user's caches: kernels built once
    log = open(tmp_path / f"engine{i}.log", "a")  # noqa: SIM115 (the process keeps it)
    return hosts.run(i, argv, env=env, stdout=log, stderr=subprocess.STDOUT)


def _serve(hosts, model, tmp_path, router: str) -> subprocess.Popen:
    engines = [a for i in (0, 1) for a in ("--engine", f"tcp://{hosts.address(i)}:{ENGINE_PORT}")]
    argv = [sys.executable, "-m", "pastry.cli", "serve", "--model", str(model), "--engines", "0",
            *engines, "--engine-token", TOKEN, "--router", router, "--port", str(HTTP_PORT),
            "--engine-hang-timeout", "10"]  # fmt: skip
    for i in (0, 1):  # the server connects to engines that serve (it fails at start else)
        _serving(tmp_path / f"engine{i}.log")
    env = dict(os.environ)
    log = open(tmp_path / "server.log", "a")  # noqa: SIM115
    return hosts.run(SERVER, argv, env=env, stdout=log, stderr=subprocess.STDOUT)


def _serving(log, deadline_s: float = 240) -> None:
    """Wait until the engine writing ``log`` says it serves."""
    end = time.time() + deadline_s
    while "serving " not in log.read_text():
        assert time.time() < end, f"the engine did not start: {log.read_text()[-2000:]}"
        time.sleep(0.2)


def _http(method: str, path: str, body: dict | None = None, timeout: float = 120):
    """A request to the server, from a thread on the server's host."""
    import httpx

    r = httpx.request(method, f"http://127.0.0.1:{HTTP_PORT}{path}", json=body, timeout=timeout)
    return r.status_code, r.json()


def _health(hosts, want: str, tmp_path, deadline_s: float = 240) -> dict:
    """``/health`` once it says ``want`` (``ok``: every engine up)."""
    import httpx

    end = time.time() + deadline_s
    while True:
        try:
            _code, body = hosts.call(SERVER, _http, "GET", "/health", None, 5)
            if body.get("status") == want:
                return body
        except httpx.HTTPError:
            pass
        if time.time() > end:
            logs = {f.name: f.read_text()[-1500:] for f in tmp_path.glob("*.log")}
            raise AssertionError(f"/health never said {want!r}; logs: {logs}")
        time.sleep(0.5)


def _complete(hosts, prompts, max_tokens: int = 12, **extra) -> list[tuple[int, dict]]:
    """``/v1/completions`` of each prompt, all at once, from the server's host."""
    _code, models = hosts.call(SERVER, _http, "GET", "/v1/models")
    model = models["data"][0]["id"]

    def one(prompt):
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}  # fmt: skip
        return hosts.call(SERVER, _http, "POST", "/v1/completions", body, 300)

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def _stream(model: str, started: threading.Barrier) -> dict:
    """A streamed greedy completion of 1500 tokens from the server's host: its text, how
    many chunks came, its finish reason, and the error that ended it (``None``: none)."""
    import httpx

    body = {"model": model, "prompt": "Once upon a time", "max_tokens": 1500,
            "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
    out = {"text": "", "tokens": 0, "error": None, "finish": None}
    url = f"http://127.0.0.1:{HTTP_PORT}/v1/completions"
    try:
        with httpx.stream("POST", url, json=body, timeout=300) as r:
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line.removeprefix("data: "))
                if "error" in chunk:
                    out["error"] = json.dumps(chunk["error"])
                    break
                out["text"] += chunk["choices"][0]["text"]
                out["finish"] = chunk["choices"][0].get("finish_reason") or out["finish"]
                out["tokens"] += 1
                if out["tokens"] == 1:
                    started.wait(120)
    finally:
        if out["tokens"] == 0:
            started.abort()
    return out


def _texts(results) -> list[str]:
    assert all(code == 200 for code, _ in results), results
    return [body["choices"][0]["text"] for _, body in results]


def test_engines_on_two_hosts_answer_as_one_engine(hosts, make_tiny, tmp_path, single_engine_texts):  # noqa: F811
    """Through every router (P/D and migration move K/V across the bridge over TCP: the
    hosts do not share ``/dev/shm``), greedy texts equal one engine's; the same two
    engines serve one server after another."""
    model = make_tiny()
    for i in (0, 1):
        _engine(hosts, i, model, tmp_path)
    for router in ROUTERS:
        server = _serve(hosts, model, tmp_path, router)
        try:
            health = _health(hosts, "ok", tmp_path)
            assert len(health["engines"]) == 2, health
            assert _texts(_complete(hosts, PROMPTS)) == single_engine_texts, router
        finally:
            server.terminate()
            server.wait(60)


def test_a_lost_host_fails_only_its_requests_and_rejoins(hosts, make_tiny, tmp_path):
    """Round robin over two hosts, four long greedy requests; every process of host 1 is
    killed while they run: its requests fail naming its engine (503), host 0's finish,
    the server goes on answering on host 0; host 1's engine started again is connected to
    again and serves (host 0 then lost: the requests go to host 1)."""
    model = make_tiny()
    for i in (0, 1):
        _engine(hosts, i, model, tmp_path)
    _serve(hosts, model, tmp_path, "round-robin")
    _health(hosts, "ok", tmp_path)
    want = _texts(_complete(hosts, ["Once upon a time"]))[0]
    model_id = hosts.call(SERVER, _http, "GET", "/v1/models")[1]["data"][0]["id"]
    started = threading.Barrier(5)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        streams = [pool.submit(hosts.call, SERVER, _stream, model_id, started) for _ in range(4)]
        started.wait(120)  # every stream has its first tokens: all four run
        hosts.kill(1)
        results = [s.result() for s in streams]
    lost = f"{hosts.address(1)}:{ENGINE_PORT}"
    failed = [r for r in results if r["error"]]
    done = [r for r in results if not r["error"]]
    assert len(failed) == 2 and len(done) == 2, results  # round robin: two on each host
    for r in failed:
        assert lost in r["error"] and r["finish"] is None, r
    for r in done:
        assert r["finish"] == "length" and r["text"].startswith(want), r
    assert _texts(_complete(hosts, ["Once upon a time"] * 2)) == [want] * 2  # host 0 serves
    assert _health(hosts, "degraded", tmp_path, 30)
    (tmp_path / "engine1.log").unlink()
    _engine(hosts, 1, model, tmp_path)  # the host comes back
    health = _health(hosts, "ok", tmp_path)
    assert [e["restarts"] for e in health["engines"]] == [0, 1], health
    hosts.kill(0)
    _health(hosts, "degraded", tmp_path, 30)
    assert _texts(_complete(hosts, ["Once upon a time"] * 2)) == [want] * 2  # host 1 serves


def test_a_host_cut_off_fails_only_its_requests_and_rejoins_when_mended(hosts, make_tiny, tmp_path):
    """Host 1's link cut while four streams run: the connection's heartbeat notices within
    10 s, its two streams fail naming its engine, host 0's finish; the link mended, the
    engine (which ran on) is connected to again and serves."""
    model = make_tiny()
    for i in (0, 1):
        _engine(hosts, i, model, tmp_path)
    _serve(hosts, model, tmp_path, "round-robin")
    _health(hosts, "ok", tmp_path)
    model_id = hosts.call(SERVER, _http, "GET", "/v1/models")[1]["data"][0]["id"]
    started = threading.Barrier(5)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        streams = [pool.submit(hosts.call, SERVER, _stream, model_id, started) for _ in range(4)]
        started.wait(120)
        hosts.cut(1)
        cut_at = time.monotonic()
        results = [s.result() for s in streams]
        noticed = time.monotonic() - cut_at
    failed = [r for r in results if r["error"]]
    assert len(failed) == 2 and sum(r["finish"] == "length" for r in results) == 2, results
    assert all(f"{hosts.address(1)}:{ENGINE_PORT}" in r["error"] for r in failed), failed
    assert noticed < 30, noticed  # the heartbeat's 10 s, and host 0's streams finishing
    hosts.cut(1, up=True)
    health = _health(hosts, "ok", tmp_path)
    assert [e["restarts"] for e in health["engines"]] == [0, 1], health
    hosts.kill(0)
    _health(hosts, "degraded", tmp_path, 30)
    assert len(_texts(_complete(hosts, ["Once upon a time"] * 2))) == 2  # host 1 serves
