"""Cost of preparing a batch of decode steps, by context length and batch size.

A batch's fused decode steps (:class:`pastry.control.steps.Step`: ``embed_txt -> forward ->
sample`` of one token) are prepared together by :meth:`Step.prepare_batch`: every step's
handles (its two embedding slots and its context's KV pages) are translated to physical
ids and the batch's integers become the calls' int64 arrays. Each step here is another
inferlet's, as in a served batch: ``S`` instances whose contexts hold ``P`` pages each
(allocated in rounds, so the instances' handles interleave in the engine's pages), a step
writing into its last page (``P - 1`` context pages, one written). Measured: µs per batch
and per step for ``P`` = 4, 32, 128, 512 (2k tokens at 128 with 16-token pages) and ``S``
= 1, 128, 512; and :meth:`ResourceManager.translate` (one call's handles, as the
three-call API and the prefill translate them) of 1 to 512 handles. No prefix cache (the
write claims' cost is the same whatever the tables).

The script runs unchanged against an older checkout (its ``src`` first on
``PYTHONPATH``), for before/after comparisons. Run it on an otherwise idle machine
(``python benchmarks/translate_batch.py --quick``). Prints tables, then one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import timeit

from pastry.control.resources import ResourceManager
from pastry.control.steps import Step

try:  # commands as ops (issue 27); an older checkout's commands carry ``batched``
    from pastry.control.commands import Command, Stage

    OPS = True
except ImportError:
    from pastry.control.scheduler import Command, Stage

    OPS = False

PAGES = (4, 32, 128, 512)
STEPS = (1, 128, 512)
TRANSLATE = (1, 4, 32, 128, 512)


def batch(loop: asyncio.AbstractEventLoop, steps: int, pages: int) -> list[Command]:
    """``steps`` commands, one step of another instance each, over contexts of ``pages``."""
    res = ResourceManager(num_pages=steps * pages, num_embeds=2 * steps)
    for inst in range(steps):
        res.add_instance(inst)
    kv: dict[int, list[int]] = {inst: [] for inst in range(steps)}
    chunk = max(1, pages // 4)
    for done in range(0, pages, chunk):  # in rounds: the instances' pages interleave
        for inst in range(steps):
            kv[inst] += res.alloc(inst, "kv", min(chunk, pages - done))
    cmds = []
    for inst in range(steps):
        e_in, e_out = res.alloc(inst, "embed", 2)
        length = (pages - 1) * 16 + 5  # the last page partly filled
        fut = loop.create_future()
        if OPS:  # a command is its op (a greedy step: no sampling record)
            step = Step(res, inst, [7], [length], [e_in, e_out], kv[inst], pages - 1, 16, 5)
            cmds.append(Command(Stage.EMBED, step, tokens=1, last_stage=Stage.OUTPUT, future=fut))
            continue
        step = Step(
            res, inst, [7], [length], [e_in, e_out], kv[inst], pages - 1, 16, 5,
            (0.0, 0, 1.0, 0.0, None), {},
        )  # fmt: skip
        cmds.append(
            Command(Stage.EMBED, tokens=1, last_stage=Stage.OUTPUT, batched=step, future=fut)
        )  # before 2026-12: a command carried its data as ``batched``
    return cmds


def prepare_us(loop: asyncio.AbstractEventLoop, steps: int, pages: int, budget: int) -> float:
    """µs per ``Step.prepare_batch`` of the batch (best of 5 means)."""
    cmds = batch(loop, steps, pages)
    assert Step.prepare_batch(cmds) == [] and all(c.call is not None for c in cmds)
    number = max(3, budget // (steps * pages + 8 * steps))
    best = min(timeit.repeat(lambda: Step.prepare_batch(cmds), number=number, repeat=5))
    return best / number * 1e6


def translate_us(n: int, budget: int) -> float:
    """µs per ``ResourceManager.translate`` of ``n`` KV handles (best of 5 means)."""
    res = ResourceManager(num_pages=2 * n, num_embeds=1)
    res.add_instance(1)
    res.add_instance(2)
    handles = []
    for _ in range(n):  # interleaved with another instance's
        handles += res.alloc(1, "kv", 1)
        res.alloc(2, "kv", 1)
    assert res.translate(1, "kv", handles) == list(range(0, 2 * n, 2))
    number = max(10, budget // (n + 8))
    best = min(timeit.repeat(lambda: res.translate(1, "kv", handles), number=number, repeat=5))
    return best / number * 1e6


def main() -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions, same shapes")
    args = ap.parse_args()
    budget = 100_000 if args.quick else 1_000_000  # handles translated per timing
    loop = asyncio.new_event_loop()
    result: dict = {}
    print("Step.prepare_batch: µs per batch (µs per step), one step per instance")
    print("| context pages | " + " | ".join(f"{s} step{'s' * (s > 1)}" for s in STEPS) + " |")
    print("|---" * (len(STEPS) + 1) + "|")
    for pages in PAGES:
        cells = []
        for steps in STEPS:
            us = prepare_us(loop, steps, pages, budget)
            result[f"prepare_us_{steps}x{pages}"] = round(us, 2)
            cells.append(f"{us:.1f} ({us / steps:.2f})")
        print(f"| {pages} | " + " | ".join(cells) + " |")
    print()
    print("ResourceManager.translate: µs per call")
    print("| handles | " + " | ".join(str(n) for n in TRANSLATE) + " |")
    print("|---" * (len(TRANSLATE) + 1) + "|")
    cells = []
    for n in TRANSLATE:
        us = translate_us(n, budget)
        result[f"translate_us_{n}"] = round(us, 3)
        cells.append(f"{us:.2f}")
    print("| µs | " + " | ".join(cells) + " |")
    loop.close()
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
