"""The cost of the WebAssembly sandbox: sandboxed vs trusted Python inferlets.

    python benchmarks/sandbox.py [--quick] [--model DIR] [--device cpu|cuda]

Without --model, uses the random-weight ``small`` llama checkpoint of ``engine_decode.py``
(bf16, one ``InProcessEngine`` handle shared by every measurement; each run gets a fresh
controller and trusted runtime). Needs the Python runtime component (pyrt), built once by
``python -m pastry.runtime.build_pyrt`` (this script builds it if missing).

(a) Launch latency of a trivial inferlet (``return "ok"``) at 1, 64 and 256 simultaneous
    launches: from ``launch()`` to the instance's result event, mean and max over the
    instances, and the round's wall time / N (launches run one after another on the one
    event loop, so the mean grows with N). *Cold* = the first launches of a program in a fresh ``WasmSandbox`` (the
    compiled pyrt is deserialised, the linker built and the source checked inside the
    timed interval); *warm* = the same launches again (each launch still instantiates
    pyrt in a new Store and ``exec``s the source; nothing is shared between instances).
    Trusted rows: ``Program.from_source`` + launch (cold) and launch again (warm).
(b) Per-call overhead, timed inside the inferlet with ``time.perf_counter``: a plain
    call (``get_kv_page_size``, answered by the Session) and a queued call
    (``await synchronize(q)``, a scheduler round trip without the engine); mean µs of
    the timed iterations after a warm-up, one instance.
(c) Time per output token of text completion (``Context`` + greedy ``Sampler``, the
    inferlet of ``overhead.py``) at 1 and 64 concurrent inferlets, prefill excluded: from
    the first instance's "first token" message to the last result, / (N-1). Sandboxed
    and trusted alternate; fastest of the repeats; outputs must match.
(d) Memory per instance: N instances parked in ``receive()`` (after sending "ready");
    process RSS delta / N (trusted: Python allocations traced by tracemalloc / N, RSS
    cannot resolve KiB per instance). Then each gets a message and ends.

Prints tables, then as the last line one JSON object with the headline numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import sys
import time
import tracemalloc
from collections.abc import Sequence
from pathlib import Path

import torch

from pastry.control.controller import Controller
from pastry.control.events import Finished, Message
from pastry.engine.config import EngineConfig
from pastry.engine.engine import Engine
from pastry.engine.handle import InProcessEngine
from pastry.runtime.trusted import Program, TrustedRuntime

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_decode import prompts, small_checkpoint
from overhead import TEXT_COMPLETION, check, csv

PROMPT = 32
PAGE_SIZE = 16

TRIVIAL = """
async def main(args):
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
    return json.dumps([plain / n * 1e6, queued / n * 1e6])
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


async def launch_round(server: Server, prog_fn, n: int) -> tuple[float, float, float]:
    """Mean and max ms from launch to result over ``n`` simultaneous launches, and the
    whole round's wall time / ``n`` (the cost of one launch when they queue)."""
    t0 = time.perf_counter()
    prog = prog_fn()
    insts = [server.runtime.launch(prog, []) for _ in range(n)]
    events = await asyncio.gather(*(collect(i) for i in insts))
    lat = [(evs[-1][0] - t0) * 1e3 for evs in events]
    for evs in events:
        assert check([ev for _, ev in evs]) == "ok"
    return sum(lat) / n, max(lat), max(lat) / n


