"""Where a decode step's time goes: the engine as served, profiled at one batch size.

    python benchmarks/decode_profile.py [--quick] [--model DIR] [--batch 1] [--quantize ...]
        [--dtype bfloat16|float32] [--no-compile]

Runs ``--batch`` sequences (32-token prompts, greedy) through the fused loop
(``engine/generate.py``) on the model (default: the random ``small`` checkpoint that
``engine_decode.py`` writes) in ``--dtype`` (default bf16), with the compiled decode step
unless ``--no-compile``, and profiles the decode steps with ``torch.profiler``. Prints the mean wall time of a step,
then each operator's self time per step, grouped:

- ``projections``: the decoder layers' linears (``pastry::linear`` in the compiled graph;
  oneDNN, Pastry's native bf16 or float32-panel, int8 or int4 kernels);
- ``lm_head``: the output head's matrix product, outside the graph;
- ``compiled graph``: inductor's fused kernels (norms, RoPE, K/V store and gather,
  attention, residuals; everything of the step but the projections) and the graph's
  wrappers;
- ``eager ops``: any other operator (sampling, embedding, call preparation; the whole
  eager model with ``--no-compile``);
- ``not in an operator``: wall time minus all of the above (Python: call building,
  validation, dispatch).

The same number of steps in ``--quick`` (32) with fewer repetitions (1 instead of 3).
Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
from torch.profiler import ProfilerActivity, profile

from pastry.engine.engine import Engine
from pastry.engine.generate import FusedGenerator, Request, _Running
from pastry.engine.quant import QUANT_MODES
from pastry.wire.config import EngineConfig

PROMPT = 32
STEPS = 32


_KERNELS = (
    "mkldnn::_linear_pointwise",
    "pastry_native::blocked_linear",
    "pastry_native::panel_linear",
    "pastry_native::int4_expanded",
    "aten::_weight_int8pack_mm",
    "aten::_weight_int4pack_mm_for_cpu",
    "aten::mm",
    "aten::addmm",
)


# the compiled graph's frames in a profile; its fused kernels are their self time
_GRAPH = ("Torch-Compiled Region", "CompiledFunction", "## Call CompiledFxGraph", "cpp_fused")


def group(event) -> str:
    """The group of a profiled operator (its self time), by itself and its ancestors."""
    up = event.cpu_parent
    while up is not None:
        if up.name == "pastry::linear":
            return "projections"
        up = up.cpu_parent
    name = event.name
    if name == "pastry::linear" or (name in _KERNELS and _in_graph(event)):
        return "projections"
    if name in _KERNELS:
        return "lm_head (outside the graph)"
    if name.startswith(_GRAPH) or _in_graph(event):
        return "compiled graph"
    return "eager ops"


def _in_graph(event) -> bool:
    up = event.cpu_parent
    while up is not None:
        if up.name.startswith(_GRAPH):
            return True
        up = up.cpu_parent
    return False


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="same steps, fewer repetitions")
    ap.add_argument("--model", type=Path, help="checkpoint directory (default: small)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--quantize", default="auto", choices=QUANT_MODES)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--no-compile", dest="compile", action="store_false")
    args = ap.parse_args()
    if args.model is None:
        sys.path.insert(0, str(Path(__file__).parent))
        from engine_decode import small_checkpoint

        args.model = small_checkpoint("cpu")
    b = args.batch
    cfg = EngineConfig(
        dtype=args.dtype,
        page_size=16,
        num_pages=b * (PROMPT + 4 * STEPS) // 16 + 64,
        num_embeds=b * (PROMPT + 2) + 64,
        num_host_pages=1,
        quantize=args.quantize,
        compile=args.compile,
    )
    engine = Engine.load(args.model, cfg)
    rng = np.random.default_rng(0)
    vocab = engine.info.vocab_size
    gen = FusedGenerator(engine.execute, engine.info, prefill_budget=b * PROMPT, max_running=b)
    running = [
        _Running(Request(rng.integers(3, vocab, PROMPT).tolist(), max_new_tokens=1 << 30))
        for _ in range(b)
    ]
    gen.step(running)  # prefill
    for _ in range(4):
        gen.step(running)  # warm up
    reps = 1 if args.quick else 3
    walls, groups = [], defaultdict(float)
    top: dict[str, float] = defaultdict(float)
    for _ in range(reps):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t = time.perf_counter()
            for _ in range(STEPS):
                gen.step(running)
            walls.append((time.perf_counter() - t) / STEPS)
        for e in prof.events():
            us = e.self_cpu_time_total / STEPS / reps
            groups[group(e)] += us
            top[e.name] += us
    wall_ms = float(np.mean(walls)) * 1e3  # the mean, as the per-operator times
    in_ops = sum(groups.values()) / 1e3
    print(
        f"# {engine.info.model_name}, batch {b}, {args.dtype}, projections "
        f"{'/'.join(sorted({lin.kind for lin in engine.model.linears()}))}, compiled "
        f"{engine.compiled is not None and engine.compiled.enabled}, {STEPS} steps x {reps}"
    )
    print(f"# wall {wall_ms:.2f} ms per step (profiler on: a little slower than unprofiled)")
    print()
    print("| where | ms per step | share of wall |")
    print("|---|---|---|")
    rows = sorted(groups.items(), key=lambda kv: -kv[1])
    rows.append(("not in an operator (Python)", max(0.0, wall_ms - in_ops) * 1e3))
    for name, us in rows:
        print(f"| {name} | {us / 1e3:.2f} | {us / 1e3 / wall_ms:.0%} |")
    print()
    print("| operator | ms per step |")
    print("|---|---|")
    for key, us in sorted(top.items(), key=lambda kv: -kv[1])[:12]:
        print(f"| `{key}` | {us / 1e3:.3f} |")
    print()
    out = {
        "model": engine.info.model_name,
        "dtype": args.dtype,
        "batch": b,
        "wall_ms": round(wall_ms, 2),
        **{k: round(v / 1e3, 3) for k, v in groups.items()},
        "quick": args.quick,
    }
    engine.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
