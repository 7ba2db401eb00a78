"""The seeds' cluster experiments at their scale, on the cluster simulator
(``pastry.sched.cluster``: the real router programs and schedulers over modelled A100s and
links; ``docs/scheduling.md``, "The cluster").

    python benchmarks/cluster_sim.py [--quick] [--synthetic] [--sections autellix,microserving] [--runs FILE]
                                     [--jobs N]

(a) autellix — the data-locality-aware load balancer (Autellix §6.4, Fig. 14 and 15):
    LLaMA-3.1-8B engines on A100-80GB (``CostModel.a100_llama8b``, 442,704 KV tokens each,
    multi-step scheduling every 8 steps), PLAS on ShareGPT and ATLAS on LATS (the paper's
    "identical scheduling policies"), every LLM call sent with its program's whole history
    and routed by round robin, least loaded (the paper's "least used": fewest calls) or
    locality (Alg. 2, threshold 2048). ShareGPT on 4 engines (Fig. 14's 8B setup) and 8,
    16, 32, 64 (Fig. 15's scaling), LATS on 4 and 8. Programs arrive by a Poisson process
    at a per-engine rate for ``ARRIVALS_S`` simulated seconds; those arriving in
    ``MEASURE`` are measured (steady state). Metric: the paper's program-level token latency
    (response time / tokens generated), average over the measured programs. "Throughput at
    the same latency": for each SLO (``SLO_X`` x the round robin's latency at the lowest
    rate), the highest per-engine rate whose average stays under it (linear between the
    rates run; a run that did not finish every measured program is over every SLO); the
    ratio of two routers' rates is the key.
(b) microserving — DP vs P/D disaggregation (LLM microserving §4.1, Fig. 10 and 11):
    LLaMA-3.1-8B engines on A100-40GB (147,786 KV tokens each), FCFS, K/V moved at 23 GB/s
    (its Table 3), single requests at per-engine ("per-GPU") rates: the synthetic
    long-input set (input normal(3000, 5), output normal(100, 5)) and a ShareGPT-like one
    (lognormal, means 200 in and 260 out). On 2 engines: DP (round robin), 1P1D (``pd``),
    1P1D-balance 0.2 (``pd-balance:0.2``); on 3: DP and 1P2D; on 8: DP, 4P4D (``pd:4``)
    and 4P4D-balance. Metrics: JCT (mean, P99), TTFT and TPOT (mean).

``--quick``: one seed per point instead of three (the same shapes and rates). The last
line is a JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from machine import cpu_name
from pastry.sched import workloads
from pastry.sched.cluster import (
    ClusterConfig,
    a100_kv_tokens,
    simulate_cluster,
)
from pastry.sched.programs import CallSpec, ProgramSpec, Stage

ARRIVALS_S = 240.0  # programs arrive for this long (simulated seconds)
MEASURE = (60.0, 180.0)  # ... and those arriving in this window are measured
# The run stops this long after the last arrival. Long: a measured ShareGPT conversation
# of 80 turns under round robin takes over 1,700 s at 0.07 s/token, and one cut off counts
# as over every SLO (with 1,800 s, 1-2% of round robin's were, which made locality look
# up to 7x better); a run stops once its measured programs are done anyway.
DRAIN_S = 3 * 3600.0
SLO_X = (2.0, 3.0, 4.0)  # SLOs: multiples of round robin's unloaded latency

AUTELLIX = {  # (workload, engines): per-engine rates (programs/s)
    ("sharegpt", 4): (0.25, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5),
    ("sharegpt", 8): (0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5),
    ("sharegpt", 16): (0.5, 1.5, 2.5, 3.5),
    # 32 and 64 engines cost the most (a 64-engine run at 3/s: ~12 minutes of one core), so
    # they run fewer rates: the scaling of Fig. 15, not a full curve
    ("sharegpt", 32): (0.5, 2.0, 3.0),
    ("sharegpt", 64): (0.5, 2.0),
    ("lats", 4): (0.01, 0.2, 0.4, 0.6, 0.8, 1.0, 1.5),
    ("lats", 8): (0.01, 0.2, 0.5, 1.0, 1.5),
}
LB_ROUTERS = ("round-robin", "least-loaded", "locality:2048")

MS_RATES = {"longinput": (0.5, 1.0, 1.5, 2.0, 2.5, 3.0), "sharegpt": (0.5, 1.0, 2.0, 3.0, 4.0)}
MS_SETUPS = {  # engines: routers
    2: ("round-robin", "pd", "pd-balance:0.2"),
    3: ("round-robin", "pd"),
    8: ("round-robin", "pd:4", "pd-balance:0.2,4"),
}
MS_ARRIVALS_S, MS_MEASURE = 200.0, (40.0, 160.0)

_SOURCES = workloads.Sources()


@dataclass
class Run:
    workload: str
    engines: int
    router: str
    rate: float  # per engine
    seed: int
    summary: dict
    jct: dict
    wall_s: float


def _init(sources: workloads.Sources) -> None:
    global _SOURCES
    _SOURCES = sources


def _requests(kind: str, n: int, rate: float, seed: int) -> list[ProgramSpec]:
    """Single-request programs of microserving's workloads arriving at ``rate``/s."""
    rng = np.random.default_rng(seed)
    t = np.cumsum(rng.exponential(1 / rate, n))
    if kind == "longinput":
        ins, outs = rng.normal(3000, 5, n), rng.normal(100, 5, n)
    else:  # ShareGPT-like: lognormal with the paper's means
        ins = rng.lognormal(math.log(200) - 0.5, 1.0, n)
        outs = np.minimum(2048, rng.lognormal(math.log(260) - 0.5, 1.0, n))
    return [ProgramSpec(kind, float(a), (Stage((CallSpec(max(1, round(i)), max(1, round(o))),)),))
            for a, i, o in zip(t, ins, outs, strict=True)]  # fmt: skip