def section_launch(handle: InProcessEngine, counts: Sequence[int]) -> dict:
    from pastry.runtime.wasm import WasmSandbox

    print(
        "(a) launch latency of a trivial inferlet, launch -> result, ms "
        "(mean / max / round wall per launch)"
    )
    print("| simultaneous | sandboxed cold | sandboxed warm | trusted cold | trusted warm |")
    print("|---|---|---|---|---|")
    out = {}
    for n in counts:
        row = {}

        async def go(n=n, row=row):
            async with Server(handle) as server:
                holder = {}

                def cold_box():
                    holder["box"] = WasmSandbox()  # deserialise pyrt, build the linker
                    return make("sandboxed", "trivial", TRIVIAL, holder["box"])

                row["s_cold"] = await launch_round(server, cold_box, n)
                box = holder["box"]
                row["s_warm"] = await launch_round(
                    server, lambda: make("sandboxed", "trivial", TRIVIAL, box), n
                )
                row["t_cold"] = await launch_round(
                    server, lambda: make("trusted", f"trivial{n}", TRIVIAL), n
                )
                row["t_warm"] = await launch_round(
                    server, lambda: make("trusted", f"trivial{n}", TRIVIAL), n
                )

        asyncio.run(go())
        gc.collect()
        cells = " | ".join(" / ".join(f"{x:.2f}" for x in row[k]) for k in row)
        print(f"| {n} | {cells} |")
        out[f"launch_cold_ms_{n}"] = round(row["s_cold"][0], 2)
        out[f"launch_warm_ms_{n}"] = round(row["s_warm"][0], 2)
        out[f"launch_warm_ms_per_launch_{n}"] = round(row["s_warm"][2], 2)
        out[f"launch_trusted_ms_{n}"] = round(row["t_warm"][0], 3)
    return out


# --------------------------------------------------------------------------- (b) calls


def section_calls(handle: InProcessEngine, iters: int, warm: int) -> dict:
    print(f"(b) per-call overhead, µs per call, {iters} timed iterations, one instance")
    print("| call | sandboxed | trusted | sandboxed / trusted |")
    print("|---|---|---|---|")
    res = {}

    async def go():
        async with Server(handle) as server:
            for kind in ("sandboxed", "trusted"):
                inst = server.runtime.launch(make(kind, "calls", CALLS), [str(iters), str(warm)])
                evs = await collect(inst)
                res[kind] = json.loads(check([ev for _, ev in evs]))

    asyncio.run(go())
    out = {}
    for i, (label, key) in enumerate(
        [("plain (get_kv_page_size)", "plain"), ("queued (await synchronize)", "queued")]
    ):
        s, t = res["sandboxed"][i], res["trusted"][i]
        print(f"| {label} | {s:.1f} | {t:.1f} | {s / t:.1f}x |")
        out[f"call_us_{key}_sandboxed"] = round(s, 1)
        out[f"call_us_{key}_trusted"] = round(t, 1)
    return out


# --------------------------------------------------------------------------- (c) TPOT


async def tpot(handle: InProcessEngine, kind: str, ps: list[list[int]], n: int):
    async with Server(handle) as server:
        prog = make(kind, "tc", TEXT_COMPLETION)
        insts = [server.runtime.launch(prog, [csv(p), str(n)]) for p in ps]
        events = await asyncio.gather(*(collect(i) for i in insts))
    t0 = min(t for evs in events for t, ev in evs if isinstance(ev, Message))
    t1 = max(evs[-1][0] for evs in events)
    outs = [check([ev for _, ev in evs]) for evs in events]
    return (t1 - t0) / (n - 1), outs


def section_tpot(handle: InProcessEngine, n: int, reps: int, vocab: int) -> dict:
    print(f"(c) text completion, ms per output token, {n} new tokens, fastest of {reps}")
    print("| concurrent | sandboxed | trusted | **sandboxed / trusted** | same output |")
    print("|---|---|---|---|---|")
    out = {}
    for b in (1, 64):
        ps = prompts(b, PROMPT, vocab, seed=10)
        for kind in ("trusted", "sandboxed"):  # warm-up on these shapes
            asyncio.run(tpot(handle, kind, ps, 3))
        best: dict[str, tuple] = {}
        for _ in range(reps):
            for kind in ("trusted", "sandboxed"):
                r = asyncio.run(tpot(handle, kind, ps, n))
                if kind not in best or r[0] < best[kind][0]:
                    best[kind] = r
        s, t = best["sandboxed"], best["trusted"]
        same = sum(a == c for a, c in zip(s[1], t[1], strict=True))
        print(f"| {b} | {s[0] * 1e3:.2f} | {t[0] * 1e3:.2f} | {s[0] / t[0]:.2f} | {same}/{b} |")
        out[f"tpot_ms_sandboxed_{b}"] = round(s[0] * 1e3, 2)
        out[f"tpot_ms_trusted_{b}"] = round(t[0] * 1e3, 2)
        out[f"tpot_sandboxed_over_trusted_{b}"] = round(s[0] / t[0], 3)
        out[f"tpot_same_output_{b}"] = same == b
    return out


