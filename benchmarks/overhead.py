"""The cost of programmability: inferlets on the control layer vs the fused loop.

    python benchmarks/overhead.py [--quick] [--model DIR] [--device cpu|cuda] [--sections abcde]

Without --model, uses the random-weight ``small`` llama checkpoint of
``engine_decode.py`` (written into ~/.cache/pastry/bench/ once). One bf16 engine is loaded
behind one ``InProcessEngine`` handle (one worker thread) that every measurement shares;
each inferlet run gets a fresh controller and trusted runtime over it. Prompts are seeded random
token ids (32 tokens), generation is greedy with no end-of-sequence stop, so the workload
is fixed and nothing depends on the tokenizer.

(a) Time per output token (TPOT). The text-completion inferlet fills a ``Context`` with
    the prompt tokens, generates 1 token (prefill + first token), ``send()``s a message,
    then generates N-1 more with a greedy ``Sampler`` and ``MaxTokens``. The driver stamps
    the arrival of each instance's message and of its result: decode wall time = last
    result - first message, so prefill is excluded; TPOT = decode wall / (N-1). The
    reference is ``FusedGenerator`` (no control layer, no inferlets) on the same prompts:
    its first step prefills every prompt and samples the first token; the clock starts
    when that step returns and stops after the last step, TPOT = that / (N-1). Both at 1
    and 32 concurrent sequences; fastest of the repeats, alternating the two.
    ``tpot_overhead_B`` = inferlet TPOT / fused TPOT. "Engine idle" = TPOT minus the
    engine's execute time per token over the same interval: the time per step spent
    outside the engine (control layer, inferlets, the fused loop's own Python). The reference calls
    ``execute_sync`` of the same ``InProcessEngine`` handle, so both compute on the same
    worker thread (torch called from the main thread instead was erratic on the loaded
    2-core machine, up to 40x slower for whole runs); the reference therefore pays the
    worker-thread hop too (about 0.1 ms per step; measured in (b)).

(b) API call latency at 1, 128, 512 and 1024 concurrent inferlets (adaptive policy), measured
    inside the inferlets with ``time.perf_counter`` around each call (the SDK wrapper
    included), first iterations of each inferlet dropped as warm-up.
    - control-layer call: a call the control layer answers without the engine. Each
      iteration times ``alloc_embeds(q, 1)``, ``store_get(key)`` and the issue of
      ``dealloc_embeds(q, h)`` separately; ``control_call_us_C`` is the mean of the three
      (µs per call). The dealloc is then awaited: it is a queued control command that
      resolves when the scheduler reaches it (no engine batch); its completion time is
      the "queued control" column.
    - engine call excluding compute: the round trip of ``await embed_txt(q, [t], [0], [e])``
      (one token; the cheapest call that runs on the engine) minus the time the engine
      spent inside ``Engine.execute`` while the call was outstanding (a wrapper around the
      engine records every batch's execute interval; batches run one at a time on the
      worker thread, so the overlap is exact). What is left is scheduling (wake-up, settle
      ticks, forming the batch, handle translation), the hop to the worker thread and
      back, resolving the futures, and waiting for the other inferlets' turns on the event
      loop. ``engine_call_us_C`` = mean µs per call of that.

    ``engine_call_us_C / C`` is the control work per inferlet and call: the cost is flat
    in the number of inferlets when that column is. ``engine_call_scheduler_us_C`` is the
    part of it that is the scheduler's own work per batch (``SchedulerStats.seconds``:
    forming and preparing the batch, dispatching it with its hooks, delivering the
    results): every call waits for one batch's worth of it. The rest of the round trip is
    the other inferlets' turns (each of the C inferlets runs its own Python once per
    cycle on the one event loop), the loop's wake-ups and the thread hop.

(c) The Pie paper's Table 5: 128 concurrent text-completion inferlets under the eager,
    k-only, t-only and adaptive policies (default parameters of the ``pastry.control.policies`` objects). After every
    inferlet has its first token (prefill excluded), output tokens are counted for a fixed
    window (or until the first inferlet finishes) from the engine's batch log: throughput =
    ``Sample`` calls in the batches that completed in the window, from the first such
    batch's end to the last's. Then the inferlets are terminated. Mean batch
    (``stats.mean_batch``: forward items per batch that had any) and the number of
    batches are over the same window, as are the engine's busy share, its execute time per
    batch and its idle time per batch (the control layer and the inferlets run while the
    engine waits). The fused loop
    with 128 running sequences over the same window is the reference row. Policies run
    interleaved in rounds; each reports its best round. Two last rows run the built-in
    ``text-completion`` (the program behind ``/v1/completions``: greedy, ``ignore_eos``)
    under the adaptive
    policy, whole (``completion_tokens_per_s_128``, ``completion_tokens_per_s_over_fused_128``)
    and streaming (``completion_stream_tokens_per_s_…``); its window starts at the first
    batch that samples for all 128.

(d) Per-inferlet-step control cost from a stub-engine profile: the text-completion
    inferlet (embed -> forward -> sample per token) at 1, 128, 512 and 1024 concurrent
    inferlets over an engine that answers at once (the same ``InProcessEngine`` worker
    thread; no compute), so the whole decode wall time is the control layer's and the
    inferlets' Python: µs per inferlet-step = decode wall / (inferlets x steps). Measured
    under the server's collector settings (``pastry.control.gc_tuning.tune_for_serving``)
    and, as references in the same run (interleaved), freezing alone (the server's
    setting before) and CPython's defaults; with the time the collector took in the window.
    The SDK decodes with the fused ``step`` command (embed, forward and sample as one
    command); the "three calls" column runs the same program with the step as the three
    API calls issued together (what ``Context.generate`` did before), same collector
    settings. "Of which scheduler" (``stub_step_scheduler_us_C``) is the scheduler's own
    work (``SchedulerStats.seconds``, read after every batch) per inferlet-step over the
    same window; the rest is the inferlets' code, the SDK and session calls they make, and
    the event loop's wake-ups.

(e) Pipelining over a remote engine: the engine in its own process (``spawn_engine``,
    ZeroMQ), 128 text completions as in (c) under the adaptive policy with
    ``max_inflight`` 1 and 2 (form and send the next batch while one runs), interleaved;
    tokens/s = forward items dispatched in the window / its length. ``--no-remote`` skips
    it.

The whole run uses the server's collector settings (``tune_for_serving`` after the
engine is loaded), as ``pastry serve`` does.

``--sections`` runs some of (a)-(e) only (the JSON then holds their keys only).

Prints tables, then as the last line one JSON object with the headline numbers. The
machine this was written on is a shared 2-vCPU VM: the inferlets' Python and the engine's
torch threads compete for the same two cores, and runs vary by ±10%.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import gc
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from machine import cpu_name  # benchmarks/ is on the path (the script's dir)
from pastry.control import gc_tuning
from pastry.control.controller import Controller
from pastry.control.events import Event, Finished, Message
from pastry.control.policies import BatchPolicy, batch_policy
from pastry.control.scheduler import SchedulerStats
from pastry.engine.engine import Engine
from pastry.engine.generate import FusedGenerator, Request, _Running
from pastry.inferlets import text_completion
from pastry.runtime.trusted import Program, TrustedRuntime
from pastry.wire.calls import Call, EngineInfo, Result, Sample
from pastry.wire.config import EngineConfig
from pastry.wire.handle import EngineHandle, InProcessEngine
from pastry.wire.remote import RemoteEngine
from pastry.wire.spawn import spawn_engine

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_decode import prompts, small_checkpoint

PROMPT = 32
PAGE_SIZE = 16
CONCURRENCY = (1, 128, 512, 1024)
POLICIES = ("eager", "k-only", "t-only", "adaptive")
POLICY_KEYS = {"eager": "eager", "k-only": "k", "t-only": "t", "adaptive": "adaptive"}

TEXT_COMPLETION = """
import pastry.sdk as px
from pastry.sdk import Context, MaxTokens, Sampler

