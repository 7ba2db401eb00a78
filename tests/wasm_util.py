"""What the sandbox tests share: the sandbox and engine fixtures, running launches to their
ends, and the checks every non-Python guest (C, JavaScript) passes."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import numpy as np
import pytest

from inferlet_util import load_engine, result, start
from pastry.control.events import Failed
from pastry.runtime.trusted import Program, ProgramError
from pastry.runtime.wasm import SandboxLimits, WasmSandbox
from test_inferlets import GREEDY_LOOP


def make_sandbox(pool_size: int = 4, **kw) -> WasmSandbox:
    """A :class:`WasmSandbox` with ``pool_size`` pre-started Python guests (0 where the
    guests are not Python; ``kw``: its other arguments), the Python runtime built first
    (cached; the test skips when it cannot be built)."""
    from pastry.runtime import build_pyrt

    try:  # WasmSandbox loads pyrt too; build it if missing (cached)
        build_pyrt.build()
    except build_pyrt.BuildError as e:
        pytest.skip(f"cannot build the Python runtime component: {e}")
    return WasmSandbox(pool_size=pool_size, **kw)


def sandbox_fixture(pool_size: int = 4, **kw):
    """A module-scoped fixture of :func:`make_sandbox`'s sandbox, closed at the end."""

    @pytest.fixture(scope="module")
    def box():
        sandbox = make_sandbox(pool_size, **kw)
        yield sandbox
        sandbox.close()

    return box


def engine_fixture(num_pages: int = 256):
    """A module-scoped fixture: an in-process engine on the tiny llama checkpoint."""

    @pytest.fixture(scope="module")
    def eng(make_tiny):
        return load_engine(make_tiny("llama"), num_pages=num_pages)

    return eng


def bound(box: WasmSandbox) -> list:
    """The guests running a launch (the pool's pre-started ones are not)."""
    return [g for g in box.guests.values() if g.session is not None]


def run(eng, launches):
    """Launch every (program, args) at once on one controller; events and controller."""

    async def go():
        controller, rt, handle = await start(eng)
        insts = [rt.launch(p, a) for p, a in launches]
        events = await asyncio.gather(*(collect(i) for i in insts))
        await controller.close()
        handle.close()
        return events, controller

    return asyncio.run(go())


async def collect(inst) -> list:
    return [ev async for ev in inst.events()]


def error(events) -> str:
    end = events[-1]
    assert isinstance(end, Failed), end
    return end.error


def released(controller) -> None:
    """Every page and embedding slot came back, and the bookkeeping is consistent."""
    res = next(iter(controller.models.values())).resources
    res.check_integrity()
    assert res.referenced("kv") == 0 and res.referenced("embed") == 0


def greedy_matches_trusted(eng, prog: Program, seed: int) -> None:
    """``prog`` (a greedy example guest) gives the trusted Python loop's tokens."""
    rng = np.random.default_rng(seed)
    prompts = [",".join(map(str, rng.integers(0, 500, k).tolist())) for k in (9, 3, 17)]
    trusted = Program.from_source("greedy-py", GREEDY_LOOP)
    launches = [(prog, [p, "8"]) for p in prompts] + [(trusted, [p, "8"]) for p in prompts]
    events, controller = run(eng, launches)
    for guest_ev, py_ev in zip(events[:3], events[3:], strict=True):
        got = result(guest_ev)
        assert got == result(py_ev)
        assert len(got.split(",")) == 8
    released(controller)


def errors_and_limits(eng, make: Callable[..., Program], junk: str) -> None:
    """``make(name, limits=...)`` builds the example guest: bad bytes are refused with
    ``junk``, a missing argument is its own usage error, a KV quota ends it."""
    with pytest.raises(ProgramError, match=junk):
        make("junk", wasm=b"\0asm junk")
    launches = [
        (make("usage"), ["1,2,3"]),
        (make("pages", limits=SandboxLimits(max_kv_pages=1)), ["1,2,3,4,5,6,7,8,9", "8"]),
    ]
    events, controller = run(eng, launches)
    assert "usage" in error(events[0])
    assert "KV page quota exceeded" in error(events[1])
    released(controller)
