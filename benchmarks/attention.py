"""Decode attention over the paged pool: the native kernel vs the compiled graph's own.

    python benchmarks/attention.py [--quick] [--pool-gb 1.5] [--threads 2]

One decode step's attention, every layer, on SmolLM2-135M's shapes (9 query heads over 3 KV
heads, head dim 64, 30 layers) for the cases a server meets:

- ``B x L``: B sequences of L keys each, their own 16-token pages scattered at random over a
  pool of ``--pool-gb`` (at least 1.5x the rows the largest case reads; what a busy engine's page table looks like: the rows do not stream);
- ``shared``: the same B x L where every sequence's pages are one prompt's (the prefix
  cache): the rows fit in the caches.

Two implementations, alternating within each repetition so machine noise hits both alike:

- ``native``: ``pastry_native::decode_attention`` (``engine/data/native.cpp``), what the
  compiled decode step calls per layer: it reads the rows in place;
- ``graph``: what the step does without the native library: ``compiled._pool_attention``
  (gather the rows widened to float32, batched matrix products, masked softmax) compiled by
  inductor the same way, one graph per case.

Both in the pool's dtype (``--dtypes``, default bf16 and float32). Prints a table of ms per
step (all layers) and the speed-up, then one JSON line. ``--quick``: the same cases, 3
repetitions instead of 10.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import types

import torch

from pastry.engine import compiled, native

HQ, HKV, D, LAYERS, PAGE = 9, 3, 64, 30, 16
CASES = [(16, 320, False), (32, 1536, False), (32, 1536, True)]


def measure(graph, q, pool, kv_rows, kv, mask, reps) -> tuple[dict[str, float], float]:
    """Median ms of all layers' attention, native and graph, and their largest difference."""

    def run_native() -> None:
        for layer in range(LAYERS):
            torch.ops.pastry_native.decode_attention(
                q, pool, layer, LAYERS + layer, kv_rows, mask, D**-0.5
            )

    def run_graph() -> None:
        graph(q, pool, kv, mask)

    b = q.shape[0]
    a = torch.ops.pastry_native.decode_attention(q, pool, 3, LAYERS + 3, kv_rows, mask, D**-0.5)
    err = (a.reshape(b, HQ * D).float() - graph(q, pool, kv, mask)[3].float()).abs().max().item()
    times: dict[str, list[float]] = {"native": [], "graph": []}
    for fn in (run_native, run_graph):  # warm: compile, first touch
        fn()
    for _ in range(reps):
        for name, fn in (("native", run_native), ("graph", run_graph)):
            t = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t) * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}, err


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--pool-gb", type=float, default=1.5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtypes", default="bfloat16,float32")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not native.load() or not native.attention(D):
        raise SystemExit("the native library is not available here (no compiler or AVX512_BF16)")
    reps = 3 if args.quick else 10
    spec = types.SimpleNamespace(num_heads=HQ, num_kv_heads=HKV, head_dim=D, num_layers=LAYERS)

    def every_layer(q, pool, kv, mask):  # one graph per case, as one per decode step
        return [compiled._pool_attention(spec, q, pool, kv, mask, i) for i in range(LAYERS)]

    torch._dynamo.config.recompile_limit = 64
    graph = torch.compile(every_layer, dynamic=False, fullgraph=True)
    rows, result, pool_gb = [], {}, {}
    for dtype in [getattr(torch, n) for n in args.dtypes.split(",")]:
        bytes_per_slot = 2 * LAYERS * HKV * D * dtype.itemsize
        needed = max(b * -(-length // PAGE) for b, length, _ in CASES)
        pages = max(int(args.pool_gb * 2**30 / bytes_per_slot) // PAGE, needed * 3 // 2)
        pool_gb[str(dtype).removeprefix("torch.")] = pages * PAGE * bytes_per_slot / 2**30
        pool = torch.randn(2 * LAYERS, HKV, pages * PAGE, D).to(dtype)
        g = torch.Generator().manual_seed(0)
        for b, length, shared in CASES:
            per = -(-length // PAGE)
            if shared:
                table = torch.randperm(pages, generator=g)[:per].expand(b, per)
            else:
                table = torch.randperm(pages, generator=g)[: b * per].view(b, per)
            slots = (table.unsqueeze(-1) * PAGE + torch.arange(PAGE)).reshape(b, -1)[:, :length]
            heads = torch.arange(HKV).view(HKV, 1, 1).expand(HKV, b, length)
            kv_slots = slots.expand(HKV, b, length)
            kv_rows = heads * pool.shape[2] + kv_slots
            mask = torch.ones(b, length, dtype=torch.bool)
            q = torch.randn(b, HQ, D).to(dtype)

            ms, err = measure(graph, q, pool, kv_rows, (heads, kv_slots), mask, reps)
            case = f"{b}x{length}" + (" shared" if shared else "")
            dname = str(dtype).removeprefix("torch.")
            rows.append((dname, case, ms["native"], ms["graph"], err))
            key = f"{dname}_{b}x{length}" + ("_shared" if shared else "")
            result[f"native_ms_{key}"] = round(ms["native"], 2)
            result[f"graph_ms_{key}"] = round(ms["graph"], 2)
            result[f"graph_over_native_{key}"] = round(ms["graph"] / ms["native"], 2)
        del pool
    sizes = ", ".join(f"{k} {v:.1f} GB" for k, v in pool_gb.items())
    print(f"decode attention, {LAYERS} layers, {HQ}/{HKV} heads x {D}, pool: {sizes}")
    print(f"{args.threads} threads, median of {reps}")
    print(
        f"{'dtype':<9} {'case':<16} {'native ms':>10} {'graph ms':>10} {'speed-up':>9} {'max |diff|':>11}"
    )
    for dname, case, n, gr, err in rows:
        print(f"{dname:<9} {case:<16} {n:>10.2f} {gr:>10.2f} {gr / n:>8.2f}x {err:>11.2e}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
