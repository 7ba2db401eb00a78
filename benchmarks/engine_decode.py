"""Engine decode/prefill/serving throughput vs HF transformers on the same weights.

    python benchmarks/engine_decode.py [--quick] [--model DIR|FILE.gguf] [--device cpu|cuda]

Without --model, writes the random-weight ``small`` llama checkpoint (hidden 768, 12
layers, vocab 32000, ~134M params) into ~/.cache/pastry/bench/ once. Both engines run the
same bf16 weights, greedy, in this process, one after the other.

- decode: B sequences with 32-token prompts; ms per decode step (all B sequences advance one
  token) of our fused loop vs HF ``generate()`` (its decode time = generate(N) - generate(1)).
- prefill: one 512-token prompt, tokens/s.
- serving: 32 requests with prompts of 64-512 tokens and 128 new tokens each: our engine with
  continuous batching vs HF serving them one at a time.
- roofline: weight bytes streamed per decode step / measured memory read bandwidth.

Prints tables, then one JSON line with the headline ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from pastry.engine.calls import EmbedTxt, Forward, ids
from pastry.engine.config import EngineConfig
from pastry.engine.engine import Engine
from pastry.engine.generate import FusedGenerator, Request, _Running
from pastry.paths import bench_dir

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


def ours_decode(engine: Engine, batch: int, steps: int, vocab: int, device: str) -> float:
    """Median seconds per decode step with ``batch`` sequences in flight."""
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
    return statistics.median(times[1:])


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


def ours_prefill(engine: Engine, length: int, vocab: int, device: str) -> float:
    tokens = ids(prompts(1, length, vocab)[0])
    ps = engine.page_size
    pages = ids(range(-(-length // ps)))
    calls = [
        EmbedTxt(tokens, ids(range(length)), ids(range(length))),
        Forward(in_embeds=ids(range(length)), out_pages=pages, positions=ids(range(length))),
    ]
    best = float("inf")
    for _ in range(3):
        sync(device)
        t = time.perf_counter()
        engine.execute(calls)
        sync(device)
        best = min(best, time.perf_counter() - t)
    return length / best


def hf_prefill(model, length: int, vocab: int, device: str) -> float:
    inp = torch.tensor(prompts(1, length, vocab), device=device)
    best = float("inf")
    with torch.inference_mode():
        for _ in range(3):
            sync(device)
            t = time.perf_counter()
            model(inp)
            sync(device)
            best = min(best, time.perf_counter() - t)
    return length / best


def serving(engine: Engine, model, n: int, new: int, vocab: int, device: str) -> dict:
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
    t = time.perf_counter()
    for p in ps:
        hf_generate(model, [p], new, device)
    hf = time.perf_counter() - t
    return {
        "requests": n,
        "new_tokens": new,
        "prompt_tokens": sum(lengths),
        "ours_s": ours,
        "hf_s": hf,
        "ours_tok_s": n * new / ours,
        "hf_tok_s": n * new / hf,
        "ours_steps": gen.steps,
        "ours_mean_batch": float(np.mean(gen.batch_sizes)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="reduced run (same JSON keys)")
    ap.add_argument(
        "--model", type=Path, help="checkpoint directory or .gguf file (default: the small one)"
    )
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batches", default="1,8,32,128")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    device = args.device
    path = args.model or small_checkpoint(device)
    batches = [int(b) for b in args.batches.split(",")]
    steps = 12 if args.quick else 48
    serve_n, serve_new = (32, 16) if args.quick else (32, 128)

    cfg = EngineConfig(
        device=device,
        dtype="bfloat16",
        page_size=16,
        num_pages=max(batches) * (PROMPT + steps + 32) // 16 + 2048,
        num_embeds=max(max(batches) * PROMPT, 512) + 4 * max(batches) + 64,
        num_host_pages=1,
    )
    bw = read_bandwidth(device)  # first, in a fresh process, before any model is loaded
    engine = Engine.load(path, cfg)
    gguf = {"gguf_file": path.name} if path.is_file() else {}  # transformers reads it too
    hf = AutoModelForCausalLM.from_pretrained(
        path.parent if gguf else path, dtype=torch.bfloat16, **gguf
    )
    hf = hf.to(device).eval()
    vocab = engine.info.vocab_size
    mc = engine.cfg
    streamed = mc.num_params - (0 if mc.tie_word_embeddings else mc.vocab_size * mc.hidden_size)
    roofline_ms = streamed * 2 / bw * 1e3

    print(f"# engine_decode: {engine.info.model_name} ({mc.num_params / 1e6:.0f}M params, bf16)")
    print(
        f"# machine: {platform.machine()} {platform.processor() or ''} {os.cpu_count()} cpus, "
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, device {device}"
    )
    print(
        f"# measured read bandwidth {bw / 1e9:.1f} GB/s -> decode roofline {roofline_ms:.2f} ms/step at B=1"
    )
    print()
    print("| batch | ours ms/step | ours tok/s | HF ms/step | HF tok/s | ours / HF |")
    print("|---|---|---|---|---|---|")
    out: dict[str, float] = {}
    for b in batches:
        ours_dec_warm = ours_decode(engine, b, 3, vocab, device)  # warm shapes
        del ours_dec_warm
        o = ours_decode(engine, b, steps, vocab, device)
        h = hf_decode(hf, b, steps, vocab, device)
        ratio = h / o
        out[f"ratio_vs_transformers_bs{b}"] = round(ratio, 3)
        out[f"ms_per_step_bs{b}"] = round(o * 1e3, 2)
        print(f"| {b} | {o * 1e3:.1f} | {b / o:.0f} | {h * 1e3:.1f} | {b / h:.0f} | {ratio:.2f}x |")
    print()
    ours_pf, hf_pf = ours_prefill(engine, 512, vocab, device), hf_prefill(hf, 512, vocab, device)
    print(
        f"prefill 512 tokens: ours {ours_pf:.0f} tok/s, HF {hf_pf:.0f} tok/s ({ours_pf / hf_pf:.2f}x)"
    )
    print()
    s = serving(engine, hf, serve_n, serve_new, vocab, device)
    sr = s["hf_s"] / s["ours_s"]
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
    print(f"| HF generate, one at a time | {s['hf_s']:.1f} | {s['hf_tok_s']:.0f} |")
    print(f"serving ratio: {sr:.2f}x")
    out.update(
        {
            "roofline_ms_bs1": round(roofline_ms, 2),
            "read_bandwidth_gbs": round(bw / 1e9, 1),
            "prefill_tok_s_512": round(ours_pf),
            "prefill_ratio_vs_transformers_512": round(ours_pf / hf_pf, 3),
            "serving_ratio_vs_transformers_32": round(sr, 3),
            "quick": args.quick,
            "device": device,
        }
    )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
