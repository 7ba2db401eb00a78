"""Guests polled on several threads (``runtime/wasm_pollers.py``): the event loop's thread and
helpers run guests in parallel while host calls stay one at a time. A guest computing for
long blocks neither the loop nor other inferlets, terminate reaches a guest running on a
helper, the CPU budget counts a helper's time, and results equal the serial path's.

The sandboxes here set ``poll_threads`` explicitly, so the parallel path is tested on a
one-core machine too.
"""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

pytest.importorskip("wasmtime")
pytest.importorskip("componentize_py")

from inferlet_util import result, start
from pastry.control.events import Failed, Message, Terminated
from pastry.runtime.trusted import Program
from pastry.runtime.wasm import SandboxLimits, WasmSandbox, sandboxed_program
from pastry.runtime.wasm_pollers import GuestPollers
from test_inferlets import CONTEXT_TOKENS, GREEDY_LOOP
from test_wasm_safety import Ticker
from wasm_util import bound, collect, engine_fixture, make_sandbox, sandbox_fixture

SPIN = """
import pastry.sdk as px

async def main(args):
    px.send("go")
    x = 0
    while True:
        x += 1
"""

MESSAGES = """
import pastry.sdk as px

async def main(args):
    px.send("ready " + args[0])
    got = await px.receive()
    px.store_set("k" + args[0], got)
    return px.store_get("k" + args[0]) + "/" + str(px.get_instance_id() > 0)
"""


def _box(threads: int) -> WasmSandbox:
    return make_sandbox(pool_size=4, poll_threads=threads)


box = sandbox_fixture(pool_size=4, poll_threads=2)
eng = engine_fixture()


