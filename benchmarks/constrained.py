"""JSON-schema-constrained generation: the token mask on the device vs pulling the
distribution vs unconstrained.

    python benchmarks/constrained.py [--quick] [--model DIR] [--concurrent 32] [--tokens 64]

Without --model, uses the random-weight ``small`` llama checkpoint of ``engine_decode.py``
(bf16). ``--concurrent`` inferlets (default 32) run at once on one engine (trusted runner,
adaptive batching); each fills a seeded random 32-token prompt, then generates ``--tokens``
tokens greedily, one forward per token (no fast-forward of forced tokens, so every
variant samples every token), in three variants:

- ``device``: ``sdk.grammar.generate`` — the host's llguidance matcher gives its bitmask to
  ``sample(..., constraint=)``, applied on the device (one sample call per token; only the
  token id comes back);
- ``pull``: the previous path — ``get_next_dist`` with k = the whole vocabulary, the pick
  among the allowed tokens made on the host (``device_mask=False``);
- ``unconstrained``: ``Context.generate`` with a greedy sampler, the same number of tokens.

The schema (an object holding an array of at least 200 small integers) cannot complete
within ``--tokens``, so every variant generates exactly that many tokens. Each inferlet
stamps the time after its first token and at its last: decode TPOT = (last - first) /
(tokens - 1), averaged over the inferlets (prefill excluded); tokens/s = concurrent / TPOT.
The variants run interleaved, rounds of (device, pull, unconstrained); each reports its
best round.

Per-token cost of the mask, measured apart: the host time llguidance takes per
``compute_bitmask`` during the device runs (``pastry.control.constraints.STATS``), and the engine time to apply
``--concurrent`` masks: one batch of that many ``Sample`` rows with a mask vs without, on
the same hidden states, best of many.

Prints tables, then as the last line one JSON object: ``constrained_over_unconstrained_tpot``
(device TPOT / unconstrained TPOT; goal <= 1.10) and ``speedup_vs_pull_path`` (device tokens/s
over pull tokens/s), with the mask costs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from pastry.control import constraints
from pastry.control.controller import Controller
from pastry.control.events import Finished
from pastry.engine.engine import Engine
from pastry.runtime.trusted import Program, TrustedRuntime
from pastry.wire.calls import EmbedTxt, Forward, Sample, ids, mask_words
from pastry.wire.config import EngineConfig
from pastry.wire.handle import InProcessEngine

sys.path.insert(0, str(Path(__file__).parent))
from engine_decode import prompts, small_checkpoint
from machine import cpu_name

SCHEMA = {
    "type": "object",
    "properties": {
        "values": {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 99},
            "minItems": 200,
        }
    },
    "required": ["values"],
    "additionalProperties": False,
}

SRC = """
import json
import time

from pastry.sdk import Context, MaxTokens, Sampler
from pastry.sdk.grammar import Constraint, generate

async def main(args):
    opts = json.loads(args[0])
    n, variant = opts["tokens"], opts["variant"]
    async with Context() as ctx:
        ctx.fill_tokens(opts["prompt"])
        if variant == "unconstrained":
            await ctx.generate(Sampler(), MaxTokens(1))
            first = time.perf_counter()
            await ctx.generate(Sampler(), MaxTokens(n - 1))
            made = n
        else:
            c = Constraint(ctx, {"json_schema": opts["schema"]})
            device = variant == "device"
            out = await generate(ctx, c, 1, fast_forward=False, device_mask=device)
            first = time.perf_counter()
            rest = await generate(ctx, c, n - 1, fast_forward=False, device_mask=device)
            made = len(out.tokens) + len(rest.tokens)
        end = time.perf_counter()
    return json.dumps({"first": first, "end": end, "tokens": made})
