"""The control layer's cost per inferlet-step, counted in instructions instead of timed.

``benchmarks/overhead.py`` times the control layer, and on a shared 2-core VM its figures
move ±25% between runs: a 10-20% change in the per-step cost cannot be told from noise
there. This script counts instead. Each measurement is a child process run under
``valgrind --tool=callgrind``, whose instruction count is the same for the same code and
inputs whatever else the machine is doing:

- ``control``: N trusted inferlets each fill a 32-token context and generate S tokens
  greedily (``Context.generate``, the fused decode step) through a real controller,
  scheduler and resource tables over a stub engine that answers every call at once (no
  torch, no model: what is counted is the control layer's, the SDK's and the inferlets'
  Python, and the stub's few instructions);
- ``per-step``: the same tokens, one ``Context.decode_step`` request per token (what programs
  that decide per token pay, and every explicit API call);
- ``floor`` (the reference): N asyncio tasks each submitting a small command and awaiting
  its future, one resolver answering a round at a time (``benchmarks/loop_floor.py``'s
  ``call`` shape): the least a step can cost with N inferlets on one event loop.

Each runs at S1 and S2 steps; (count at S2 - count at S1) / (N x (S2 - S1)) is the count
per inferlet-step, with start-up, imports and launches cancelled out (S2 is raised so that
N x (S2 - S1) >= 2,048: a single inferlet's 8 steps are lost in the start-up's variation). ``control / floor``
is the ratio the table reports. ``--quick`` runs the same shapes once; the full run twice
(the counts should agree to a few parts in a thousand: allocation addresses and hash
seeds differ between processes).

    python benchmarks/control_cost.py [--quick] [--inferlets 1,128,512] [--steps 4,12]

Needs valgrind (Debian's ``valgrind``); without it the script says so and prints
``{"skipped": ...}``. Prints a table, then one JSON line (``control_instr_per_step_N``,
``per_step_instr_per_step_N``, ``floor_instr_per_step_N``, ``control_over_floor_N``,
``per_step_over_floor_N``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from machine import cpu_name  # benchmarks/ is on the path (the script's dir)

HERE = Path(__file__).resolve().parent
PROMPT = 32
MIN_SPAN = 2048  # inferlet-steps between the two runs of a measurement
INFERLET = """
from pastry.sdk import Context, MaxTokens, Sampler

async def main(args):
    ctx = Context()
    ctx.fill_tokens([5] * int(args[0]))
    await ctx.generate(Sampler(), MaxTokens(int(args[1])))
    return str(len(ctx.tokens))
"""
# The same tokens stepped one request per token (``Context.decode_step``, the fused step):
# what programs that decide per token pay, and every explicit API call.
PER_STEP = """
from pastry.sdk import Context, MaxTokens, Sampler

async def main(args):
    ctx = Context()
    ctx.fill_tokens([5] * int(args[0]))
    sampler = Sampler()
    await ctx.generate(sampler, MaxTokens(1))
    for i in range(1, int(args[1])):
        tok = await ctx.decode_step(ctx.pending[0], sampler.sampling(i))
        ctx.tokens.append(tok)
        ctx.pending = [tok]
    return str(len(ctx.tokens))