async def main(args):
    n = int(args[1])
    ctx = Context()
    ctx.fill_tokens([int(t) for t in args[0].split(",")])
    await ctx.generate(Sampler(), MaxTokens(1))
    px.send("first")
    if n > 1:
        await ctx.generate(Sampler(), MaxTokens(n - 1))
    return ",".join(map(str, ctx.tokens[-n:]))
"""

# The same program with the decode step as three API calls (embed_txt, forward, sample,
# issued together and awaited once): how Context.generate stepped before the fused ``step``.
TEXT_COMPLETION_CALLS = """
import pastry.sdk as px
from pastry.sdk import Context, MaxTokens, Sampler
from pastry.sdk.context import await_step

async def main(args):
    n = int(args[1])
    ctx = Context()
    ctx.fill_tokens([int(t) for t in args[0].split(",")])
    await ctx.generate(Sampler(), MaxTokens(1))
    px.send("first")
    for _ in range(n - 1):
        futs, (emb,) = ctx.forward_tokens(ctx.pending, 1)
        tok = await await_step(futs, px.sample(ctx.queue, emb))
        ctx.tokens.append(tok)
        ctx.pending = [tok]
    return ",".join(map(str, ctx.tokens[-n:]))
"""

# The built-in behind /v1/completions, as the server loads it.
BUILTIN_TEXT_COMPLETION = Path(text_completion.__file__).read_text()

CONTROL_CALLS = """
import json
import time
import pastry.sdk as px

async def main(args):
    clock = time.perf_counter
    q = px.create_queue(px.available_models()[0])
    px.store_set("bench-key", "value")
    rows = []
    for _ in range(int(args[0])):
        t0 = clock()
        h = px.alloc_embeds(q, 1)
        t1 = clock()
        px.store_get("bench-key")
        t2 = clock()
        f = px.dealloc_embeds(q, h)
        t3 = clock()
        await f
        t4 = clock()
        rows.append((t1 - t0, t2 - t1, t3 - t2, t4 - t3))
    return json.dumps(rows)
"""

ENGINE_CALLS = """
import json
import time
import pastry.sdk as px

async def main(args):
    clock = time.perf_counter
    tok = int(args[1])
    q = px.create_queue(px.available_models()[0])
    e = px.alloc_embeds(q, 1)
    rows = []
    for _ in range(int(args[0])):
        t0 = clock()
        await px.embed_txt(q, [tok], [0], e)
        rows.append((t0, clock()))
    return json.dumps(rows)
