"""Sandboxed (WebAssembly) inferlets: same results as trusted ones, limits, escapes.

Needs wasmtime and componentize-py; the Python runtime component is built once (about a
minute) and cached under $PASTRY_HOME, so later runs start in milliseconds.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("wasmtime")
pytest.importorskip("componentize_py")

from inferlet_util import result, start
from pastry.control.events import Failed, Finished, Message, Terminated
from pastry.runtime.trusted import Program, ProgramError
from pastry.runtime.wasm import SandboxLimits, WasmSandbox, sandboxed_program
from test_inferlets import CONTEXT_TOKENS, GREEDY_LOOP, THREE_LINES
from wasm_util import bound, engine_fixture, error, released, run, sandbox_fixture

box = sandbox_fixture(pool_size=4)
eng = engine_fixture()


def test_same_source_same_results(eng, box):
    tokens = ",".join(map(str, np.random.default_rng(0).integers(0, 500, 9).tolist()))
    cases = [(GREEDY_LOOP, [tokens, "8"]), (THREE_LINES, ["Hello,", "8"])]
    launches = []
    for src, args in cases:
        launches += [
            (Program.from_source("t", src), args),
            (sandboxed_program("s", src, box=box), args),
        ]
    events, controller = run(eng, launches)
    for i in range(0, len(events), 2):
        assert result(events[i + 1]) == result(events[i])
    released(controller)


def test_sandboxed_and_trusted_batch_together(eng, box):
    rng = np.random.default_rng(2)
    prompts = [",".join(map(str, rng.integers(0, 500, 5).tolist())) for _ in range(6)]
    trusted = Program.from_source("t", CONTEXT_TOKENS)
    boxed = sandboxed_program("s", CONTEXT_TOKENS, box=box)
    launches = [(trusted, [p, "6"]) for p in prompts] + [(boxed, [p, "6"]) for p in prompts]
    events, controller = run(eng, launches)
    for a, b in zip(events[:6], events[6:], strict=True):
        assert result(a) == result(b)
    stats = next(iter(controller.models.values())).scheduler.stats
    assert stats.forward_items / stats.forward_batches > 6, stats  # mixed batches
    released(controller)


MESSAGES = """
import pastry.sdk as px

async def main(args):
    px.send("ready")
    got = await px.receive()
    px.store_set("k", got)
    return px.store_get("k") + "/" + str(px.get_arguments())
"""


def test_messages_and_store(eng, box):
    async def go():
        controller, rt, handle = await start(eng)
        inst = rt.launch(sandboxed_program("m", MESSAGES, box=box), ["a"])
        evs = inst.events()
        assert await anext(evs) == Message("ready")
        inst.send("pong")
        end = await anext(evs)
        await controller.close()
        handle.close()
        return end

    end = asyncio.run(go())
    assert end == Finished("pong/['a']")


HEALTHY = (THREE_LINES, ["Hello,", "4"])

RUNAWAY = """
async def main(args):
    while True:
        pass
"""

MEMORY_BOMB = """
async def main(args):
    blocks = []
    while True:
        blocks.append(bytearray(8 << 20))
"""

PAGE_HOG = """
import pastry.sdk as px

async def main(args):
    q = px.create_queue(px.available_models()[0])
    px.alloc_kvpages(q, 3)
    px.alloc_kvpages(q, 3)
    return "not stopped"
"""

EMBED_HOG = """
import pastry.sdk as px

async def main(args):
    q = px.create_queue(px.available_models()[0])
    px.alloc_embeds(q, 6)
    px.alloc_embeds(q, 6)
    return "not stopped"
"""

BIG_MESSAGE = """
import pastry.sdk as px

async def main(args):
    px.send("x" * (2 << 20))
    return "not stopped"
"""

RECURSION = """
import sys

async def main(args):
    sys.setrecursionlimit(10**7)
    def f(n):
        return f(n + 1) + 1
    return str(f(0))
"""

BAD_HOST_CALL = """
from wit_world.imports import api

async def main(args):
    api.wait([12345], None)
    return "not stopped"
"""

# Re-waiting and re-taking a finished call (the host must never poll a completed future
# twice: that crashed the process in the design measurements).
DOUBLE_WAIT = """
from wit_world.imports import api

async def main(args):
    q = api.create_queue(api.available_models()[0], -1)
    p = api.synchronize(q)
    api.wait([p, p], None)
    api.wait([p], None)
    api.take(p)
    api.take(p)
    return "not stopped"
