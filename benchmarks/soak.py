"""An hour at scale (issue 31, point 6): many concurrent clients on one ``pastry serve``,
with its engine process killed once midway, and a report.

    python benchmarks/soak.py                     # 60 minutes, 256 clients, the tiny model
    python benchmarks/soak.py --minutes 10        # shorter (say so when you quote it)
    python benchmarks/soak.py --quick             # 3 minutes, 1-minute windows (same clients)
    python benchmarks/soak.py --model ~/.cache/pastry/models/X.gguf --num-pages 2048

Each client loops over a mix: OpenAI ``/v1/completions`` (plain), ``/v1/chat/completions``
streamed (a tenth of them dropped by the client after the first chunk), SGLang's
``/generate``, and over the WebSocket protocol a sandboxed upload of its own launched
with arguments and the built-in ``text-completion``. At ``--kill-at`` of the run the engine
process is SIGKILLed; the server restarts it (``server/supervisor.py``).

Checked and reported: 5xx answers (the deliberate kill's 503s, naming the engine, are
counted apart; any other is a failure), requests per 5-minute window with their p50 and
p99 latency, the server's and the engine's RSS and the live instances every 10 s (the
curve), open file descriptors at the start and the end, the engine's restarts, and once the
load is gone the instances still running (listed by program) and the KV pages left in use
after the prefix cache is flushed (a leak if either is not 0). Prints the
tables, then one JSON line. Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from pastry.client import Client, ClientError, InferletError, InstanceTerminated

UPLOAD = """
from pastry.sdk import Context

async def main(args):
    ctx = Context()
    ctx.fill(args[0])
    return await ctx.generate_until(max_tokens=6)
"""
PROMPTS = ["The history of the world", "Once upon a time", "Dear diary,", "Q: why is the sky blue?"]


@dataclass
class Sample:
    t: float  # seconds since the start, at the answer
    kind: str
    status: int  # HTTP status (WebSocket: 200, or 500 for an internal error, 503 ended)
    latency: float
    deliberate: bool = False  # a 503 naming the engine the soak killed


@dataclass
class Run:
    started: float = field(default_factory=time.monotonic)
    samples: list[Sample] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    memory: list[tuple[float, int, int]] = field(default_factory=list)  # t, server, engine
    live: list[tuple[float, int]] = field(default_factory=list)  # t, instances running
    health: list[tuple[float, str]] = field(default_factory=list)
    killed_at: float | None = None
    back_at: float | None = None

    def now(self) -> float:
        return time.monotonic() - self.started

    def add(self, kind: str, status: int, latency: float, text: str = "") -> None:
        deliberate = status == 503 and "engine" in text and "restart" in text
        self.samples.append(Sample(self.now(), kind, status, latency, deliberate))
        if status >= 500 and not deliberate:
            self.failures.append(f"{kind}: {status} {text[:300]}")


# ----------------------------------------------------------------------------- the server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return -1


def engine_pid(server_pid: int) -> int | None:
    """The engine process among the server's children."""
    for child in Path(f"/proc/{server_pid}/task").glob("*/children"):
        for pid in child.read_text().split():
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            if b"pastry.engine.serve" in cmd:
                return int(pid)
    return None


def start_server(
    model: Path, port: int, num_pages: int, home: Path, clients: int
) -> subprocess.Popen:
    # Every client is the one local user: its instance quota has room for one instance per
    # client and the ones still ending after their client had its answer.
    cmd = [sys.executable, "-m", "pastry", "serve", "--model", str(model), "--port", str(port),
           "--num-pages", str(num_pages), "--log-level", "warning",
           "--max-instances-per-user", str(2 * clients),
           "--programs-dir", str(home / "programs")]  # fmt: skip
    log = open(home / "server.log", "w")  # noqa: SIM115 (the process's, until it ends)
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)


async def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(timeout=5) as c:
        while True:
            try:
                if (await c.get(url + "/health")).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the server did not start (see server.log)")
            await asyncio.sleep(0.5)


# ----------------------------------------------------------------------------- clients


async def openai_plain(c: httpx.AsyncClient, run: Run, model: str, rng: random.Random) -> None:
    body = {"model": model, "prompt": rng.choice(PROMPTS), "max_tokens": rng.randint(4, 24),
            "temperature": rng.choice([0, 0.8])}  # fmt: skip
    t0 = time.monotonic()
    r = await c.post("/v1/completions", json=body)
    run.add("openai", r.status_code, time.monotonic() - t0, r.text)


