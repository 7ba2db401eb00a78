"""The floor under an engine call's latency when N inferlets share one event loop.

``benchmarks/overhead.py`` (b) measures an engine call's round trip excluding compute at 1,
128, 512 and 1024 concurrent inferlets. Every inferlet is a coroutine on the server's one
asyncio loop, and a batched call returns only after the batch is formed and its results
delivered, so each round trip contains every other inferlet's turn on the loop. This script
measures the least such a turn can cost in CPython, with no Pastry code at all: N tasks,
each in a loop of "submit a request, await its future", and one resolver that, once the N
requests are in, resolves all N futures (what a scheduler delivering a batch's results
does, with nothing else to do). Two shapes:

- ``bare``: the submission is appending the future to a list;
- ``call``: the submission is a small command object carrying a few integers (a step's
  fields) appended to the queue, and the result a tuple — still far less than any real
  API call does (argument checks, handle translation, the engine call itself).

µs per round = the latency of one call excluding compute for every inferlet in that
setting; ÷ N is the per-inferlet cost. A design that keeps the inferlets' Python on one
loop cannot have an engine call cheaper than this at N inferlets, whatever the control layer
does; one that spreads inferlets over P processes divides it by at most P (the cores).

    python benchmarks/loop_floor.py [--quick]

Prints a table, then one JSON line (``floor_us_N``, ``floor_call_us_N``).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import time

from machine import cpu_name  # benchmarks/ is on the path (the script's dir)

COUNTS = (1, 128, 512, 1024)


class Command:
    __slots__ = ("fields", "future", "instance")

    def __init__(self, instance: int, fields: tuple[int, ...], future: asyncio.Future) -> None:
        self.instance, self.fields, self.future = instance, fields, future


async def rounds(n: int, iters: int, shape: str) -> list[float]:
    """Seconds per round (every one of ``n`` tasks made one call) over ``iters`` rounds."""
    loop = asyncio.get_running_loop()
    queue: list = []
    full = asyncio.Event()

    async def inferlet(i: int) -> None:
        for step in range(iters):
            fut = loop.create_future()
            if shape == "bare":
                queue.append(fut)
            else:
                queue.append(Command(i, (step, i, 7, 3, 0), fut))
            if len(queue) == n:
                full.set()
            r = await fut
            if shape == "call" and r[0] != step:
                raise AssertionError("wrong result")

    async def resolver() -> list[float]:
        times = []
        t = time.perf_counter()
        for _ in range(iters):
            await full.wait()
            full.clear()
            batch, queue[:] = list(queue), []
            if shape == "bare":
                for fut in batch:
                    fut.set_result(None)
            else:
                for cmd in batch:
                    cmd.future.set_result((cmd.fields[0], cmd.instance))
            now = time.perf_counter()
            times.append(now - t)
            t = now
        return times

    tasks = [asyncio.create_task(inferlet(i)) for i in range(n)]
    times = await resolver()
    await asyncio.gather(*tasks)
    return times


def measure(n: int, iters: int, reps: int, shape: str) -> float:
    """Median µs per round, the first rounds of each repetition dropped as warm-up."""
    per_round = []
    for _ in range(reps):
        gc.collect()
        times = asyncio.run(rounds(n, iters, shape))
        per_round += times[max(1, iters // 5) :]
    return statistics.median(per_round) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer repetitions, same shapes")
    p.add_argument("--iters", type=int, default=100, help="rounds per repetition")
    args = p.parse_args()
    reps = 2 if args.quick else 6
    print(f"# loop_floor: {cpu_name()}, one asyncio loop, {args.iters} rounds x {reps} reps")
    print("| inferlets | bare: µs per round | ÷ inferlets | call: µs per round | ÷ inferlets |")
    print("|---|---|---|---|---|")
    out: dict[str, float] = {}
    for n in COUNTS:
        bare = measure(n, args.iters, reps, "bare")
        call = measure(n, args.iters, reps, "call")
        out[f"floor_us_{n}"] = round(bare, 1)
        out[f"floor_call_us_{n}"] = round(call, 1)
        print(f"| {n} | {bare:.1f} | {bare / n:.2f} | {call:.1f} | {call / n:.2f} |")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