def run_one(task: tuple) -> Run:
    section, workload, engines, router, rate, seed = task
    t0 = time.perf_counter()
    if section == "autellix":
        total = rate * engines
        specs = workloads.make(workload, round(total * ARRIVALS_S), total, seed=seed,
                               sources=_SOURCES)  # fmt: skip
        cfg = ClusterConfig(engines=engines, router=router, steps_per_schedule=8,
                            schedule="plas" if workload == "sharegpt" else "atlas",
                            measure=MEASURE, max_time_s=ARRIVALS_S + DRAIN_S)  # fmt: skip
    else:
        total = rate * engines
        specs = _requests(workload, round(total * MS_ARRIVALS_S), total, seed)
        cfg = ClusterConfig(engines=engines, router=router, schedule="fcfs",
                            kv_tokens=a100_kv_tokens(40 * 2**30), measure=MS_MEASURE,
                            max_time_s=MS_ARRIVALS_S + DRAIN_S)  # fmt: skip
    r = simulate_cluster(specs, cfg)
    s = r.summary()
    done = [p for p in r.measured if p.finish is not None]
    jct = {}
    if done and section == "microserving":
        j = np.array([p.finish - p.arrival for p in done])
        ttft = np.array([p.first_token - p.arrival for p in done])
        tpot = np.array([(p.finish - p.first_token) / max(1, p.tokens - 1) for p in done])
        jct = {"jct": float(j.mean()), "p99_jct": float(np.percentile(j, 99)),
               "ttft": float(ttft.mean()), "tpot": float(tpot.mean())}  # fmt: skip
    return Run(workload, engines, router, rate, seed, s, jct, time.perf_counter() - t0)


def _load_runs(path: str) -> dict[tuple, Run]:
    """The runs ``--runs`` wrote before, by task."""
    out: dict[tuple, Run] = {}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                rec = json.loads(line)
                out[tuple(rec["task"])] = Run(**rec["run"])
    return out


def _mean(runs: list[Run], key: str, where: str = "summary") -> float:
    vals = [getattr(r, where).get(key, math.nan) for r in runs]
    return float(np.mean(vals)) if vals else math.nan


def _complete(runs: list[Run]) -> bool:
    return all(r.summary["completed"] == r.summary["programs"] for r in runs)


def rate_at(curve: list[tuple[float, float, bool]], slo: float) -> float:
    """The highest rate whose latency is under ``slo``, linear between the rates run (0 if
    even the lowest is over; the highest run if none is)."""
    best = 0.0
    prev = None
    for rate, lat, ok in curve:
        lat = lat if ok else math.inf
        if lat <= slo:
            best = rate
        elif prev is not None and prev[1] <= slo:
            r0, l0 = prev
            best = r0 + (rate - r0) * ((slo - l0) / (lat - l0) if math.isfinite(lat) else 0.0)
            break
        else:
            break
        prev = (rate, lat)
    return best


def _over(got: dict[str, float], capped: dict[str, bool], base: str) -> float:
    """Locality's rate over ``base``'s (none where ``base``'s is only a lower bound)."""
    loc = got["locality:2048"]
    return loc / got[base] if got[base] and not capped[base] else math.nan


