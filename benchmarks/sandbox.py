"""The cost of the WebAssembly sandbox: sandboxed vs trusted Python inferlets.

    python benchmarks/sandbox.py [--quick] [--model DIR] [--device cpu|cuda] [--serial-ab]
                                 [--sections launch,calls,tpot,memory] [--launch-counts 256]

Without --model, uses the random-weight ``small`` llama checkpoint of ``engine_decode.py``
(bf16, one ``InProcessEngine`` handle shared by every measurement; each run gets a fresh
controller and trusted runtime). Needs the Python runtime component (pyrt), built once by
``python -m pastry.runtime.build_pyrt`` (this script builds it if missing).

(a) Launch latency as the Pie paper's Figure 9 measures it: N inferlets launched at once
    (N = 1, 64, 256, 896), each sending an acknowledgement as its first action (then
    returning); the *average* over the N of request -> acknowledgement, ms (and the
    request -> end average, the older ``launch_*_ms`` keys). *Warm*: the program is
    compiled already (Pie: its binary is cached) and was launched before at this scale,
    and the pool is sized for N (Pie: the pooling allocator is sized for 1,000): N
    generic pre-started guests, and guests loaded with the program. *Cold*: the upload is
    compiled inside the timed interval (in a guest, off the event loop), then the N
    launches take generic guests. Also warm with the default pool (64) and with no pool
    (every launch instantiates), and trusted inferlets (cold: ``Program.from_source`` in
    the interval). Each round starts with the pool full and ended guests freed; median
    of the rounds. All on one event loop, so the acknowledgements of a burst mostly
    arrive after all its launches ran: the average is about the burst's total work.
(b) Per-call overhead, timed inside the inferlet with ``time.perf_counter``: a host call
    (``get_kv_page_size``, answered by the Session) right after a scheduler round trip
    (``host_call_us``: the host's code is cache-cold, as in an inferlet's step) and back
    to back (``host_call_us_back_to_back``), and a queued call (``await
    synchronize(q)``, a scheduler round trip without the engine); mean µs of the timed
    iterations after a warm-up, one instance. Measured once the pool is full and idle:
    a pool thread making guests meanwhile competes for the CPU and the GIL (it doubled
    the host call and the queued call here).
(c) Time per output token of text completion (``Context`` + greedy ``Sampler``, the
    inferlet of ``overhead.py``) at 1, 64 and 256 concurrent inferlets, prefill excluded:
    from the first instance's "first token" message to the last result, / (N-1).
    Sandboxed and trusted alternate; fastest of the repeats; outputs must match.
(d) Memory: N instances parked in ``receive()``: process RSS delta / N (the older key;
    RSS counts the runtime image's shared pages once per instance) and USS delta / N
    (private memory: what an instance really costs), the linear memory each reports
    (``Program.memory``), and the USS of one pre-started (pooled) guest.

Guests run on the sandbox's poll threads (``WasmSandbox(poll_threads=...)``: the event
loop's thread and helpers, one per core up to 4; ``poll_threads`` in the JSON).
``--serial-ab`` also measures the serial path (every guest on the loop's thread,
``poll_threads`` 1) interleaved with it: warm launches (``launch_avg_warm_ms_N_serial``)
and TPOT (``tpot_sandboxed_serial_over_trusted_N``). ``--sections`` and
``--launch-counts`` narrow a run for development (the full set is the default).

The whole run uses the server's collector settings (``tune_for_serving`` after the engine
is loaded), as ``pastry serve`` and ``overhead.py`` do.

Prints tables, then as the last line one JSON object with the headline numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

import torch

from pastry.control import gc_tuning
from pastry.control.controller import Controller
from pastry.control.events import Finished, Message
from pastry.engine.engine import Engine
from pastry.runtime.trusted import Program, TrustedRuntime
from pastry.wire.config import EngineConfig
from pastry.wire.handle import InProcessEngine

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_decode import prompts, small_checkpoint
from machine import cpu_name
from overhead import TEXT_COMPLETION, check, csv

PROMPT = 32
PAGE_SIZE = 16
LAUNCH_COUNTS = (1, 64, 256, 896)
TPOT_COUNTS = (1, 64, 256)

# Pie's launch experiment: text completion modified to acknowledge before generating.
ACK = """
import pastry.sdk as px

