"""A non-Python sandboxed inferlet built from the WIT: examples/js/greedy.js, built with
componentize-qjs (npm) against wit/pastry.wit world ``inferlet`` into a component, gives
the same greedy tokens as the trusted Python loop. Skipped without npm/componentize-qjs."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

pytest.importorskip("wasmtime")

from pastry.runtime import build_js
from pastry.runtime.wasm import component_program
from wasm_util import engine_fixture, errors_and_limits, greedy_matches_trusted, sandbox_fixture

JS_DIR = Path(__file__).resolve().parents[1] / "examples" / "js"


box = sandbox_fixture(pool_size=0)  # these guests are not Python: no pool needed
eng = engine_fixture()


@pytest.fixture(scope="module")
def greedy_wasm() -> bytes:
    if build_js.tool() is None and shutil.which("npm") is None:
        pytest.skip("neither componentize-qjs nor npm is available")
    try:
        return build_js.build(JS_DIR / "greedy.js", install_missing=True).read_bytes()
    except build_js.BuildError as e:
        pytest.skip(f"componentize-qjs is not usable here: {e}")


def test_js_greedy_matches_trusted_python(eng, box, greedy_wasm):
    greedy_matches_trusted(eng, component_program("greedy-js", greedy_wasm, box=box), seed=5)


def test_js_errors_and_limits(eng, box, greedy_wasm):
    def make(name, wasm=greedy_wasm, **kw):
        return component_program(name, wasm, box=box, **kw)

    errors_and_limits(eng, make, "not a valid wasm component")
