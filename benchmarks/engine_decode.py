"""Engine decode/prefill/serving throughput vs HF transformers on the same weights.

    python benchmarks/engine_decode.py [--quick] [--model DIR|FILE.gguf] [--device cpu|cuda]
        [--dtype bfloat16|float32] [--quantize none|int8|int4] [--no-compile]

Without --model, writes the random-weight ``small`` llama checkpoint (hidden 768, 12
layers, vocab 32000, ~134M params) into ~/.cache/pastry/bench/ once. Both engines run the
same weights in ``--dtype`` (default bf16), greedy, in this process.

- decode: B sequences with 32-token prompts; ms per decode step (all B sequences advance one
  token) of our fused loop vs HF ``generate()`` (its decode time = generate(N) - generate(1)).
  "ours" is the engine as served (compiled decode step on CPU, ``--quantize`` applied);
  "eager" is the same engine with the eager model only (the path before the compiled step),
  so ``ours / eager`` shows what compiling buys at each batch size.
- prefill: one 512-token prompt, tokens/s.
- serving: 32 requests with prompts of 64-512 tokens and 128 new tokens each: our engine with
  continuous batching vs HF serving them one at a time.
- roofline: weight bytes streamed per decode step / measured memory read bandwidth.

``--quick`` measures exactly the same shapes (same batches, step counts, prompt and output
lengths, the same 32 serving requests) with fewer repetitions: one round of decode steps
instead of three, one prefill instead of three, and HF serves every fourth request of the
32 (its tokens/s is per request, so a sample estimates it) instead of all of them.

Prints tables, then one JSON line with the headline ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from machine import cpu_name  # benchmarks/ is on the path (the script's dir)
from pastry.engine.engine import Engine
from pastry.engine.generate import FusedGenerator, Request, _Running
from pastry.paths import bench_dir
from pastry.wire.calls import EmbedTxt, Forward, ids
from pastry.wire.config import EngineConfig

PROMPT = 32


def small_checkpoint(device: str) -> Path:
    from pastry.engine.tiny import create_tiny

    path = bench_dir() / "llama-small-seed0"
    if not (path / "config.json").exists():
        print(f"writing the small checkpoint to {path} ...", flush=True)
        create_tiny(path, arch="llama", size="small", seed=0, dtype="bfloat16")
    return path


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def read_bandwidth(device: str) -> float:
    """Bytes/s of a 1 GiB read (sum of random float32 data), median of 7."""
    x = torch.randn(1 << 28, dtype=torch.float32, device=device)
    times = []
    for _ in range(7):
        sync(device)
        t = time.perf_counter()
        x.sum()
        sync(device)
        times.append(time.perf_counter() - t)
    return x.numel() * 4 / statistics.median(times)


def prompts(n: int, length: int | list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    lengths = [length] * n if isinstance(length, int) else length
    return [rng.integers(0, vocab, ln).tolist() for ln in lengths]


def ours_decode(engine: Engine, batch: int, steps: int, vocab: int, device: str) -> list[float]:
    """Seconds of each of ``steps`` decode steps with ``batch`` sequences in flight."""
    gen = FusedGenerator(
        engine.execute, engine.info, prefill_budget=batch * PROMPT, max_running=batch
    )
    running = [_Running(Request(p, max_new_tokens=1 << 30)) for p in prompts(batch, PROMPT, vocab)]
    gen.step(running)  # prefill
    times = []
    for _ in range(steps):
        sync(device)
        t = time.perf_counter()
        gen.step(running)
        sync(device)
        times.append(time.perf_counter() - t)
    return times


def hf_generate(model, batch: list[list[int]], new: int, device: str) -> float:
    inp = torch.tensor(batch, device=device)
    sync(device)
    t = time.perf_counter()
    with torch.inference_mode():
        model.generate(
            inp,
            attention_mask=torch.ones_like(inp),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
        )
    sync(device)
    return time.perf_counter() - t


def hf_decode(model, batch: int, steps: int, vocab: int, device: str) -> float:
    """HF seconds per decode step: (generate(steps+1) - generate(1)) / steps."""
    p = prompts(batch, PROMPT, vocab)
    hf_generate(model, p, 2, device)  # warm up
    t1 = min(hf_generate(model, p, 1, device) for _ in range(2))
    tn = hf_generate(model, p, steps + 1, device)
    return (tn - t1) / steps


def ours_prefill(engine: Engine, length: int, vocab: int, device: str, reps: int) -> float:
    tokens = ids(prompts(1, length, vocab)[0])
    ps = engine.page_size
    pages = ids(range(-(-length // ps)))
    calls = [
        EmbedTxt(tokens, ids(range(length)), ids(range(length))),
        Forward(in_embeds=ids(range(length)), out_pages=pages, positions=ids(range(length))),
    ]
    engine.execute(calls)  # warm up
    best = float("inf")
    for _ in range(reps):
        sync(device)
        t = time.perf_counter()
        engine.execute(calls)
        sync(device)
        best = min(best, time.perf_counter() - t)
    return length / best


def hf_prefill(model, length: int, vocab: int, device: str, reps: int) -> float:
    inp = torch.tensor(prompts(1, length, vocab), device=device)
    best = float("inf")
    with torch.inference_mode():
        model(inp)  # warm up
        for _ in range(reps):
            sync(device)
            t = time.perf_counter()
            model(inp)
            sync(device)
            best = min(best, time.perf_counter() - t)
    return length / best


def serving(
    engine: Engine, model, n: int, new: int, vocab: int, device: str, hf_every: int
) -> dict:
    """Our engine serves all ``n`` requests; HF serves every ``hf_every``-th of them one at a
    time (its tokens/s is per request)."""
    lengths = np.random.default_rng(1).integers(64, 513, n).tolist()
    ps = prompts(n, lengths, vocab, seed=2)
    gen = FusedGenerator(engine.execute, engine.info, prefill_budget=512, max_running=n)
    reqs = [Request(p, max_new_tokens=new) for p in ps]
    sync(device)
    t = time.perf_counter()
    gen.run(reqs)
    sync(device)
    ours = time.perf_counter() - t
    assert all(len(r.output) == new for r in reqs)
    sample = ps[::hf_every]
    t = time.perf_counter()
    for p in sample:
        hf_generate(model, [p], new, device)
    hf = time.perf_counter() - t
    return {
        "requests": n,
        "new_tokens": new,
        "prompt_tokens": sum(lengths),
        "ours_s": ours,
        "hf_requests": len(sample),
        "hf_s": hf,
        "ours_tok_s": n * new / ours,
        "hf_tok_s": len(sample) * new / hf,
        "ours_steps": gen.steps,
        "ours_mean_batch": float(np.mean(gen.batch_sizes)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="same shapes, fewer repetitions")
    ap.add_argument(
        "--model", type=Path, help="checkpoint directory or .gguf file (default: the small one)"
    )
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--quantize", default="none", choices=("none", "int8", "int4"))
    ap.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="compiled decode step for 'ours' (CPU; default on)",
    )
    ap.add_argument("--batches", default="1,8,32,128")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    device = args.device
    dtype = getattr(torch, args.dtype)
    path = args.model or small_checkpoint(device)
    batches = [int(b) for b in args.batches.split(",")]
    steps, rounds, reps, hf_every = 32, (1 if args.quick else 3), (1 if args.quick else 3), 1
    if args.quick:
        hf_every = 4
    serve_n, serve_new = 32, 128

    def config(compiled: bool) -> EngineConfig:
        return EngineConfig(
            device=device,
            dtype=args.dtype,
            page_size=16,
            num_pages=max(batches) * (PROMPT + steps + 32) // 16 + 2048,
            num_embeds=max(max(batches) * PROMPT, 512) + 4 * max(batches) + 64,
            num_host_pages=1,
            quantize=args.quantize,
            compile=compiled,
        )

    bw = read_bandwidth(device)  # first, in a fresh process, before any model is loaded
    t0 = time.perf_counter()
    engine = Engine.load(path, config(args.compile and device == "cpu"))
    compile_s = time.perf_counter() - t0
    eager = Engine.load(path, config(False)) if engine.compiled is not None else None
    gguf = {"gguf_file": path.name} if path.is_file() else {}  # transformers reads it too
    hf = AutoModelForCausalLM.from_pretrained(path.parent if gguf else path, dtype=dtype, **gguf)
    hf = hf.to(device).eval()
    vocab = engine.info.vocab_size
    mc = engine.cfg
    elem = 2 if dtype == torch.bfloat16 else 4
    streamed = sum(
        lin.quantized.nbytes
        if lin.quantized is not None
        else lin.out_features * lin.in_features * elem
        for lin in engine.model.linears()
    )
    roofline_ms = streamed / bw * 1e3

    kinds = {lin.kind for lin in engine.model.linears()}
    print(
        f"# engine_decode: {engine.info.model_name} ({mc.num_params / 1e6:.0f}M params, "
        f"{args.dtype}, projections {'/'.join(sorted(kinds))}, "
        f"{'compiled decode step' if engine.compiled else 'eager'})"
    )
    print(
        f"# machine: {cpu_name()}, {os.cpu_count()} cpus, "
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, device {device}"
    )
    print(
        f"# measured read bandwidth {bw / 1e9:.1f} GB/s -> decode roofline {roofline_ms:.2f} "
        f"ms/step at B=1 ({streamed / 1e6:.0f} MB of weights per step); engine load"
        f"{' + compile' if engine.compiled else ''} {compile_s:.1f}s"
    )
    print()
    print(
        "| batch | ours ms/step | ours tok/s | eager ms/step | ours / eager "
        "| HF ms/step | HF tok/s | ours / HF |"
    )
    print("|---|---|---|---|---|---|---|---|")
    out: dict[str, float] = {}
    for b in batches:
        ours_decode(engine, b, 3, vocab, device)  # warm shapes
        if eager is not None:
            ours_decode(eager, b, 3, vocab, device)
        o_t, e_t = [], []
        for _ in range(rounds):  # rounds alternate the two engines over the same shapes
            o_t += ours_decode(engine, b, steps, vocab, device)
            if eager is not None:
                e_t += ours_decode(eager, b, steps, vocab, device)
        o = statistics.median(o_t)
        e = statistics.median(e_t) if e_t else o
        h = hf_decode(hf, b, steps, vocab, device)
        ratio = h / o
        out[f"ratio_vs_transformers_bs{b}"] = round(ratio, 3)
        out[f"ms_per_step_bs{b}"] = round(o * 1e3, 2)
        out[f"ratio_vs_eager_bs{b}"] = round(e / o, 3)
        print(
            f"| {b} | {o * 1e3:.1f} | {b / o:.0f} | {e * 1e3:.1f} | {e / o:.2f}x "
            f"| {h * 1e3:.1f} | {b / h:.0f} | {ratio:.2f}x |"
        )
    print()
    ours_pf = ours_prefill(engine, 512, vocab, device, reps)
    hf_pf = hf_prefill(hf, 512, vocab, device, reps)
    print(
        f"prefill 512 tokens: ours {ours_pf:.0f} tok/s, HF {hf_pf:.0f} tok/s ({ours_pf / hf_pf:.2f}x)"
    )
    print()
    s = serving(engine, hf, serve_n, serve_new, vocab, device, hf_every)
    sr = s["ours_tok_s"] / s["hf_tok_s"]
    print(
        f"serving {s['requests']} requests, prompts 64-512 ({s['prompt_tokens']} tokens), "
        f"{s['new_tokens']} new tokens each:"
    )
    print("| engine | wall s | output tok/s |")
    print("|---|---|---|")
    print(
        f"| ours, continuous batching ({s['ours_steps']} steps, mean batch {s['ours_mean_batch']:.1f}) "
        f"| {s['ours_s']:.1f} | {s['ours_tok_s']:.0f} |"
    )
    print(
        f"| HF generate, one at a time ({s['hf_requests']} of the requests) | {s['hf_s']:.1f} "
        f"| {s['hf_tok_s']:.0f} |"
    )
    print(f"serving ratio: {sr:.2f}x")
    out.update(
        {
            "roofline_ms_bs1": round(roofline_ms, 2),
            "read_bandwidth_gbs": round(bw / 1e9, 1),
            "prefill_tok_s_512": round(ours_pf),
            "prefill_ratio_vs_transformers_512": round(ours_pf / hf_pf, 3),
            "serving_ratio_vs_transformers_32": round(sr, 3),
            "compiled": engine.compiled is not None,
            "dtype": args.dtype,
            "quantize": args.quantize,
            "quick": args.quick,
            "device": device,
        }
    )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
