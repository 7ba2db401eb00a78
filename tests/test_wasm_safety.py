"""The sandbox against hostile inferlets (issue 17): the server's event loop is never blocked
by guest code, terminate is prompt, memory comes back when an instance ends, bad handle
values are API errors, and what tenants see names no server path.

Each test here failed before the change it checks (sleeps blocked the loop, uploads were
parsed on the host, Stores were freed by the garbage collector, an out-of-range handle
trapped the instance, host tracebacks reached the guest).
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import re
import time

import pytest

pytest.importorskip("wasmtime")
pytest.importorskip("componentize_py")

from inferlet_util import result, start
from pastry.control.events import Failed, Finished, Message, Terminated
from pastry.control.quotas import Quotas
from pastry.runtime.trusted import Program, ProgramError
from pastry.runtime.wasm import SandboxLimits, sandboxed_program
from wasm_util import bound, collect, engine_fixture, sandbox_fixture

box = sandbox_fixture(pool_size=4)
eng = engine_fixture()


class Ticker:
    """Measures the longest gap between turns of the event loop while it runs."""

    def __init__(self, period: float = 0.005) -> None:
        self.period, self.worst, self._task = period, 0.0, None

    async def _run(self) -> None:
        last = time.perf_counter()
        while True:
            await asyncio.sleep(self.period)
            now = time.perf_counter()
            self.worst = max(self.worst, now - last - self.period)
            last = now

    def __enter__(self) -> Ticker:
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    def __exit__(self, *exc) -> None:
        self._task.cancel()


def test_sleeps_suspend_only_their_instance(eng, box):
    """time.sleep and asyncio.sleep (nothing else in flight) park the guest on the host's
    timer: the loop keeps turning and both sleep as long as asked."""
    sleepers = {
        "time": "import time\nasync def main(args):\n    time.sleep(0.6)\n    return 'up'\n",
        "asyncio": (
            "import asyncio\nasync def main(args):\n    await asyncio.sleep(0.6)\n    return 'up'\n"
        ),
    }

    async def go():
        controller, rt, handle = await start(eng)
        progs = [sandboxed_program(k, src, box=box) for k, src in sleepers.items()]
        t0 = time.perf_counter()
        with Ticker() as ticker:
            ends = await asyncio.gather(*(rt.launch(p, []).wait() for p in progs))
        took = time.perf_counter() - t0
        await controller.close()
        handle.close()
        return ends, took, ticker.worst

    ends, took, worst = asyncio.run(go())
    assert ends == [Finished("up"), Finished("up")]
    assert took >= 0.6
    assert worst < 0.25, f"the event loop stalled for {worst:.2f} s while guests slept"


def test_wasi_waits_end_the_instance_not_the_server(eng, box):
    """A wait that bypasses time.sleep (select with a timeout, through WASI's clocks)
    ends that instance with a clear error instead of blocking the server's thread."""
    src = "import select\nasync def main(args):\n    select.select([], [], [], 3)\n    return 'x'\n"

    async def go():
        controller, rt, handle = await start(eng)
        with Ticker() as ticker:
            end = await rt.launch(sandboxed_program("sel", src, box=box), []).wait()
        await controller.close()
        handle.close()
        return end, ticker.worst

    end, worst = asyncio.run(go())
    assert isinstance(end, Failed) and "blocking waits" in end.error, end
    assert worst < 0.25


def test_wall_clock_limit(eng, box):
    limits = SandboxLimits(wall_seconds=0.4)
    waiter = "import pastry.sdk as px\nasync def main(args):\n    return await px.receive()\n"
    sleeper = "import time\nasync def main(args):\n    time.sleep(30)\n"

    async def go():
        controller, rt, handle = await start(eng)
        t0 = time.perf_counter()
        w = rt.launch(sandboxed_program("w", waiter, limits, box=box), [])
        s = rt.launch(sandboxed_program("s", sleeper, limits, box=box), [])
        ends = await asyncio.gather(w.wait(), s.wait())
        took = time.perf_counter() - t0
        await controller.close()
        handle.close()
        return ends, took

    (waited, slept), took = asyncio.run(go())
    assert isinstance(waited, Failed) and "wall-clock limit of 0.4 s exceeded" in waited.error
    assert isinstance(slept, Failed) and "would go past the wall-clock limit" in slept.error
    assert took < 5


@pytest.mark.parametrize(
    "body",
    [
        "import time\n    time.sleep(20)",
        "await px.receive()",
        "while True:\n        pass",
    ],
    ids=["sleeping", "waiting", "spinning"],
)
def test_terminate_is_prompt(eng, box, body):
    src = f"import time\nimport pastry.sdk as px\nasync def main(args):\n    px.send('go')\n    {body}\n"

    async def go():
        controller, rt, handle = await start(eng)
        inst = rt.launch(sandboxed_program("t", src, box=box), [])
        evs = inst.events()
        assert await anext(evs) == Message("go")
        await asyncio.sleep(0.05)
        t0 = time.perf_counter()
        rt.terminate(inst.id, "stop")
        end = await anext(evs)
        await asyncio.sleep(0.05)  # the guest's task sees the cancellation
        took = time.perf_counter() - t0
        live = bound(box)
        await controller.close()
        handle.close()
        return end, took, live

    end, took, live = asyncio.run(go())
    assert end == Terminated("stop")
    assert took < 0.5
    assert not live


def test_compile_runs_off_the_event_loop_under_a_cpu_budget(eng, box):
    """The host never parses tenant source: a source that takes long to parse costs a
    compile thread (bounded by the CPU budget), not the event loop, even though parsing
    holds no lock the loop needs (the guest compiles it, without the GIL)."""
    from pastry.runtime import wasm

    slow = "x = f'" + "{1}" * 30000 + "'\nasync def main(args):\n    return 'ok'\n"
    fine = "async def main(args):\n    return 1\n"

    async def go():
        loop = asyncio.get_running_loop()
        with Ticker() as ticker:
            with pytest.raises(ProgramError, match="CPU"):
                await loop.run_in_executor(
                    None,
                    sandboxed_program,
                    "slow",
                    slow,
                    SandboxLimits(compile_cpu_seconds=0.3),
                    box,
                )
            prog = await wasm.sandboxed_program_async("fine", fine, box=box)
        return prog, ticker.worst

    prog, worst = asyncio.run(go())
    assert prog.name == "fine"
    assert worst < 0.25, f"the event loop stalled for {worst:.2f} s during a compile"


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_memory_is_released_when_an_instance_ends(eng, box):
    """Instances that each fill 48 MiB, one after another, with the garbage collector
    off: the memory of each comes back when it ends."""
    src = "async def main(args):\n    data = b'x' * (48 << 20)\n    return str(len(data))\n"
    prog = sandboxed_program("heavy", src, box=box)

    def settle():  # ended guests are freed on the pool's thread: wait until it is done
        pool = getattr(box, "pool", None)
        if pool is not None:
            pool.idle(5)

    async def go():
        controller, rt, handle = await start(eng)
        await rt.launch(prog, []).wait()  # warm: first-use allocations of the host
        settle()
        before = _rss()
        for _ in range(8):
            assert await rt.launch(prog, []).wait() == Finished(str(48 << 20))
        settle()
        after = _rss()
        await controller.close()
        handle.close()
        return after - before

    gc.disable()
    try:
        grown = asyncio.run(go())
    finally:
        gc.enable()
    assert grown < 100 << 20, f"RSS grew by {grown >> 20} MiB over 8 x 48 MiB instances"


OUT_OF_RANGE = """
import json
import pastry.sdk as px

async def main(args):
    q = px.create_queue(px.available_models()[0])
    errors = {}
    cases = {
        "negative": lambda: px.alloc_kvpages(q, -1),
        "over 32 bits": lambda: px.alloc_kvpages(q, 2**32),
        "negative queue": lambda: px.get_kv_page_size(-1),
        "priority": lambda: px.set_queue_priority(q, 2**40),
        "page list": lambda: px.forward(q, [-5], 1, [], [], 0, []),
        "text as a number": lambda: px.alloc_embeds(q, "3"),
        "number as text": lambda: px.tokenize(q, 12),
        "store key": lambda: px.store_get(7),
    }
    for name, call in cases.items():
        try:
            call()
        except px.ApiError as e:
            errors[name] = str(e)
    return json.dumps(errors)
"""


def test_out_of_range_handles_are_api_errors(eng, box):
    async def go():
        controller, rt, handle = await start(eng)
        evs = await collect(rt.launch(sandboxed_program("oor", OUT_OF_RANGE, box=box), []))
        await controller.close()
        handle.close()
        return evs

    errors = json.loads(result(asyncio.run(go())))
    assert len(errors) == 8, errors
    assert "alloc_kvpages: n must be an integer from 0 to 2**32-1, got -1" in errors["negative"]
    assert "got 4294967296" in errors["over 32 bits"]
    assert "priority must be an integer from -2**31" in errors["priority"]
    assert "in_kv must be a list of integers" in errors["page list"]
    assert "must be a string, got 12" in errors["number as text"]


TENANT_ERRORS = """
import pastry.sdk as px

async def main(args):
    try:
        await px.http_get("http://10.1.2.3/secret")
    except px.ApiError as e:
        px.send(str(e))
    raise KeyError("mine")
"""


def test_tenants_never_see_server_paths(eng, box):
    async def go():
        controller, rt, handle = await start(eng)
        evs = await collect(rt.launch(sandboxed_program("err", TENANT_ERRORS, box=box), []))
        recurse = "async def main(a):\n    return await main(a)\n"
        trap = await collect(rt.launch(sandboxed_program("rec", recurse, box=box), []))
        await controller.close()
        handle.close()
        return evs, trap

    evs, trap = asyncio.run(go())
    denied, end = evs[0], evs[-1]
    assert isinstance(denied, Message) and "not in the HTTP allowlist" in denied.text, denied
    assert "http://10.1.2.3/secret" in denied.text
    assert isinstance(end, Failed) and end.error.endswith("KeyError: 'mine'"), end
    assert 'File "<inferlet err>", line 9, in main' in end.error
    for text in (denied.text, end.error, trap[-1].error):
        assert "/work/" not in text and os.getcwd() not in text, text
        assert not re.search(r"wasm\w*\.py|wasmtime_raw|trusted\.py|pyrt_app", text), text


LONG_TOKENIZE = """
import json
import time
import pastry.sdk as px

async def main(args):
    q = px.create_queue(px.available_models()[0])
    n = int(args[0])
    text = ("Tokenize me, said the inferlet: {0} apples and {0} pears. ".format(n)) * n
    short = text[:4095]
    out = {"chars": len(text)}
    t0 = time.perf_counter()
    ids = px.tokenize(q, text)
    out["seconds"] = time.perf_counter() - t0
    out["long"] = ids
    out["short"] = px.tokenize(q, short)
    out["edge"] = px.tokenize(q, text[:4096])
    out["long_bos"] = px.tokenize(q, text[1:], True)
    out["edge_bos"] = px.tokenize(q, text[:4096], True)
    for name, call in {
        "too long": lambda: px.tokenize(q, "x" * (2 << 20)),
        "bad queue": lambda: px.tokenize(q + 99, text),
    }.items():
        try:
            call()
            out[name] = "no error"
        except px.ApiError as e:
            out[name] = str(e)
    return json.dumps(out)
"""


def test_a_long_tokenize_suspends_only_its_instance(eng, box):
    """Tokenizing a long text in a sandboxed inferlet runs in the model's tokenizing thread
    while the guest's fiber waits: the event loop keeps turning (it did not while the
    tokenizer ran on it), and the ids are the trusted tokenize's, long or short; over the
    tokenize quota or on a bad queue, an ApiError."""
    n = "14000"  # ~0.8 MB of text, under the 1 MiB tokenize quota

    async def go():
        controller, rt, handle = await start(eng, quotas=Quotas())  # the server's defaults
        trusted = await collect(rt.launch(Program.from_source("t", LONG_TOKENIZE), [n]))
        with Ticker() as ticker:
            evs = await collect(rt.launch(sandboxed_program("s", LONG_TOKENIZE, box=box), [n]))
        await controller.close()
        handle.close()
        return json.loads(result(trusted)), json.loads(result(evs)), ticker.worst

    trusted, sandboxed, worst = asyncio.run(go())
    assert sandboxed["chars"] > 700_000
    for key in ("long", "short", "edge", "long_bos", "edge_bos"):
        assert sandboxed[key] == trusted[key], key
    assert len(sandboxed["long"]) > 100_000
    assert "at most 1048576 bytes" in sandboxed["too long"], sandboxed["too long"]
    assert "queue" in sandboxed["bad queue"], sandboxed["bad queue"]
    assert worst < 0.25, (
        f"the event loop stalled for {worst:.2f} s while a guest tokenized "
        f"(the tokenize took {sandboxed['seconds']:.2f} s, trusted on the loop "
        f"{trusted['seconds']:.2f} s)"
    )


def test_stored_uploads_compile_off_the_event_loop(eng, box, tmp_path, monkeypatch):
    """An upload stored by an earlier server run is compiled when it is first launched, on
    the sandbox's compile thread (it was compiled on the event loop, inside the launch):
    ``get`` returns at once, the loop keeps turning, simultaneous first launches share one
    compile."""
    from pastry.runtime import wasm
    from pastry.server.registry import ProgramRegistry

    monkeypatch.setattr(wasm, "_shared", box)
    compiles = []
    compile_ = box.compile
    monkeypatch.setattr(box, "compile", lambda *a: compiles.append(a[0]) or compile_(*a))
    # ~0.3-0.7 s of compiling in the guest on the 2-core EPYC
    slow = (
        "x = f'"
        + "{1}" * 10000
        + "'\nasync def main(args):\n    return str(len(x) + int(args[0]))\n"
    )
    ProgramRegistry(tmp_path).upload(slow, "slow")  # compiled (here) and stored
    assert compiles == ["slow"]
    reg = ProgramRegistry(tmp_path)  # the server restarts
    t0 = time.perf_counter()
    prog = reg.get("slow")
    took = time.perf_counter() - t0
    assert reg.get("slow") is prog

    async def go():
        controller, rt, handle = await start(eng)
        with Ticker() as ticker:
            insts = [rt.launch(prog, [str(i)]) for i in range(3)]
            evs = await asyncio.gather(*(collect(i) for i in insts))
        await controller.close()
        handle.close()
        return evs, ticker.worst

    evs, worst = asyncio.run(go())
    assert [result(e) for e in evs] == [str(10000 + i) for i in range(3)]
    assert compiles == ["slow", "slow"]  # the upload's, then one for the three launches
    assert took < 0.1, f"get() took {took:.2f} s: it compiled on the calling (event loop) thread"
    assert worst < 0.25, f"the event loop stalled for {worst:.2f} s during the launches"