"""


def run_control(n: int, steps: int, source: str = INFERLET) -> None:
    """N inferlets x ``steps`` greedy tokens over a stub engine, every one checked."""
    from pastry.control import gc_tuning
    from pastry.control.controller import Controller
    from pastry.control.events import Finished
    from pastry.runtime.trusted import Program, TrustedRuntime
    from pastry.wire.handle import InProcessEngine

    handle = InProcessEngine(_Stub(_stub_info(n, steps)))
    gc_tuning.tune_for_serving()  # as the server does

    async def go() -> None:
        controller = Controller([handle], None)
        runtime = TrustedRuntime(controller)
        prog = Program.from_source("control-cost", source)
        insts = [runtime.launch(prog, [str(PROMPT), str(steps)]) for _ in range(n)]
        ends = await asyncio.gather(*(_last(i) for i in insts))
        await controller.close()
        await handle.execute([])
        bad = [e for e in ends if not (isinstance(e, Finished) and e.result == str(PROMPT + steps))]
        if bad:
            raise SystemExit(f"{len(bad)} of {n} inferlets did not finish as expected: {bad[0]}")

    asyncio.run(go())


async def _last(inst):
    last = None
    async for ev in inst.events():
        last = ev
    return last


class _Stub:
    """Answers every call at once: ``Sample`` -> token 7, the rest -> None."""

    def __init__(self, info) -> None:
        from pastry.wire.calls import Sample

        self.info, self.sample = info, Sample

    def execute(self, batch):
        return [7 if type(c) is self.sample else None for c in batch]


def _stub_info(n: int, steps: int):
    from tokenizers import Tokenizer, models

    from pastry.wire.calls import EngineInfo

    # A word-level vocabulary: the inferlets decode nothing, the server needs a tokenizer.
    vocab = {f"t{i}": i for i in range(8000)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0")).to_str()
    pages = -(-(PROMPT + steps + 1) // 16) + 1
    return EngineInfo(
        model_name="stub", arch="stub", vocab_size=8000, hidden_size=8, num_layers=1,
        max_position=4096, dtype="bfloat16", device="cpu", page_size=16,
        num_pages=n * pages + 8, num_embeds=n * (PROMPT + 2) + 8, num_host_pages=1,
        max_batch_tokens=max(8192, n * (PROMPT + 1)), traits=("sample",), bos_token_id=1,
        eos_token_ids=(2,), tokenizer_json=tokenizer, chat_template=None, special_tokens={},
    )  # fmt: skip


def run_floor(n: int, steps: int) -> None:
    from loop_floor import rounds

    asyncio.run(rounds(n, steps, "call"))


def count(kind: str, n: int, steps: int) -> int:
    """Instructions callgrind counts for one child run of ``kind``."""
    cmd = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null"]
    cmd += [sys.executable, str(Path(__file__).resolve()), "--child", kind, str(n), str(steps)]
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    m = re.search(r"Collected : (\d+)", p.stderr)
    if p.returncode or not m:
        raise SystemExit(f"{kind} {n}x{steps} failed (rc {p.returncode}):\n{p.stderr[-2000:]}")
    return int(m.group(1))


def per_step(kind: str, n: int, s1: int, s2: int) -> float:
    """Instructions per inferlet-step: the difference of two runs over at least 2,048
    inferlet-steps (fewer inferlets take more steps), so that what varies between
    processes (start-up, the event loop's idle polls) stays small beside it."""
    s2 = max(s2, s1 + -(-MIN_SPAN // n))
    return (count(kind, n, s2) - count(kind, n, s1)) / (n * (s2 - s1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one repetition (the same shapes)")
    ap.add_argument("--inferlets", default="1,128,512", help="comma-separated counts")
    ap.add_argument("--steps", default="4,12", help="the two step counts S1,S2")
    ap.add_argument("--child", nargs=3, metavar=("KIND", "N", "STEPS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        kind, n, steps = args.child[0], int(args.child[1]), int(args.child[2])
        if kind == "floor":
            run_floor(n, steps)
        else:
            run_control(n, steps, PER_STEP if kind == "per-step" else INFERLET)
        return
    if shutil.which("valgrind") is None:
        print("control_cost.py: valgrind is not installed (apt install valgrind); skipped")
        print(json.dumps({"skipped": "valgrind not installed"}))
        return
    counts = [int(c) for c in args.inferlets.split(",")]
    s1, s2 = (int(s) for s in args.steps.split(","))
    if not 0 < s1 < s2:
        ap.error("--steps needs two increasing positive counts, e.g. 4,12")
    reps = 1 if args.quick else 2
    print(f"# control_cost: {cpu_name()}, python {sys.version.split()[0]}, steps {s1} -> {s2}")
    print("Instructions per inferlet-step (callgrind), control layer over a stub engine vs the")
    print(f"event-loop floor; {reps} repetition(s) each")
    print(
        "| inferlets | **control** (run ahead) | per step | floor | **control / floor** | per step / floor |"
    )
    print("|---|---|---|---|---|---|")
    out: dict[str, object] = {"quick": args.quick, "steps": [s1, s2]}
    for n in counts:
        control = [per_step("control", n, s1, s2) for _ in range(reps)]
        stepped = [per_step("per-step", n, s1, s2) for _ in range(reps)]
        floor = [per_step("floor", n, s1, s2) for _ in range(reps)]
        c, p, f = (sum(x) / reps for x in (control, stepped, floor))
        spread = f" ({min(control):,.0f}-{max(control):,.0f})" if reps > 1 else ""
        print(f"| {n} | {c:,.0f}{spread} | {p:,.0f} | {f:,.0f} | {c / f:.1f}x | {p / f:.1f}x |")
        out[f"control_instr_per_step_{n}"] = round(c)
        out[f"per_step_instr_per_step_{n}"] = round(p)
        out[f"floor_instr_per_step_{n}"] = round(f)
        out[f"control_over_floor_{n}"] = round(c / f, 2)
        out[f"per_step_over_floor_{n}"] = round(p / f, 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
