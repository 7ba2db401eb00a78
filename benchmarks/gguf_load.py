"""Start-up time of a GGUF model: first start (conversion) vs second start (the cache) vs a
safetensors directory holding the same weights, and transformers' GGUF loader.

    python benchmarks/gguf_load.py [--quick] [--model FILE.gguf] [--dtype bfloat16]

Every start is a fresh process that imports Pastry and torch first and then times
``Engine.load`` alone (small fixed pools, so that pool sizing does not count), as
``pastry serve`` loads its engine:

- first: ``$PASTRY_HOME`` is an empty temporary directory, so the file is hashed, its
  metadata read, its tensors dequantized into ``--dtype`` and everything cached;
- second: the same ``$PASTRY_HOME`` again: only the cache is read;
- safetensors: a Hugging Face directory with the same config, tokenizer and weights
  (``model.safetensors`` = the cached ``model.<dtype>.safetensors``), the format the
  issue's goal compares with ("as fast as a safetensors load");
- transformers: ``AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`` in ``--dtype``
  plus ``AutoTokenizer`` from the same file (what a user would otherwise run).

second and safetensors alternate (A/B) for ``--repeats`` rounds; medians are reported.
Default model: the SmolLM2-135M-Instruct GGUF that scripts/setup.sh fetches. Prints a
table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from machine import cpu_name  # benchmarks/ is on the path (the script's dir)

OURS = """
import sys, time
import torch  # imported before timing, as in a serving process
from pastry.wire.config import EngineConfig
from pastry.engine.engine import Engine
t = time.perf_counter()
Engine.load(sys.argv[1], EngineConfig(dtype=sys.argv[2], num_pages=256, num_embeds=1024,
                                      num_host_pages=1))
print(time.perf_counter() - t)
"""
HF = """
import sys, time
from pathlib import Path
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
p = Path(sys.argv[1])
t = time.perf_counter()
AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, dtype=getattr(torch, sys.argv[2]))
AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name)
print(time.perf_counter() - t)
"""


def start(code: str, model: Path, dtype: str, home: Path) -> float:
    """Seconds one fresh process spends loading ``model``."""
    env = {**os.environ, "PASTRY_HOME": str(home), "TRANSFORMERS_VERBOSITY": "error"}
    proc = subprocess.run(
        [sys.executable, "-c", code, str(model), dtype], env=env, capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise SystemExit(f"a start failed:\n{proc.stderr[-3000:]}")
    return float(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (same starts)")
    ap.add_argument("--model", type=Path, help="a .gguf file (default: the embedded model)")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"))
    args = ap.parse_args()
    from pastry.paths import default_gguf

    model = (args.model or default_gguf()).resolve()
    if not model.is_file():
        raise SystemExit(f"{model}: not found (`pastry model fetch-default` fetches the default)")
    repeats = 1 if args.quick else 3
    with tempfile.TemporaryDirectory(prefix="gguf-load-") as tmp:
        home = Path(tmp) / "home"
        first = start(OURS, model, args.dtype, home)
        [cache] = (home / "models" / "gguf-cache").glob("*-v*")
        hf_dir = Path(tmp) / "hf"
        hf_dir.mkdir()
        for name in ("config.json", "generation_config.json", "tokenizer.json"):
            shutil.copy(cache / name, hf_dir / name)
        shutil.copy(cache / "tokenizer_config.json", hf_dir / "tokenizer_config.json")
        os.link(cache / f"model.{args.dtype}.safetensors", hf_dir / "model.safetensors")
        second, safetensors = [], []
        for _ in range(repeats):
            second.append(start(OURS, model, args.dtype, home))
            safetensors.append(start(OURS, hf_dir, args.dtype, home))
        hf = [start(HF, model, args.dtype, home) for _ in range(repeats)]
        weights_mb = (cache / f"model.{args.dtype}.safetensors").stat().st_size / 1e6
    sec, saf, hfs = (statistics.median(x) for x in (second, safetensors, hf))
    print(f"# gguf_load: {model.name} ({model.stat().st_size / 1e6:.0f} MB) -> {args.dtype} "
          f"({weights_mb:.0f} MB cached)")  # fmt: skip
    print(f"# machine: {cpu_name()}, {os.cpu_count()} cpus, python {platform.python_version()}")
    print(f"# {repeats} rounds; medians; each start a fresh process timing Engine.load only")
    print()
    print("| start | seconds | vs safetensors |")
    print("|---|---|---|")
    print(f"| first (hash, read metadata, dequantize, cache) | {first:.2f} | {first / saf:.2f}x |")
    print(f"| second (from the cache) | {sec:.2f} | {sec / saf:.2f}x |")
    print(f"| safetensors directory, same weights | {saf:.2f} | 1.00x |")
    print(f"| transformers, from_pretrained(gguf_file=...) + tokenizer | {hfs:.2f} | "
          f"{hfs / saf:.2f}x |")  # fmt: skip
    print(
        json.dumps(
            {
                "first_s": round(first, 3),
                "second_s": round(sec, 3),
                "safetensors_s": round(saf, 3),
                "transformers_s": round(hfs, 3),
                "second_vs_safetensors": round(sec / saf, 3),
                "first_vs_second": round(first / sec, 3),
                "model": model.name,
                "dtype": args.dtype,
                "quick": args.quick,
            }
        )
    )


if __name__ == "__main__":
    main()
