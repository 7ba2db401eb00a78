"""Engines come back (issue 31, point 3): an engine process killed (SIGKILL) or hung
(SIGSTOP) mid-generation is restarted with the same configuration. The request that was
on it fails cleanly (503, the reason naming the engine); a request sent meanwhile waits
for the new process and succeeds; ``/health`` says ``degraded`` while it is down and
``ok`` after; no page is left held; ``/metrics`` counts the restart."""

from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import time
from pathlib import Path

import httpx
import pytest

from server_util import call, integrity, running_server


def completion(url: str, model: str, max_tokens: int, timeout: float = 300) -> httpx.Response:
    body = {"model": model, "prompt": "The history of the world", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    return httpx.post(f"{url}/v1/completions", json=body, timeout=timeout)


def health(url: str) -> tuple[int, dict]:
    r = httpx.get(f"{url}/health", timeout=10)
    return r.status_code, r.json()


def restarts(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {m[0]: float(m[1]) for m in re.findall(r'pastry_engine_restarts_total\{engine="([^"]+)"\} (\S+)', text)}  # fmt: skip


def generating(server, model: str) -> bool:
    return call(server, lambda: server.controller.models[model].scheduler.stats.batches) > 20


def wait_for(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.mark.parametrize("how", ["sigkill", "hang"])
def test_an_engine_lost_mid_generation_comes_back(make_tiny, tmp_path, how):
    overrides = dict(in_process=False, engine_hang_timeout=3.0)
    with running_server(make_tiny("llama"), tmp_path, **overrides) as (url, server):
        model = server.models[0]
        (sup,) = server.engines.processes
        first_pid = sup.pid
        counted = restarts(url).get(sup.name, 0.0)  # the counter is process-wide
        assert health(url) == (200, {"status": "ok", "models": [model], "engines": [
            {"model": model, "rank": 0, "state": "up", "restarts": 0}]})  # fmt: skip
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            long = pool.submit(completion, url, model, 1500)
            wait_for(lambda: generating(server, model), 60, "the generation to start")
            os.kill(first_pid, signal.SIGKILL if how == "sigkill" else signal.SIGSTOP)
            r = long.result(timeout=120)
            # the request on it fails cleanly, naming the engine, with its request id
            assert r.status_code == 503, r.text
            error = r.json()["error"]
            assert error["request_id"] == r.headers["x-request-id"]
            assert f"engine {sup.name} failed" in error["message"]
            assert ("exited" if how == "sigkill" else "hung") in error["message"] or (
                "lost the connection" in error["message"]
            ), error["message"]
            status, body = health(url)
            degraded = body["status"] == "degraded"
            # a request sent now waits for the new engine process and is served
            again = pool.submit(completion, url, model, 8)
            if degraded:
                assert status == 503 and body["engines"][0]["state"] in ("restarting", "down")
            r = again.result(timeout=180)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 8
        assert sup.pid != first_pid and sup.restarts == 1
        status, body = health(url)
        assert status == 200 and body["status"] == "ok"
        assert body["engines"][0]["restarts"] == 1 and body["engines"][0]["state"] == "up"
        assert restarts(url)[sup.name] == counted + 1
        wait_for(lambda: integrity(server) == (0, 0), 10, "every page to be free")
        assert not Path(f"/proc/{first_pid}").exists()  # reaped, not left a zombie


def test_an_idle_engine_killed_is_restarted_before_anyone_asks(make_tiny, tmp_path):
    with running_server(make_tiny("llama"), tmp_path, in_process=False) as (url, server):
        model = server.models[0]
        (sup,) = server.engines.processes
        pid = sup.pid
        assert completion(url, model, 4).status_code == 200
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: sup.restarts == 1 and sup.state == "up", 120, "the restart")
        assert sup.pid != pid
        assert completion(url, model, 4).status_code == 200
        assert integrity(server) == (0, 0)
