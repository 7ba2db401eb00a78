"""A non-Python sandboxed inferlet: examples/c/greedy.c, compiled with zig cc (the
``ziglang`` package) to a core wasm module importing ``pastry.*`` (examples/c/pastry.h),
gives the same greedy tokens as the trusted Python loop."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("wasmtime")
pytest.importorskip("ziglang")

from pastry.runtime.wasm import core_program
from pastry.runtime.wasm_core import build_c
from wasm_util import engine_fixture, errors_and_limits, greedy_matches_trusted, sandbox_fixture

C_DIR = Path(__file__).resolve().parents[1] / "examples" / "c"


box = sandbox_fixture(pool_size=0)  # these guests are not Python: no pool needed
eng = engine_fixture()


@pytest.fixture(scope="module")
def greedy_wasm(tmp_path_factory) -> bytes:
    try:
        return build_c(C_DIR / "greedy.c")
    except (RuntimeError, OSError) as e:
        pytest.skip(f"zig cc is not usable here: {e}")


def test_c_greedy_matches_trusted_python(eng, box, greedy_wasm):
    greedy_matches_trusted(eng, core_program("greedy-c", greedy_wasm, box=box), seed=3)


def test_c_errors_and_limits(eng, box, greedy_wasm):
    def make(name, wasm=greedy_wasm, **kw):
        return core_program(name, wasm, box=box, **kw)

    errors_and_limits(eng, make, "not a valid wasm module")
