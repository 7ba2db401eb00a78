"""Pastry's engine and llama.cpp side by side on the same weights.

    python benchmarks/vs_llamacpp.py [--quick] [--models small,smollm2] [--batches 1,8,32]

llama.cpp runs through llama-cpp-python (an optional benchmark dependency: ``pip install
llama-cpp-python`` builds llama.cpp from source, about 4-6 minutes on 2 cores, needing cmake
and a C++ compiler; without it this script says so and exits cleanly). It is driven through
its low-level batch API: one sequence per batch row, logits copied out and argmax taken in
numpy. Both engines use the same threads (``torch.get_num_threads()``, default: all cores).

Models:
- ``small``: the random-weight llama checkpoint (hidden 768, 12 layers, vocab 32000), as
  ``engine_decode.py`` writes it; llama.cpp gets a GGUF written from it with the ``gguf``
  package (synthetic vocabulary: only the weights matter to the timing).
- ``smollm2``: SmolLM2-135M-Instruct, the Q4_1 GGUF ``scripts/setup.sh`` fetches
  (``pastry.paths.default_gguf()``); skipped when absent.
- or a checkpoint directory / GGUF file path.

Per model, two pairs on identical weights:
- **bf16**: a bf16 GGUF written from the checkpoint's weights for llama.cpp; Pastry serves
  the same weights in bf16 (oneDNN-packed projections, compiled decode step).
- **q4**: the 4-bit file (SmolLM2's own Q4_1; for ``small`` a Q4_0 written here, llama.cpp's
  fastest 4-bit type) for llama.cpp; Pastry serves the same file keeping the blocks as int4
  (``engine/quant.py``; what ``--quantize int4`` serves from it).

Figures: decode ms per step (every sequence advances one token) at each batch size with
32-token prompts, greedy; prefill tokens/s of one 512-token prompt; the roofline (weight
bytes streamed per step / measured read bandwidth). Blocks of steps of the two engines are
interleaved and medians reported, so machine noise hits both alike. Prints tables, then
one JSON line (ours / llama.cpp ratios: below 1 is faster for ms, above 1 for tok/s).
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from machine import cpu_name  # benchmarks/ is on the path (the script's dir)
from pastry.engine.engine import Engine
from pastry.engine.generate import FusedGenerator, Request, _Running
from pastry.engine.gguf_export import export_gguf
from pastry.paths import bench_dir, default_gguf
from pastry.wire.calls import EmbedTxt, Forward, ids
from pastry.wire.config import EngineConfig, ModelConfig

PROMPT = 32
PREFILL = 512
INSTALL = (
    "llama-cpp-python is not installed; install it with `pip install llama-cpp-python` "
    "(a source build of llama.cpp: about 4-6 minutes on 2 cores, needs cmake and a C++ "
    "compiler) to run this benchmark"
)


# ---------------------------------------------------------------------------- llama.cpp


class LlamaCpp:
    """One llama.cpp model and context, fed token ids through ``llama_batch``."""

    _quiet = None

    def __init__(self, path: Path, threads: int, seq_ctx: int, n_seq: int) -> None:
        """``n_seq`` sequences of up to ``seq_ctx`` tokens each (a KV stream per sequence,
        as llama.cpp does by default)."""
        import llama_cpp as lc

        self.lc = lc
        if LlamaCpp._quiet is None:  # llama.cpp logs every load at length
            LlamaCpp._quiet = lc.llama_log_callback(lambda level, text, data: None)
            lc.llama_log_set(LlamaCpp._quiet, ctypes.c_void_p())
        lc.llama_backend_init()
        mp = lc.llama_model_default_params()
        self.model = lc.llama_model_load_from_file(str(path).encode(), mp)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        cp = lc.llama_context_default_params()
        self.n_batch = max(PREFILL, n_seq)
        cp.n_ctx, cp.n_seq_max = seq_ctx * n_seq, n_seq
        cp.n_batch = cp.n_ubatch = self.n_batch
        cp.n_threads = cp.n_threads_batch = threads
        cp.no_perf = True
        self.ctx = lc.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.batch = lc.llama_batch_init(self.n_batch, 0, 1)

    def clear(self) -> None:
        self.lc.llama_memory_clear(self.lc.llama_get_memory(self.ctx), True)

    def decode(self, rows: list[tuple[int, list[int], int]]) -> np.ndarray:
        """One ``llama_decode`` of ``(sequence, tokens, first position)`` rows; the logits
        of each row's last token, ``[rows, vocab]``."""
        b, n, outs = self.batch, 0, []
        for seq, tokens, pos in rows:
            for j, t in enumerate(tokens):
                b.token[n], b.pos[n], b.n_seq_id[n] = t, pos + j, 1
                b.seq_id[n][0] = seq
                b.logits[n] = j == len(tokens) - 1
                if b.logits[n]:
                    outs.append(n)
                n += 1
        assert n <= self.n_batch
        b.n_tokens = n
        if (rc := self.lc.llama_decode(self.ctx, b)) != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        return np.stack(
            [
                np.ctypeslib.as_array(self.lc.llama_get_logits_ith(self.ctx, i), (self.vocab,))
                for i in outs
            ]
        )

    def close(self) -> None:
        self.lc.llama_batch_free(self.batch)
        self.lc.llama_free(self.ctx)
        self.lc.llama_model_free(self.model)