async def openai_stream(c: httpx.AsyncClient, run: Run, model: str, rng: random.Random) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": rng.choice(PROMPTS)}],
            "max_tokens": rng.randint(4, 24), "stream": True}  # fmt: skip
    drop = rng.random() < 0.1
    t0 = time.monotonic()
    async with c.stream("POST", "/v1/chat/completions", json=body) as r:
        text = ""
        async for chunk in r.aiter_text():
            text += chunk
            if drop:
                break  # the client goes away mid-stream
    status, said = r.status_code, text[-400:]
    if status == 200 and (error := _stream_error(text)) is not None:  # failed after the start
        said = error
        status = 503 if "the request was ended" in said else 500
    run.add("openai-stream-dropped" if drop else "openai-stream", status, time.monotonic() - t0, said)  # fmt: skip


def _stream_error(text: str) -> str | None:
    """The message of a stream's error event, if it has one (the model's text may say
    "error" too: only an event with an ``error`` member is one)."""
    for line in text.splitlines():
        if line.startswith("data: {"):
            with contextlib.suppress(ValueError):
                event = json.loads(line[6:])
                if "error" in event:
                    return json.dumps(event["error"])
    return None


async def sglang(c: httpx.AsyncClient, run: Run, model: str, rng: random.Random) -> None:
    body = {"text": rng.choice(PROMPTS), "sampling_params": {"max_new_tokens": rng.randint(4, 24),
            "temperature": rng.choice([0, 0.7])}}  # fmt: skip
    t0 = time.monotonic()
    r = await c.post("/generate", json=body)
    run.add("sglang", r.status_code, time.monotonic() - t0, r.text)


async def websocket(ws: Client, run: Run, rng: random.Random, program: str | None) -> None:
    t0 = time.monotonic()
    kind = "ws-upload" if program else "ws-builtin"
    try:
        if program:
            await (await ws.launch(program, [rng.choice(PROMPTS)])).result()
        else:
            args = json.dumps({"prompt": rng.choice(PROMPTS), "max_tokens": rng.randint(4, 16)})
            await (await ws.launch("text-completion", [args])).result()
        run.add(kind, 200, time.monotonic() - t0)
    except InstanceTerminated as e:  # ended by the server: what a 503 says over HTTP
        run.add(kind, 503, time.monotonic() - t0, str(e))
    except InferletError as e:  # failed: a 500
        run.add(kind, 500, time.monotonic() - t0, str(e))  # fmt: skip


async def client(
    i: int, url: str, model: str, run: Run, stop: asyncio.Event, sandbox: bool
) -> None:
    rng = random.Random(i)
    limits = httpx.Limits(max_connections=2)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as c:
        ws: Client | None = None
        program = None
        while not stop.is_set():
            pick = rng.random()
            what = ("openai" if pick < 0.35 else "openai-stream" if pick < 0.6
                    else "sglang" if pick < 0.8 else "websocket")  # fmt: skip
            try:
                if pick < 0.35:
                    await openai_plain(c, run, model, rng)
                elif pick < 0.6:
                    await openai_stream(c, run, model, rng)
                elif pick < 0.8:
                    await sglang(c, run, model, rng)
                else:
                    if ws is None:
                        ws = await Client.connect(url, timeout=60)
                        if sandbox and i % 4 == 0 and program is None:
                            program = await ws.upload(UPLOAD, name=f"soak-{i}")
                    await websocket(ws, run, rng, program if rng.random() < 0.5 else None)
            except (httpx.HTTPError, ClientError, OSError) as e:
                run.failures.append(
                    f"client {i} ({what}, at {run.now():.0f} s): {type(e).__name__}: {e}"
                )
                if ws is not None:  # a new connection next time (its program stays stored)
                    with contextlib.suppress(ClientError, OSError):
                        await ws.close()
                    ws = None
                await asyncio.sleep(1)
        if ws is not None:
            await ws.close()


async def monitor(url: str, proc: subprocess.Popen, run: Run, stop: asyncio.Event) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        while not stop.is_set():
            eng = engine_pid(proc.pid)
            run.memory.append((run.now(), rss(proc.pid), rss(eng) if eng else 0))
            try:
                h = (await c.get("/health")).json()
                run.health.append((run.now(), h["status"]))
                run.live.append((run.now(), _running((await c.get("/metrics")).text)))
                if run.killed_at is not None and run.back_at is None and h["status"] == "ok":
                    run.back_at = run.now()
            except (httpx.HTTPError, ValueError) as e:
                run.failures.append(f"/health: {e}")
            with contextlib.suppress(TimeoutError):  # every 10 s; every 1 s while down
                await asyncio.wait_for(
                    stop.wait(), 10 if run.killed_at is None or run.back_at else 1
                )


