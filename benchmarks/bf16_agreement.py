"""Does bf16 keep transformers' decisions? First-token agreement with transformers' float32.

    python benchmarks/bf16_agreement.py [--quick] [--model FILE.gguf]

Default model: SmolLM2-135M-Instruct (the embedded Q4_1 GGUF). transformers loads it with
its own GGUF reader in float32 and in bfloat16; Pastry's engine serves it in float32 and in
bfloat16 on this CPU's bf16 path (the native kernels, oneDNN's packed product, or PyTorch's
plain bf16 product on a CPU without bf16 arithmetic; the table names it; activations in
float32 between the products, engine/model.py ``set_act_dtype``).

Prompts: 200 chat-formatted questions made from the sentences of the shipped prose
(``engine/data/prose.txt``), and the demo's questions (``scripts/demo.sh``). For each
variant: how often its greedy first token equals transformers' float32 one, and — the
issue's bar — how often it does where transformers' own bf16 agrees with its float32; for
the demo questions, whether the 32-token greedy answer equals transformers' float32 answer,
and the answer itself. ``--quick``: 50 of the prompts (the same lengths). Prints a table,
then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import time
from pathlib import Path

import numpy as np
import torch

from pastry.engine import native
from pastry.engine.build import build_model
from pastry.engine.engine import Engine
from pastry.engine.generate import FusedGenerator, Request
from pastry.paths import default_gguf
from pastry.wire.config import EngineConfig

PROSE = Path(__file__).parents[1] / "src" / "pastry" / "engine" / "data" / "prose.txt"
DEMO = [
    "What is the capital of France?",
    "Name three primary colors.",
    "What is 12 times 12?",
    "Write one sentence about the sea.",
]
ANSWER = 32


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def questions(n: int) -> list[str]:
    """``n`` questions from the prose's sentences: 'Explain: <sentence>'."""
    text = PROSE.read_text()
    sentences = [s.strip() for s in re.split(r"(?<=[.!?])\s+", text) if 40 < len(s.strip()) < 200]
    step = max(1, len(sentences) // n)
    return [f"Explain briefly: {s}" for s in sentences[::step][:n]]


def bf16_path() -> str:
    if native.ready:
        return "native AVX512_BF16 kernels (+ oneDNN from 5 rows)"
    if native.cpu_bf16():
        return "oneDNN packed bf16"
    return "PyTorch's plain bf16 product (no bf16 arithmetic on this CPU)"


def pastry_greedy(engine: Engine, prompts: list[list[int]], new: int) -> list[list[int]]:
    stop = tuple(engine.info.eos_token_ids)
    reqs = [Request(p, max_new_tokens=new, stop_ids=stop) for p in prompts]
    FusedGenerator(engine.execute, engine.info, max_running=16).run(reqs)
    return [strip(r.output, stop) for r in reqs]


def strip(tokens: list[int], stop) -> list[int]:
    """The answer without the end-of-turn token(s) that ended it."""
    while tokens and tokens[-1] in stop:
        tokens = tokens[:-1]
    return tokens


@torch.inference_mode()
def hf_greedy(model, prompts: list[list[int]], new: int) -> list[list[int]]:
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        gen = model.generate(ids, max_new_tokens=new, do_sample=False)
        eos = model.generation_config.eos_token_id
        stop = tuple(eos) if isinstance(eos, list) else (eos,)
        out.append(strip(gen[0, len(p) :].tolist(), stop))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="50 prompts instead of 200")
    ap.add_argument("--model", type=Path, default=None, help="a GGUF file (default: SmolLM2)")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    from pastry.engine.gguf import load_gguf

    source = args.model or default_gguf()
    ckpt = load_gguf(source)
    tok = ckpt.tokenizer

    def chat(q: str) -> list[int]:
        text = tok.apply_chat_template([{"role": "user", "content": q}])
        return tok.encode(text, add_special_tokens=True)

    prompts = [chat(q) for q in questions(50 if args.quick else 200)]
    demo = [chat(q) for q in DEMO]
    pools = EngineConfig(page_size=16, num_pages=1024, num_embeds=4096, num_host_pages=1)
    firsts: dict[str, np.ndarray] = {}
    answers: dict[str, list[list[int]]] = {}
    seconds: dict[str, float] = {}
    for name, dtype in (
        ("transformers fp32", torch.float32),
        ("transformers bf16", torch.bfloat16),
    ):
        t = time.perf_counter()
        hf = AutoModelForCausalLM.from_pretrained(
            source.parent, gguf_file=source.name, dtype=dtype
        ).eval()
        firsts[name] = np.array([g[0] if g else -1 for g in hf_greedy(hf, prompts, 1)])
        answers[name] = hf_greedy(hf, demo, ANSWER)
        seconds[name] = time.perf_counter() - t
        del hf
        print(f"# {name}: {seconds[name]:.0f}s", flush=True)
    path = "float32"
    for name, dtype in (("pastry fp32", torch.float32), ("pastry bf16", torch.bfloat16)):
        t = time.perf_counter()
        model = build_model(
            ckpt.config, dtype, torch.device("cpu"), ckpt.load_state_dict(dtype), "none"
        )
        engine = Engine(model, pools)
        if dtype == torch.bfloat16:
            path = bf16_path()
        firsts[name] = np.array([g[0] if g else -1 for g in pastry_greedy(engine, prompts, 1)])
        answers[name] = pastry_greedy(engine, demo, ANSWER)
        seconds[name] = time.perf_counter() - t
        del engine, model
        print(f"# {name}: {seconds[name]:.0f}s", flush=True)

    ref = firsts["transformers fp32"]
    hf_ok = firsts["transformers bf16"] == ref
    rows, out = [], {}
    for name in firsts:
        agree = firsts[name] == ref
        where = float(agree[hf_ok].mean()) if hf_ok.any() else float("nan")
        same = [a == b for a, b in zip(answers[name], answers["transformers fp32"], strict=True)]
        first = tok.decode(answers[name][0], skip_special_tokens=True).strip()
        rows.append((name, float(agree.mean()), where, sum(same), first))
        out[name] = {
            "first_token_agreement": round(float(agree.mean()), 4),
            "agreement_where_hf_bf16_agrees": round(where, 4),
            "demo_answers_equal_fp32": int(sum(same)),
            "france": first,
            "seconds": round(seconds[name], 1),
        }
    print(
        f"# {source.name} on {cpu_name()} (PyTorch ISA {native.cpu_isa()}); pastry bf16 = "
        f"{path}; {len(prompts)} prompts; demo answers {ANSWER} greedy tokens"
    )
    print()
    print(
        "| variant | first token = transformers fp32 | ... where transformers bf16 = fp32 "
        f"| demo answers = fp32 (of {len(DEMO)}) | answer to '{DEMO[0]}' |"
    )
    print("|---|---|---|---|---|")
    for name, agree, where, same, first in rows:
        print(f"| {name} | {agree:.1%} | {where:.1%} | {same} | {first[:70]!r} |")
    print()
    out.update(
        {
            "cpu": cpu_name(),
            "isa": native.cpu_isa(),
            "bf16_path": path,
            "prompts": len(prompts),
            "quick": args.quick,
        }
    )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