"""


def test_limits_stop_only_that_inferlet(eng, box):
    limits = SandboxLimits(memory_bytes=64 << 20, cpu_seconds=0.5, max_kv_pages=4, max_embeds=8)
    progs = {
        name: sandboxed_program(name, src, limits, box=box)
        for name, src in [
            ("runaway", RUNAWAY),
            ("memory", MEMORY_BOMB),
            ("pages", PAGE_HOG),
            ("embeds", EMBED_HOG),
            ("message", BIG_MESSAGE),
            ("recursion", RECURSION),
            ("badcall", BAD_HOST_CALL),
            ("doublewait", DOUBLE_WAIT),
        ]
    }
    healthy = sandboxed_program("ok", HEALTHY[0], box=box)
    launches = [(p, []) for p in progs.values()] + [(healthy, HEALTHY[1])]
    events, controller = run(eng, launches)
    errors = dict(zip(progs, (error(e) for e in events[: len(progs)]), strict=True))
    errors = {k: re.sub(r"inferlet \d+", "inferlet N", v) for k, v in errors.items()}  # random ids
    assert "CPU budget of 0.5 s exceeded" in errors["runaway"]
    assert "MemoryError" in errors["memory"]
    assert (
        "KV page quota exceeded: inferlet N holds 3, asked for 3 more, quota 4 (set by "
        "SandboxLimits.max_kv_pages). Free KV pages it no longer needs, or raise "
        "SandboxLimits.max_kv_pages" in errors["pages"]
    ), errors["pages"]
    assert (
        "embedding quota exceeded: inferlet N holds 6, asked for 6 more, quota 8 (set by "
        "SandboxLimits.max_embeds)" in errors["embeds"]
    ), errors["embeds"]
    assert "pending call" in errors["doublewait"] and "does not exist" in errors["doublewait"]
    assert "exceeds the limit of 1048576" in errors["message"]
    assert "RecursionError" in errors["recursion"] or "trapped" in errors["recursion"]
    assert "pending call 12345 does not exist" in errors["badcall"]
    alone, _ = run(eng, [(Program.from_source("t", HEALTHY[0]), HEALTHY[1])])
    assert result(events[-1]) == result(alone[0])
    released(controller)


ESCAPES = """
import json

async def main(args):
    out = {}
    def attempt(name, fn):
        try:
            fn()
            out[name] = "allowed"
        except BaseException as e:
            out[name] = type(e).__name__
    attempt("open", lambda: open("/etc/passwd").read())
    attempt("listdir", lambda: __import__("os").listdir("/"))
    def connect():
        import socket
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.connect(("127.0.0.1", 80))
    attempt("socket", connect)
    def spawn():
        import subprocess
        subprocess.run(["ls"])
    attempt("subprocess", spawn)
    attempt("ctypes", lambda: __import__("ctypes"))
    attempt("numpy", lambda: __import__("numpy"))
    out["environ"] = dict(__import__("os").environ)
    return json.dumps(out)
"""


def test_escape_attempts_fail(eng, box):
    events, _ = run(eng, [(sandboxed_program("e", ESCAPES, box=box), [])])
    out = json.loads(result(events[0]))
    assert out.pop("environ") == {}
    assert all(v != "allowed" for v in out.values()), out


def test_terminate_and_syntax_error(eng, box):
    with pytest.raises(ProgramError, match="syntax error"):
        sandboxed_program("bad", "def main(:\n", box=box)

    async def go():
        controller, rt, handle = await start(eng)
        inst = rt.launch(sandboxed_program("r", MESSAGES, box=box), [])
        evs = inst.events()
        await anext(evs)  # it waits in receive now
        rt.terminate(inst.id, "stopped by the test")
        end = await anext(evs)
        await asyncio.sleep(0.01)
        assert not bound(box)  # the fiber and store are gone
        await controller.close()
        handle.close()
        return end

    end = asyncio.run(go())
    assert end == Terminated("stopped by the test")


def test_the_guest_gets_the_whole_sdk():
    """Every SDK module is built into the Python runtime."""
    from pastry.runtime import build_pyrt

    sdk = Path(build_pyrt.PKG / "sdk")
    modules = {f"sdk/{p.name}" for p in sdk.glob("*.py")}
    assert modules <= set(build_pyrt.GUEST_SOURCES)


IMPORTS = """
import json
import sys

async def main(args):
    out = {}
    for name in args:
        try:
            __import__(name)
            out[name] = "ok" if name in sys.modules else "missing"
        except BaseException as e:
            out[name] = repr(e)
    return json.dumps(out)
