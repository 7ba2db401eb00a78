"""Weight-only quantized matrix products vs bf16, on a model's real projection shapes.

    python benchmarks/quant_kernels.py [--quick] [--model DIR] [--rows 1,2,4,8,12,16,32,64,128,512]

For every decoder projection of the model (default: the random ``small`` checkpoint that
``engine_decode.py`` writes), times one pass over all layers' projections at each number of
rows M (M=1 is a batch-1 decode step, M=512 a prefill chunk) with:

- ``bf16``: oneDNN-prepacked bf16 weights (what the engine serves unquantized);
- ``int4``: ``aten._weight_int4pack_mm_for_cpu``, groups of 32 (``--quantize int4``);
- ``int8 kernel``: ``aten._weight_int8pack_mm``, per-channel scales;
- ``int8 dense``: the int8 weight expanded to bf16 for one ``F.linear``;
- ``int4 hybrid``: what ``--quantize int4-hybrid`` serves: the int4 kernel below
  ``quant.INT4_DENSE_FROM_M`` rows, a oneDNN-packed bf16 copy of the same weight from there on.

Kernels alternate within each repetition so machine noise hits all alike. The engine's
choice for int8 (``quant.INT8_DENSE_FROM_M``: the kernel below it, the expansion from it
on) and for int4-hybrid (``quant.INT4_DENSE_FROM_M``) come from this table. Prints the table,
then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from pastry.engine import quant
from pastry.engine.checkpoint import load_checkpoint


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="fewer repetitions, same shapes")
    ap.add_argument("--model", type=Path, help="checkpoint directory (default: small)")
    ap.add_argument("--rows", default="1,2,4,8,12,16,32,64,128,512")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    from engine_decode import small_checkpoint

    path = args.model or small_checkpoint("cpu")
    ckpt = load_checkpoint(path)
    cfg = ckpt.config
    sd = ckpt.load_state_dict(torch.float32)
    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        qkv = torch.cat([sd[f"{p}self_attn.{x}_proj.weight"] for x in "qkv"])
        gate_up = torch.cat([sd[f"{p}mlp.gate_proj.weight"], sd[f"{p}mlp.up_proj.weight"]])
        for w in (qkv, sd[f"{p}self_attn.o_proj.weight"], gate_up, sd[f"{p}mlp.down_proj.weight"]):
            wb = w.to(torch.bfloat16)
            int8 = quant.Int8Weight(quant.Int8Codes.from_dense(w), torch.bfloat16)
            hybrid = quant.Int4Weight(quant.quantize_int4(w), torch.bfloat16)
            hybrid.keep_dense()
            layers.append(
                {
                    "bf16": torch.ops.mkldnn._reorder_linear_weight(wb, 1),
                    "int4": quant.Int4Weight(quant.quantize_int4(w), torch.bfloat16),
                    "int8": int8,
                    "int4 hybrid": hybrid,
                }
            )
    del sd

    def one_pass(kind: str, xs: dict[int, torch.Tensor]) -> float:
        t = time.perf_counter()
        for w in layers:
            x = xs[w["int4"].in_features]
            if kind == "bf16":
                torch.ops.mkldnn._linear_pointwise(x, w["bf16"], None, "none", [], "")
            elif kind == "int4":
                w["int4"].matmul(x)
            elif kind == "int4 hybrid":
                w["int4 hybrid"].matmul(x)
            elif kind == "int8 kernel":
                torch.ops.aten._weight_int8pack_mm(x, w["int8"].q, w["int8"].scale)
            else:
                F.linear(x, w["int8"].dequantize())
        return time.perf_counter() - t

    kinds = ("bf16", "int4", "int8 kernel", "int8 dense", "int4 hybrid")
    reps = 3 if args.quick else 9
    rows = [int(m) for m in args.rows.split(",")]
    weight_mb = sum(w["int4"].out_features * w["int4"].in_features for w in layers) * 2 / 1e6
    print(
        f"# quant_kernels: {cfg.num_layers} layers x 4 projections of {path.name} "
        f"({weight_mb:.0f} MB in bf16), {torch.get_num_threads()} threads, ms per pass "
        f"(median of {reps})"
    )
    print()
    print("| M | " + " | ".join(kinds) + " | int4 / bf16 | int8 best / bf16 | hybrid / bf16 |")
    print("|---|" + "---|" * (len(kinds) + 3))
    out: dict = {"rows": {}}
    with torch.inference_mode():
        for m in rows:
            xs = {
                k: torch.randn(m, k, dtype=torch.bfloat16)
                for k in {w["int4"].in_features for w in layers}
            }
            times: dict[str, list[float]] = {k: [] for k in kinds}
            for k in kinds:
                one_pass(k, xs)  # warm up
            for _ in range(reps):
                for k in kinds:
                    times[k].append(one_pass(k, xs))
            ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
            int8 = min(ms["int8 kernel"], ms["int8 dense"])
            print(
                f"| {m} | "
                + " | ".join(f"{ms[k]:.2f}" for k in kinds)
                + f" | {ms['int4'] / ms['bf16']:.2f}x | {int8 / ms['bf16']:.2f}x"
                + f" | {ms['int4 hybrid'] / ms['bf16']:.2f}x |"
            )
            out["rows"][m] = {k: round(v, 3) for k, v in ms.items()}
    print()
    out["int8_dense_from_m_engine"] = quant.INT8_DENSE_FROM_M
    out["int4_dense_from_m_engine"] = quant.INT4_DENSE_FROM_M
    # the measured crossover: the fewest rows from which bf16 beats the int4 kernel
    slower = [m for m in rows if out["rows"][m]["int4"] > out["rows"][m]["bf16"]]
    out["int4_slower_than_bf16_from_m"] = min(slower) if slower else None
    out["quick"] = args.quick
    print(json.dumps(out))


if __name__ == "__main__":
    main()
