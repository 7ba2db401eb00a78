"""Quality of the quantized weights: perplexity and greedy agreement with the bf16 model.

    python benchmarks/quant_quality.py [--quick] [--model DIR|FILE.gguf] [--gguf FILE.gguf]

Default model: SmolLM2-135M-Instruct (``pastry.paths.default_gguf()``, a Q4_1 GGUF; its
dense weights are the blocks expanded). Variants, all served by Pastry's engine in bf16:

- ``bf16``: dense weights (the reference);
- ``gguf int4 (kept)``: the GGUF's 4-bit blocks kept as int4 codes (``--quantize auto``),
  i.e. what llama.cpp multiplies by (only the scales are rounded to bf16);
- ``--quantize int8`` and ``--quantize int4``: the dense weights quantized by Pastry
  (per-channel int8; int4 in groups of 32, asymmetric; the head int8 in both).

Perplexity: the shipped prose (``engine/data/prose.txt``) in non-overlapping 512-token
windows, each scored from its second token on, and how often each variant's most likely
next token there equals the bf16 model's (teacher-forced, so one difference does not carry
over). Greedy agreement: 16 prompts (the first
lines of the prose's paragraphs, chat-formatted) continued for 64 tokens by each variant;
reports the share of tokens equal to the bf16 continuation at the same position and the
mean length of the common prefix. ``--quick`` scores 4 windows and 4 prompts (same lengths).
Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch

from pastry.engine.build import build_model
from pastry.engine.engine import Engine
from pastry.engine.generate import FusedGenerator, Request
from pastry.engine.quant import gguf_codes
from pastry.paths import default_gguf
from pastry.wire.calls import EmbedTxt, Forward, ids
from pastry.wire.config import EngineConfig

WINDOW = 512
NEW = 64
PROSE = Path(__file__).parents[1] / "src" / "pastry" / "engine" / "data" / "prose.txt"


def load(source: Path):
    """(config, bf16 weights by HF name, tokenizer) of a checkpoint dir or GGUF."""
    if source.suffix == ".gguf":
        from pastry.engine.gguf import load_gguf  # issue 9's loader

        ckpt = load_gguf(source)
    else:
        from pastry.engine.checkpoint import load_checkpoint

        ckpt = load_checkpoint(source)
    return ckpt.config, ckpt.load_state_dict(torch.bfloat16), ckpt.tokenizer


def perplexity(engine: Engine, tokens: list[int], windows: int) -> tuple[float, int, np.ndarray]:
    """exp(mean NLL) over ``windows`` windows of WINDOW tokens, the tokens scored, and the
    argmax prediction at each scored position."""
    ps = engine.page_size
    nll, n, top = 0.0, 0, []
    for w in range(windows):
        chunk = tokens[w * WINDOW : (w + 1) * WINDOW]
        if len(chunk) < WINDOW:
            break
        pos = ids(range(WINDOW))
        out = ids(range(WINDOW, 2 * WINDOW))
        engine.execute(
            [
                EmbedTxt(ids(chunk), pos, pos),
                Forward(
                    in_embeds=pos,
                    out_pages=ids(range(WINDOW // ps)),
                    positions=pos,
                    out_embeds=out,
                    out_indices=pos,
                ),
            ]
        )
        with torch.inference_mode():
            hidden = engine.embeds.hidden[WINDOW : 2 * WINDOW - 1]
            logp = engine.model.logits(hidden).log_softmax(-1)
            target = torch.tensor(chunk[1:])
            nll -= logp.gather(1, target.unsqueeze(1)).sum().item()
            top.append(logp.argmax(-1).numpy())
        n += WINDOW - 1
    return math.exp(nll / n), n, np.concatenate(top)


def greedy(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    reqs = [Request(p, max_new_tokens=NEW) for p in prompts]
    FusedGenerator(engine.execute, engine.info, max_running=len(reqs)).run(reqs)
    return [r.output for r in reqs]


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="fewer windows and prompts")
    ap.add_argument("--model", type=Path, default=None, help="default: SmolLM2's GGUF")
    ap.add_argument("--gguf", type=Path, help="the 4-bit GGUF of --model (default: --model)")
    args = ap.parse_args()
    source = args.model or default_gguf()
    q4 = args.gguf or (source if source.suffix == ".gguf" else None)
    cfg, weights, tok = load(source)
    text = PROSE.read_text()
    tokens = tok.encode(text, add_special_tokens=False)
    paragraphs = [p.strip() for p in text.split("\n\n") if len(p.strip()) > 80]
    n_prompts, windows = (4, 4) if args.quick else (16, len(tokens) // WINDOW)
    prompts = [
        tok.encode(
            tok.apply_chat_template([{"role": "user", "content": p.split(". ")[0] + "."}]),
            add_special_tokens=True,
        )
        for p in paragraphs[:n_prompts]
    ]
    pools = EngineConfig(page_size=16, num_pages=512, num_embeds=2048, num_host_pages=1)
    variants = {"bf16": {}, "int8": {}, "int4": {}}
    if q4 is not None:
        variants["gguf int4 (kept)"] = gguf_codes(q4, cfg)
    rows, out, ref, ref_top = [], {}, None, None
    for name, codes in variants.items():
        t = time.perf_counter()
        quantize = name if name in ("int8", "int4") else "auto"
        model = build_model(
            cfg, torch.bfloat16, torch.device("cpu"), {**weights, **codes}, quantize
        )
        engine = Engine(model, pools)
        ppl, n, top = perplexity(engine, tokens, windows)
        gen = greedy(engine, prompts)
        if ref is None:
            ref, ref_top = gen, top
        top1 = float(np.mean(top == ref_top))
        same = np.mean([np.mean(np.array(a) == np.array(b)) for a, b in zip(gen, ref, strict=True)])
        prefix = np.mean(
            [
                next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), NEW)
                for a, b in zip(gen, ref, strict=True)
            ]
        )
        kinds = sorted({lin.kind for lin in model.linears()})
        mb = sum(
            lin.quantized.nbytes
            if lin.quantized is not None
            else lin.out_features * lin.in_features * 2
            for lin in model.linears()
        )
        rows.append((name, "/".join(kinds), mb / 1e6, ppl, top1, same, prefix))
        out[name] = {
            "perplexity": round(ppl, 3),
            "top1_agreement": round(top1, 4),
            "token_agreement": round(float(same), 3),
            "common_prefix": round(float(prefix), 1),
            "projection_mb": round(mb / 1e6, 1),
        }
        print(f"# {name}: {time.perf_counter() - t:.0f}s", flush=True)
    print(
        f"# {cfg.name or source.name}: perplexity over {n} tokens of prose.txt ({WINDOW}-token "
        f"windows); greedy agreement with bf16 over {len(prompts)} prompts x {NEW} tokens"
    )
    print()
    print(
        "| weights | projections | MB | perplexity | next-token argmax = bf16 "
        "| greedy tokens = bf16 | greedy common prefix |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, kinds, mb, ppl, top1, same, prefix in rows:
        print(
            f"| {name} | {kinds} | {mb:.0f} | {ppl:.3f} | {top1:.1%} | {same:.1%} "
            f"| {prefix:.1f} / {NEW} |"
        )
    print()
    out["quick"] = args.quick
    print(json.dumps(out))


if __name__ == "__main__":
    main()
