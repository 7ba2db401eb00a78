"""Engines on a Ray cluster set up as users set one up: ``ray start --head`` on one host,
``ray start --address HEAD:6379 --num-cpus 2 --resources '{"pastry_host_I": 1}'`` on two
others (hosts made as network namespaces: own address, hostname and ``/dev/shm``, so K/V
moves between the engines over TCP only), and ``pastry serve --ray HEAD:6379 --engines 2``
on the head's host. Ray places one engine on each worker host (SPREAD by default; by the
hosts' resource labels when asked), and greedy outputs through every router equal one
engine's. Also: what ``--ray-engine-resources`` / ``--ray-placement`` refuse."""

from __future__ import annotations

import concurrent.futures
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

import pastry
from netns_util import hosts_or_skip
from pastry.server.config import ConfigError, ServerConfig
from pastry.server.ray_placement import engine_bundles, parse_engine_resources
from test_hosts import HTTP_PORT, SERVER, _complete, _health, _http, _stream, _texts
from test_multi_engine import PROMPTS, ROUTERS, single_engine_texts  # noqa: F401 (a fixture)

HEAD = SERVER  # the Ray head and the server on host 2; Ray workers on hosts 0 and 1
WORKERS = (0, 1)
GCS_PORT = 6379
WORKER_CPUS = 2  # room for both engines on one worker: only SPREAD puts them apart


# ------------------------------------------------------------------- the options, no Ray


def test_engine_resources_are_checked():
    assert parse_engine_resources('{"pastry_host_a": 1}') == {"pastry_host_a": 1.0, "CPU": 1.0}
    assert parse_engine_resources('{"CPU": 2, "node:10.0.0.5": 0.01}') == {
        "CPU": 2.0, "node:10.0.0.5": 0.01,
    }  # fmt: skip
    bad = {
        "{CPU: 2}": "not JSON",
        "[1]": "non-empty JSON object",
        "{}": "non-empty JSON object",
        '{"CPU": 1.5}': "whole number",
        '{"CPU": 0}': "must be > 0",
        '{"x": -1}': "must be > 0",
        '{"x": true}': "must be a number",
        '{"x": "1"}': "must be a number",
        '{"GPU": 1}': "run on CPU",
    }
    for text, why in bad.items():
        with pytest.raises(ValueError, match=why):
            parse_engine_resources(text)
    one, two = {"CPU": 1.0, "a": 1.0}, {"CPU": 2.0, "b": 1.0}
    assert engine_bundles([], 2) == [{"CPU": 1.0}, {"CPU": 1.0}]
    assert engine_bundles([one], 2) == [one, one]
    assert engine_bundles([one, two], 2) == [one, two]
    with pytest.raises(ValueError, match="given 2 times for --engines 3"):
        engine_bundles([one, two], 3)


def test_serve_refuses_bad_ray_placement(capsys):
    from pastry.cli import main

    def refused(*argv: str) -> str:
        assert main(["serve", "--engines", "2", *argv]) == 2
        return capsys.readouterr().err

    assert "--ray-placement must be one of SPREAD" in refused("--ray", "auto", "--ray-placement", "spread")  # fmt: skip
    assert "whole number" in refused("--ray", "auto", "--ray-engine-resources", '{"CPU": 0.5}')
    assert "given 3 times for --engines 2" in refused(
        "--ray", "auto", *["--ray-engine-resources", '{"CPU": 1}'] * 3
    )
    assert "give the cluster with --ray ADDRESS" in refused("--ray-engine-resources", '{"a": 1}')
    with pytest.raises(ConfigError, match="--ray ADDRESS"):
        ServerConfig(engines=2, ray_placement="PACK")


# ------------------------------------------------------------ a cluster on three hosts


def _start(hosts, i: int, argv: list[str], env: dict, logs: Path) -> None:
    """``ray start ...`` on host ``i``; it returns once the node has joined."""
    out = logs / f"ray-start-h{i}.log"
    with open(out, "w") as f:
        rc = hosts.run(i, argv, env=env, stdout=f, stderr=subprocess.STDOUT).wait(180)
    assert rc == 0, f"ray start on host {i} failed ({rc}): {out.read_text()[-3000:]}"