class LlamaCppDecode:
    """``batch`` sequences decoding greedily in llama.cpp."""

    def __init__(self, lc: LlamaCpp, prompts: list[list[int]]) -> None:
        self.lc = lc
        lc.clear()
        nxt = []
        for seq, p in enumerate(prompts):  # prompts one by one: a batch holds n_batch tokens
            nxt.append(int(lc.decode([(seq, p, 0)])[0].argmax()))
        self.next = nxt
        self.pos = [len(p) for p in prompts]

    def step(self) -> None:
        rows = [(s, [t], p) for s, (t, p) in enumerate(zip(self.next, self.pos, strict=True))]
        logits = self.lc.decode(rows)
        self.next = logits.argmax(-1).tolist()
        self.pos = [p + 1 for p in self.pos]


def llamacpp_prefill(lc: LlamaCpp, tokens: list[int]) -> float:
    lc.clear()
    t = time.perf_counter()
    lc.decode([(0, tokens, 0)])
    return time.perf_counter() - t


# ---------------------------------------------------------------------------- Pastry


class PastryDecode:
    """``batch`` sequences decoding greedily in Pastry's fused loop (on-device argmax)."""

    def __init__(self, engine: Engine, prompts: list[list[int]]) -> None:
        self.gen = FusedGenerator(
            engine.execute,
            engine.info,
            prefill_budget=len(prompts) * PROMPT,
            max_running=len(prompts),
        )
        self.running = [_Running(Request(p, max_new_tokens=1 << 30)) for p in prompts]
        self.gen.step(self.running)  # prefill

    def step(self) -> None:
        self.gen.step(self.running)