def _prompts(n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [",".join(map(str, rng.integers(0, 500, 6).tolist())) for _ in range(n)]


def test_a_computing_guest_blocks_neither_the_loop_nor_other_inferlets(eng, box):
    """Two guests spin (so every polling section is parallel: one of them runs on the
    helper) while others generate: those finish, the loop keeps turning, and terminate
    ends the spinners wherever they run."""

    async def go():
        controller, rt, handle = await start(eng)
        spin = sandboxed_program("spin", SPIN, box=box)
        work = sandboxed_program("ctx", CONTEXT_TOKENS, box=box)
        helped = box.pollers.helped
        with Ticker() as ticker:
            spinners = [rt.launch(spin, []) for _ in range(2)]
            streams = [s.events() for s in spinners]
            for s in streams:
                assert await anext(s) == Message("go")
            others = [rt.launch(work, [p, "6"]) for p in _prompts(4, 3)]
            done = await asyncio.gather(*(collect(i) for i in others))
            t0 = time.perf_counter()
            for s in spinners:
                rt.terminate(s.id, "stop")
            ends = [await anext(s) for s in streams]
            took = time.perf_counter() - t0
        await asyncio.sleep(0.05)  # the runners see the cancellation
        live = bound(box)
        await controller.close()
        handle.close()
        return done, ends, took, ticker.worst, box.pollers.helped - helped, live

    done, ends, took, worst, helped, live = asyncio.run(go())
    assert all(result(evs) for evs in done)  # every other inferlet finished
    assert ends == [Terminated("stop")] * 2
    assert took < 0.5
    assert worst < 0.25, f"the event loop stalled for {worst:.2f} s while guests computed"
    assert helped > 0, "no guest was polled on a helper thread"
    assert not live


def test_cpu_budget_counts_time_on_a_helper_thread(eng, box):
    limits = SandboxLimits(cpu_seconds=0.3)

    async def go():
        controller, rt, handle = await start(eng)
        prog = sandboxed_program("spin", SPIN, limits, box=box)
        t0 = time.perf_counter()
        ends = await asyncio.gather(*(rt.launch(prog, []).wait() for _ in range(3)))
        took = time.perf_counter() - t0
        await controller.close()
        handle.close()
        return ends, took

    ends, took = asyncio.run(go())
    for end in ends:
        assert isinstance(end, Failed) and "CPU budget of 0.3 s exceeded" in end.error, end
    assert took < 10


def test_parallel_and_serial_polling_give_the_same_results(eng, box):
    """The same launches (generation, messages, the store) through the parallel path and
    through the serial one (every guest on the loop's thread): the same events."""
    serial = _box(1)
    prompts = _prompts(6, 7)

    def run(b: WasmSandbox) -> list:
        async def go():
            controller, rt, handle = await start(eng)
            greedy = sandboxed_program("greedy", GREEDY_LOOP, box=b)
            ctx = sandboxed_program("ctx", CONTEXT_TOKENS, box=b)
            msgs = sandboxed_program("msgs", MESSAGES, box=b)
            insts = [rt.launch(greedy, [p, "5"]) for p in prompts]
            insts += [rt.launch(ctx, [p, "5"]) for p in prompts]
            talkers = [rt.launch(msgs, [str(i)]) for i in range(4)]
            streams = [t.events() for t in talkers]
            for i, s in enumerate(streams):
                assert await anext(s) == Message(f"ready {i}")
            for i, t in enumerate(talkers):
                t.send(f"hello {i}")
            events = await asyncio.gather(*(collect(i) for i in insts))
            events += [[ev async for ev in s] for s in streams]
            await controller.close()
            handle.close()
            return events

        return asyncio.run(go())

    helped = box.pollers.helped
    try:
        parallel, one = run(box), run(serial)
    finally:
        serial.close()
    assert box.pollers.helped > helped
    assert serial.pollers.helped == 0
    assert parallel == one
    trusted = [
        result(evs)
        for evs in asyncio.run(_trusted(eng, [(GREEDY_LOOP, [p, "5"]) for p in prompts]))
    ]
    assert [result(evs) for evs in parallel[:6]] == trusted


async def _trusted(eng, launches) -> list:
    controller, rt, handle = await start(eng)
    insts = [rt.launch(Program.from_source("t", src), args) for src, args in launches]
    events = await asyncio.gather(*(collect(i) for i in insts))
    await controller.close()
    handle.close()
    return events


# ---------------------------------------------------------------------------- GuestPollers


def test_pollers_poll_each_item_once_on_several_threads_with_the_loop():
    pollers = GuestPollers(3)
    seen: list[tuple[int, int, bool]] = []

    async def go():
        loop = asyncio.get_running_loop()

        def poll(item: int) -> None:
            time.sleep(0.002)  # native work without the GIL, as a guest's
            seen.append((item, threading.get_ident(), asyncio.get_running_loop() is loop))

        return pollers.run(list(range(40)), poll, seconds=60)

    try:
        rest = asyncio.run(go())
    finally:
        pollers.close()
    assert rest == []
    assert sorted(item for item, _, _ in seen) == list(range(40))
    assert len({tid for _, tid, _ in seen}) > 1
    assert all(ok for _, _, ok in seen)  # helpers run host code with the loop as theirs
    assert asyncio.events._get_running_loop() is None


@pytest.mark.parametrize("threads", [1, 2])
def test_pollers_stop_taking_items_at_the_deadline(threads):
    pollers = GuestPollers(threads)
    polled: list[int] = []

    async def go():
        return pollers.run(list(range(100)), lambda i: (time.sleep(0.002), polled.append(i)), 0.02)

    try:
        rest = asyncio.run(go())
    finally:
        pollers.close()
    assert 0 < len(polled) < 100
    assert sorted(polled) + rest == list(range(100))  # the rest, in order, not polled


def test_pollers_a_failing_poll_on_a_helper_does_not_stop_the_section(caplog):
    """What a poll raises on a helper is logged; the section goes on and returns."""
    pollers = GuestPollers(2)
    polled: list[int] = []

    def poll(i: int) -> None:
        time.sleep(0.002)
        if threading.current_thread().name.startswith("pastry-wasm-poll"):
            raise RuntimeError("boom")
        polled.append(i)

    async def go():
        return pollers.run(list(range(20)), poll, seconds=60)

    try:
        rest = asyncio.run(go())
    finally:
        pollers.close()
    assert rest == []
    assert len(polled) < 20
    assert "polling a guest failed" in caplog.text and "boom" in caplog.text
