"""Start-up and memory of `pastry serve` as a user meets them.

    python benchmarks/startup.py [--quick] [--model FILE] [--warm N]

Runs `pastry serve` with default settings (the embedded SmolLM2-135M-Instruct GGUF unless
``--model``), first on a cold ``$PASTRY_HOME`` (a fresh directory holding only the model
file: GGUF conversion, native kernels and compiled decode step all built), then ``--warm``
times on the home that run filled (default 3; ``--quick`` 1). For each start: seconds until
``/health`` answers ok (requests are served from then on), until the compiled decode step has
taken over (its log line), the engine process's RSS once ready and after a 64-token
completion, and the KV pool the log line reports. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from pastry.paths import default_gguf


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_rss(server: int) -> int:
    """VmRSS in bytes of the server's engine child process (0 if none)."""
    out = subprocess.run(
        ["ps", "-o", "pid=", "--ppid", str(server)], capture_output=True, text=True
    )
    for pid in out.stdout.split():
        try:
            if b"pastry.engine.serve" in Path(f"/proc/{pid}/cmdline").read_bytes():
                status = Path(f"/proc/{pid}/status").read_text()
                return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) * 1024
        except (OSError, AttributeError):
            continue
    return 0


def one_start(model: Path, home: Path, timeout: float) -> dict:
    port = free_port()
    env = {**os.environ, "PASTRY_HOME": str(home), "PASTRY_AUTH_TOKEN": ""}
    cmd = [sys.executable, "-m", "pastry", "serve", "--model", str(model), "--port", str(port)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    compiled_at: list[float] = []

    def read() -> None:
        for line in proc.stderr:
            lines.append(line)
            if "compiled the decode step for batch 2 and more" in line:
                compiled_at.append(time.perf_counter() - t0)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    ready = None
    try:
        while time.perf_counter() - t0 < timeout and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if json.load(r)["status"] == "ok":
                        ready = time.perf_counter() - t0
                        break
            except OSError:
                time.sleep(0.05)
        if ready is None:
            raise SystemExit("serve did not start:\n" + "".join(lines[-20:]))
        rss_ready = engine_rss(proc.pid)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=30) as r:
            name = json.load(r)["data"][0]["id"]
        body = {"model": name, "prompt": "Once upon a time", "max_tokens": 64}
        body = json.dumps(body).encode()
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=300) as r:
            json.load(r)
        rss_used = engine_rss(proc.pid)
        while not compiled_at and time.perf_counter() - t0 < timeout and proc.poll() is None:
            time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        reader.join(5)
    pool = next((ln.split("KV pool", 1)[1].strip() for ln in lines if "KV pool" in ln), "?")
    return {
        "ready_s": round(ready, 1),
        "compiled_s": round(compiled_at[0], 1) if compiled_at else None,
        "rss_ready_mib": rss_ready >> 20,
        "rss_after_request_mib": rss_used >> 20,
        "pool": pool,
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="one warm start")
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--warm", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=900)
    args = ap.parse_args()
    model = args.model or default_gguf()
    warm = 1 if args.quick else args.warm
    home = Path(tempfile.mkdtemp(prefix="pastry-startup-"))
    try:
        local = home / "models" / model.name
        local.parent.mkdir(parents=True)
        shutil.copy(model, local)
        runs = [("cold", one_start(local, home, args.timeout))]
        runs += [(f"warm {i + 1}", one_start(local, home, args.timeout)) for i in range(warm)]
    finally:
        shutil.rmtree(home, ignore_errors=True)
    print(f"# pastry serve --model {model.name}, default settings; {os.cpu_count()} CPUs")
    print()
    print("| start | ready (s) | compiled step (s) | engine RSS ready (MiB) | after 64 tokens |")
    print("|---|---|---|---|---|")
    for name, r in runs:
        print(
            f"| {name} | {r['ready_s']} | {r['compiled_s']} | {r['rss_ready_mib']} "
            f"| {r['rss_after_request_mib']} |"
        )
    print()
    print(f"# KV pool: {runs[0][1]['pool']}")
    print(json.dumps({"runs": dict(runs), "quick": args.quick}))


if __name__ == "__main__":
    main()