def pastry_prefill(engine: Engine, tokens: list[int]) -> float:
    n, ps = len(tokens), engine.page_size
    calls = [
        EmbedTxt(ids(tokens), ids(range(n)), ids(range(n))),
        Forward(
            in_embeds=ids(range(n)), out_pages=ids(range(-(-n // ps))), positions=ids(range(n))
        ),
    ]
    t = time.perf_counter()
    engine.execute(calls)
    return time.perf_counter() - t


# ---------------------------------------------------------------------------- models


@dataclass
class Model:
    """A model's weights for both engines: the dense weights Pastry serves in bf16 and
    llama.cpp's two files (bf16 written from them, and the 4-bit file)."""

    name: str
    config: ModelConfig
    weights: dict[str, torch.Tensor]  # bf16, by HF name
    bf16_gguf: Path
    q4_gguf: Path
    q4_type: str


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    files = (
        [path] if path.is_file() else [*sorted(path.glob("*.safetensors")), path / "config.json"]
    )
    for f in files:
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 24):
                h.update(chunk)
    return h.hexdigest()[:12]


def _dense_weights(source: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The checkpoint's config and bf16 weights by HF name (GGUF blocks expanded)."""
    if source.suffix == ".gguf":
        from pastry.engine.gguf import load_gguf  # issue 9's loader

        ckpt = load_gguf(source)
        return ckpt.config, ckpt.load_state_dict(torch.bfloat16)
    from pastry.engine.checkpoint import load_checkpoint

    ckpt = load_checkpoint(source)
    return ckpt.config, ckpt.load_state_dict(torch.bfloat16)


def prepare(name: str, q4_file: Path | None) -> Model | None:
    out = bench_dir() / "vs_llamacpp"
    out.mkdir(parents=True, exist_ok=True)
    if name == "small":
        from engine_decode import small_checkpoint

        source, q4_file = small_checkpoint("cpu"), None
    elif name == "smollm2":
        source = q4_file = default_gguf()
        if not source.is_file():
            print(f"# smollm2: skipped, {source} is absent (scripts/setup.sh fetches it)")
            return None
    else:
        source = Path(name)
        if source.suffix == ".gguf" and q4_file is None:
            q4_file = source
    key = _digest(source)
    cfg, weights = _dense_weights(source)
    dense = {k: v.float().numpy() for k, v in weights.items()}
    tokenizer = source if source.suffix == ".gguf" else q4_file
    bf16 = out / f"{source.stem}-{key}-bf16.gguf"
    files = [(bf16, "BF16")]
    if q4_file is None:  # llama.cpp's fastest 4-bit type, written from the same weights
        q4_file = out / f"{source.stem}-{key}-q4_0.gguf"
        files.append((q4_file, "Q4_0"))
    for path, qtype in files:
        if not path.exists():
            print(f"# writing {path.name} ...", flush=True)
            tmp = path.with_suffix(".tmp")
            export_gguf(tmp, cfg, dense, qtype, tokenizer_from=tokenizer)
            tmp.rename(path)
    return Model(name, cfg, weights, bf16, q4_file, gguf_type(q4_file))


def gguf_type(path: Path) -> str:
    """The type of a GGUF's first decoder projection (what "the 4-bit file" is)."""
    import gguf

    r = gguf.GGUFReader(str(path))
    return next(t.tensor_type.name for t in r.tensors if t.name == "blk.0.ffn_up.weight")


def pastry_engine(m: Model, pair: str, cfg: EngineConfig) -> Engine:
    """Pastry on the pair's weights: the dense bf16 ones, or with every projection of the
    4-bit file kept in its blocks (int4) — the same values llama.cpp multiplies by."""
    from pastry.engine.build import build_model
    from pastry.engine.quant import gguf_codes

    weights = dict(m.weights)
    if pair == "q4":
        weights.update(gguf_codes(m.q4_gguf, m.config))
    model = build_model(m.config, torch.bfloat16, torch.device("cpu"), weights)
    return Engine(model, cfg)


def streamed_bytes(engine: Engine) -> int:
    """Weight bytes one decode step reads: every projection (the embedding table is only
    gathered)."""
    total = 0
    for lin in engine.model.linears():
        if lin.quantized is not None:
            total += lin.quantized.nbytes
        else:
            total += lin.out_features * lin.in_features * 2
    return total


def gguf_streamed_bytes(path: Path) -> int:
    import gguf

    r = gguf.GGUFReader(str(path))
    names = {t.name for t in r.tensors}
    total = 0
    for t in r.tensors:
        if len(t.shape) == 2 and (t.name != "token_embd.weight" or "output.weight" not in names):
            total += int(t.n_bytes)
    return total


# ---------------------------------------------------------------------------- measuring


def read_bandwidth() -> float:
    """Bytes/s of a 1 GiB read (sum of float32 data), median of 7."""
    x = torch.randn(1 << 28)
    times = []
    for _ in range(7):
        t = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t)
    return x.numel() * 4 / statistics.median(times)


def interleaved(runs: dict[str, object], steps: int, rounds: int) -> dict[str, float]:
    """Median seconds per ``step()`` of each runner, blocks of ``steps`` alternating."""
    times: dict[str, list[float]] = {k: [] for k in runs}
    for r in runs.values():
        for _ in range(2):
            r.step()  # warm shapes
    for _ in range(rounds):
        for k, r in runs.items():
            for _ in range(steps):
                t = time.perf_counter()
                r.step()
                times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, length).tolist() for _ in range(n)]


