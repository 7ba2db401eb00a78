"""Cost of the prefix cache's provenance per decode step, by context length.

Each observed decode step (``embed_txt`` of one token, then a ``forward`` over the context
writing its K/V) makes :class:`pastry.control.provenance.KvProvenance` certify the context
as one chain of records. The reference, measured in the same run: the same code with the
known chains disabled, i.e. a walk of every context page on every step (what main did
before issue 16's session 4). Two step mixes per context length:

- ``same``: one decode step into the context's partial last page, repeated (steady state);
- ``rolling``: 64 consecutive decode steps from a fresh prefill (with 16-slot pages: four
  pages filled and appended), the mean per step.

Run it under the shared lock: ``flock -x /tmp/pastry-bench.lock python
benchmarks/provenance_walk.py --quick``. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import timeit

from pastry.control.provenance import KvProvenance
from pastry.wire.calls import EmbedTxt, Forward, ids

PS = 16
STEPS = 64  # rolling steps per run
SLOT = 0  # the embedding slot a decode step uses


class _Queue:
    instance = 1


Q = _Queue()


def _step(length: int, pages: list[int]) -> list:
    ctx = pages[: -(-length // PS)]
    head = length % PS
    out = [ctx[-1]] if head else [pages[len(ctx)]]
    forward = Forward(
        in_embeds=ids([SLOT]),
        ctx_pages=ids(ctx),
        ctx_last_len=head or PS,
        out_pages=ids(out),
        out_offset=head,
        out_embeds=ids([]),
        out_indices=ids([0]),
    )
    return [(Q, EmbedTxt(ids([7]), ids([length]), ids([SLOT]))), (Q, forward)]


def _prefilled(cls, num_pages: int, known: bool) -> tuple[KvProvenance, list[int], int]:
    pages = list(range(num_pages + STEPS // PS + 1))
    p = cls(
        PS,
        len(pages),
        num_pages * PS,
        vocab_size=100,
        max_position=1 << 20,
        max_batch_tokens=1 << 20,
    )
    if not known:  # (main's code before the known chains: walk, remember nothing)
        p._known = lambda ctx: (None, 0)
        p._remember = lambda *args: None
    n = (num_pages - 1) * PS + 1  # the last page holds one token
    p.observe(
        [
            (Q, EmbedTxt(ids([5] * n), ids(range(n)), ids(range(n)))),
            (Q, Forward(ids(range(n)), out_pages=ids(pages[:num_pages]), out_indices=ids([]))),
        ]
    )
    assert p.certified(pages[:num_pages])[-1] == 1
    return p, pages, n


def same_us(cls, num_pages: int, known: bool, number: int) -> float:
    p, pages, n = _prefilled(cls, num_pages, known)
    calls = _step(n, pages)
    p.observe(calls)  # (the first step learns the chain)
    return min(timeit.repeat(lambda: p.observe(calls), number=number, repeat=3)) / number * 1e6


def rolling_us(cls, num_pages: int, known: bool, runs: int) -> float:
    best = float("inf")
    for _ in range(runs):
        p, pages, n = _prefilled(cls, num_pages, known)
        steps = [_step(n + i, pages) for i in range(STEPS)]
        observe = p.observe
        t = timeit.default_timer()
        for calls in steps:
            observe(calls)
        best = min(best, timeit.default_timer() - t)
        assert p.certified([pages[(n + STEPS - 1) // PS]]) == [(n + STEPS - 1) % PS + 1]
    return best / STEPS * 1e6


def main(cls=KvProvenance) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions, same shapes")
    args = ap.parse_args()
    number, runs = (300, 5) if args.quick else (3000, 30)
    result: dict = {}
    print(f"µs per observed decode step (page size {PS}), walk = every page, known = chains")
    print("| pages | same: walk | same: known | ratio | rolling: walk | rolling: known | ratio |")
    print("|---|---|---|---|---|---|---|")
    for pages in (4, 32, 128, 512):
        sw = same_us(cls, pages, False, number)
        sk = same_us(cls, pages, True, number)
        rw = rolling_us(cls, pages, False, runs)
        rk = rolling_us(cls, pages, True, runs)
        print(
            f"| {pages} | {sw:.2f} | {sk:.2f} | {sk / sw:.2f}x "
            f"| {rw:.2f} | {rk:.2f} | {rk / rw:.2f}x |"
        )
        result[f"step_walk_us_{pages}"] = round(sw, 3)
        result[f"step_known_us_{pages}"] = round(sk, 3)
        result[f"rolling_walk_us_{pages}"] = round(rw, 3)
        result[f"rolling_known_us_{pages}"] = round(rk, 3)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
