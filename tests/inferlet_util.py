"""Run inferlets against an in-process engine (trusted runner), for tests."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from pastry.control.controller import Controller
from pastry.control.events import Event, Finished
from pastry.control.policies import BatchPolicy
from pastry.engine.engine import Engine
from pastry.runtime.trusted import Program, TrustedRuntime
from pastry.wire.config import EngineConfig
from pastry.wire.handle import InProcessEngine

# Guest code (its module imports asyncio): ``slow(api.generate_more)`` answers 10 ms late,
# so a run-ahead loop runs on meanwhile and its answers merge several tokens.
SLOW_READER = """

def slow(more):
    async def generate_more(q, stop):
        await asyncio.sleep(0.01)
        return await more(q, stop)
    return generate_more
"""

POOLS = dict(num_pages=512, num_embeds=4096, num_host_pages=4, page_size=4)


def load_engine(path, **kw) -> Engine:
    return Engine.load(path, EngineConfig(dtype="float32", **{**POOLS, **kw}))


async def start(engine: Engine, batching: BatchPolicy | None = None, **kw):
    handle = InProcessEngine(engine)
    controller = Controller([handle], batching, **kw)
    return controller, TrustedRuntime(controller), handle


async def run_all(
    engine: Engine,
    launches: Sequence[tuple[str, Sequence[str]]],
    batching: BatchPolicy | None = None,
) -> tuple[list[list[Event]], Controller]:
    """Launch every (source, args) at once; each instance's events, in launch order."""
    controller, rt, handle = await start(engine, batching)
    programs: dict[str, Program] = {}
    insts = []
    for src, args in launches:
        prog = programs.get(src) or programs.setdefault(src, Program.from_source("test", src))
        insts.append(rt.launch(prog, args))

    async def collect(inst):
        return [ev async for ev in inst.events()]

    events = await asyncio.gather(*(collect(i) for i in insts))
    await controller.close()
    handle.close()
    return events, controller


def result(events: list[Event]) -> str:
    end = events[-1]
    assert isinstance(end, Finished), end
    return end.result


def sandbox(**kw):
    """A :class:`~pastry.runtime.wasm.WasmSandbox` (``kw``: its options); skips the test
    without wasmtime or the Python runtime component."""
    import pytest

    pytest.importorskip("wasmtime")
    pytest.importorskip("componentize_py")
    from pastry.runtime import build_pyrt
    from pastry.runtime.wasm import WasmSandbox

    try:
        build_pyrt.build()
    except build_pyrt.BuildError as e:
        pytest.skip(f"cannot build the Python runtime component: {e}")
    return WasmSandbox(**kw)


def trusted_and_sandboxed(engine: Engine, source: str, args: Sequence[str]):
    """Run ``source`` with ``args`` on the trusted runner and in the sandbox at once (skips
    without wasmtime or the Python runtime component); each instance's events."""
    from pastry.runtime.wasm import sandboxed_program

    box = sandbox(pool_size=1)

    async def collect(inst):
        return [ev async for ev in inst.events()]

    async def go():
        controller, rt, handle = await start(engine)
        insts = [
            rt.launch(Program.from_source("t", source), list(args)),
            rt.launch(sandboxed_program("s", source, box=box), list(args)),
        ]
        events = await asyncio.gather(*(collect(i) for i in insts))
        await controller.close()
        handle.close()
        return events

    try:
        return asyncio.run(go())
    finally:
        box.close()
