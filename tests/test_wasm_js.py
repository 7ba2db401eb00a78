"""A non-Python sandboxed inferlet built from the WIT: examples/js/greedy.js, built with
componentize-qjs (npm) against wit/pastry.wit world ``inferlet`` into a component, gives
the same greedy tokens as the trusted Python loop. Skipped without npm/componentize-qjs."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("wasmtime")

from inferlet_util import load_engine, result
from pastry.runtime import build_js
from pastry.runtime.trusted import Program, ProgramError
from pastry.runtime.wasm import SandboxLimits, WasmSandbox, component_program
from test_inferlets import GREEDY_LOOP
from test_wasm import _released, error, run

JS_DIR = Path(__file__).resolve().parents[1] / "examples" / "js"


@pytest.fixture(scope="module")
def box() -> WasmSandbox:
    from pastry.runtime import build_pyrt

    try:  # WasmSandbox loads pyrt too; build it if missing (cached)
        build_pyrt.build()
    except build_pyrt.BuildError as e:
        pytest.skip(f"cannot build the Python runtime component: {e}")
    return WasmSandbox(pool_size=0)  # these guests are not Python: no pool needed


@pytest.fixture(scope="module")
def greedy_wasm() -> bytes:
    if build_js.tool() is None and shutil.which("npm") is None:
        pytest.skip("neither componentize-qjs nor npm is available")
    try:
        return build_js.build(JS_DIR / "greedy.js", install_missing=True).read_bytes()
    except build_js.BuildError as e:
        pytest.skip(f"componentize-qjs is not usable here: {e}")


@pytest.fixture(scope="module")
def eng(make_tiny):
    return load_engine(make_tiny("llama"), num_pages=256)


def test_js_greedy_matches_trusted_python(eng, box, greedy_wasm):
    rng = np.random.default_rng(5)
    prompts = [",".join(map(str, rng.integers(0, 500, k).tolist())) for k in (9, 3, 17)]
    js_prog = component_program("greedy-js", greedy_wasm, box=box)
    trusted = Program.from_source("greedy-py", GREEDY_LOOP)
    launches = [(js_prog, [p, "8"]) for p in prompts] + [(trusted, [p, "8"]) for p in prompts]
    events, controller = run(eng, launches)
    for js_ev, py_ev in zip(events[:3], events[3:], strict=True):
        got = result(js_ev)
        assert got == result(py_ev)
        assert len(got.split(",")) == 8
    _released(controller)


def test_js_errors_and_limits(eng, box, greedy_wasm):
    with pytest.raises(ProgramError, match="not a valid wasm component"):
        component_program("junk", b"\0asm junk", box=box)
    tiny = SandboxLimits(max_kv_pages=1)
    launches = [
        (component_program("usage", greedy_wasm, box=box), ["1,2,3"]),
        (component_program("pages", greedy_wasm, tiny, box=box), ["1,2,3,4,5,6,7,8,9", "8"]),
    ]
    events, controller = run(eng, launches)
    assert "usage" in error(events[0])
    assert "KV page quota exceeded" in error(events[1])
    _released(controller)