# --------------------------------------------------------------------------- (d) memory


async def parked_rss(handle: InProcessEngine, kind: str, n: int) -> float:
    """Bytes of RSS per instance parked in receive()."""
    async with Server(handle) as server:
        prog = make(kind, "parked", PARKED)
        # warm: one instance first (lazy imports, first-use allocations)
        inst = server.runtime.launch(prog, [])
        evs = inst.events()
        await anext(evs)
        inst.send("x")
        assert await anext(evs) == Finished("x")
        gc.collect()
        if kind == "trusted":  # KiB-scale: below RSS resolution, count Python allocations
            tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0] if kind == "trusted" else rss_bytes()
        insts = [server.runtime.launch(prog, []) for _ in range(n)]
        streams = [i.events() for i in insts]
        for s in streams:
            assert await anext(s) == Message("ready")
        gc.collect()
        after = tracemalloc.get_traced_memory()[0] if kind == "trusted" else rss_bytes()
        tracemalloc.stop()
        for i in insts:
            i.send("bye")
        for s in streams:
            assert await anext(s) == Finished("bye")
    return (after - before) / n


def section_memory(handle: InProcessEngine, n: int) -> dict:
    print(f"(d) memory per idle instance ({n} parked in receive()), delta / {n}")
    print("| runner | KiB per instance |")
    print("|---|---|")
    out = {}
    for kind in ("sandboxed", "trusted"):
        per = asyncio.run(parked_rss(handle, kind, n))
        how = "tracemalloc" if kind == "trusted" else "RSS"
        print(f"| {kind} ({how}) | {per / 1024:.1f} |")
        out[f"mem_kib_per_instance_{kind}"] = round(per / 1024, 1)
    out["mem_mib_per_instance"] = round(out["mem_kib_per_instance_sandboxed"] / 1024, 2)
    return out


# --------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="reduced run (same JSON keys)")
    ap.add_argument("--model", type=Path, help="checkpoint directory (default: the small one)")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    t_start = time.perf_counter()
    torch.manual_seed(0)

    from pastry.runtime import build_pyrt

    if not build_pyrt.cached_path().exists():
        print("# building the Python runtime component (once) ...", flush=True)
        build_pyrt.build()

    path = args.model or small_checkpoint(args.device)
    n_tok, reps = (8, 1) if args.quick else (64, 3)
    iters, warm = (50, 10) if args.quick else (500, 50)
    n_mem = 64 if args.quick else 256
    cfg = EngineConfig(
        device=args.device,
        dtype="bfloat16",
        page_size=PAGE_SIZE,
        num_pages=64 * (-(-(PROMPT + n_tok + 1) // PAGE_SIZE)) + 512,
        num_embeds=8192,
        num_host_pages=1,
    )
    engine = Engine.load(path, cfg)
    handle = InProcessEngine(engine)
    vocab = engine.info.vocab_size
    print(f"# sandbox: {engine.info.model_name} ({engine.cfg.num_params / 1e6:.0f}M params, bf16)")
    print(
        f"# machine: {platform.machine()} {platform.processor() or ''} {os.cpu_count()} cpus, "
        f"torch {torch.__version__}, device {args.device}, quick={args.quick}"
    )
    out: dict[str, object] = {}
    print()
    out.update(section_launch(handle, (1, 64, 256)))
    print()
    out.update(section_calls(handle, iters, warm))
    print()
    out.update(section_tpot(handle, n_tok, reps, vocab))
    print()
    out.update(section_memory(handle, n_mem))
    handle.close()
    out.update(
        {
            "quick": args.quick,
            "device": args.device,
            "seconds": round(time.perf_counter() - t_start),
        }
    )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
