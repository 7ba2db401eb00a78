"""The automatic prefix cache (RadixAttention) on SGLang's workloads, cache on and off.

    python benchmarks/prefix_cache.py [--quick] [--model PATH ...] [--device cpu|cuda]

Models: the random-weight ``small`` llama checkpoint of ``engine_decode.py`` and the default
real model (``pastry.paths.default_gguf()``, SmolLM2-135M-Instruct; skipped with the reason
when it cannot be loaded), or the ``--model`` paths instead. One bf16 engine per model
behind one ``InProcessEngine``; every measurement gets a fresh controller over it, with the
prefix cache on or off (``Controller(prefix_cache=...)``) and an admission order (LPM, FCFS,
random). Each workload runs with a KV budget smaller than what it touches, so the cache
evicts (the controller sees only the first ``kv_pages`` pages of the engine's pool).

Programs are one inferlet: a ``Context`` filled with the prompt's token ids (seeded random,
so nothing depends on the tokenizer), then greedy generation of a fixed number of tokens
(no end-of-sequence stop). Outputs with the cache on must equal those with it off; the
script counts any difference. The workloads (the digest's §6.4 recipes; lengths in tokens):

- ``fewshot`` (MMLU-like): 4 subjects, each with its own 5-shot prefix (5 x 64); 8
  questions of 40 per subject, arriving interleaved across subjects; 1-token answers.
- ``multiturn``: 4 chat sessions replayed turn by turn (each turn a new program whose
  prompt is the whole history: a shared 64-token system prompt, then per turn a 32-token
  user message and the 16 tokens generated in reply); 4 turns each, sessions concurrent.
- ``tot``: tree-of-thought (the built-in ``tree_of_thought``): 4 problems of 32 tokens after
  a shared 128-token instruction; breadth 2, keep 1, depth 2, 6-token thoughts.
- ``shared-S-U``: SGLang's sweep (Figure 12, left): 4 programs sharing S tokens, each
  with U of its own, 256 generated; S/U = 256/256 (base), 1024/256, 256/1024.
- ``articles-A-Q`` (Figure 12, right): A articles of 1000 tokens, Q questions of 256 per
  article, 8 generated; A x Q = 5 x 2 (base), 5 x 4, 10 x 2.
- ``subtrees``: 16 subtrees x 8 branches (128 programs; 256 shared per subtree, 256 own),
  1 generated: the share of time spent in cache bookkeeping on a trace with hits.
- ``nohit``: the same 128 x 512 tokens with nothing shared: the cost of the cache when it
  never helps (wall-clock, on vs off, and the bookkeeping share).

Per workload and setting: throughput (programs/s, every stream at once), single-program
latency (programs one at a time; for multiturn one session alone, per turn), hit rate
(prompt tokens taken from the cache / prompt tokens asked), and tree-operation time as a
share of the run (time in the control layer's cache bookkeeping: matching, inserting,
evicting, page provenance). Settings run interleaved, repeated (3x; ``--quick``: once, same
shapes); the median is reported.

Prints tables, then as the last line one JSON object. The machine this was written on is a
shared, loaded 2-vCPU VM: absolute times vary a lot; ratios measured in the same run are
the numbers to read.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from engine_decode import small_checkpoint  # benchmarks/ is on the path when run
from machine import cpu_name
from pastry.control.controller import Controller
from pastry.control.events import Finished
from pastry.control.policies import admission_policy
from pastry.engine.engine import Engine
from pastry.paths import default_gguf
from pastry.runtime.trusted import Program, TrustedRuntime
from pastry.wire.config import EngineConfig
from pastry.wire.handle import InProcessEngine

PAGE_SIZE = 16

PROGRAM = """
import json
from pastry.sdk import Context, MaxTokens, Sampler

async def main(args):
    o = json.loads(args[0])
    ctx = Context()
    ctx.fill_tokens(o["prompt"])
    await ctx.generate(Sampler(), MaxTokens(o["max_tokens"]))
    return json.dumps(ctx.tokens[len(o["prompt"]):])
