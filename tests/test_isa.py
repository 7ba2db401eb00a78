"""Every ISA-dependent path, on one machine: the engine in a subprocess per capped ISA
(``ONEDNN_MAX_CPU_ISA``, ``ATEN_CPU_CAPABILITY``), asserting the path that CPU would take
(float32 where there is no bf16 arithmetic, oneDNN's packed bf16, the native kernels, the
native float32 panels where there is AVX-512) and that each computes the float32 engine's
function (float32 panels: MKL's float32 product's, to float32 summation order). A test never asserts a fast path the
CPU does not offer: what is expected is derived from this CPU's flags and the cap."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

CHILD = r"""
import json, sys
import numpy as np
import torch
from pastry.engine import layers, native
from pastry.engine.engine import Engine
from pastry.wire.config import EngineConfig
from tests.engine_util import SMALL_POOLS, all_probs

path = sys.argv[1]
tokens = [1, 42, 7, 99, 3, 18, 64, 5, 77, 12]
f32 = Engine.load(path, EngineConfig(dtype="float32", **SMALL_POOLS))
ref = all_probs(f32, tokens)
out = {"isa": native.cpu_isa(), "bf16": native.cpu_bf16(), "panels": native.panels_ready}
out["f32_kinds"] = sorted({lin.kind for lin in f32.model.linears()})
ready, native.panels_ready = native.panels_ready, False  # MKL's product over plain weights
plain = Engine.load(path, EngineConfig(dtype="float32", **SMALL_POOLS))
native.panels_ready = ready
out["plain_kinds"] = sorted({lin.kind for lin in plain.model.linears()})
out["f32_err"] = float(np.abs(all_probs(plain, tokens) - ref).max())
auto = Engine.load(path, EngineConfig(dtype="auto", **SMALL_POOLS))
out["auto_dtype"] = auto.info.dtype
out["auto_err"] = float(np.abs(all_probs(auto, tokens) - ref).max())
bf = Engine.load(path, EngineConfig(dtype="bfloat16", **SMALL_POOLS))
out["native"] = native.ready
out["kinds"] = sorted({lin.kind for lin in bf.model.linears()})
out["blocked"] = any(lin.blocked_kp is not None for lin in bf.model.linears())
out["bf16_err"] = float(np.abs(all_probs(bf, tokens) - ref).max())
q4 = Engine.load(path, EngineConfig(dtype="float32", quantize="int4", **SMALL_POOLS))
out["q4"] = native.q4_ready
out["int4_vnni"] = sorted({lin.quantized.vnni for lin in q4.model.linears() if lin.kind == "int4"})
print(json.dumps(out))
"""

CAPS = {
    "avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"},
    "avx512-core": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"},
    "avx512-vnni": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI"},
    "avx512-bf16": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"},
    "uncapped": {},
}
ORDER = ["avx2", "avx512-core", "avx512-vnni", "avx512-bf16", "uncapped"]


def cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


def expected(cap: str, flags: set[str]) -> dict:
    """The path a CPU with ``flags`` takes under ``cap``."""
    level = ORDER.index(cap)
    avx512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags
    # oneDNN's bf16: AVX512 BW/VL/DQ (or AVX-NE-CONVERT) and a cap at AVX512_CORE or above
    bf16 = level >= 1 and (avx512 or "avx_ne_convert" in flags)
    native_bf16 = level >= 3 and avx512 and "avx512_bf16" in flags
    # the float32 panels: AVX-512F and a cap at AVX512_CORE or above
    panels = level >= 1 and "avx512f" in flags
    # the int4 x int8 kernel: AVX512_VNNI and a cap at AVX512_CORE_VNNI or above
    q4 = level >= 2 and avx512 and "avx512_vnni" in flags
    return {"bf16": bf16, "native": native_bf16, "panels": panels, "q4": q4}


@pytest.mark.parametrize("cap", ORDER)
def test_each_isa_takes_its_path_and_computes_the_same_function(make_tiny, cap):
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_MAX_CPU_ISA",
                                                            "ATEN_CPU_CAPABILITY")}  # fmt: skip
    env.update(CAPS[cap])
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(make_tiny("llama"))],
        env=env, capture_output=True, text=True, timeout=600, cwd=root,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    want = expected(cap, cpu_flags())
    assert got["bf16"] == want["bf16"], got
    assert got["native"] == want["native"], got
    assert got["panels"] == want["panels"], got
    assert got["q4"] == want["q4"], got
    assert got["int4_vnni"] == [want["q4"]], got  # --quantize int4 takes the kernel it runs
    # float32: Pastry's panels where the CPU has AVX-512, MKL's product over the plain
    # weight elsewhere (and when they are off); the same function either way
    assert got["f32_kinds"] == (["panels"] if want["panels"] else ["dense"]), got
    assert got["plain_kinds"] == ["dense"], got
    assert got["f32_err"] < 1e-5, got
    if cap == "avx2":
        assert got["isa"] == "AVX2"
    # auto: bf16 only where the CPU multiplies bf16; float32 (the same numbers) elsewhere
    assert got["auto_dtype"] == ("bfloat16" if want["bf16"] else "float32"), got
    if not want["bf16"]:
        assert got["auto_err"] < 1e-5, got
    # explicit bf16: oneDNN's packed weights where it has bf16, the plain product where not;
    # the native kernel reads them only where it runs
    assert got["kinds"] == (["packed"] if want["bf16"] else ["dense"]), got
    if not want["native"]:
        assert not got["blocked"], got
    assert got["bf16_err"] < 0.02, got  # bf16 rounding, same function