class Cluster:
    """The Ray cluster of the module: ``hosts``, the head's address, the environment
    every node and the server run with, and :meth:`join` (``ray start`` a worker)."""

    def __init__(self, hosts, env: dict, temp: str, logs: Path) -> None:
        self.hosts, self.env, self.temp, self.logs = hosts, env, temp, logs
        self.head = f"{hosts.address(HEAD)}:{GCS_PORT}"

    def start_head(self) -> None:
        _start(self.hosts, HEAD, [str(RAY), "start", "--head", "--port", str(GCS_PORT),
                                  "--node-ip-address", self.hosts.address(HEAD), "--num-cpus",
                                  "0", "--include-dashboard=false", "--temp-dir",
                                  f"{self.temp}/h{HEAD}", *SMALL], self.env, self.logs)  # fmt: skip

    def join(self, i: int) -> None:
        """Worker host ``i`` joins the cluster with ``WORKER_CPUS`` cores and its label."""
        _start(self.hosts, i, [str(RAY), "start", "--address", self.head, "--node-ip-address",
                               self.hosts.address(i), "--num-cpus", str(WORKER_CPUS),
                               "--resources", json.dumps({f"pastry_host_{i}": 1}),
                               "--temp-dir", f"{self.temp}/h{i}", *SMALL], self.env, self.logs)  # fmt: skip