"""

TOT = Path(__file__).parents[1] / "src" / "pastry" / "inferlets" / "tree_of_thought.py"


# ------------------------------------------------------------------------------ workloads


@dataclass
class Stream:
    """Programs run one after another; ``step(previous result)`` gives the next program's
    args (``None``: done)."""

    step: Callable[[str | None], list[str] | None]


def fixed(args: list[list[str]]) -> Stream:
    it = iter(args)
    return Stream(lambda _prev: next(it, None))


@dataclass(frozen=True)
class Workload:
    name: str
    kv_pages: int  # the KV budget (pages of 16 tokens)
    streams: Callable[[], list[Stream]]  # fresh streams for one run
    program: str = PROGRAM
    # The streams timed one program at a time, one after another, on one controller: a
    # few that share what the workload shares (so later ones can hit), e.g. every 4th
    latency_streams: slice = field(default_factory=lambda: slice(0, 1))


def _tokens(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    return rng.integers(3, vocab, n).tolist()


def _args(prompt: list[int], max_tokens: int) -> list[str]:
    return [json.dumps({"prompt": prompt, "max_tokens": max_tokens})]


def fewshot(vocab: int) -> Workload:
    def streams() -> list[Stream]:
        rng = np.random.default_rng(1)
        subjects = [_tokens(rng, 5 * 64, vocab) for _ in range(4)]
        order = [(q, s) for q in range(8) for s in range(4)]  # interleaved subjects
        qs = {(q, s): _tokens(rng, 40, vocab) for q, s in order}
        return [fixed([_args(subjects[s] + qs[q, s], 1)]) for q, s in order]

    # two subjects' prefixes and a few questions fit; four do not
    # latency: four questions of one subject, one at a time (the first one misses)
    return Workload("fewshot", kv_pages=64, streams=streams, latency_streams=slice(0, 16, 4))


def multiturn(vocab: int) -> Workload:
    def streams() -> list[Stream]:
        rng = np.random.default_rng(2)
        system = _tokens(rng, 64, vocab)

        def session(c: int) -> Stream:
            users = [_tokens(rng, 32, vocab) for _ in range(4)]
            history = list(system)
            turn = [0]

            def step(prev: str | None) -> list[str] | None:
                if prev is not None:
                    history.extend(json.loads(prev))
                if turn[0] == len(users):
                    return None
                history.extend(users[turn[0]])
                turn[0] += 1
                return _args(list(history), 16)

            return Stream(step)

        return [session(c) for c in range(4)]

    return Workload("multiturn", kv_pages=40, streams=streams)


def tree_of_thought(vocab: int) -> Workload:
    def streams() -> list[Stream]:
        rng = np.random.default_rng(3)
        instruction = _tokens(rng, 128, vocab)
        opts = {"breadth": 2, "keep": 1, "depth": 2, "thought_tokens": 6, "score": "logprob"}
        return [
            fixed([[json.dumps({"prompt": instruction + _tokens(rng, 32, vocab), **opts})]])
            for _ in range(4)
        ]

    return Workload("tot", kv_pages=48, streams=streams, program=TOT.read_text())


def shared(vocab: int, s: int, u: int, out: int = 256) -> Workload:
    def streams() -> list[Stream]:
        rng = np.random.default_rng(4)
        prefix = _tokens(rng, s, vocab)
        return [fixed([_args(prefix + _tokens(rng, u, vocab), out)]) for _ in range(4)]

    # room for the shared part and two programs' own tokens, not four
    pages = -(-s // PAGE_SIZE) + 2 * -(-(u + out) // PAGE_SIZE) + 2
    return Workload(f"shared-{s}-{u}", kv_pages=pages, streams=streams, latency_streams=slice(2))


def articles(vocab: int, a: int, q: int) -> Workload:
    def streams() -> list[Stream]:
        rng = np.random.default_rng(5)
        docs = [_tokens(rng, 1000, vocab) for _ in range(a)]
        order = [(j, i) for j in range(q) for i in range(a)]  # questions interleaved
        return [fixed([_args(docs[i] + _tokens(rng, 256, vocab), 8)]) for j, i in order]

    # room for 60% of the articles with their questions: the rest is evicted and comes again
    pages = -(-6 * a // 10) * -(-(1256 + 8) // PAGE_SIZE)
    # latency: the questions of the first article (streams are question-major)
    return Workload(
        f"articles-{a}x{q}", kv_pages=pages, streams=streams, latency_streams=slice(0, a * q, a)
    )


def subtrees(vocab: int, hit: bool) -> Workload:
    def streams() -> list[Stream]:
        rng = np.random.default_rng(6)
        out = []
        for _ in range(16):
            root = _tokens(rng, 256, vocab)
            for _ in range(8):
                head = root if hit else _tokens(rng, 256, vocab)
                out.append(fixed([_args(head + _tokens(rng, 256, vocab), 1)]))
        return out

    # latency: the eight branches of the first subtree
    name = "subtrees" if hit else "nohit"
    return Workload(name, kv_pages=160, streams=streams, latency_streams=slice(8))


def workloads(vocab: int) -> list[Workload]:
    return [
        fewshot(vocab),
        multiturn(vocab),
        tree_of_thought(vocab),
        shared(vocab, 256, 256),
        shared(vocab, 1024, 256),
        shared(vocab, 256, 1024),
        articles(vocab, 5, 2),
        articles(vocab, 5, 4),
        articles(vocab, 10, 2),
        subtrees(vocab, hit=True),
        subtrees(vocab, hit=False),
    ]


# ------------------------------------------------------------------------------ running


class Budget:
    """An engine handle whose pool looks ``num_pages`` long to the control layer."""

    def __init__(self, handle: InProcessEngine, num_pages: int) -> None:
        self.handle = handle
        self.info = dataclasses.replace(handle.info, num_pages=num_pages)

    async def execute(self, batch):
        return await self.handle.execute(batch)


@dataclass
class Run:
    seconds: float
    programs: int
    outputs: list[str]
    hit_rate: float = 0.0
    tree_seconds: float = 0.0
    evicted: int = 0
    deferred: int = 0
    failed: int = 0

    @property
    def throughput(self) -> float:
        return self.programs / self.seconds

    @property
    def tree_share(self) -> float:
        return self.tree_seconds / self.seconds


async def run(
    handle: InProcessEngine, w: Workload, cache: bool, order: str, streams: list[Stream]
) -> Run:
    controller = Controller(
        [Budget(handle, w.kv_pages)],
        prefix_cache=cache,
        admission=lambda: admission_policy(order),
    )
    model = next(iter(controller.models.values()))
    rt = TrustedRuntime(controller)
    prog = Program.from_source(w.name, w.program)
    outputs: list[str] = []
    failed = [0]

    async def go(stream: Stream) -> None:
        prev = None
        while (args := stream.step(prev)) is not None:
            events = [ev async for ev in rt.launch(prog, args).events()]
            end = events[-1]
            if not isinstance(end, Finished):
                if not failed[0]:
                    why = getattr(end, "error", None) or getattr(end, "reason", "")
                    print(f"  ! {w.name}: a program ended: {why.strip().splitlines()[-1]}")
                failed[0] += 1
                return
            prev = end.result
            outputs.append(prev)

    t0 = time.perf_counter()
    await asyncio.gather(*(go(s) for s in streams))
    seconds = time.perf_counter() - t0
    model.resources.check_integrity()
    stats = model.prefiller.stats
    out = Run(
        seconds,
        len(outputs),
        outputs,
        stats.hit_rate,
        stats.seconds + model.resources.cache_seconds,
        model.resources.cache_events["evicted"],
        stats.deferred,
        failed[0],
    )
    await controller.close()
    return out


async def latency(handle: InProcessEngine, w: Workload, cache: bool) -> float:
    """Mean seconds per program, one program at a time: the ``latency_streams`` one after
    another on one controller (with the cache on, a later program may reuse what an
    earlier one left)."""
    controller = Controller([Budget(handle, w.kv_pages)], prefix_cache=cache)
    rt = TrustedRuntime(controller)
    prog = Program.from_source(w.name, w.program)
    n, t0 = 0, time.perf_counter()
    for stream in w.streams()[w.latency_streams]:
        prev = None
        while (args := stream.step(prev)) is not None:
            events = [ev async for ev in rt.launch(prog, args).events()]
            prev = events[-1].result
            n += 1
    seconds = time.perf_counter() - t0
    await controller.close()
    return seconds / max(1, n)


SETTINGS = [
    ("off", False, "lpm"),
    ("lpm", True, "lpm"),
    ("fcfs", True, "fcfs"),
    ("random", True, "random"),
]


@dataclass
class Result:
    runs: dict[str, list[Run]] = field(default_factory=dict)
    latency: dict[str, list[float]] = field(default_factory=dict)
    mismatches: int = 0


def measure(handle: InProcessEngine, w: Workload, reps: int, settings) -> Result:
    res = Result()
    for _ in range(reps):
        for name, cache, order in settings:  # interleaved: drift hits every setting alike
            r = asyncio.run(run(handle, w, cache, order, w.streams()))
            res.runs.setdefault(name, []).append(r)
        for name, cache in (("off", False), ("on", True)):
            res.latency.setdefault(name, []).append(asyncio.run(latency(handle, w, cache)))
    off = sorted(map(_canonical, res.runs["off"][0].outputs))
    for name, runs in res.runs.items():
        for r in runs:
            if r.failed or sorted(map(_canonical, r.outputs)) != off:
                res.mismatches += 1
                print(
                    f"  ! {w.name} {name}: {r.failed} failed, outputs differ from off", flush=True
                )
    return res


def _canonical(result: str) -> str:
    """A result with its floats (scores) rounded: reused K/V were computed in a matrix
    product of another shape, so log-probabilities may differ in the last digits."""

    def walk(x):
        if isinstance(x, float):
            return round(x, 4)
        if isinstance(x, list):
            return [walk(v) for v in x]
        if isinstance(x, dict):
            return {k: walk(v) for k, v in x.items()}
        return x

    return json.dumps(walk(json.loads(result)))


def med(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def report(w: Workload, res: Result) -> dict[str, float]:
    off = res.runs["off"]
    row = {}
    tp_off = med([r.throughput for r in off])
    lat_off, lat_on = med(res.latency["off"]), med(res.latency["on"])
    print(
        f"{w.name:<16} {'off':<7} {tp_off:8.3f} p/s {'':>8}  latency {lat_off:7.3f} s "
        f"{'':>14} evicted {'-':>5}"
    )
    for name in [s for s in res.runs if s != "off"]:
        runs = res.runs[name]
        tp = med([r.throughput for r in runs])
        hit = med([r.hit_rate for r in runs])
        share = med([r.tree_share for r in runs])
        lat = f"latency {lat_on:7.3f} s" if name == "lpm" else " " * 17
        print(
            f"{'':<16} {name:<7} {tp:8.3f} p/s {tp / tp_off:7.2f}x  {lat} hit {hit:5.1%} "
            f"tree {share:6.2%} evicted {med([r.evicted for r in runs]):5.0f}"
        )
        row[f"{name}_throughput"] = tp
        row[f"{name}_hit_rate"] = hit
        row[f"{name}_tree_share"] = share
    row.update(
        off_throughput=tp_off,
        latency_off=lat_off,
        latency_on=lat_on,
        mismatches=res.mismatches,
    )
    return row


def load(path: Path | str, device: str, pages: int) -> Engine:
    cfg = EngineConfig(
        device=device,
        dtype="bfloat16",
        page_size=PAGE_SIZE,
        num_pages=pages,
        num_embeds=8192,
        num_host_pages=1,
    )
    return Engine.load(path, cfg)


def bench_model(path, device: str, reps: int, only: set[str] | None) -> dict[str, object]:
    engine = load(path, device, pages=512)
    handle = InProcessEngine(engine)
    vocab = engine.info.vocab_size
    print(f"\n## {engine.info.model_name} ({engine.cfg.num_params / 1e6:.0f}M params, bf16)")
    print(
        f"{'workload':<16} {'setting':<7} {'throughput':>12} {'vs off':>8}  {'single program':<17} "
        f"{'hit rate':<9} {'tree ops':<11} {'evicted':>7}"
    )
    rows: dict[str, dict] = {}
    for w in workloads(vocab):
        if only and w.name not in only:
            continue
        rows[w.name] = report(w, measure(handle, w, reps, SETTINGS))
    handle.close()
    return {"model": engine.info.model_name, "rows": rows}


def summary(model: dict) -> dict[str, float]:
    rows = model["rows"]
    out = {}

    def ratio(w: str, a: str, b: str) -> float | None:
        r = rows.get(w)
        return None if r is None else round(r[f"{a}_throughput"] / r[f"{b}_throughput"], 3)

    out["fewshot_throughput_cache_over_nocache"] = ratio("fewshot", "lpm", "off")
    out["multiturn_throughput_cache_over_nocache"] = ratio("multiturn", "lpm", "off")
    out["tot_throughput_cache_over_nocache"] = ratio("tot", "lpm", "off")
    out["hit_rate_fewshot"] = rows.get("fewshot", {}).get("lpm_hit_rate")
    out["lpm_over_fcfs_fewshot"] = ratio("fewshot", "lpm", "fcfs")
    out["lpm_over_random_fewshot"] = ratio("fewshot", "lpm", "random")
    out["lpm_over_fcfs_multiturn"] = ratio("multiturn", "lpm", "fcfs")
    out["lpm_over_fcfs_articles_5x4"] = ratio("articles-5x4", "lpm", "fcfs")
    for w in rows:
        if w.startswith(("shared", "articles")):
            out[f"{w}_cache_over_nocache"] = ratio(w, "lpm", "off")
    if "nohit" in rows:
        nohit = rows["nohit"]
        out["tree_overhead_pct_nohit"] = round(100 * nohit["lpm_tree_share"], 3)
        out["nohit_wall_overhead_pct"] = round(
            100 * (nohit["off_throughput"] / nohit["lpm_throughput"] - 1), 2
        )
    if "subtrees" in rows:
        out["tree_overhead_pct_subtrees"] = round(100 * rows["subtrees"]["lpm_tree_share"], 3)
    for w in ("fewshot", "multiturn"):
        if w in rows:
            out[f"{w}_latency_cache_over_nocache"] = round(
                rows[w]["latency_on"] / rows[w]["latency_off"], 3
            )
    out["mismatches"] = sum(r["mismatches"] for r in rows.values())
    return {k: v for k, v in out.items() if v is not None}


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="one repetition (same shapes)")
    ap.add_argument(
        "--model",
        type=Path,
        action="append",
        help="checkpoint (repeatable; default: small and the default real model)",
    )
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--only", nargs="+", help="run only these workloads (names as printed)")
    args = ap.parse_args()
    t_start = time.perf_counter()
    torch.manual_seed(0)
    reps = 1 if args.quick else 3
    cpu = cpu_name()
    commit = _commit()
    print(
        f"# prefix cache: {cpu}, {os.cpu_count()} cpus, torch {torch.__version__}, "
        f"threads {torch.get_num_threads()}, device {args.device}, commit {commit}, "
        f"page size {PAGE_SIZE}, reps {reps}"
    )
    paths: list[tuple[str, Path]] = []
    if args.model:
        paths = [(p.name, p) for p in args.model]
    else:
        paths = [("small", small_checkpoint(args.device)), ("default", default_gguf())]
    out: dict[str, object] = {}
    models = {}
    for label, path in paths:
        try:
            models[label] = bench_model(path, args.device, reps, set(args.only or ()))
        except (OSError, ValueError, RuntimeError) as e:
            print(f"\n## {label} ({path}): skipped: {type(e).__name__}: {e}")
            out[f"{label}_skipped"] = str(e)[:200]
    for label, m in models.items():
        for k, v in summary(m).items():
            out[k if label == next(iter(models)) else f"{label}_{k}"] = v
        out[f"{label}_model"] = m["model"]
    out.update(
        quick=args.quick,
        device=args.device,
        cpu=cpu,
        commit=commit,
        seconds=round(time.perf_counter() - t_start),
    )
    print(json.dumps(out))


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
        ).stdout.strip()
    except OSError:
        return "unknown"


if __name__ == "__main__":
    main()