def section_autellix(results: dict[tuple, list[Run]]) -> dict:
    out: dict = {"configs": {}}
    print("\n(a) Autellix: load balancers, average program token latency (s/token), "
          "per-engine arrival rate (programs/s)")  # fmt: skip
    best_rr = best_lu = 0.0
    for (w, n), rates in AUTELLIX.items():
        print(f"\n{w}, {n} engines")
        print(f"{'rate/engine':>11} " + " ".join(f"{r:>26}" for r in LB_ROUTERS))
        curves: dict[str, list] = {r: [] for r in LB_ROUTERS}
        for rate in rates:
            cells = []
            for router in LB_ROUTERS:
                runs = results.get(("autellix", w, n, router, rate), [])
                if not runs:
                    cells.append(f"{'not run':>26}")
                    continue
                lat, ok = _mean(runs, "avg_latency"), _complete(runs)
                hit = _mean(runs, "hit_rate")
                curves[router].append((rate, lat, ok))
                cells.append(
                    f"{lat:>10.4f}{'' if ok else '*':1} hit {hit:4.2f} p99 {_mean(runs, 'p99_latency'):6.3f}"
                )
            print(f"{rate:>11} " + " ".join(cells))
        base = curves["round-robin"][0][1] if curves["round-robin"] else math.nan
        cfg: dict = {"unloaded_latency": base, "slos": {}}
        for x in SLO_X:
            slo = x * base
            got = {r: rate_at(curves[r], slo) for r in LB_ROUTERS}
            # under the SLO even at the highest rate run: that rate is a lower bound
            capped = {r: bool(c) and c[-1][2] and c[-1][1] <= slo for r, c in curves.items()}
            over_rr, over_lu = (_over(got, capped, b) for b in ("round-robin", "least-loaded"))
            cfg["slos"][f"{x:g}x"] = {"rates": got, "lower_bounds": capped,
                                      "locality_over_round_robin": over_rr,
                                      "locality_over_least_used": over_lu}  # fmt: skip
            ge = ">=" if capped["locality:2048"] else ""
            print(f"  SLO {x:g}x unloaded ({slo:.4f} s/tok): max rate/engine "
                  + ", ".join(f"{r} {'>=' if capped[r] else ''}{v:.3f}" for r, v in got.items())
                  + f"; locality / round robin {ge}{over_rr:.2f}x, / least used {ge}{over_lu:.2f}x")  # fmt: skip
            if math.isfinite(over_rr):
                best_rr = max(best_rr, over_rr)
            if math.isfinite(over_lu):
                best_lu = max(best_lu, over_lu)
        out["configs"][f"{w}x{n}"] = cfg
    print("  (* a measured program did not finish: over every SLO; >=: under the SLO at the "
          "highest rate run, a lower bound; a ratio over a baseline at its bound is not taken)")  # fmt: skip
    out["locality_lb_over_round_robin_sim"] = round(best_rr, 3)
    out["locality_lb_over_least_used_sim"] = round(best_lu, 3)
    return out