"""


class TimedEngine:
    """An engine that logs (start, end, samples) of every ``execute`` (on the worker thread)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.info = engine.info
        self.cuda = engine.device.type == "cuda"
        self.log: list[tuple[float, float, int]] = []

    def execute(self, batch: Sequence[Call]) -> list[Result]:
        t0 = time.perf_counter()
        results = self.engine.execute(batch)
        if self.cuda:
            torch.cuda.synchronize()
        samples = sum(1 for c in batch if type(c) is Sample)
        self.log.append((t0, time.perf_counter(), samples))
        return results


def busy_until(log: list[tuple[float, float, int]], t: np.ndarray | float) -> np.ndarray:
    """Seconds the engine spent in ``execute`` from its first logged batch up to each ``t``
    (batches run one at a time, so their intervals do not overlap)."""
    arr = np.array([(s, e) for s, e, _ in log]).reshape(-1, 2)
    arr = arr[np.argsort(arr[:, 0])]
    starts, ends = arr[:, 0], arr[:, 1]
    cum = np.concatenate([[0.0], np.cumsum(ends - starts)])
    t = np.asarray(t, dtype=np.float64)
    i = np.searchsorted(starts, t, side="right")  # batches started by t
    unfinished = np.where(i > 0, np.maximum(0.0, ends[np.maximum(i - 1, 0)] - t), 0.0)
    return cum[i] - unfinished


def busy(log: list[tuple[float, float, int]], t0: float, t1: float) -> float:
    return float(busy_until(log, t1) - busy_until(log, t0))


class Server:
    """A fresh controller + trusted runtime over ``handle`` (async context manager)."""

    def __init__(self, handle: InProcessEngine, policy: BatchPolicy | None = None) -> None:
        self.handle, self.policy = handle, policy

    async def __aenter__(self) -> Server:
        self.controller = Controller([self.handle], self.policy)
        self.runtime = TrustedRuntime(self.controller)
        self.scheduler = next(iter(self.controller.models.values())).scheduler
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.controller.close()
        await self.handle.execute([])  # batches run in order: this waits for those in flight


def csv(tokens: Sequence[int]) -> str:
    return ",".join(map(str, tokens))


def check(events: list[Event]) -> str:
    end = events[-1]
    if not isinstance(end, Finished):
        raise RuntimeError(f"inferlet ended with {end}")
    return end.result


async def launch_and_collect(
    server: Server, source: str, launches: Sequence[Sequence[str]]
) -> list[list[tuple[float, Event]]]:
    """Launch all at once; every instance's events with their arrival times."""
    prog = Program.from_source("bench", source)
    insts = [server.runtime.launch(prog, args) for args in launches]

    async def collect(inst):
        return [(time.perf_counter(), ev) async for ev in inst.events()]

    return await asyncio.gather(*(collect(i) for i in insts))


def fused(handle: InProcessEngine, n_seqs: int) -> FusedGenerator:
    """The reference loop, computing on the same worker thread as the inferlets' batches."""
    budget = max(512, n_seqs * PROMPT)
    return FusedGenerator(handle.execute_sync, handle.info, budget, max_running=n_seqs)


# --------------------------------------------------------------------------- (a) TPOT


@dataclasses.dataclass
class Tpot:
    tpot: float  # seconds per output token, prefill excluded
    compute: float  # of which the engine spent in execute
    outputs: list[list[int]]


def fused_tpot(handle: InProcessEngine, ps: list[list[int]], n: int) -> Tpot:
    log = handle.engine.log
    gen = fused(handle, len(ps))
    running = [_Running(Request(p, max_new_tokens=n)) for p in ps]
    gen.step(running)  # every prompt prefilled, first token sampled
    assert all(len(r.req.output) == 1 for r in running)
    t0 = time.perf_counter()
    for _ in range(n - 1):
        gen.step(running)
    t1 = time.perf_counter()
    return Tpot((t1 - t0) / (n - 1), busy(log, t0, t1) / (n - 1), [r.req.output for r in running])


async def inferlet_tpot(handle: InProcessEngine, ps: list[list[int]], n: int) -> Tpot:
    async with Server(handle) as server:
        events = await launch_and_collect(server, TEXT_COMPLETION, [[csv(p), str(n)] for p in ps])
    t0 = min(t for evs in events for t, ev in evs if isinstance(ev, Message))
    t1 = max(evs[-1][0] for evs in events)
    outs = [[int(t) for t in check([ev for _, ev in evs]).split(",")] for evs in events]
    return Tpot((t1 - t0) / (n - 1), busy(handle.engine.log, t0, t1) / (n - 1), outs)


def measure_tpot(handle: InProcessEngine, batch: int, n: int, reps: int, vocab: int):
    """(fused, inferlet, sequences with identical outputs); the fastest of ``reps`` each."""
    ps = prompts(batch, PROMPT, vocab, seed=10)
    fused_tpot(handle, ps, 4)  # warm up both paths on these shapes
    asyncio.run(inferlet_tpot(handle, ps, 4))
    ref, ours = [], []
    for _ in range(reps):
        ref.append(fused_tpot(handle, ps, n))
        ours.append(asyncio.run(inferlet_tpot(handle, ps, n)))
    f, i = min(ref, key=lambda r: r.tpot), min(ours, key=lambda r: r.tpot)
    same = sum(a == b for a, b in zip(f.outputs, i.outputs, strict=True))
    return f, i, same