RAY = Path(sys.executable).with_name("ray")
SMALL = ["--object-store-memory", str(100 << 20), "--disable-usage-stats"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A Ray head on host 2 (no CPUs: engines go to the workers) and a worker on hosts 0
    and 1, each labelled ``pastry_host_I``; every Ray process stops with its host."""
    if not RAY.exists():
        pytest.skip("the `ray` extra is not installed (no `ray` command next to python)")
    hosts = hosts_or_skip(3)
    temp = tempfile.mkdtemp(prefix="pray-")  # short: Ray's socket paths live under it
    src = str(Path(pastry.__file__).parents[1])  # the workers import this very pastry
    # Ray's token authentication, one fresh token for every node and the server (set
    # explicitly: a ~/.ray/auth_token that a local ray.init() left turns it on for the
    # head only, and workers given the head's address are then refused)
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "token",
           "RAY_AUTH_TOKEN": secrets.token_hex(32),
           "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}  # fmt: skip
    try:
        c = Cluster(hosts, env, temp, tmp_path_factory.mktemp("ray-start"))
        c.start_head()
        for i in WORKERS:
            c.join(i)
        yield c
    finally:
        hosts.close()  # every process of every host: the raylets, GCS, workers, engines
        shutil.rmtree(temp, ignore_errors=True)


def _serve(hosts, head: str, env: dict, model, tmp_path, *extra: str) -> subprocess.Popen:
    argv = [sys.executable, "-m", "pastry.cli", "serve", "--model", str(model), "--ray", head,
            "--engines", "2", "--dtype", "float32", "--num-pages", "256", "--num-embeds",
            "1024", "--no-compile", "--port", str(HTTP_PORT), *extra]  # fmt: skip
    log = open(tmp_path / "server.log", "a")  # noqa: SIM115 (the process keeps it)
    return hosts.run(HEAD, argv, env=env, stdout=log, stderr=subprocess.STDOUT)


def _stop(server: subprocess.Popen) -> None:
    server.terminate()
    server.wait(90)


def _placed(hosts) -> list[str]:
    """The address of the host each engine (in rank order) runs on: that of its
    ``--kv-recv`` endpoint, where peers on other hosts send it K/V over TCP."""
    _code, body = hosts.call(HEAD, _http, "GET", "/microserving/engines")
    (replicas,) = body["engines"].values()
    out = []
    for e in sorted(replicas, key=lambda e: e["rank"]):
        (tcp,) = [p for p in e["kv_peers"] if p.startswith("tcp://")]
        out.append(tcp.removeprefix("tcp://").rsplit(":", 1)[0])
    return out


def _engine_processes(hosts, i: int) -> list[int]:
    """The engine server processes on host ``i``."""
    found = []
    for pid in hosts.pids(i):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:  # exited meanwhile
            continue
        if b"pastry.engine.serve" in cmd:
            found.append(pid)
    return found


def _gone(hosts, deadline_s: float = 30) -> None:
    end = time.time() + deadline_s
    while any(_engine_processes(hosts, i) for i in WORKERS):
        assert time.time() < end, {i: _engine_processes(hosts, i) for i in WORKERS}
        time.sleep(0.5)


def test_ray_spreads_engines_over_workers_and_answers_as_one_engine(
    cluster,
    make_tiny,
    tmp_path,
    single_engine_texts,  # noqa: F811
):
    """``pastry serve --ray HEAD --engines 2 --router R``, nothing else about placement:
    each worker could hold both engines, SPREAD puts one on each; through every router
    (P/D and migration move K/V from host to host over TCP), greedy texts equal one
    engine's. Stopping the server stops its engines on the workers."""
    hosts, head, env = cluster.hosts, cluster.head, cluster.env
    for router in ROUTERS:
        server = _serve(hosts, head, env, make_tiny(), tmp_path, "--router", router)
        try:
            health = _health(hosts, "ok", tmp_path)
            assert len(health["engines"]) == 2, health
            assert sorted(_placed(hosts)) == [hosts.address(i) for i in WORKERS], router
            got = _complete(hosts, PROMPTS)
            assert all(c == 200 for c, _ in got), (router, [b for c, b in got if c != 200])
            assert _texts(got) == single_engine_texts, router
        finally:
            _stop(server)
        _gone(hosts)


def test_ray_places_engines_by_resource_label(cluster, make_tiny, tmp_path, single_engine_texts):  # noqa: F811
    """One ``--ray-engine-resources`` per engine naming a worker's label (and its
    cores): engine 0 on host 1 with 2 cores, engine 1 on host 0; a label no node has
    is refused at start, saying what the nodes have."""
    hosts, head, env = cluster.hosts, cluster.head, cluster.env
    labels = ["--ray-engine-resources", json.dumps({"CPU": 2, "pastry_host_1": 1}),
              "--ray-engine-resources", json.dumps({"pastry_host_0": 1})]  # fmt: skip
    server = _serve(hosts, head, env, make_tiny(), tmp_path, *labels, "--router", "pd")
    try:
        _health(hosts, "ok", tmp_path)
        assert _placed(hosts) == [hosts.address(1), hosts.address(0)]
        assert _texts(_complete(hosts, PROMPTS)) == single_engine_texts
    finally:
        _stop(server)
    _gone(hosts)
    log = tmp_path / "server.log"
    log.unlink()
    nowhere = ["--ray-engine-resources", json.dumps({"pastry_host_9": 1})]
    assert _serve(hosts, head, env, make_tiny(), tmp_path, *nowhere).wait(120) != 0
    text = log.read_text()
    assert "no node of the Ray cluster can hold engine 0's resources" in text, text[-3000:]
    assert "pastry_host_0=1" in text and "pastry_host_1=1" in text, text[-3000:]


def test_a_killed_ray_engine_is_started_again_and_used(
    cluster,
    make_tiny,
    tmp_path,
    single_engine_texts,  # noqa: F811
):
    """SIGKILL the engine process on one worker: the server notices (the connection
    closes), asks the engine's actor where it serves, the actor starts it again, and the
    server connects to it and uses it (``/health`` ``ok``, that engine's ``restarts`` 1);
    greedy texts through both engines then equal one engine's."""
    import signal

    hosts, head, env = cluster.hosts, cluster.head, cluster.env
    server = _serve(hosts, head, env, make_tiny(), tmp_path, "--router", "round-robin")
    try:
        _health(hosts, "ok", tmp_path)
        (pid,) = _engine_processes(hosts, WORKERS[0])
        os.kill(pid, signal.SIGKILL)
        end = time.time() + 240
        while True:  # back once an engine has restarted and every engine is up
            health = _health(hosts, "ok", tmp_path)
            if any(e.get("restarts", 0) >= 1 for e in health["engines"]):
                break
            assert time.time() < end, health
            time.sleep(1)
        assert sorted(_placed(hosts)) == [hosts.address(i) for i in WORKERS]
        assert _engine_processes(hosts, WORKERS[0]) not in ([], [pid])
        assert _texts(_complete(hosts, PROMPTS)) == single_engine_texts
    finally:
        _stop(server)
    _gone(hosts)


def test_a_lost_ray_worker_host_fails_only_its_requests_and_ray_places_its_engine_again(
    cluster,
    make_tiny,
    tmp_path,
    single_engine_texts,  # noqa: F811
):
    """Every process of worker host 0 killed (its raylet, the engine's actor, the engine)
    while four greedy streams run over round robin: the two on its engine fail naming
    that engine, host 1's finish, and the server answers on host 1 meanwhile. Ray finds
    the node dead, places the engine's bundle again on the host that has room (host 1),
    restarts the actor there, and the server reconnects to its new engine (``/health``
    ``ok`` with that engine's ``restarts`` 1) and P/D sends it K/V where it is now. The
    host started again rejoins the cluster. Then engines pinned to hosts by label: host 0
    lost again, the server is ``degraded`` and serves on host 1 until host 0 has rejoined,
    then uses its engine there again. Last in the module: the cluster is not as the other
    tests expect while a host is down."""
    c, hosts = cluster, cluster.hosts
    model = make_tiny()
    server = _serve(hosts, c.head, c.env, model, tmp_path, "--router", "round-robin")
    try:
        _health(hosts, "ok", tmp_path)
        lost = _placed(hosts).index(hosts.address(0))  # the rank of host 0's engine
        want = _texts(_complete(hosts, ["Once upon a time"]))[0]
        model_id = hosts.call(HEAD, _http, "GET", "/v1/models")[1]["data"][0]["id"]
        started = threading.Barrier(5)
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            streams = [pool.submit(hosts.call, HEAD, _stream, model_id, started) for _ in range(4)]
            started.wait(120)  # every stream has its first tokens: all four run
            hosts.kill(0)
            killed_at = time.monotonic()
            results = [s.result() for s in streams]
        failed = [r for r in results if r["error"]]
        done = [r for r in results if not r["error"]]
        assert len(failed) == 2 and len(done) == 2, results  # round robin: two on each engine
        for r in failed:
            assert f"ray-engine-{lost}" in r["error"] and r["finish"] is None, r
        for r in done:
            assert r["finish"] == "length" and r["text"].startswith(want), r
        assert _texts(_complete(hosts, ["Once upon a time"] * 2)) == [want] * 2  # host 1 serves
        health = _health(hosts, "ok", tmp_path, 300)  # Ray re-placed the engine, it serves
        replaced_s = time.monotonic() - killed_at
        assert health["engines"][lost]["restarts"] == 1, health
        assert _placed(hosts) == [hosts.address(1)] * 2, health
        assert len(_engine_processes(hosts, 1)) == 2
        assert _texts(_complete(hosts, ["Once upon a time"] * 2)) == [want] * 2
        # P/D now sends K/V to the re-placed engine at its new endpoint (on one host now)
        assert hosts.call(HEAD, _http, "POST", "/microserving/router", {"router": "pd"})[0] == 200
        assert _texts(_complete(hosts, PROMPTS)) == single_engine_texts
        print(f"engine {lost} re-placed by Ray and serving {replaced_s:.1f} s after its host died")
    finally:
        _stop(server)
    _gone(hosts)
    c.join(0)  # the host comes back and joins again
    # engines pinned by label: host 0's engine can only go back to host 0, so the running
    # server is degraded while it is down, and uses it again once it has rejoined
    labels = ["--ray-engine-resources", json.dumps({"pastry_host_0": 1}),
              "--ray-engine-resources", json.dumps({"pastry_host_1": 1})]  # fmt: skip
    server = _serve(hosts, c.head, c.env, model, tmp_path, *labels)
    try:
        _health(hosts, "ok", tmp_path)
        assert _placed(hosts) == [hosts.address(0), hosts.address(1)]
        hosts.kill(0)
        health = _health(hosts, "degraded", tmp_path, 30)
        assert [e["state"] for e in health["engines"]][1] == "up", health
        assert _texts(_complete(hosts, ["Once upon a time"] * 2)) == [want] * 2  # host 1 serves
        c.join(0)
        health = _health(hosts, "ok", tmp_path, 300)
        assert [e["restarts"] for e in health["engines"]] == [1, 0], health
        assert _placed(hosts) == [hosts.address(0), hosts.address(1)]
        assert _texts(_complete(hosts, PROMPTS)) == single_engine_texts
    finally:
        _stop(server)
    _gone(hosts)
