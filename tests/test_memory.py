"""Memory a user can live with: the default KV pool, --kv-memory, pools committed as used,
and the RSS of a default `pastry serve` on the real weights."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import replace

import pytest
import torch
from tests.server_util import free_port

from pastry.cli_common import parse_size
from pastry.engine import pool
from pastry.engine.pool import PoolSizes, zeros
from pastry.wire.config import DEFAULT_KV_BUDGET, EngineConfig, ModelConfig

GiB = 1 << 30
CPU = torch.device("cpu")


def smollm2_like(max_position: int = 8192) -> ModelConfig:
    # SmolLM2-135M's shape: 30 layers, 3 KV heads of 64
    return ModelConfig(
        arch="llama",
        head_dim=64,
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        max_position=max_position,
    )


@pytest.fixture
def plenty(monkeypatch):
    """A host with 64 GiB, all free."""
    monkeypatch.setattr(pool, "_meminfo", lambda key: 64 * GiB)


def test_default_pool_is_sequences_times_context(plenty):
    m = smollm2_like()
    page = PoolSizes.bytes_per_page(m, 16, torch.bfloat16)
    assert page == 2 * 30 * 16 * 192 * 2
    sizes = PoolSizes.resolve(m, EngineConfig(), torch.bfloat16, CPU)
    assert sizes.num_pages == 16 * 8192 // 16  # 16 sequences of the full 8k context
    assert sizes.num_pages * page < DEFAULT_KV_BUDGET
    assert sizes.num_host_pages == sizes.num_pages // 4  # swap is the same memory on CPU
    assert "16 sequences x 8192 tokens" in sizes.describe(16)
    more = PoolSizes.resolve(m, EngineConfig(kv_sequences=4), torch.bfloat16, CPU)
    assert more.num_pages == 4 * 512


def test_default_pool_stays_within_the_budget(plenty, monkeypatch):
    m = smollm2_like(max_position=131072)  # a long-context model: 16 x 128k would be 45 GiB
    sizes = PoolSizes.resolve(m, EngineConfig(), torch.bfloat16, CPU)
    assert sizes.num_pages == DEFAULT_KV_BUDGET // sizes.page_bytes
    # a small machine: a quarter of its memory, and half of what is free
    monkeypatch.setattr(pool, "_meminfo", lambda key: 8 * GiB if key == "MemTotal" else 3 * GiB)
    small = PoolSizes.resolve(m, EngineConfig(), torch.bfloat16, CPU)
    assert small.num_pages == (3 * GiB // 2) // small.page_bytes
    assert "within 1.50 GiB" in small.describe(16)


def test_kv_memory_and_num_pages_are_what_the_user_asked(plenty):
    m = smollm2_like()
    sizes = PoolSizes.resolve(m, EngineConfig(kv_memory=GiB), torch.bfloat16, CPU)
    assert sizes.num_pages == GiB // sizes.page_bytes  # beyond 16 x 8k is allowed
    assert "--kv-memory 1.00 GiB" in sizes.describe(16)
    assert PoolSizes.resolve(m, EngineConfig(num_pages=77), torch.bfloat16, CPU).num_pages == 77
    with pytest.raises(ValueError, match="holds no KV page"):
        PoolSizes.resolve(m, EngineConfig(kv_memory=1000), torch.bfloat16, CPU)
    with pytest.raises(ValueError, match="kv_memory"):
        EngineConfig(kv_memory=-1)
    with pytest.raises(ValueError, match="kv_sequences"):
        replace(EngineConfig(), kv_sequences=0)


@pytest.mark.parametrize(
    ("text", "nbytes"),
    [("4GiB", 4 * GiB), ("4GB", 4 * GiB), ("512M", 512 << 20), ("512MiB", 512 << 20),
     ("1.5g", 3 * GiB // 2), ("2", 2 * GiB), ("64k", 64 << 10)],
)  # fmt: skip
def test_sizes_parse(text, nbytes):
    assert parse_size(text) == nbytes


@pytest.mark.parametrize("text", ["", "GiB", "four", "-1G", "0", "nan"])
def test_bad_sizes_are_refused(text):
    with pytest.raises(argparse.ArgumentTypeError):
        parse_size(text)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_pools_are_committed_as_written():
    before = _rss()
    t = zeros((4, 1 << 26), torch.bfloat16, CPU)  # 512 MiB
    assert t.shape == (4, 1 << 26) and t.dtype == torch.bfloat16
    assert _rss() - before < 64 << 20  # not resident yet
    t[1, :1000] = 3.0
    assert bool((t[1, :1000] == 3.0).all()) and not bool(t[2, :1000].any())
    assert _rss() - before < 64 << 20  # one page written, one page resident
    assert zeros((0, 5), torch.float32, CPU).shape == (0, 5)


def test_default_serve_fits_weights_pool_and_a_gigabyte(smollm2_gguf, tmp_path):
    """`pastry serve` with no memory flags on the real weights: the engine's RSS after a
    request stays below weights + KV pool + 1 GiB (was 14.9 GB: the pool sized from free
    memory and written in full at start)."""
    port = free_port()
    env = {**os.environ, "PASTRY_AUTH_TOKEN": ""}
    cmd = [sys.executable, "-m", "pastry", "serve", "--model", str(smollm2_gguf)]
    cmd += ["--port", str(port), "--no-compile"]
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    try:
        deadline = time.time() + 300  # a hang detector, not a speed bar
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if json.load(r)["status"] == "ok":
                        break
            except OSError:
                pass
            assert proc.poll() is None and time.time() < deadline, "serve did not start"
            time.sleep(0.2)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=30) as r:
            model = json.load(r)["data"][0]["id"]
        body = {"model": model, "prompt": "The capital of France is", "max_tokens": 16}
        body = json.dumps(body).encode()
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions",
            body,
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=120) as r:
            assert json.load(r)["choices"][0]["text"]
        engine = _engine_pid(proc.pid)
        with open(f"/proc/{engine}/status") as f:
            rss = int(re.search(r"VmRSS:\s+(\d+) kB", f.read()).group(1)) * 1024
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        lines = err.splitlines()
    pool_line = next(line for line in lines if "KV pool" in line)
    m = re.search(r"KV pool (\d+) pages x 16 tokens \(([\d.]+) GiB", pool_line)
    assert m, pool_line
    pool_bytes = float(m.group(2)) * GiB
    assert pool_bytes <= DEFAULT_KV_BUDGET
    weights = 135e6 * 2  # bf16 (the GGUF's Q4 blocks expanded)
    assert rss <= weights + pool_bytes + GiB, (rss, pool_line)


def _engine_pid(server: int) -> int:
    out = subprocess.run(
        ["ps", "-o", "pid=", "--ppid", str(server)], capture_output=True, text=True, check=True
    )
    pids = [int(p) for p in out.stdout.split()]
    for pid in pids:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"pastry.engine.serve" in f.read():
                return pid
    raise AssertionError(f"no engine process among the server's children {pids}")
