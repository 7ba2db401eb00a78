"""Several engines on a CPU: microserving's experiments scaled down (digest §4.6), and
Autellix's locality-aware load balancer.

    flock -x /tmp/pastry-bench.lock .venv/bin/python benchmarks/microserving.py [--quick]

Engines are separate processes, each pinned to its own core (``pastry serve --engines``);
the control layer and the request driver run in this process. Parts:

1. **KV transfer bandwidth**: ``SendKv`` of N pages (every layer) into another engine's
   shared-memory pool, against the same page copies in one process (``index_select`` +
   ``index_copy_`` between two pools) and one contiguous memcpy of as many bytes; and over
   TCP (the cross-host path) on loopback.
2. **Per-layer compute vs transfer (paper Table 3)**: a prefill of ``u`` new tokens on top
   of a context of ``c``, per layer, against sending the ``c + u`` tokens' K/V of one layer.
3. **KV migration (paper Fig. 12)**: a context of ``c`` tokens already on engine 0, a new
   prompt ``c + u``: engine 0 computes ``u`` on top of what it holds and writes all of it
   into engine 1, which decodes (migration), against engine 1 recomputing ``c + u``.
   The time is from the request to the first token.
4. **DP vs 1P1D vs 1P1D-balance (0.1, 0.2, 0.3)** (paper Figs. 10, 11, 13): Poisson arrivals
   at per-engine rates of a ShareGPT-like workload (in ~200, out ~64 tokens) and a
   long-input one (normal(960, 5) in, normal(32, 5) out: the paper's 3000/100 scaled by
   0.32), every request through the router: TTFT / TPOT / JCT mean and P99.
5. **Locality (Autellix Alg. 2)**: multi-turn programs (each turn a new call carrying the
   whole history; threshold 2048 scaled to 256 tokens), locality vs round robin vs least
   loaded: programs per second.

``--hosts netns``: the same parts across hosts made as Linux network namespaces joined by a
bridge (``tests/netns_util.py``: own address, hostname and ``/dev/shm``; needs root). Part 1's
TCP transfer goes from an engine on host 0 to a receiver on host 1; parts 3 to 5 run on
``pastry engine --listen`` processes on hosts 0 and 1 (one core each), the control layer and
the driver in this process on host 2, so every K/V a router moves crosses the bridge over
TCP. Everything made is removed at the end, also on failure.

``--quick`` runs the same shapes with fewer requests and repetitions. The last line is a
JSON object. Numbers depend on the CPU (``lscpu``) and on anything else running.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from pastry.wire.calls import EmbedTxt, Forward, SendKv, ids

ROOT = Path(__file__).resolve().parents[1]
log = logging.getLogger("microserving")


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


# ----------------------------------------------------------------------------- 1 + 2: engines


def engine_pair(model: str, dtype: str, pages: int):
    """Two engines in this process with shared-memory pools (bandwidth and Table 3)."""
    import uuid

    from pastry.engine.engine import Engine
    from pastry.wire.config import EngineConfig

    def one() -> Engine:
        shm = f"/dev/shm/pastry-kv-bench-{uuid.uuid4().hex[:8]}"
        return Engine.load(model, EngineConfig(dtype=dtype, num_pages=pages, num_embeds=8192,
                                               kv_shm=shm))  # fmt: skip

    return one(), one()


def bandwidth(a, b, n_pages: int, reps: int, hosts=None) -> dict:
    """GB/s of SendKv (shm, tcp) and of a plain copy of the same K/V, best of ``reps``.
    With ``hosts``, the TCP receiver is on host 1 and the sender's connection on host 0
    (else both on loopback)."""
    from pastry.engine.transfer import KvReceiver

    src, dst = ids(range(n_pages)), ids(range(n_pages, 2 * n_pages))
    ps = a.page_size
    nbytes = 2 * a.cfg.num_layers * n_pages * ps * a.cfg.kv_size * a.kv.k[0].element_size()
    pages_s, pages_d = torch.from_numpy(src), torch.from_numpy(dst)

    def plain() -> None:  # the same page copies in one process, no transfer machinery
        for sk, dk in ((a.kv.k, b.kv.k), (a.kv.v, b.kv.v)):
            for s, d in zip(sk, dk, strict=True):
                h, slots, dim = s.shape
                block = s.view(h, slots // ps, ps * dim).index_select(1, pages_s)
                d.view(h, -1, ps * dim).index_copy_(1, pages_d, block)

    def timed(fn) -> float:
        best = float("inf")
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t)
        return best

    flat_src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    flat_dst = torch.empty(nbytes, dtype=torch.uint8)
    shm = SendKv(src, dst, n_pages * ps, b.info.kv_peers[0])
    if hosts is None:
        recv = KvReceiver(b.kv, "tcp://127.0.0.1:0")
    else:  # its sockets are made on host 1 (zmq's threads start in its namespace)
        recv = hosts.call(1, KvReceiver, b.kv, f"tcp://{hosts.address(1)}:0")
    tcp = SendKv(src, dst, n_pages * ps, recv.endpoint)
    try:
        # connect once (on host 0: the sender's connection is made there)
        (a.execute if hosts is None else lambda c: hosts.call(0, a.execute, c))([tcp])
        t_plain = timed(plain)
        t_memcpy = timed(lambda: flat_dst.copy_(flat_src))
        t_shm = timed(lambda: a.execute([shm]))
        t_tcp = timed(lambda: a.execute([tcp]))
    finally:
        recv.close()
    return {
        "bytes": nbytes,
        "plain_copy_gbs": nbytes / t_plain / 1e9,
        "memcpy_gbs": nbytes / t_memcpy / 1e9,
        "shm_gbs": nbytes / t_shm / 1e9,
        "tcp_gbs": nbytes / t_tcp / 1e9,
    }


def per_layer_table(a, b, contexts: list[int], unique: int, reps: int) -> list[dict]:
    """Paper Table 3: per-layer prefill time of ``unique`` tokens on a context vs per-layer
    transfer time of the context + unique tokens' K/V."""
    ps = a.page_size
    rows = []
    rng = np.random.default_rng(0)
    for c in contexts:
        n = c + unique
        tokens = rng.integers(100, a.cfg.vocab_size - 100, n)
        pages = list(range(-(-n // ps)))
        a.execute([EmbedTxt(ids(tokens[:c]), ids(range(c)), ids(range(c))),
                   Forward(ids(range(c)), out_pages=ids(pages[: -(-c // ps)]))])  # fmt: skip
        ctx = pages[: -(-c // ps)]
        last = c - (len(ctx) - 1) * ps
        calls = [
            EmbedTxt(ids(tokens[c:]), ids(range(c, n)), ids(range(unique))),
            Forward(ids(range(unique)), ctx_pages=ids(ctx), ctx_last_len=last,
                    out_pages=ids(pages[c // ps :]), out_offset=c % ps),
        ]  # fmt: skip
        forward = min(_time(lambda calls=calls: a.execute(calls)) for _ in range(reps))
        send = SendKv(ids(pages), ids([p + len(pages) for p in pages]), n, b.info.kv_peers[0])
        transfer = min(_time(lambda send=send: a.execute([send])) for _ in range(reps))
        layers = a.cfg.num_layers
        rows.append({
            "input": n, "context": c, "unique": unique,
            "t_per_layer_ms": forward / layers * 1e3, "t_kv_transfer_ms": transfer / layers * 1e3,
            "ratio": transfer / forward,
        })  # fmt: skip
    return rows


def _time(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


# ----------------------------------------------------------------------------- 3: migration

MIGRATION = """
import time
import pastry.sdk as px
from pastry.sdk import Context

async def main(args):
    c, u, mode = int(args[0]), int(args[1]), args[2]
    model = px.available_models()[0]
    tokens = [int(t) for t in args[3].split(",")]
    context, prompt = tokens[:c], tokens[: c + u]
    held = Context(engine=0)
    held.fill_tokens(context)
    await held.flush(keep_last=False)  # the context is on engine 0 already
    q1 = px.create_queue(model, 1)
    t = time.perf_counter()
    if mode == "migrate":
        kv, matched = await px.prep_recv(q1, prompt, -1)
        await px.remote_send(held.queue, prompt, kv, 1, matched, -1, held.pages, c)
        pages = px.start_generate(q1, prompt, -1)
        ctx = Context(queue=q1)
        ctx.pages, ctx.kv_len, ctx.tokens, ctx.pending = pages, len(prompt) - 1, prompt, prompt[-1:]
    else:
        ctx = Context(queue=q1)
        ctx.fill_tokens(prompt)
    await ctx.generate_until(max_tokens=1)
    elapsed = time.perf_counter() - t
    await held.release()
    await ctx.release()
    return str(elapsed)
"""


async def migration(server, contexts: list[int], unique: int, reps: int, vocab: int) -> list[dict]:
    from pastry.runtime.trusted import Program

    prog = Program.from_source("bench-migration", MIGRATION)
    rng = np.random.default_rng(1)
    rows = []
    for c in contexts:
        times: dict[str, list[float]] = {"migrate": [], "recompute": []}
        for _ in range(reps):  # interleaved A/B
            for mode in times:
                # fresh tokens every launch: the engines' prefix caches must not serve them
                tokens = ",".join(map(str, rng.integers(100, vocab - 100, c + unique)))
                end = await server.runtime.launch(prog, [str(c), str(unique), mode, tokens]).wait()
                times[mode].append(float(end.result))
        m, r = min(times["migrate"]), min(times["recompute"])
        rows.append({"context": c, "unique": unique, "migrate_s": m, "recompute_s": r,
                     "speedup": r / m})  # fmt: skip
    return rows


# ----------------------------------------------------------------------------- 4: patterns


def workload(kind: str, n: int, vocab: int, seed: int) -> list[tuple[int, int]]:
    """(prompt tokens, output tokens) per request."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        if kind == "sharegpt":  # short and balanced (ShareGPT's means 200 / 260, out scaled)
            i, o = int(rng.integers(100, 300)), int(rng.integers(32, 96))
        else:  # long input: normal(3000, 5) / normal(100, 5) scaled by 0.32
            i, o = int(rng.normal(960, 5)), max(2, int(rng.normal(32, 5)))
        out.append((i, o))
    return out


def with_tokens(
    lengths: list[tuple[int, int]], vocab: int, rng: np.random.Generator
) -> list[tuple[list[int], int]]:
    """The same request lengths with fresh prompt tokens: every pattern and rate runs the
    same shapes, and none finds an earlier run's prompts in the engines' prefix caches."""
    return [(rng.integers(100, vocab - 100, i).tolist(), o) for i, o in lengths]


async def run_requests(server, reqs, rate_total: float, seed: int) -> dict:
    """Poisson arrivals at ``rate_total`` req/s through the active router: TTFT/TPOT/JCT."""
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1 / rate_total, len(reqs))
    results = []

    async def one(prompt: list[int], n_out: int, delay: float) -> None:
        await asyncio.sleep(delay)
        t0 = time.perf_counter()
        opts = {"prompt": prompt, "max_tokens": n_out, "temperature": 0, "stream": True}
        inst = server.launch("text-completion", [json.dumps(opts)])
        first = None
        async for ev in inst.events():
            if ev.kind == "message" and first is None:
                first = time.perf_counter()
            if ev.kind != "message":
                end = time.perf_counter()
                if ev.kind != "result":
                    raise RuntimeError(f"request failed: {ev}")
                used = json.loads(ev.result)["usage"]["completion_tokens"]
                first = first or end
                tpot = (end - first) / max(1, used - 1)
                results.append((first - t0, tpot, end - t0))

    t = time.perf_counter()
    await asyncio.gather(*(one(p, o, d) for (p, o), d in zip(reqs, np.cumsum(gaps), strict=True)))
    wall = time.perf_counter() - t
    ttft, tpot, jct = (list(x) for x in zip(*results, strict=True))
    return {
        "ttft_mean": statistics.mean(ttft), "ttft_p99": pct(ttft, 99),
        "tpot_mean": statistics.mean(tpot), "tpot_p99": pct(tpot, 99),
        "jct_mean": statistics.mean(jct), "jct_p99": pct(jct, 99), "wall": wall,
    }  # fmt: skip


# ----------------------------------------------------------------------------- 5: locality

PROGRAM = """
import json
import pastry.sdk as px
from pastry.sdk import Context

async def main(args):
    spec = json.loads(args[0])
    history = list(spec["system"])
    for turn in spec["turns"]:
        history += turn
        ctx = Context()  # each call a new context with the whole history, placed by the router
        ctx.fill_tokens(history)
        await ctx.generate_until(max_tokens=spec["out"])
        history = list(ctx.tokens)
        await ctx.release()
    return str(len(history))
"""


async def run_programs(server, programs: list[str], rate: float, seed: int) -> dict:
    """Programs at Poisson arrivals of ``rate`` programs/s: programs per second (first
    arrival to last end), mean program latency (its arrival to its end), and the share of
    prompt tokens the engines' prefix caches served (over the run)."""
    from pastry.runtime.trusted import Program

    prog = Program.from_source("bench-multiturn", PROGRAM)
    gaps = np.cumsum(np.random.default_rng(seed).exponential(1 / rate, len(programs)))
    latencies: list[float] = []

    async def one(spec: str, delay: float) -> None:
        await asyncio.sleep(delay)
        t = time.perf_counter()
        end = await server.runtime.launch(prog, [spec]).wait()
        if end.kind != "result":
            raise RuntimeError(f"program failed: {end}")
        latencies.append(time.perf_counter() - t)

    before = _cache_counts(server)
    t = time.perf_counter()
    await asyncio.gather(*(one(s, d) for s, d in zip(programs, gaps, strict=True)))
    wall = time.perf_counter() - t
    hit, looked = (a - b for a, b in zip(_cache_counts(server), before, strict=True))
    return {"programs_s": len(programs) / wall, "latency_mean": statistics.mean(latencies),
            "cache_hit": hit / looked if looked else float("nan")}  # fmt: skip


def _cache_counts(server) -> tuple[int, int]:
    """(prompt tokens the prefix caches matched, prompt tokens looked up), every engine."""
    hit = looked = 0
    for m in server.controller.all_engines():
        if m.prefiller is not None:  # what /metrics reports (pastry_prefix_cache_*_tokens)
            hit += m.prefiller.stats.cached_tokens
            looked += m.prefiller.stats.tokens
    return hit, looked


def multiturn(n: int, vocab: int, seed: int) -> list[str]:
    """``n`` programs of fixed shapes (a shared system prompt, 5 turns); ``seed`` picks
    their tokens."""
    rng = np.random.default_rng(seed)
    system = rng.integers(100, vocab - 100, 96).tolist()  # shared by every program
    return [
        json.dumps({"system": system, "out": 24,
                    "turns": [rng.integers(100, vocab - 100, 40).tolist() for _ in range(5)]})
        for _ in range(n)
    ]  # fmt: skip


# ----------------------------------------------------------------------------- main


async def serving_parts(args, model: str, vocab: int, out: dict, remote=()) -> None:
    """Parts 3 to 5 on two engines: local processes (``pastry serve --engines 2``), or the
    ``remote`` ``pastry engine --listen`` endpoints."""
    from pastry.server.service import PastryServer, ServerConfig

    where = (
        {"engines": 0, "remote_engines": tuple(remote), "engine_token": TOKEN}
        if remote
        else {"engines": 2}
    )
    cfg = ServerConfig(model=Path(model), dtype=args.dtype, num_pages=args.pages,
                       num_embeds=8192, router="round-robin", **where,
                       programs_dir=Path(os.environ.get("TMPDIR", "/tmp")) / "pastry-bench-programs")  # fmt: skip
    server = PastryServer(cfg)
    await server.start()
    try:
        reps = 2 if args.quick else 4
        scale = args.scale
        ctxs = [int(x * scale) for x in (500, 2500, 4500)]
        out["migration"] = await migration(server, ctxs, int(500 * scale), reps, vocab)
        n_req = 8 if args.quick else 24
        patterns = {"dp": "round-robin", "1p1d": "pd", **{f"1p1d-balance-{r}": f"pd-balance:{r}"
                                                          for r in (0.1, 0.2, 0.3)}}  # fmt: skip
        out["patterns"] = {}
        tokens_rng = np.random.default_rng(6)
        for kind, rates in (("sharegpt", args.rates_sharegpt), ("longinput", args.rates_long)):
            lengths = workload(kind, n_req, vocab, seed=2)
            for rate in rates:  # per engine
                for name, router in patterns.items():
                    await server.set_router(router)
                    reqs = with_tokens(lengths, vocab, tokens_rng)
                    r = await run_requests(server, reqs, 2 * rate, seed=3)
                    out["patterns"][f"{kind}/{rate}/{name}"] = r
                    print(f"  {kind:9} {rate:5.2f} req/s/engine {name:16} TTFT {r['ttft_mean']:6.2f}"
                          f" / {r['ttft_p99']:6.2f}  TPOT {r['tpot_mean'] * 1e3:6.1f} / "
                          f"{r['tpot_p99'] * 1e3:6.1f} ms  JCT {r['jct_mean']:6.2f} / "
                          f"{r['jct_p99']:6.2f} s", flush=True)  # fmt: skip
        out["locality"] = {}
        for i, (name, router) in enumerate((("round-robin", "round-robin"),
                                            ("least-loaded", "least-loaded"),
                                            ("locality", "locality:256"))):  # fmt: skip
            # the same shapes with fresh tokens per router (an earlier router's programs
            # would otherwise be in the prefix caches)
            programs = multiturn(6 if args.quick else 16, vocab, seed=10 + i)
            await server.set_router(router)
            r = await run_programs(server, programs, args.program_rate, seed=5)
            out["locality"][name] = r
            print(f"  locality {name:13} {r['programs_s']:.3f} programs/s, program latency "
                  f"{r['latency_mean']:.2f} s, prefix-cache hits {r['cache_hit']:.0%}", flush=True)  # fmt: skip
    finally:
        await server.stop()


TOKEN = "microserving-bench"  # the engines' token on the namespaced hosts
ENGINE_PORT, KV_PORT = 7000, 7001


def make_hosts():
    """Three hosts as network namespaces (``tests/netns_util.py``), or exit saying why not."""
    import shutil
    import subprocess

    sys.path.insert(0, str(ROOT / "tests"))
    from netns_util import Hosts

    if os.geteuid() != 0 or not (shutil.which("ip") and shutil.which("unshare")):
        sys.exit("--hosts netns needs root, ip (iproute2) and unshare (util-linux)")
    try:
        return Hosts(3)
    except subprocess.CalledProcessError as e:
        sys.exit(f"--hosts netns: cannot make network namespaces: {e.stderr.strip()}")


def start_remote_engines(hosts, args, logdir: Path) -> list[str]:
    """``pastry engine --listen`` on hosts 0 and 1, core ``i`` each; their endpoints once
    both serve."""
    import subprocess

    endpoints = []
    for i in (0, 1):
        addr = hosts.address(i)
        argv = ["taskset", "-c", str(i % (os.cpu_count() or 1)), sys.executable, "-m",
                "pastry.cli", "engine", "--listen", f"tcp://{addr}:{ENGINE_PORT}", "--kv-recv",
                f"tcp://{addr}:{KV_PORT}", "--model", args.model, "--dtype", args.dtype,
                "--num-pages", str(args.pages), "--num-embeds", "8192", "--threads", "1"]  # fmt: skip
        log = open(logdir / f"engine{i}.log", "w")  # noqa: SIM115 (the process keeps it)
        hosts.run(i, argv, env={**os.environ, "PASTRY_ENGINE_TOKEN": TOKEN}, stdout=log,
                  stderr=subprocess.STDOUT)  # fmt: skip
        endpoints.append(f"tcp://{addr}:{ENGINE_PORT}")
    deadline = time.time() + 600
    for i in (0, 1):
        log = logdir / f"engine{i}.log"
        while "serving " not in log.read_text():
            if time.time() > deadline:
                sys.exit(f"engine on host {i} did not start: {log.read_text()[-2000:]}")
            time.sleep(0.5)
    return endpoints


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="checkpoint directory (default: the embedded model)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--pages", type=int, default=2048, help="KV pages per engine")
    p.add_argument("--scale", type=float, default=0.25, help="context lengths x this")
    p.add_argument("--rates-sharegpt", type=float, nargs="+", default=[0.2, 0.5])
    p.add_argument("--rates-long", type=float, nargs="+", default=[0.1, 0.25])
    p.add_argument("--program-rate", type=float, default=0.5)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--details", metavar="FILE", help="write every measurement here (JSON)")
    p.add_argument("--hosts", choices=("local", "netns"), default="local",
                   help="netns: engines on hosts made as network namespaces (needs root)")  # fmt: skip
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.model is None:
        from pastry.engine.tiny import ensure_default_model

        args.model = str(ensure_default_model())
    torch.set_num_threads(1)
    os.sched_setaffinity(0, {0})
    out: dict = {"model": args.model, "dtype": args.dtype, "quick": args.quick, "hosts": args.hosts}
    hosts = make_hosts() if args.hosts == "netns" else None
    if hosts is not None:  # a TERM also removes the namespaces (the finally below)
        import signal

        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        run_parts(args, out, hosts)
    finally:
        if hosts is not None:
            hosts.close()
    report(args, out)


def run_parts(args, out: dict, hosts) -> None:
    a, b = engine_pair(args.model, args.dtype, 1024)
    vocab = a.cfg.vocab_size
    tcp_path = "TCP loopback" if hosts is None else "TCP host to host (veth, bridge)"
    try:
        out["bandwidth"] = bw = bandwidth(a, b, 256, 3 if args.quick else 10, hosts)
        print(f"KV transfer of {bw['bytes'] / 1e6:.1f} MB (every layer): SendKv through shared "
              f"memory {bw['shm_gbs']:.2f} GB/s, over {tcp_path} {bw['tcp_gbs']:.2f} GB/s; the "
              f"same gathers and scatters in one process {bw['plain_copy_gbs']:.2f} GB/s; one "
              f"contiguous memcpy {bw['memcpy_gbs']:.2f} GB/s")  # fmt: skip
        scale = args.scale
        out["table3"] = rows = per_layer_table(a, b, [int(x * scale) for x in (500, 2500, 4500)],
                                               int(500 * scale), 2 if args.quick else 5)  # fmt: skip
        print("per layer (Table 3): input, T_per-layer ms, T_KV-transfer ms, ratio")
        for r in rows:
            print(f"  {r['input']:6} {r['t_per_layer_ms']:8.3f} {r['t_kv_transfer_ms']:8.3f} "
                  f"{r['ratio'] * 100:6.1f}%")  # fmt: skip
    finally:
        a.close()
        b.close()
        del a, b
    os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))
    if hosts is None:
        asyncio.run(serving_parts(args, args.model, vocab, out))
        return
    import tempfile

    remote = start_remote_engines(hosts, args, Path(tempfile.mkdtemp(prefix="ms-hosts-")))
    # the control layer on host 2: its connections to the engines are made there
    hosts.call(2, lambda: asyncio.run(serving_parts(args, args.model, vocab, out, remote)))


def report(args, out: dict) -> None:
    for r in out["migration"]:
        print(f"migration: context {r['context']} + {r['unique']}: {r['migrate_s']:.3f} s vs "
              f"recompute {r['recompute_s']:.3f} s ({r['speedup']:.2f}x)")  # fmt: skip
    pat = out["patterns"]
    high = max(args.rates_long)
    dp = pat[f"longinput/{high}/dp"]["jct_p99"]
    best_pd = min(v["jct_p99"] for k, v in pat.items()
                  if k.startswith(f"longinput/{high}/1p1d"))  # fmt: skip
    loc = out["locality"]
    summary = {
        "p99_jct_dp_over_best_pd_longinput": dp / best_pd,
        "migration_prefill_speedup": out["migration"][0]["speedup"],
        "kv_transfer_gbs": out["bandwidth"]["shm_gbs"],
        "kv_transfer_over_plain_copy": out["bandwidth"]["shm_gbs"]
        / out["bandwidth"]["plain_copy_gbs"],
        "kv_transfer_over_memcpy": out["bandwidth"]["shm_gbs"] / out["bandwidth"]["memcpy_gbs"],
        ("kv_transfer_tcp_gbs" if args.hosts == "local" else "kv_transfer_tcp_hosts_gbs"): out[
            "bandwidth"
        ]["tcp_gbs"],
        "hosts": args.hosts,
        "locality_lb_throughput_over_round_robin": loc["locality"]["programs_s"]
        / loc["round-robin"]["programs_s"],
        "locality_lb_throughput_over_least_loaded": loc["locality"]["programs_s"]
        / loc["least-loaded"]["programs_s"],
        "program_latency_round_robin_over_locality": loc["round-robin"]["latency_mean"]
        / loc["locality"]["latency_mean"],
        "cache_hit_locality_round_robin": [
            loc["locality"]["cache_hit"],
            loc["round-robin"]["cache_hit"],
        ],
        "table3_transfer_ratio": [round(r["ratio"], 4) for r in out["table3"]],
    }
    if args.details:
        Path(args.details).write_text(json.dumps(out, indent=1))
    print(json.dumps(summary))


if __name__ == "__main__":
    sys.exit(main())