def section_microserving(results: dict[tuple, list[Run]]) -> dict:
    out: dict = {}
    print("\n(b) microserving: DP vs P/D, per-engine request rate (requests/s); JCT mean / "
          "P99, TTFT and TPOT means (s)")  # fmt: skip
    for w, rates in MS_RATES.items():
        for n, routers in MS_SETUPS.items():
            print(f"\n{w}, {n} engines")
            print(f"{'rate/engine':>11} " + " ".join(f"{r:>34}" for r in routers))
            for rate in rates:
                cells = []
                row = {}
                for router in routers:
                    runs = results.get(("microserving", w, n, router, rate), [])
                    if not runs:
                        cells.append(f"{'not run':>34}")
                        continue
                    m = {k: _mean(runs, k, "jct") for k in ("jct", "p99_jct", "ttft", "tpot")}
                    m["complete"] = _complete(runs)
                    row[router] = m
                    star = "" if m["complete"] else "*"
                    cells.append(f"{m['jct']:7.2f}/{m['p99_jct']:7.2f}{star:1} "
                                 f"{m['ttft']:6.3f} {m['tpot'] * 1e3:6.1f}ms")  # fmt: skip
                out[f"{w}x{n}@{rate}"] = row
                print(f"{rate:>11} " + " ".join(cells))
    print("  (* a measured request did not finish in the run)")

    def ratio(w: str, n: int, rate: float, a: str, bs: tuple[str, ...]) -> float:
        row = out.get(f"{w}x{n}@{rate}", {})
        if a not in row or not all(b in row for b in bs):
            return math.nan
        if not row[a]["complete"] or not all(row[b]["complete"] for b in bs):
            return math.nan
        return row[a]["p99_jct"] / min(row[b]["p99_jct"] for b in bs)

    pd2 = ("pd", "pd-balance:0.2")
    long_dp = [ratio("longinput", 2, r, "round-robin", pd2) for r in MS_RATES["longinput"]]
    share_dp = [ratio("sharegpt", 2, r, "round-robin", pd2) for r in MS_RATES["sharegpt"]]
    bal = ratio("longinput", 2, 2.5, "pd", ("pd-balance:0.2",))
    long8 = [ratio("longinput", 8, r, "round-robin", ("pd:4", "pd-balance:0.2,4"))
             for r in MS_RATES["longinput"]]  # fmt: skip
    fin = [x for x in long_dp if math.isfinite(x)]
    out["p99_jct_dp_over_best_pd_longinput_sim"] = round(max(fin), 3) if fin else None
    fin = [x for x in share_dp if math.isfinite(x)]
    out["p99_jct_dp_over_best_pd_sharegpt_sim"] = round(max(fin), 3) if fin else None
    out["p99_jct_1p1d_over_balanced_pd_sim"] = round(bal, 3) if math.isfinite(bal) else None
    fin = [x for x in long8 if math.isfinite(x)]
    out["p99_jct_dp8_over_best_4p4d_longinput_sim"] = round(max(fin), 3) if fin else None
    print(
        "\nlong input, 2 engines: P99 JCT DP / best P/D per rate: "
        + ", ".join(f"{r}: {x:.2f}" for r, x in zip(MS_RATES["longinput"], long_dp, strict=True))
    )
    print(
        "sharegpt-like, 2 engines: P99 JCT DP / best P/D per rate: "
        + ", ".join(f"{r}: {x:.2f}" for r, x in zip(MS_RATES["sharegpt"], share_dp, strict=True))
    )
    print(f"long input at 2.5/engine: P99 JCT 1P1D / 1P1D-balance {bal:.2f}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one seed per point (same shapes)")
    ap.add_argument("--synthetic", action="store_true", help="synthetic ShareGPT lengths")
    ap.add_argument("--sections", default="autellix,microserving")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--runs", metavar="FILE", help="append every run here (JSON lines); runs "
                    "already there are not run again (a stopped study resumes)")  # fmt: skip
    args = ap.parse_args()
    sections = set(args.sections.split(","))
    unknown = sections - {"autellix", "microserving"}
    if unknown:
        ap.error(f"unknown section(s): {', '.join(sorted(unknown))}")
    seeds = (0,) if args.quick else (0, 1, 2)
    sources = workloads.Sources()
    if "autellix" in sections and not args.synthetic:
        from pastry.sched.datasets import sharegpt_conversations

        sources = workloads.Sources(sharegpt_conversations())
    tasks = []
    if "autellix" in sections:
        tasks += [("autellix", w, n, router, rate, s) for (w, n), rates in AUTELLIX.items()
                  for rate in rates for router in LB_ROUTERS for s in seeds]  # fmt: skip
    if "microserving" in sections:
        tasks += [("microserving", w, n, router, rate, s) for w, rates in MS_RATES.items()
                  for n, routers in MS_SETUPS.items() for rate in rates for router in routers
                  for s in seeds]  # fmt: skip
    print(
        f"# cluster_sim: simulated A100s (the results do not depend on this machine; its wall time does): {cpu_name()}, {os.cpu_count()} cpus"
    )
    print(f"{len(tasks)} simulated runs on {args.jobs} processes", flush=True)
    t0 = time.perf_counter()
    results: dict[tuple, list[Run]] = {}
    done = _load_runs(args.runs) if args.runs else {}
    for task in [t for t in tasks if t in done]:
        results.setdefault(task[:5], []).append(done[task])
    todo = [t for t in tasks if t not in done]
    log = open(args.runs, "a") if args.runs else None  # noqa: SIM115 (closed below)
    with ProcessPoolExecutor(args.jobs, initializer=_init, initargs=(sources,)) as pool:
        # the biggest first, so that the pool's tail is short
        order = sorted(todo, key=lambda t: -(t[2] * t[4] * (10 if t[1] == "lats" else 7)))
        for task, run in zip(order, pool.map(run_one, order), strict=True):
            results.setdefault(task[:5], []).append(run)
            if log is not None:
                log.write(json.dumps({"task": task, "run": asdict(run)}) + "\n")
                log.flush()
            print(
                f"  {task} {run.wall_s:.1f}s: avg {run.summary['avg_latency']:.4f} "
                f"done {run.summary['completed']}/{run.summary['programs']}",
                flush=True,
            )
    if log is not None:
        log.close()
    out: dict = {"bench": "cluster_sim", "quick": args.quick, "seeds": len(seeds),
                 "wall_s": None}  # fmt: skip
    if "autellix" in sections:
        out["autellix"] = section_autellix(results)
    if "microserving" in sections:
        out["microserving"] = section_microserving(results)
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    keys = {}
    for sec in ("autellix", "microserving"):
        for k, v in out.get(sec, {}).items():
            if k.endswith("_sim"):
                keys[k] = v
    print(json.dumps({**keys, **out}))


if __name__ == "__main__":
    main()