def section_tpot(handle: InProcessEngine, n: int, reps: int, vocab: int) -> dict:
    print(f"(a) time per output token, {n} new tokens, prefill excluded, fastest of {reps}")
    print(
        "| sequences | fused ms/token (engine idle) | inferlet ms/token (engine idle) "
        "| **inferlet / fused** | same output |"
    )
    print("|---|---|---|---|---|")
    out = {}
    for b in (1, 32):
        f, i, same = measure_tpot(handle, b, n, reps, vocab)
        out[f"tpot_overhead_{b}"] = round(i.tpot / f.tpot, 3)
        out[f"tpot_ms_fused_{b}"] = round(f.tpot * 1e3, 2)
        out[f"tpot_ms_inferlet_{b}"] = round(i.tpot * 1e3, 2)
        out[f"idle_ms_per_token_fused_{b}"] = round((f.tpot - f.compute) * 1e3, 3)
        out[f"idle_ms_per_token_inferlet_{b}"] = round((i.tpot - i.compute) * 1e3, 3)
        print(
            f"| {b} | {f.tpot * 1e3:.2f} ({(f.tpot - f.compute) * 1e3:.2f}) "
            f"| {i.tpot * 1e3:.2f} ({(i.tpot - i.compute) * 1e3:.2f}) "
            f"| {i.tpot / f.tpot:.3f}x | {same}/{b} |"
        )
    return out


# --------------------------------------------------------------------------- (b) call latency


async def thread_hop_us(handle: InProcessEngine, n: int = 200) -> float:
    """Median µs of ``await handle.execute([])``: to the worker thread and back, no compute."""
    times = []
    for _ in range(n):
        t = time.perf_counter()
        await handle.execute([])
        times.append(time.perf_counter() - t)
    return float(np.median(times) * 1e6)


async def call_latency(
    handle: InProcessEngine, conc: int, iters: int, warmup: int, vocab: int
) -> dict:
    log = handle.engine.log
    async with Server(handle) as server:
        events = await launch_and_collect(server, CONTROL_CALLS, [[str(iters)]] * conc)
    ctl = np.array([json.loads(check([ev for _, ev in e]))[warmup:] for e in events]) * 1e6
    ctl = ctl.reshape(-1, 4)  # alloc, store_get, dealloc issue, dealloc completion (µs)

    log.clear()
    tok = int(np.random.default_rng(3).integers(0, vocab))
    async with Server(handle) as server:
        events = await launch_and_collect(server, ENGINE_CALLS, [[str(iters), str(tok)]] * conc)
        stats = server.scheduler.stats
    rt = np.array([json.loads(check([ev for _, ev in e]))[warmup:] for e in events]).reshape(-1, 2)
    compute = busy_until(log, rt[:, 1]) - busy_until(log, rt[:, 0])
    rest = (rt[:, 1] - rt[:, 0] - compute) * 1e6
    return {
        "alloc_us": float(ctl[:, 0].mean()),
        "store_get_us": float(ctl[:, 1].mean()),
        "dealloc_issue_us": float(ctl[:, 2].mean()),
        "control_call_us": float(ctl[:, :3].mean()),
        "queued_control_us": float(ctl[:, 3].mean()),
        "engine_rt_us": float((rt[:, 1] - rt[:, 0]).mean() * 1e6),
        "engine_compute_us": float(compute.mean() * 1e6),
        "engine_call_us": float(rest.mean()),
        "engine_call_p90_us": float(np.percentile(rest, 90)),
        "exec_ms": float(np.mean([e - s for s, e, _ in log if e > s]) * 1e3),
        "calls_per_batch": stats.calls / max(stats.batches, 1),
        "sched_us": stats.seconds / max(stats.batches, 1) * 1e6,
    }