"""


def test_the_guest_imports_every_sdk_and_lang_module(eng, box):
    """Not only built in: every module of pastry.sdk and of pastry.lang's inferlet side
    imports in the guest (the client-side modules endpoint and ship are left out)."""
    from pastry.runtime import build_pyrt

    pkg = Path(build_pyrt.PKG)
    names = [
        f"pastry.{p.parent.name}" + ("" if p.stem == "__init__" else f".{p.stem}")
        for p in [*(pkg / "sdk").glob("*.py"), *(pkg / "lang").glob("*.py")]
        if p.stem not in ("endpoint", "ship")
    ]
    events, controller = run(eng, [(sandboxed_program("imports", IMPORTS, box=box), names)])
    out = json.loads(result(events[0]))
    assert out == dict.fromkeys(names, "ok")
    released(controller)


def test_logit_processing_and_logprobs_in_the_sandbox(eng, box):
    from test_api_output import LOGITS, check

    events, controller = run(
        eng,
        [(Program.from_source("t", LOGITS), []), (sandboxed_program("s", LOGITS, box=box), [])],
    )
    trusted, boxed = (json.loads(result(e)) for e in events)
    check(boxed)
    del trusted["bad_mask"], boxed["bad_mask"]  # checked by the guest before the host

    def rounded(x):  # batch composition moves the last float bits of the lm_head's rows
        if isinstance(x, float):
            return float(f"{x:.5g}")
        return [rounded(v) for v in x] if isinstance(x, list) else x

    assert rounded(list(boxed.values())) == rounded(list(trusted.values()))
    released(controller)


GROWS = """
import pastry.sdk as px

async def main(args):
    data = b"x" * (int(args[0]) << 20)
    px.send("ready")
    return await px.receive() + str(len(data) > 0)
"""


def test_memory_per_instance_is_reported(eng, box):
    prog = sandboxed_program("grows", GROWS, box=box)
    trusted = Program.from_source("grows", GROWS)

    async def go():
        controller, rt, handle = await start(eng)
        insts = [rt.launch(prog, ["1"]), rt.launch(prog, ["40"]), rt.launch(trusted, ["1"])]
        streams = [i.events() for i in insts]
        for s in streams:
            assert await anext(s) == Message("ready")
        sizes = [prog.memory(i.id) for i in insts[:2]]
        for i in insts:
            i.send("ok")
        ends = [await i.wait() for i in insts]
        after = prog.memory(insts[0].id)
        await controller.close()
        handle.close()
        return sizes, ends, after

    (small, big), ends, after = asyncio.run(go())
    assert ends == [Finished("okTrue")] * 3
    assert 1 << 20 < small < 64 << 20  # the runtime's image and heap, a few tens of MiB
    assert big - small >= 39 << 20
    assert after is None and trusted.memory is None


def test_the_server_lists_sandboxed_memory(make_tiny, tmp_path):
    from pastry.client import Client
    from server_util import running_server

    async def go(url):
        async with await Client.connect(url) as c:
            await c.upload(GROWS, name="grows")
            inst = await c.launch("grows", ["8"])
            assert (await anext(inst.events())).data == "ready"
            rows = {i.id: i for i in await c.list_instances()}
            await inst.send("bye")
            return rows[inst.id]

    with running_server(make_tiny("llama"), tmp_path) as (url, _):
        row = asyncio.run(asyncio.wait_for(go(url), 60))
    assert row.memory_bytes is not None and row.memory_bytes > 8 << 20


COUNTER = """
import pastry.sdk as px

LAUNCHES = []  # module state: each instance has its own

async def main(args):
    LAUNCHES.append(args[0])
    return str(len(LAUNCHES))
"""

TOP_LEVEL_CALL = """
import pastry.sdk as px

Q = px.create_queue("m")  # the module runs before the instance is bound to a session

async def main(args):
    return str(Q)
"""

TOP_LEVEL_SLEEP = """
import time

time.sleep(0.01)

async def main(args):
    return "slept"
"""


def test_launches_of_a_program_take_guests_loaded_with_it(eng, make_tiny):
    box = WasmSandbox(pool_size=8)
    try:
        counter = sandboxed_program("counter", COUNTER, box=box)
        call = sandboxed_program("call", TOP_LEVEL_CALL, box=box)
        sleep = sandboxed_program("sleep", TOP_LEVEL_SLEEP, box=box)

        async def burst(rt, prog, n):
            return [await i.wait() for i in [rt.launch(prog, [str(k)]) for k in range(n)]]

        async def go():
            controller, rt, handle = await start(eng)
            first = await burst(rt, counter, 4)  # generic guests; the pool learns the burst
            box.pool.wait_full(30)
            loaded = box.pool.taken_loaded
            second = await burst(rt, counter, 4)
            again = box.pool.taken_loaded - loaded
            others = []
            for prog in (call, sleep):  # twice: the second run would take loaded guests
                for _ in range(2):
                    others += await burst(rt, prog, 1)
                    box.pool.wait_full(30)
            await controller.close()
            handle.close()
            return first, second, again, others

        first, second, again, others = asyncio.run(go())
    finally:
        box.close()
    assert first == second == [Finished("1")] * 4  # module state is never shared
    assert again == 4
    call1, call2, sleep1, sleep2 = others
    for end in (call1, call2):  # as trusted: the module runs unbound, so this fails
        assert isinstance(end, Failed) and "available from main(), not while" in end.error
        assert 'File "<inferlet call>", line 4' in end.error
    assert sleep1 == sleep2 == Finished("slept")  # not loadable ahead: loaded at launch
