"""A non-Python sandboxed inferlet: examples/c/greedy.c, compiled with zig cc (the
``ziglang`` package) to a core wasm module importing ``pastry.*`` (examples/c/pastry.h),
gives the same greedy tokens as the trusted Python loop."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("wasmtime")
pytest.importorskip("ziglang")

from inferlet_util import load_engine, result
from pastry.runtime.trusted import Program, ProgramError
from pastry.runtime.wasm import SandboxLimits, WasmSandbox, core_program
from pastry.runtime.wasm_core import build_c
from test_inferlets import GREEDY_LOOP
from test_wasm import _released, error, run

C_DIR = Path(__file__).resolve().parents[1] / "examples" / "c"


@pytest.fixture(scope="module")
def box() -> WasmSandbox:
    from pastry.runtime import build_pyrt

    try:  # WasmSandbox loads pyrt too; build it if missing (cached)
        build_pyrt.build()
    except build_pyrt.BuildError as e:
        pytest.skip(f"cannot build the Python runtime component: {e}")
    return WasmSandbox(pool_size=0)  # these guests are not Python: no pool needed


@pytest.fixture(scope="module")
def greedy_wasm(tmp_path_factory) -> bytes:
    try:
        return build_c(C_DIR / "greedy.c")
    except (RuntimeError, OSError) as e:
        pytest.skip(f"zig cc is not usable here: {e}")


@pytest.fixture(scope="module")
def eng(make_tiny):
    return load_engine(make_tiny("llama"), num_pages=256)


def test_c_greedy_matches_trusted_python(eng, box, greedy_wasm):
    rng = np.random.default_rng(3)
    prompts = [",".join(map(str, rng.integers(0, 500, k).tolist())) for k in (9, 3, 17)]
    c_prog = core_program("greedy-c", greedy_wasm, box=box)
    trusted = Program.from_source("greedy-py", GREEDY_LOOP)
    launches = [(c_prog, [p, "8"]) for p in prompts] + [(trusted, [p, "8"]) for p in prompts]
    events, controller = run(eng, launches)
    for c_ev, py_ev in zip(events[:3], events[3:], strict=True):
        got = result(c_ev)
        assert got == result(py_ev)
        assert len(got.split(",")) == 8
    _released(controller)


def test_c_errors_and_limits(eng, box, greedy_wasm):
    with pytest.raises(ProgramError, match="not a valid wasm module"):
        core_program("junk", b"\0asm junk", box=box)
    tiny = SandboxLimits(max_kv_pages=1)
    launches = [
        (core_program("usage", greedy_wasm, box=box), ["1,2,3"]),
        (core_program("pages", greedy_wasm, tiny, box=box), ["1,2,3,4,5,6,7,8,9", "8"]),
    ]
    events, controller = run(eng, launches)
    assert "usage" in error(events[0])
    assert "KV page quota exceeded" in error(events[1])
    _released(controller)