def section_latency(handle: InProcessEngine, iters: int, warmup: int, vocab: int) -> dict:
    hop = asyncio.run(thread_hop_us(handle))
    print(
        f"(b) API call latency, µs per call, timed inside the inferlets ({iters - warmup} calls "
        f"each, adaptive policy); worker-thread hop alone (await execute([])): {hop:.0f} µs"
    )
    print(
        "| inferlets | alloc_embeds | store_get | dealloc issue | **control call** "
        "| queued control (await dealloc) | engine call round trip | engine compute in it "
        "| **engine call excl. compute** (p90) | ÷ inferlets | engine ms/batch | calls/batch "
        "| scheduler µs/batch |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    out: dict[str, float] = {"thread_hop_us": round(hop, 1)}
    for c in CONCURRENCY:
        r = asyncio.run(call_latency(handle, c, iters, warmup, vocab))
        out[f"control_call_us_{c}"] = round(r["control_call_us"], 2)
        out[f"engine_call_us_{c}"] = round(r["engine_call_us"], 1)
        out[f"engine_call_us_per_inferlet_{c}"] = round(r["engine_call_us"] / c, 2)
        out[f"engine_call_scheduler_us_{c}"] = round(r["sched_us"], 1)
        print(
            f"| {c} | {r['alloc_us']:.2f} | {r['store_get_us']:.2f} | {r['dealloc_issue_us']:.2f} "
            f"| {r['control_call_us']:.2f} | {r['queued_control_us']:.0f} "
            f"| {r['engine_rt_us']:.0f} | {r['engine_compute_us']:.0f} "
            f"| {r['engine_call_us']:.0f} ({r['engine_call_p90_us']:.0f}) "
            f"| {r['engine_call_us'] / c:.1f} | {r['exec_ms']:.2f} | {r['calls_per_batch']:.0f} "
            f"| {r['sched_us']:.0f} |"
        )
    return out


# --------------------------------------------------------------------------- (c) policies


def window_stats(log: list[tuple[float, float, int]], t0: float, t1: float) -> dict:
    """Sampled tokens/s over the batches that ended in [t0, t1] (end of the first to end of
    the last), and the share of that time the engine was executing."""
    done = sorted((e, n) for _, e, n in log if t0 <= e <= t1)
    if len(done) < 2:
        raise RuntimeError(f"only {len(done)} engine batches ended in the window: make it longer")
    a, b = done[0][0], done[-1][0]
    compute = busy(log, a, b)
    return {
        "tok_s": sum(n for _, n in done[1:]) / (b - a),
        "busy": compute / (b - a),
        "idle_ms": (b - a - compute) / (len(done) - 1) * 1e3,
        "exec_ms": compute / (len(done) - 1) * 1e3,
        "window_s": t1 - t0,
    }


async def policy_throughput(
    handle: EngineHandle,
    policy: BatchPolicy,
    ps: list[list[int]],
    max_tokens: int,
    window: float,
    timed: bool = True,
    builtin: str = "",
) -> dict:
    """Throughput over ``handle``; ``timed``: it wraps a :class:`TimedEngine` (the engine's
    batch log gives the window's numbers), else (a remote engine) tokens are the forward
    items the scheduler dispatched in the window. ``builtin`` "stream" or "whole": the
    built-in ``text-completion`` (greedy, ``ignore_eos``, streaming or not) instead of the
    benchmark's program; the window then starts at the first batch that samples for every
    sequence (a delta can be empty text, so messages cannot mark the prefills' end)."""
    log = handle.engine.log if timed else []
    log.clear()
    async with Server(handle, policy) as server:
        if builtin:
            prog = Program.from_source(
                "text-completion", Path(text_completion.__file__).read_text()
            )
            opts = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
            opts["stream"] = builtin == "stream"
            argv = [[json.dumps({**opts, "prompt": p})] for p in ps]
        else:
            prog = Program.from_source("text-completion", TEXT_COMPLETION)
            argv = [[csv(p), str(max_tokens)] for p in ps]
        insts = [server.runtime.launch(prog, a) for a in argv]
        first, done = asyncio.Event(), asyncio.Event()
        n_first, failures, stopping = 0, [], False

        async def watch(inst) -> None:
            nonlocal n_first
            seen = False
            async for ev in inst.events():
                if isinstance(ev, Message):
                    if not seen and not builtin:
                        seen = True
                        n_first += 1
                        if n_first == len(insts):
                            first.set()
                    continue
                if not isinstance(ev, Finished) and not stopping:
                    failures.append(str(ev))
                    first.set()
                done.set()

        watchers = [asyncio.create_task(watch(i)) for i in insts]
        if builtin:  # every sequence decoding: one batch sampled for all of them
            while not (failures or done.is_set() or any(k >= len(ps) for *_, k in log)):
                await asyncio.sleep(0.005)
        else:
            await first.wait()
        if failures:
            raise RuntimeError(failures[0])
        t0 = time.perf_counter()
        s0 = dataclasses.replace(server.scheduler.stats)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(done.wait(), window)
        t1 = time.perf_counter()
        s1 = dataclasses.replace(server.scheduler.stats)
        stopping = True
        for iid in list(server.runtime.instances):
            server.runtime.terminate(iid, "benchmark window over")
        await asyncio.gather(*watchers)
    if failures:
        raise RuntimeError(failures[0])
    delta = SchedulerStats(
        batches=s1.batches - s0.batches,
        forward_items=s1.forward_items - s0.forward_items,
        forward_batches=s1.forward_batches - s0.forward_batches,
    )
    stats = {"batches": delta.batches, "mean_batch": delta.mean_batch}
    if not timed:
        return {"tok_s": delta.forward_items / (t1 - t0), "window_s": t1 - t0, **stats}
    return {**window_stats(log, t0, t1), **stats}


def fused_throughput(handle: InProcessEngine, ps: list[list[int]], window: float) -> dict:
    log = handle.engine.log
    log.clear()
    gen = fused(handle, len(ps))
    running = [_Running(Request(p, max_new_tokens=1 << 30)) for p in ps]
    gen.step(running)  # prefill + first token
    t0 = time.perf_counter()
    steps = 0
    while time.perf_counter() - t0 < window:
        gen.step(running)
        steps += 1
    return {**window_stats(log, t0, time.perf_counter()), "batches": steps, "mean_batch": len(ps)}


def section_policies(
    handle: InProcessEngine, n: int, max_tokens: int, window: float, rounds: int, vocab: int
) -> dict:
    ps = prompts(n, PROMPT, vocab, seed=20)
    print(
        f"(c) {n} concurrent text-completion inferlets: output tokens/s over a {window:g} s "
        f"window after prefill (Pie Table 5), best of {rounds} rounds (policies interleaved); "
        "engine busy, execute and idle time per batch, batches and mean batch over that window"
    )
    print(
        "| policy | **tok/s** | vs adaptive | engine busy | execute ms/batch | idle ms/batch "
        "| batches | mean batch | window s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    fused_throughput(handle, ps[:8], 0.5)  # warm up
    ref = "fused loop (reference, no inferlets)"
    built = {
        "whole": "built-in text-completion (what /v1/completions runs), adaptive",
        "stream": "the same, streaming",
    }
    runs: dict[str, list[dict]] = {ref: [], **{k: [] for k in POLICIES}}
    runs.update({label: [] for label in built.values()})
    for _ in range(rounds):
        runs[ref].append(fused_throughput(handle, ps, window))
        for kind in POLICIES:
            policy = batch_policy(kind)
            runs[kind].append(
                asyncio.run(policy_throughput(handle, policy, ps, max_tokens, window))
            )
        for mode, label in built.items():
            adaptive = batch_policy("adaptive")
            run = policy_throughput(handle, adaptive, ps, max_tokens, window, builtin=mode)
            runs[label].append(asyncio.run(run))
    rows = {name: max(rs, key=lambda r: r["tok_s"]) for name, rs in runs.items()}
    out: dict[str, float] = {}
    for kind in POLICIES:
        r = rows[kind]
        out[f"throughput_{POLICY_KEYS[kind]}"] = round(r["tok_s"], 1)
        out[f"mean_batch_{POLICY_KEYS[kind]}"] = round(r["mean_batch"], 1)
        out[f"batches_{POLICY_KEYS[kind]}"] = r["batches"]
    adaptive = out["throughput_adaptive"]
    for name, r in rows.items():
        label = batch_policy(name).describe() if name in POLICIES else name
        print(
            f"| {label} | {r['tok_s']:.0f} | {r['tok_s'] / adaptive:.2f}x | {r['busy']:.0%} "
            f"| {r['exec_ms']:.1f} | {r['idle_ms']:.2f} | {r['batches']} | {r['mean_batch']:.1f} "
            f"| {r['window_s']:.1f} |"
        )
    out["throughput_fused"] = round(rows[ref]["tok_s"], 1)
    out["throughput_adaptive_vs_fused"] = round(adaptive / out["throughput_fused"], 3)
    for mode, key in (("whole", "completion"), ("stream", "completion_stream")):
        tok_s = rows[built[mode]]["tok_s"]
        out[f"{key}_tokens_per_s_{n}"] = round(tok_s, 1)
        out[f"{key}_tokens_per_s_over_fused_{n}"] = round(tok_s / out["throughput_fused"], 3)
    return out


# --------------------------------------------------------------------------- (d) stub engine


class StubEngine:
    """Answers every call at once (``Sample`` -> a fixed token, the rest -> None): what is
    left of a step is the control layer's and the inferlets' work."""

    def __init__(self, info: EngineInfo, token: int) -> None:
        self.info, self.token = info, token

    def execute(self, batch: Sequence[Call]) -> list[Result]:
        return [self.token if type(c) is Sample else None for c in batch]


class GcClock:
    """Seconds the collector ran (``gc.callbacks``), as intervals to sum over a window."""

    def __init__(self) -> None:
        self.spans: list[tuple[float, float]] = []
        self._start = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.spans.append((self._start, time.perf_counter()))

    def within(self, t0: float, t1: float) -> float:
        return sum(min(b, t1) - max(a, t0) for a, b in self.spans if b > t0 and a < t1)


async def stub_step_us(
    handle: InProcessEngine,
    conc: int,
    steps: int,
    clock: GcClock,
    source: str = TEXT_COMPLETION,
    builtin: str = "",
) -> tuple[float, float, float]:
    """(µs per inferlet-step, share of the decode window the collector took, µs of the
    scheduler's own work per inferlet-step in the window). ``builtin`` "whole" or
    "stream": the built-in ``text-completion`` instead of ``source``; the window then
    starts at the end of the last batch that forwards a prompt (a command of several
    tokens)."""
    async with Server(handle) as server:
        stats = server.scheduler.stats
        marks = [(0.0, 0.0, False)]  # (time, scheduler seconds, a prefill's forward in it)
        server.scheduler.observers.append(
            lambda batch, elapsed: marks.append(
                (time.perf_counter(), stats.seconds, any(c.tokens > 1 for c in batch))
            )
        )
        ps = [[5 + i % 100] * PROMPT for i in range(conc)]
        if builtin:
            opts = {"max_tokens": steps + 1, "temperature": 0, "ignore_eos": True}
            opts["stream"] = builtin == "stream"
            launches = [[json.dumps({**opts, "prompt": p})] for p in ps]
            events = await launch_and_collect(server, BUILTIN_TEXT_COMPLETION, launches)
            t0 = max(t for t, _, prefill in marks if prefill)
        else:
            launches = [[csv(p), str(steps + 1)] for p in ps]
            events = await launch_and_collect(server, source, launches)
            t0 = max(t for evs in events for t, ev in evs if isinstance(ev, Message))
    t1 = max(evs[-1][0] for evs in events)
    for evs in events:
        check([ev for _, ev in evs])

    def sched_at(t: float) -> float:  # the scheduler's seconds by the last batch done by t
        return max((m for m in marks if m[0] <= t), key=lambda m: m[0])[1]

    sched = (sched_at(t1) - sched_at(t0)) / (conc * steps) * 1e6
    return (t1 - t0) / (conc * steps) * 1e6, clock.within(t0, t1) / (t1 - t0), sched


def section_stub(info: EngineInfo, steps: int, reps: int, serving: gc_tuning.GcSettings) -> dict:
    """Per-inferlet-step cost over a stub engine under the server's collector settings,
    freezing alone and CPython's defaults (``serving``: what ``tune_for_serving`` replaced
    at the start of the run), and with the decode step as three API calls instead of the
    fused ``step`` (server's settings), interleaved; leaves the server's settings on."""
    most = max(CONCURRENCY)
    stub_info = dataclasses.replace(
        info,
        num_pages=most * (-(-(PROMPT + steps + 2) // PAGE_SIZE) + 1),
        num_embeds=most * (PROMPT + 2),
    )
    handle = InProcessEngine(StubEngine(stub_info, token=7))
    clock = GcClock()
    gc.callbacks.append(clock)
    print(
        f"(d) stub engine (answers at once): µs of control-layer + inferlet Python per "
        f"inferlet-step (embed -> forward -> sample), {steps} decode steps, fastest of {reps}; "
        "the server's collector settings (freeze + young threshold "
        f"{gc_tuning.YOUNG_THRESHOLD}) vs freezing alone (what the server did before) and "
        "CPython's defaults, and the fused step vs the step as three API calls (what the SDK "
        "did before), interleaved; share of the window the collector ran"
    )
    print(
        "| inferlets | **µs/step, serving gc** (gc share) | of which scheduler "
        "| three calls (gc share) | freeze only (gc share) | CPython defaults (gc share) "
        "| three calls / fused | freeze only / serving | defaults / serving |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    modes = {  # (collector settings, program), applied in this order every repetition
        "default": (lambda: gc_tuning.restore(serving), TEXT_COMPLETION),
        "freeze only": (lambda: gc_tuning.tune_for_serving(serving.thresholds[0]), TEXT_COMPLETION),
        "three calls": (gc_tuning.tune_for_serving, TEXT_COMPLETION_CALLS),
        "serving": (gc_tuning.tune_for_serving, TEXT_COMPLETION),
    }
    out: dict[str, float] = {}
    try:
        asyncio.run(stub_step_us(handle, 8, 4, clock))  # warm up
        asyncio.run(stub_step_us(handle, 8, 4, clock, TEXT_COMPLETION_CALLS))
        for c in CONCURRENCY:
            runs: dict[str, list[tuple[float, float, float]]] = {m: [] for m in modes}
            for _ in range(reps):
                for mode, (apply, source) in modes.items():
                    apply()
                    runs[mode].append(asyncio.run(stub_step_us(handle, c, steps, clock, source)))
            best = {m: min(r) for m, r in runs.items()}
            tuned = best["serving"][0]
            out[f"stub_step_us_{c}"] = round(tuned, 1)
            out[f"stub_step_scheduler_us_{c}"] = round(best["serving"][2], 1)
            out[f"stub_step_us_three_calls_{c}"] = round(best["three calls"][0], 1)
            out[f"stub_step_us_freeze_only_{c}"] = round(best["freeze only"][0], 1)
            out[f"stub_step_us_default_gc_{c}"] = round(best["default"][0], 1)
            cells = [f"{tuned:.1f} ({best['serving'][1]:.0%})", f"{best['serving'][2]:.1f}"]
            cells += [
                f"{best[m][0]:.1f} ({best[m][1]:.0%})"
                for m in ("three calls", "freeze only", "default")
            ]
            row = " | ".join(cells)
            print(
                f"| {c} | {row} | {best['three calls'][0] / tuned:.2f}x "
                f"| {best['freeze only'][0] / tuned:.2f}x "
                f"| {best['default'][0] / tuned:.2f}x |"
            )
        out.update(stub_builtin(handle, steps, reps, clock))
    finally:
        gc.callbacks.remove(clock)
        gc_tuning.tune_for_serving()
        handle.close()
    return out


def stub_builtin(handle: InProcessEngine, steps: int, reps: int, clock: GcClock) -> dict:
    """The built-in ``text-completion`` over the stub engine, whole and streaming, beside
    the benchmark's program (server's collector settings, interleaved)."""
    print()
    print(
        f"(d) the built-in text-completion (what /v1/completions runs: greedy, ignore_eos, "
        f"{steps + 1} tokens) over the same stub engine, µs per inferlet-step from the last "
        f"prefill on, fastest of {reps}; beside the benchmark's program (table above)"
    )
    print("| inferlets | **whole** (gc share) | **streaming** (gc share) | whole / program |")
    print("|---|---|---|---|")
    gc_tuning.tune_for_serving()
    out: dict[str, float] = {}
    for c in CONCURRENCY:
        runs: dict[str, list] = {"whole": [], "stream": [], "program": []}
        for _ in range(reps):
            for mode in runs:
                builtin = "" if mode == "program" else mode
                run = stub_step_us(handle, c, steps, clock, builtin=builtin)
                runs[mode].append(asyncio.run(run))
        best = {m: min(r) for m, r in runs.items()}
        out[f"stub_step_us_builtin_{c}"] = round(best["whole"][0], 1)
        out[f"stub_step_us_builtin_stream_{c}"] = round(best["stream"][0], 1)
        print(
            f"| {c} | {best['whole'][0]:.1f} ({best['whole'][1]:.0%}) "
            f"| {best['stream'][0]:.1f} ({best['stream'][1]:.0%}) "
            f"| {best['whole'][0] / best['program'][0]:.2f}x |"
        )
    return out


# --------------------------------------------------------------------------- (e) remote


def section_remote(
    path: Path, cfg: EngineConfig, n: int, max_tokens: int, window: float, rounds: int, vocab: int
) -> dict:
    """The adaptive policy with 1 and 2 batches in flight over an engine in another process
    (``spawn_engine``, ZeroMQ): does forming and sending the next batch while one runs
    help?"""
    ps = prompts(n, PROMPT, vocab, seed=20)
    print(
        f"(e) {n} concurrent text-completion inferlets over an engine process (ZeroMQ): "
        f"output tokens/s over a {window:g} s window after prefill, adaptive policy with "
        f"max_inflight 1 and 2, best of {rounds} rounds (interleaved); tokens = forward items "
        "dispatched in the window"
    )
    print("| batches in flight | **tok/s** | vs 1 | batches | mean batch |")
    print("|---|---|---|---|---|")
    runs: dict[int, list[dict]] = {1: [], 2: []}

    async def one(endpoint: str, inflight: int) -> dict:
        async with await RemoteEngine.connect(endpoint) as handle:
            policy = batch_policy("adaptive", max_inflight=inflight)
            return await policy_throughput(handle, policy, ps, max_tokens, window, timed=False)

    with spawn_engine(path, cfg, startup_timeout=600) as proc:
        asyncio.run(one(proc.endpoint, 1))  # warm up
        for _ in range(rounds):
            for k in runs:
                runs[k].append(asyncio.run(one(proc.endpoint, k)))
    best = {k: max(rs, key=lambda r: r["tok_s"]) for k, rs in runs.items()}
    out: dict[str, float] = {}
    for k, r in best.items():
        out[f"throughput_remote_inflight_{k}"] = round(r["tok_s"], 1)
        out[f"mean_batch_remote_inflight_{k}"] = round(r["mean_batch"], 1)
        print(
            f"| {k} | {r['tok_s']:.0f} | {r['tok_s'] / best[1]['tok_s']:.2f}x | {r['batches']} "
            f"| {r['mean_batch']:.1f} |"
        )
    return out


# --------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="reduced run (same JSON keys)")
    ap.add_argument("--model", type=Path, help="checkpoint directory (default: the small one)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--no-remote", action="store_true", help="skip (e), the engine process")
    ap.add_argument(
        "--sections",
        default="abcde",
        help="which sections to run, e.g. 'bd' (default all; the JSON has their keys only)",
    )
    args = ap.parse_args()
    sections = set(args.sections)
    if not sections <= set("abcde"):
        ap.error(f"--sections takes letters of 'abcde', got {args.sections!r}")
    if args.no_remote:
        sections.discard("e")
    t_start = time.perf_counter()
    torch.manual_seed(0)
    path = args.model or small_checkpoint(args.device)
    n_tok, reps = (16, 2) if args.quick else (128, 3)
    iters, warmup = (10, 2) if args.quick else (50, 5)
    window, rounds, max_tokens = (3.0, 1, 96) if args.quick else (8.0, 3, 160)
    n_conc = 128
    stub_steps, stub_reps = (8, 1) if args.quick else (32, 2)

    seq_pages = -(-(PROMPT + max_tokens + 1) // PAGE_SIZE)
    cfg = EngineConfig(
        device=args.device,
        dtype="bfloat16",
        page_size=PAGE_SIZE,
        num_pages=n_conc * seq_pages + 512,
        num_embeds=8192,
        num_host_pages=1,
    )
    engine = Engine.load(path, cfg)
    handle = InProcessEngine(TimedEngine(engine))
    serving = gc_tuning.tune_for_serving()  # as the server does once its engines are loaded
    vocab = engine.info.vocab_size
    print(f"# overhead: {engine.info.model_name} ({engine.cfg.num_params / 1e6:.0f}M params, bf16)")
    print(
        f"# machine: {cpu_name()}, {os.cpu_count()} cpus, "
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, device {args.device}"
    )
    print(f"# prompts {PROMPT} tokens (seeded), greedy, page size {PAGE_SIZE}, quick={args.quick}")
    out: dict[str, object] = {}
    if "a" in sections:
        print()
        out.update(section_tpot(handle, n_tok, reps, vocab))
    if "b" in sections:
        print()
        out.update(section_latency(handle, iters, warmup, vocab))
    if "c" in sections:
        print()
        out.update(section_policies(handle, n_conc, max_tokens, window, rounds, vocab))
    handle.close()
    if "d" in sections:
        print()
        out.update(section_stub(engine.info, stub_steps, stub_reps, serving))
    if "e" in sections:
        print()
        out.update(section_remote(path, cfg, n_conc, max_tokens, window, rounds, vocab))
    seconds = round(time.perf_counter() - t_start)
    out.update({"quick": args.quick, "device": args.device, "seconds": seconds})
    print(json.dumps(out))


if __name__ == "__main__":
    main()