def run_model(m: Model, batches: list[int], quick: bool, threads: int, bw: float) -> dict:
    steps, rounds = (8, 2) if quick else (16, 4)
    prefill_reps = 2 if quick else 4
    vocab = m.config.vocab_size
    seq_ctx = max(PREFILL, PROMPT + 4 + steps * (rounds + 1)) + 64
    pages = max(batches) * (PROMPT + 4 + steps * (rounds + 1)) // 16 + PREFILL // 16 + 64
    cfg = dict(
        device="cpu",
        page_size=16,
        num_pages=pages,
        num_embeds=max(max(batches) * (PROMPT + 2), PREFILL) + 64,
        num_host_pages=1,
        compile=True,
    )
    print(f"# building Pastry ({m.name}) and compiling its decode step ...", flush=True)
    ours = {pair: pastry_engine(m, pair, EngineConfig(**cfg)) for pair in ("bf16", "q4")}
    theirs = {
        "bf16": LlamaCpp(m.bf16_gguf, threads, seq_ctx, max(batches)),
        "q4": LlamaCpp(m.q4_gguf, threads, seq_ctx, max(batches)),
    }
    res: dict = {"model": m.name, "params_m": round(m.config.num_params / 1e6, 1)}
    rows = []
    for pair in ("bf16", "q4"):
        eng = ours[pair]
        bytes_ours = streamed_bytes(eng)
        bytes_theirs = gguf_streamed_bytes(m.bf16_gguf if pair == "bf16" else m.q4_gguf)
        for b in batches:
            ps = prompts(b, PROMPT, vocab, seed=b)
            runs = {"llama.cpp": LlamaCppDecode(theirs[pair], ps), "pastry": PastryDecode(eng, ps)}
            t = interleaved(runs, steps, rounds)
            lc_ms, our_ms = t["llama.cpp"] * 1e3, t["pastry"] * 1e3
            rows.append((pair, b, our_ms, lc_ms))
            res[f"{pair}_bs{b}"] = {"pastry_ms": round(our_ms, 2), "llamacpp_ms": round(lc_ms, 2)}
        tokens = prompts(1, PREFILL, vocab, seed=99)[0]
        lc_pf = min(llamacpp_prefill(theirs[pair], tokens) for _ in range(prefill_reps))
        our_pf = min(pastry_prefill(eng, tokens) for _ in range(prefill_reps))
        res[f"{pair}_prefill_tok_s"] = {
            "pastry": round(PREFILL / our_pf),
            "llamacpp": round(PREFILL / lc_pf),
        }
        res[f"{pair}_roofline_ms_bs1"] = {
            "pastry": round(bytes_ours / bw * 1e3, 2),
            "llamacpp": round(bytes_theirs / bw * 1e3, 2),
        }
        print(
            f"# {m.name} {pair}: prefill {PREFILL} tokens ours {PREFILL / our_pf:.0f} tok/s, "
            f"llama.cpp {PREFILL / lc_pf:.0f} tok/s; weights streamed per step ours "
            f"{bytes_ours / 1e6:.0f} MB (roofline {bytes_ours / bw * 1e3:.2f} ms), llama.cpp "
            f"{bytes_theirs / 1e6:.0f} MB ({bytes_theirs / bw * 1e3:.2f} ms)"
        )
    for lc in theirs.values():
        lc.close()
    print()
    print(f"| {m.name} weights | batch | Pastry ms/step | llama.cpp ms/step | Pastry / llama.cpp |")
    print("|---|---|---|---|---|")
    for pair, b, our_ms, lc_ms in rows:
        label = "bf16" if pair == "bf16" else f"{m.q4_type} (Pastry: int4 kept)"
        print(f"| {label} | {b} | {our_ms:.1f} | {lc_ms:.1f} | {our_ms / lc_ms:.2f}x |")
    print()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="fewer repetitions, same shapes")
    ap.add_argument("--models", default="small,smollm2", help="small, smollm2, or paths")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument(
        "--q4",
        type=Path,
        help="the 4-bit GGUF for a model given as a path (default: a Q4_0 "
        "written from its weights)",
    )
    args = ap.parse_args()
    try:
        import llama_cpp
    except ImportError:
        print(f"# skipped: {INSTALL}")
        print(json.dumps({"skipped": INSTALL}))
        return
    sys.path.insert(0, str(Path(__file__).parent))  # engine_decode's small checkpoint
    threads = torch.get_num_threads()
    batches = [int(b) for b in args.batches.split(",")]
    bw = read_bandwidth()
    print(
        f"# vs_llamacpp: {cpu_name()}, {os.cpu_count()} cpus, torch {torch.__version__}, "
        f"llama-cpp-python {llama_cpp.__version__}, {threads} threads each, "
        f"read bandwidth {bw / 1e9:.1f} GB/s"
    )
    out: dict = {"threads": threads, "read_bandwidth_gbs": round(bw / 1e9, 1), "models": {}}
    for name in args.models.split(","):
        m = prepare(name, args.q4)
        if m is not None:
            out["models"][m.name] = run_model(m, batches, args.quick, threads, bw)
    # headline keys: SmolLM2 when it ran, else the first model
    if out["models"]:
        r = out["models"].get("smollm2") or next(iter(out["models"].values()))
        for b in batches:
            x = r[f"bf16_bs{b}"]
            out[f"ms_ratio_vs_llamacpp_bf16_bs{b}"] = round(x["pastry_ms"] / x["llamacpp_ms"], 3)
        if 1 in batches:
            x = r["q4_bs1"]
            out["ms_ratio_vs_llamacpp_q4_bs1"] = round(x["pastry_ms"] / x["llamacpp_ms"], 3)
            out["ms_per_step_bs1"] = r["bf16_bs1"]["pastry_ms"]
            out["q4_ms_per_step_bs1"] = r["q4_bs1"]["pastry_ms"]
        pf = r["bf16_prefill_tok_s"]
        out["prefill_ratio_vs_llamacpp_512"] = round(pf["pastry"] / pf["llamacpp"], 3)
        out["roofline_ms_bs1"] = r["bf16_roofline_ms_bs1"]["pastry"]
        out["headline_model"] = r["model"]
    out["quick"] = args.quick
    print(json.dumps(out))


if __name__ == "__main__":
    main()