async def main(args):
    px.send("ack")
    return "ok"
"""

CALLS = """
import json
import time
import pastry.sdk as px

async def main(args):
    n, warm = int(args[0]), int(args[1])
    clock = time.perf_counter
    q = px.create_queue(px.available_models()[0])
    plain = queued = 0.0
    for i in range(n + warm):
        t0 = clock()
        px.get_kv_page_size(q)
        t1 = clock()
        await px.synchronize(q)
        t2 = clock()
        if i >= warm:
            plain += t1 - t0
            queued += t2 - t1
    for _ in range(warm):
        px.get_kv_page_size(q)
    t0 = clock()
    for _ in range(n):
        px.get_kv_page_size(q)
    tight = clock() - t0
    return json.dumps([plain / n * 1e6, queued / n * 1e6, tight / n * 1e6])
"""

PARKED = """
import pastry.sdk as px

async def main(args):
    px.send("ready")
    return await px.receive()
"""


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def uss_bytes() -> int:
    """Private (unshared) resident memory of this process."""
    total = 0
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith(("Private_Clean:", "Private_Dirty:")):
                total += int(line.split()[1]) * 1024
    return total


class Server:
    def __init__(self, handle: InProcessEngine) -> None:
        self.handle = handle

    async def __aenter__(self) -> Server:
        self.controller = Controller([self.handle])
        self.runtime = TrustedRuntime(self.controller)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.controller.close()
        await self.handle.execute([])


async def collect(inst):
    return [(time.perf_counter(), ev) async for ev in inst.events()]


def make(kind: str, name: str, source: str, box=None) -> Program:
    if kind == "trusted":
        return Program.from_source(name, source)
    from pastry.runtime.wasm import sandboxed_program

    return sandboxed_program(name, source, box=box)


# --------------------------------------------------------------------------- (a) launch


async def launch_round(server: Server, make_prog, n: int) -> tuple[float, float]:
    """``n`` simultaneous launches of the program ``await make_prog()`` returns (made
    inside the timed interval): mean ms from the request to the acknowledgement, and to
    the end."""
    t0 = time.perf_counter()
    prog = await make_prog()
    insts = [server.runtime.launch(prog, []) for _ in range(n)]
    events = await asyncio.gather(*(collect(i) for i in insts))
    acks, ends = [], []
    for evs in events:
        assert check([ev for _, ev in evs]) == "ok"
        assert evs[0][1] == Message("ack"), evs[0]
        acks.append((evs[0][0] - t0) * 1e3)
        ends.append((evs[-1][0] - t0) * 1e3)
    return sum(acks) / n, sum(ends) / n


def section_launch(handle: InProcessEngine, counts, reps: int, serial_ab: bool) -> dict:
    from pastry.runtime.wasm import POOL_SIZE, WasmSandbox, sandboxed_program_async

    print(
        "(a) launch latency, N simultaneous: average ms from request to acknowledgement "
        f"(median of {reps} rounds)"
    )
    print(
        "| N | sandboxed warm (pool N) | sandboxed cold (pool N) "
        f"| sandboxed warm (pool {POOL_SIZE}) | sandboxed warm (no pool) "
        "| trusted warm | trusted cold |"
        + (" sandboxed warm (pool N), serial |" if serial_ab else "")
    )
    print("|---|---|---|---|---|---|---|" + ("---|" if serial_ab else ""))
    box = WasmSandbox(pool_size=0)
    threads = box.pollers.threads
    serial = iter(range(1 << 30))
    out: dict[str, object] = {}

    def settle(pool: int | None) -> None:
        if pool is not None:
            box.pool.resize(pool)
        box.pool.wait_full(600)
        box.pool.idle(60)
        gc.collect()

    async def sandboxed_cold():
        src = f"{ACK}\n# cold {next(serial)}\n"  # a new program: nothing cached
        return await sandboxed_program_async("ack", src, box=box)

    async def trusted_cold():
        return Program.from_source(f"ack{next(serial)}", f"{ACK}\n# cold {next(serial)}\n")

    for n in counts:
        warm_prog = make("sandboxed", "ack", ACK, box)
        trusted_prog = make("trusted", "ack", ACK)

        async def ready(p):
            return p

        variants = {  # key: (pool size, or None to leave it; the program, made in the interval)
            "s_warm": (n, lambda p=warm_prog: ready(p)),
            "s_cold": (n, sandboxed_cold),
            "t_warm": (None, lambda p=trusted_prog: ready(p)),
            "t_cold": (None, trusted_cold),
            "s_warm_default": (POOL_SIZE, lambda p=warm_prog: ready(p)),
            "s_warm_nopool": (0, lambda p=warm_prog: ready(p)),
        }
        if serial_ab:
            variants["s_warm_serial"] = (n, lambda p=warm_prog: ready(p))
        if n <= POOL_SIZE:  # the same as pool N
            variants.pop("s_warm_default")
        if n > 256:  # 896 launches without a pool: minutes, and nothing new to learn
            variants.pop("s_warm_nopool")
        rounds: dict[str, list[tuple[float, float]]] = {k: [] for k in variants}

        def burst(make_prog, one_thread: bool, n=n):
            async def go():
                async with Server(handle) as server:
                    return await launch_round(server, make_prog, n)

            box.pollers.threads = 1 if one_thread else threads
            try:
                return asyncio.run(go())
            finally:
                box.pollers.threads = threads

        for _ in range(reps):
            for key, (pool, make_prog) in variants.items():
                one_thread = key.endswith("_serial")
                if key.startswith("s_warm"):  # warm: launched before, at this scale
                    settle(pool)
                    burst(make_prog, one_thread)
                settle(pool)
                rounds[key].append(burst(make_prog, one_thread))
        row = {
            k: tuple(statistics.median(x) for x in zip(*v, strict=True)) for k, v in rounds.items()
        }
        order = ("s_warm", "s_cold", "s_warm_default", "s_warm_nopool", "t_warm", "t_cold")
        order += ("s_warm_serial",) if serial_ab else ()
        cells = [f"{row[k][0]:.2f}" if k in row else "-" for k in order]
        print(f"| {n} | " + " | ".join(cells) + " |")
        out[f"launch_avg_warm_ms_{n}"] = round(row["s_warm"][0], 2)
        out[f"launch_avg_cold_ms_{n}"] = round(row["s_cold"][0], 2)
        if "s_warm_default" in row:
            out[f"launch_avg_warm_ms_{n}_pool{POOL_SIZE}"] = round(row["s_warm_default"][0], 2)
        if "s_warm_nopool" in row:
            out[f"launch_avg_warm_ms_{n}_nopool"] = round(row["s_warm_nopool"][0], 2)
        if "s_warm_serial" in row:
            out[f"launch_avg_warm_ms_{n}_serial"] = round(row["s_warm_serial"][0], 2)
        out[f"launch_avg_trusted_ms_{n}"] = round(row["t_warm"][0], 3)
        # the older keys: request -> end, mean over the instances
        out[f"launch_warm_ms_{n}"] = round(row["s_warm"][1], 2)
        out[f"launch_cold_ms_{n}"] = round(row["s_cold"][1], 2)
        out[f"launch_trusted_ms_{n}"] = round(row["t_warm"][1], 3)
    print(
        f"pool: {box.pool.made} guests made by its thread, {box.pool.taken} launches "
        f"served from it, {box.pool.missed} found it empty"
    )
    box.close()
    return out


# --------------------------------------------------------------------------- (b) calls


def section_calls(handle: InProcessEngine, box, iters: int, warm: int) -> dict:
    print(f"(b) per-call overhead, µs per call, {iters} timed iterations, one instance")
    print("| call | sandboxed | trusted | sandboxed / trusted |")
    print("|---|---|---|---|")
    res = {}

    box.pool.wait_full(600)  # the pool's thread idle: it would compete for the CPU and GIL
    box.pool.idle(60)

    async def go():
        async with Server(handle) as server:
            for kind in ("sandboxed", "trusted"):
                prog = make(kind, "calls", CALLS, box)
                inst = server.runtime.launch(prog, [str(iters), str(warm)])
                evs = await collect(inst)
                res[kind] = json.loads(check([ev for _, ev in evs]))

    asyncio.run(go())
    out = {}
    for i, (label, key) in enumerate(
        [
            ("host call (get_kv_page_size), after a round trip", "plain"),
            ("queued (await synchronize)", "queued"),
            ("host call, back to back", "tight"),
        ]
    ):
        s, t = res["sandboxed"][i], res["trusted"][i]
        print(f"| {label} | {s:.1f} | {t:.1f} | {s / t:.1f}x |")
        out[f"call_us_{key}_sandboxed"] = round(s, 1)
        out[f"call_us_{key}_trusted"] = round(t, 1)
    out["host_call_us"] = out["call_us_plain_sandboxed"]
    out["host_call_us_back_to_back"] = out["call_us_tight_sandboxed"]
    out["queued_call_us"] = out["call_us_queued_sandboxed"]
    return out


# --------------------------------------------------------------------------- (c) TPOT


async def tpot(handle: InProcessEngine, prog: Program, ps: list[list[int]], n: int):
    async with Server(handle) as server:
        insts = [server.runtime.launch(prog, [csv(p), str(n)]) for p in ps]
        events = await asyncio.gather(*(collect(i) for i in insts))
    t0 = min(t for evs in events for t, ev in evs if isinstance(ev, Message))
    t1 = max(evs[-1][0] for evs in events)
    outs = [check([ev for _, ev in evs]) for evs in events]
    return (t1 - t0) / (n - 1), outs


def section_tpot(
    handle: InProcessEngine, box, n: int, reps: int, vocab: int, counts, serial_ab: bool
) -> dict:
    print(f"(c) text completion, ms per output token, {n} new tokens, fastest of {reps}")
    print(
        "| concurrent | sandboxed | trusted | **sandboxed / trusted** | same output |"
        + (" sandboxed serial | serial / trusted |" if serial_ab else "")
    )
    print("|---|---|---|---|---|" + ("---|---|" if serial_ab else ""))
    progs = {kind: make(kind, "tc", TEXT_COMPLETION, box) for kind in ("trusted", "sandboxed")}
    progs["serial"] = progs["sandboxed"]  # the same program, every guest on the loop's thread
    kinds = ("trusted", "sandboxed", "serial") if serial_ab else ("trusted", "sandboxed")
    threads = box.pollers.threads
    out = {}
    for b in counts:
        ps = prompts(b, PROMPT, vocab, seed=10)
        for kind in ("trusted", "sandboxed"):  # warm-up on these shapes
            asyncio.run(tpot(handle, progs[kind], ps, 3))
        best: dict[str, tuple] = {}
        for _ in range(reps):
            for kind in kinds:
                box.pool.wait_full(600)
                box.pollers.threads = 1 if kind == "serial" else threads
                try:
                    r = asyncio.run(tpot(handle, progs[kind], ps, n))
                finally:
                    box.pollers.threads = threads
                if kind not in best or r[0] < best[kind][0]:
                    best[kind] = r
        s, t = best["sandboxed"], best["trusted"]
        same = sum(a == c for a, c in zip(s[1], t[1], strict=True))
        row = f"| {b} | {s[0] * 1e3:.2f} | {t[0] * 1e3:.2f} | {s[0] / t[0]:.2f} | {same}/{b} |"
        if serial_ab:
            r = best["serial"]
            assert r[1] == s[1], "the serial and the parallel path generated different text"
            row += f" {r[0] * 1e3:.2f} | {r[0] / t[0]:.2f} |"
            out[f"tpot_ms_sandboxed_serial_{b}"] = round(r[0] * 1e3, 2)
            out[f"tpot_sandboxed_serial_over_trusted_{b}"] = round(r[0] / t[0], 3)
        print(row)
        out[f"tpot_ms_sandboxed_{b}"] = round(s[0] * 1e3, 2)
        out[f"tpot_ms_trusted_{b}"] = round(t[0] * 1e3, 2)
        out[f"tpot_sandboxed_over_trusted_{b}"] = round(s[0] / t[0], 3)
        out[f"tpot_same_output_{b}"] = same == b
    return out


# --------------------------------------------------------------------------- (d) memory


def memory(kind: str) -> tuple[int, int]:
    if kind == "trusted":
        return tracemalloc.get_traced_memory()[0], 0
    return rss_bytes(), uss_bytes()


async def parked(handle: InProcessEngine, box, kind: str, n: int) -> dict:
    """Memory per instance parked in receive(): RSS and USS deltas / n (sandboxed), or
    Python allocations / n (trusted), and the linear memory each sandboxed one reports."""
    async with Server(handle) as server:
        prog = make(kind, "parked", PARKED, box)
        # warm: one instance first (lazy imports, first-use allocations)
        inst = server.runtime.launch(prog, [])
        evs = inst.events()
        await anext(evs)
        inst.send("x")
        assert await anext(evs) == Finished("x")
        if box is not None:
            box.pool.idle(60)
        gc.collect()
        if kind == "trusted":  # KiB-scale: below RSS resolution, count Python allocations
            tracemalloc.start()
        before = memory(kind)
        insts = [server.runtime.launch(prog, []) for _ in range(n)]
        streams = [i.events() for i in insts]
        for s in streams:
            assert await anext(s) == Message("ready")
        gc.collect()
        after = memory(kind)
        tracemalloc.stop()
        linear = [prog.memory(i.id) for i in insts] if prog.memory else []
        for i in insts:
            i.send("bye")
        for s in streams:
            assert await anext(s) == Finished("bye")
    return {
        "rss": (after[0] - before[0]) / n,
        "uss": (after[1] - before[1]) / n,
        "linear": statistics.mean(x or 0 for x in linear) if linear else 0,
    }


def section_memory(handle: InProcessEngine, n: int) -> dict:
    from pastry.runtime.wasm import WasmSandbox

    print(f"(d) memory per idle instance ({n} parked in receive()), delta / {n}")
    print("| runner | RSS MiB | USS MiB (private) | linear memory MiB |")
    print("|---|---|---|---|")
    out = {}
    box = WasmSandbox(pool_size=0)  # no pool: the deltas are the instances'
    m = asyncio.run(parked(handle, box, "sandboxed", n))
    rss, uss, linear = (m[k] / 2**20 for k in ("rss", "uss", "linear"))
    print(f"| sandboxed | {rss:.2f} | {uss:.2f} | {linear:.2f} |")
    t = asyncio.run(parked(handle, None, "trusted", n))
    print(f"| trusted (tracemalloc) | {t['rss'] / 2**20:.3f} | - | - |")
    box.pool.idle(60)
    gc.collect()
    rss0, uss0 = rss_bytes(), uss_bytes()
    box.pool.resize(n)
    box.pool.wait_full(600)
    pool_rss, pool_uss = (rss_bytes() - rss0) / n, (uss_bytes() - uss0) / n
    print(
        f"| one pre-started (pooled) guest | {pool_rss / 2**20:.2f} | {pool_uss / 2**20:.2f} | - |"
    )
    box.close()
    out["mem_kib_per_instance_sandboxed"] = round(m["rss"] / 1024, 1)
    out["mem_kib_per_instance_trusted"] = round(t["rss"] / 1024, 1)
    out["mem_mib_per_instance"] = round(m["rss"] / 2**20, 2)
    out["mem_uss_mib_per_instance"] = round(m["uss"] / 2**20, 2)
    out["mem_linear_mib_per_instance"] = round(m["linear"] / 2**20, 2)
    out["pool_uss_mib_per_guest"] = round(pool_uss / 2**20, 2)
    return out


# --------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (same JSON keys)")
    ap.add_argument("--model", type=Path, help="checkpoint directory (default: the small one)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--serial-ab",
        action="store_true",
        help="also measure the serial path (poll_threads 1), interleaved (extra *_serial keys)",
    )
    ap.add_argument(
        "--sections",
        default="launch,calls,tpot,memory",
        help="comma-separated subset of launch,calls,tpot,memory (development)",
    )
    ap.add_argument(
        "--launch-counts",
        default=",".join(map(str, LAUNCH_COUNTS)),
        help="comma-separated N of the launch section (development)",
    )
    ap.add_argument(
        "--tpot-counts",
        default=",".join(map(str, TPOT_COUNTS)),
        help="comma-separated concurrency of the TPOT section (development)",
    )
    args = ap.parse_args()
    sections = set(args.sections.split(","))
    unknown = sections - {"launch", "calls", "tpot", "memory"}
    if unknown:
        ap.error(f"--sections: unknown {sorted(unknown)}; choose from launch,calls,tpot,memory")
    launch_counts = [int(x) for x in args.launch_counts.split(",")]
    tpot_counts = [int(x) for x in args.tpot_counts.split(",")]
    t_start = time.perf_counter()
    torch.manual_seed(0)

    from pastry.runtime import build_pyrt
    from pastry.runtime.wasm import POOL_SIZE, WasmSandbox
    from pastry.runtime.wasm_pollers import DEFAULT_THREADS

    if not build_pyrt.cached_path().exists():
        print("# building the Python runtime component (once) ...", flush=True)
        build_pyrt.build()

    path = args.model or small_checkpoint(args.device)
    n_tok = 64  # the same shapes quick or not: --quick only repeats less
    reps, launch_reps = (1, 1) if args.quick else (3, 3)
    iters, warm = (50, 10) if args.quick else (500, 50)
    n_mem = 256
    cfg = EngineConfig(
        device=args.device,
        dtype="bfloat16",
        page_size=PAGE_SIZE,
        num_pages=max(TPOT_COUNTS) * (-(-(PROMPT + n_tok + 1) // PAGE_SIZE)) + 512,
        num_embeds=max(TPOT_COUNTS) * (PROMPT + 2) + 1024,
        num_host_pages=1,
    )
    engine = Engine.load(path, cfg)
    handle = InProcessEngine(engine)
    gc_tuning.tune_for_serving()  # the collector settings `pastry serve` runs under
    vocab = engine.info.vocab_size
    print(f"# sandbox: {engine.info.model_name} ({engine.cfg.num_params / 1e6:.0f}M params, bf16)")
    print(
        f"# machine: {cpu_name()}, {os.cpu_count()} cpus, "
        f"torch {torch.__version__}, device {args.device}, quick={args.quick}"
    )
    print(f"# guests run on {DEFAULT_THREADS} poll threads (the loop's included)")
    out: dict[str, object] = {"poll_threads": DEFAULT_THREADS}
    if "launch" in sections:
        print()
        out.update(section_launch(handle, launch_counts, launch_reps, args.serial_ab))
    box = WasmSandbox(pool_size=POOL_SIZE)  # the default sandbox a server gets
    if "calls" in sections:
        print()
        out.update(section_calls(handle, box, iters, warm))
    if "tpot" in sections:
        print()
        out.update(section_tpot(handle, box, n_tok, reps, vocab, tpot_counts, args.serial_ab))
    box.close()
    if "memory" in sections:
        print()
        out.update(section_memory(handle, n_mem))
    handle.close()
    out.update(
        {
            "quick": args.quick,
            "device": args.device,
            "machine": cpu_name(),
            "seconds": round(time.perf_counter() - t_start),
        }
    )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