# ----------------------------------------------------------------------------- the run


async def soak(model: Path, minutes: float, clients: int, num_pages: int, kill_at: float,
               window_s: float, home: Path) -> dict:  # fmt: skip
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(model, port, num_pages, home, clients)
    try:
        await wait_healthy(url, proc)
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            name = (await c.get("/v1/models")).json()["data"][0]["id"]
        fd_start = fds(proc.pid)
        sandbox = await _sandbox_ok(url)
        run = Run()
        stop = asyncio.Event()
        tasks = [
            asyncio.create_task(client(i, url, name, run, stop, sandbox)) for i in range(clients)
        ]
        tasks.append(asyncio.create_task(monitor(url, proc, run, stop)))
        duration = minutes * 60
        await asyncio.sleep(duration * kill_at)
        victim = engine_pid(proc.pid)
        if victim is None:
            run.failures.append("no engine process to kill")
        else:
            os.kill(victim, signal.SIGKILL)
            run.killed_at = run.now()
        await asyncio.sleep(max(0.0, duration - run.now()))
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        idle = await _after(url, proc, run)
        idle["fds_start"], idle["fds_end"] = fd_start, fds(proc.pid)
        return report(run, duration, window_s, clients, idle, sandbox)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def _sandbox_ok(url: str) -> bool:
    try:
        async with await Client.connect(url, timeout=60) as ws:
            await ws.upload(UPLOAD, name="soak-probe")
            await ws.delete_program("soak-probe")  # the clients' uploads fill the quota
        return True
    except (ClientError, InferletError) as e:
        print(
            f"sandboxed uploads unavailable here ({e}); the mix runs without them", file=sys.stderr
        )
        return False


def _running(metrics: str) -> int:
    """Live instances, from ``/metrics``."""
    found = re.findall(r"^pastry_inferlets_running\{[^}]*\} (\S+)$", metrics, re.M)
    return int(sum(float(v) for v in found))


async def _after(url: str, proc: subprocess.Popen, run: Run) -> dict:
    """Once the load is gone: the engine's restarts, the instances still running (a leak if
    any: every client has had its answer; they are listed by program), and the pages still
    in use after the prefix cache is flushed (a leak if any)."""
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        await asyncio.sleep(3)  # instances of dropped connections end
        health = (await c.get("/health")).json()
        await c.post("/flush_cache")
        text = (await c.get("/metrics")).text
    left: dict[str, int] = {}
    if _running(text):
        async with await Client.connect(url, timeout=60) as ws:
            for info in await ws.list_instances():
                key = f"{info.name} ({info.state}{', detached' if info.detached else ''})"
                left[key] = left.get(key, 0) + 1
    used = sum(float(v) for v in re.findall(r"^pastry_kv_pages_used\{[^}]*\} (\S+)$", text, re.M))
    restarts = sum(e["restarts"] for e in health.get("engines", []))
    return {"health": health["status"], "restarts": restarts, "kv_pages_used_idle": int(used),
            "instances_idle": _running(text), "instances_left": left}  # fmt: skip