"""

VARIANTS = ("device", "pull", "unconstrained")


async def run_variant(engine: Engine, variant: str, batch: list[list[int]], tokens: int) -> dict:
    handle = InProcessEngine(engine)
    controller = Controller([handle])
    rt = TrustedRuntime(controller)
    program = Program.from_source("constrained-bench", SRC)
    args = [
        json.dumps({"prompt": p, "tokens": tokens, "variant": variant, "schema": SCHEMA})
        for p in batch
    ]
    masks0, mask_ns0 = constraints.STATS.masks, constraints.STATS.ns  # the host's bitmasks
    insts = [rt.launch(program, [a]) for a in args]
    ends = [await i.wait() for i in insts]
    masks = constraints.STATS.masks - masks0
    mask_us = (constraints.STATS.ns - mask_ns0) / max(masks, 1) / 1e3
    stats = next(iter(controller.models.values())).scheduler.stats
    await controller.close()
    handle.close()
    outs = []
    for e in ends:
        if not isinstance(e, Finished):
            raise RuntimeError(f"{variant}: an inferlet failed: {e}")
        outs.append(json.loads(e.result))
    made = [o["tokens"] for o in outs]
    if made != [tokens] * len(outs):
        raise RuntimeError(f"{variant}: generated {set(made)} tokens, not {tokens}")
    tpot = float(np.mean([(o["end"] - o["first"]) / (tokens - 1) for o in outs]))
    return {
        "tpot_ms": tpot * 1e3,
        "tok_s": len(batch) / tpot,
        "mask_host_us": mask_us,
        "mean_batch": stats.mean_batch,
    }


def engine_mask_cost(engine: Engine, rows: int, reps: int) -> tuple[float, float]:
    """Engine time (ms) for one batch of ``rows`` greedy Sample rows, without and with a
    mask per row (best of ``reps``, alternating)."""
    vocab = engine.info.vocab_size
    slots = ids(range(rows + 1))
    engine.execute(
        [
            EmbedTxt(ids([1] * rows), ids(range(rows)), slots[:rows]),
            Forward(in_embeds=slots[:rows], out_embeds=slots[:rows], out_indices=ids(range(rows))),
        ]
    )
    rng = np.random.default_rng(0)
    masks = [
        np.packbits(rng.random(mask_words(vocab) * 32) < 0.3, bitorder="little").view(np.int32)
        for _ in range(rows)
    ]
    plain = [Sample(int(s)) for s in slots[:rows]]
    masked = [Sample(int(s), mask=m) for s, m in zip(slots[:rows], masks, strict=True)]
    best = [float("inf"), float("inf")]
    for _ in range(reps):
        for k, batch in enumerate((plain, masked)):
            t0 = time.perf_counter()
            engine.execute(batch)
            best[k] = min(best[k], time.perf_counter() - t0)
    return best[0] * 1e3, best[1] * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds (same shapes)")
    ap.add_argument("--model", type=Path, help="checkpoint (default: the small random llama)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--concurrent", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    a = ap.parse_args()
    rounds = 1 if a.quick else 3
    model = a.model or small_checkpoint(a.device)
    engine = Engine.load(model, EngineConfig(device=a.device, dtype=a.dtype, page_size=16))
    batch = prompts(a.concurrent, a.prompt_len, min(engine.info.vocab_size, 7000), seed=0)

    cpu = cpu_name()
    print(f"# constrained generation: {engine.info.model_name} ({engine.info.dtype}, {a.device})")
    print(f"# {cpu}; {a.concurrent} concurrent, prompt {a.prompt_len}, {a.tokens} tokens each")
    asyncio.run(run_variant(engine, "device", batch[:2], 4))  # warm-up (tokenizer caches, JIT)
    best: dict[str, dict] = {}
    for r in range(rounds):
        for v in VARIANTS:
            got = asyncio.run(run_variant(engine, v, batch, a.tokens))
            print(
                f"  round {r + 1} {v:14s} TPOT {got['tpot_ms']:8.2f} ms  {got['tok_s']:8.1f} "
                f"tok/s  mean batch {got['mean_batch']:.1f}"
            )
            if v not in best or got["tpot_ms"] < best[v]["tpot_ms"]:
                best[v] = got
    plain_ms, masked_ms = engine_mask_cost(engine, a.concurrent, 10 if a.quick else 40)
    engine_us = (masked_ms - plain_ms) * 1e3 / a.concurrent

    print()
    print("| variant | TPOT ms | tokens/s | vs unconstrained TPOT | mean batch |")
    print("|---|---|---|---|---|")
    base = best["unconstrained"]["tpot_ms"]
    for v in VARIANTS:
        b = best[v]
        print(
            f"| {v} | {b['tpot_ms']:.2f} | {b['tok_s']:.1f} | {b['tpot_ms'] / base:.3f}x "
            f"| {b['mean_batch']:.1f} |"
        )
    print()
    print(f"mask, host (llguidance compute_bitmask): {best['device']['mask_host_us']:.1f} µs/token")
    print(
        f"mask, engine ({a.concurrent} rows): {plain_ms:.2f} ms plain, {masked_ms:.2f} ms "
        f"masked -> {engine_us:.1f} µs/token"
    )
    result = {
        "constrained_over_unconstrained_tpot": round(best["device"]["tpot_ms"] / base, 3),
        "speedup_vs_pull_path": round(best["device"]["tok_s"] / best["pull"]["tok_s"], 3),
        "pull_over_unconstrained_tpot": round(best["pull"]["tpot_ms"] / base, 3),
        "mask_host_us_per_token": round(best["device"]["mask_host_us"], 1),
        "mask_engine_us_per_token": round(engine_us, 1),
        "concurrent": a.concurrent,
        "tokens": a.tokens,
        "model": engine.info.model_name,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