def _first(failures: list[str], n: int) -> list[str]:
    """Up to ``n`` failures, each kind once (client numbers and ids do not make a kind),
    with how often it happened."""
    counts: dict[str, list] = {}
    for f in failures:
        key = re.sub(r"\d+", "N", f)[:160]
        counts.setdefault(key, [f, 0])[1] += 1
    return [f"{c}x {f}" for f, c in list(counts.values())[:n]]


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def report(
    run: Run, duration: float, window_s: float, clients: int, idle: dict, sandbox: bool
) -> dict:
    windows = []
    for k in range(int(-(-duration // window_s))):
        lo, hi = k * window_s, (k + 1) * window_s
        ss = [s for s in run.samples if lo <= s.t < hi]
        ok = [s.latency for s in ss if s.status == 200]
        mem = [m for m in run.memory if lo <= m[0] < hi]
        live = [n for t, n in run.live if lo <= t < hi]
        windows.append({
            "window": f"{lo / 60:g}-{hi / 60:g} min", "requests": len(ss),
            "ok": len(ok), "deliberate_503": sum(s.deliberate for s in ss),
            "other_5xx": sum(1 for s in ss if s.status >= 500 and not s.deliberate),
            "4xx": sum(1 for s in ss if 400 <= s.status < 500),
            "p50_s": round(_pct(ok, 0.5), 3), "p99_s": round(_pct(ok, 0.99), 3),
            "server_rss_mib": round(max((m[1] for m in mem), default=0) / 2**20),
            "engine_rss_mib": round(max((m[2] for m in mem), default=0) / 2**20),
            "instances_max": max(live, default=0),
        })  # fmt: skip
    kinds: dict[str, list[int]] = {}
    for s in run.samples:
        kinds.setdefault(s.kind, []).append(s.status)
    rss_server = [m[1] for m in run.memory]
    out = {
        "benchmark": "soak", "minutes": round(duration / 60, 1), "clients": clients,
        "requests": len(run.samples), "other_5xx": sum(w["other_5xx"] for w in windows),
        "deliberate_503": sum(w["deliberate_503"] for w in windows),
        "killed_at_s": run.killed_at, "healthy_again_s": run.back_at, "sandboxed_uploads": sandbox,
        "client_errors": len([f for f in run.failures if f.startswith("client")]),
        "server_rss_mib_first_last_max": [round(x / 2**20) for x in (rss_server[0], rss_server[-1], max(rss_server))] if rss_server else [],
        **idle, "windows": windows,
        "by_kind": {k: {str(c): v.count(c) for c in sorted(set(v))} for k, v in sorted(kinds.items())},
        "failures": _first(run.failures, 20),
    }  # fmt: skip
    checks = {
        "no 5xx but the kill's": out["other_5xx"] == 0,
        "the engine came back": idle["restarts"] == 1 and idle["health"] == "ok",
        "no page left in use": idle["kv_pages_used_idle"] == 0,
        "no instance left running": idle["instances_idle"] == 0,
        "file descriptors back": idle["fds_end"] <= idle["fds_start"] + 8,
        "no client error": out["client_errors"] == 0,
    }
    out["checks"] = checks
    return out


def print_report(out: dict) -> None:
    print(f"soak: {out['minutes']} min, {out['clients']} clients, {out['requests']} requests; "
          f"engine killed at {out['killed_at_s']:.0f} s, healthy again at "
          f"{out['healthy_again_s'] or float('nan'):.0f} s")  # fmt: skip
    cols = ["window", "requests", "ok", "deliberate_503", "other_5xx", "4xx", "p50_s", "p99_s",
            "server_rss_mib", "engine_rss_mib", "instances_max"]  # fmt: skip
    print(" | ".join(cols))
    print(" | ".join("---" for _ in cols))
    for w in out["windows"]:
        print(" | ".join(str(w[c]) for c in cols))
    print(f"\nby kind (status: count): {json.dumps(out['by_kind'])}")
    print(f"file descriptors: {out['fds_start']} at start, {out['fds_end']} at the end; "
          f"KV pages in use when idle (cache flushed): {out['kv_pages_used_idle']}; "
          f"restarts: {out['restarts']}; server RSS MiB first/last/max: "
          f"{out['server_rss_mib_first_last_max']}")  # fmt: skip
    print(f"instances running when idle: {out['instances_idle']} {out['instances_left'] or ''}")
    for name, ok in out["checks"].items():
        print(f"  {'ok  ' if ok else 'FAIL'} {name}")
    for f in out["failures"]:
        print(f"  failure: {f}")
    print(json.dumps({k: v for k, v in out.items() if k not in ("windows", "failures")} | {"p99_by_window": [w["p99_s"] for w in out["windows"]]}))  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=60.0)
    p.add_argument("--clients", type=int, default=256)
    p.add_argument("--model", type=Path, default=None, help="default: a tiny random llama")
    p.add_argument("--num-pages", type=int, default=4096)
    p.add_argument("--kill-at", type=float, default=0.5, help="fraction of the run")
    p.add_argument("--window-minutes", type=float, default=5.0)
    p.add_argument("--quick", action="store_true",
                   help="3 minutes in 1-minute windows, the same clients")  # fmt: skip
    a = p.parse_args()
    if a.quick:  # the same shape (clients, mix, one kill), shorter
        a.minutes, a.window_minutes = 3.0, 1.0
    with tempfile.TemporaryDirectory(prefix="pastry-soak-") as tmp:
        home = Path(tmp)
        model = a.model
        if model is None:
            from pastry.engine.tiny import create_tiny

            model = create_tiny(home / "tiny", arch="llama", dtype="float32")
        out = asyncio.run(soak(model, a.minutes, a.clients, a.num_pages, a.kill_at,
                               a.window_minutes * 60, home))  # fmt: skip
        print_report(out)
    sys.exit(0 if all(out["checks"].values()) else 1)


if __name__ == "__main__":
    main()
