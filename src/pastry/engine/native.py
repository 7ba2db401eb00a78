"""Pastry's native CPU kernels (``data/native.cpp``), built on first use.

Three things, for the CPU:

- **A bfloat16 product for few rows over oneDNN's packed weight.** ``Linear.prepack``
  reorders a bf16 weight into oneDNN's blocked layout; on a CPU with AVX512_BF16 that
  layout is ``[ceil(N/64)][Kp/2][64][2]`` (64 output rows per block, pairs of inputs
  interleaved), which :func:`blocked_layout` checks byte for byte per weight. Below
  :data:`SMALL_M` rows the native kernel reads that memory in place — no second copy —
  at memory bandwidth, where oneDNN's one-row path has ~11 us of fixed cost per call and
  streams more slowly (SmolLM2-135M's 120 decoder projections at one row: ~10 ms with
  oneDNN, ~7 ms native on the 2-core Zen 4; benchmarks/RESULTS.md). Float32 sums, one
  rounding to bfloat16: a few outputs differ from oneDNN's in the last bit.
- **A float32 product over Pastry's own layout.** With AVX-512, ``Linear.prepack`` packs a
  float32 weight into panels of 64 output columns (``[ceil(N/64)][K][64]``, :func:`pack`)
  and drops the plain one; :func:`panel_linear` multiplies by it at every row count. It
  streams the weight once per call, where MKL's sgemm over the ``[N, K]`` weight reads it
  at about half the bandwidth for the 4-32 rows of decode batches (1.3-1.8x faster there
  on SmolLM2-135M's projections, 0.83-1.0x sgemm for prefill's hundreds of rows;
  benchmarks/RESULTS.md). :data:`panels_ready` says whether it runs here.
- **The C++ kernel of ``pastry::linear``**, the compiled decode step's opaque projection
  call (:mod:`pastry.engine.compiled`): called from inductor's C++ wrapper through the
  dispatcher, it no longer enters Python (120 round trips a step on SmolLM2-135M).

:func:`load` builds the library with ``torch.utils.cpp_extension`` (a C++ compiler and
ninja, as inductor needs a compiler; ~15 s on 2 cores) into ``$PASTRY_HOME/native``, keyed
by the source and the torch build, and loads it; later starts — from any virtual
environment with the same torch — load the built file directly, in milliseconds.
Without a compiler, or with ``PASTRY_NATIVE=0``, it says why once and everything runs as
before (oneDNN for the products, a Python kernel for ``pastry::linear``).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import shutil
import threading
import time
from pathlib import Path

import torch

from pastry.engine import torch_raw
from pastry.paths import pastry_home

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "data" / "native.cpp"
BLOCK = 64  # output rows per block of oneDNN's packed bf16 layout (native.cpp)
# Rows below which a blocked weight is multiplied natively; from here on oneDNN's product
# is faster (its cost grows more slowly with the rows; benchmarks/RESULTS.md).
SMALL_M = 5
# kinds of Projections.add (native.cpp)
DENSE, BLOCKED, INT4, INT8, PANELS, Q4 = 0, 1, 2, 3, 4, 5

_lock = threading.Lock()
_state: dict[str, object] = {}  # "loaded": bool, "error": str
ready = False  # the library is loaded and this CPU runs its bf16 kernel
panels_ready = False  # the library is loaded and this CPU runs its float32 panel kernel
q4_ready = False  # the library is loaded and this CPU runs its int4 x int8 (VNNI) kernel


def build_dir() -> Path:
    """Where the library is built: keyed by the source and the torch build it links."""
    key = hashlib.sha256(SOURCE.read_bytes())
    key.update(f"{torch.__version__}|{torch_raw.cxx11_abi()}".encode())
    return pastry_home() / "native" / key.hexdigest()[:16]


def load() -> bool:
    """Build (the first time) and load the library into the process, once; False, with the
    reason in :func:`error`, logged once, if it cannot be built or loaded or
    ``PASTRY_NATIVE=0``. Sets :data:`ready`, :data:`panels_ready` and :data:`q4_ready`."""
    global ready, panels_ready, q4_ready
    with _lock:
        if "loaded" in _state:
            return bool(_state["loaded"])
        try:
            if os.environ.get("PASTRY_NATIVE", "1") == "0":
                raise RuntimeError("turned off by PASTRY_NATIVE=0")
            out = build_dir()
            lib = out / "pastry_native.so"
            t = time.perf_counter()
            if lib.is_file():
                # built before (by this or another environment with the same torch): load
                # the library itself, no compiler or ninja involved
                torch.ops.load_library(str(lib))
            else:
                _build(out)
            log.info("native CPU kernels ready in %.1fs", time.perf_counter() - t)
            torch.library.register_fake("pastry_native::decode_attention", _attention_fake)
            _state["loaded"] = True
            capped = isa_capped()
            ready = bool(torch.ops.pastry_native.supported()) and capped is None
            panels_capped = isa_capped("avx512")
            panels_ready = bool(torch.ops.pastry_native.panel_supported()) and not panels_capped
            vnni_capped = isa_capped("vnni")
            q4_ready = bool(torch.ops.pastry_native.q4_supported()) and not vnni_capped
            if not panels_ready:
                log.info("float32 products stay with MKL (%s)",
                         panels_capped or "this CPU lacks AVX-512")  # fmt: skip
            if capped is not None:
                log.info("native bf16 kernels off: the ISA is capped (%s)", capped)
            elif not ready:
                log.info("this CPU lacks AVX512_BF16: bf16 products stay with oneDNN")
        except Exception as e:  # no compiler, no ninja, a failed build: as before
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            _state["error"] = f"{type(e).__name__}: {first}"
            _state["loaded"] = False
            log.warning("Pastry's native CPU kernels are unavailable (%s)", _state["error"])
        return bool(_state["loaded"])


def cpu_isa() -> str:
    """The vector ISA PyTorch's CPU kernels use here (``ATEN_CPU_CAPABILITY`` caps it)."""
    return torch.backends.cpu.get_cpu_capability()


@functools.cache
def cpu_bf16() -> bool:
    """Whether oneDNN multiplies bfloat16 on this CPU (AVX512 BW/VL/DQ or AVX-NE-CONVERT;
    ``ONEDNN_MAX_CPU_ISA`` caps it). Without it ``_reorder_linear_weight`` refuses bf16
    weights and bf16 products run PyTorch's generic loops (AVX2: 3-5x slower than float32)."""
    return torch_raw.onednn_linear_available() and torch_raw.onednn_bf16_supported()


# oneDNN's ISA names at or above AVX512_CORE_BF16 (what the bf16 kernels need)
_BF16_ISAS = ("ALL", "AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX",
              "AVX512_CORE_AMX_FP16", "AVX10_1_512", "AVX10_1_512_AMX",
              "AVX10_1_512_AMX_FP16", "AVX10_2_512", "AVX10_2_512_AMX_2")  # fmt: skip


# and the AVX-512 ones below it (what the float32 panel kernel needs; VNNI: the int4 one)
_VNNI_ISAS = ("AVX512_CORE_VNNI", *_BF16_ISAS)
_AVX512_ISAS = ("AVX512_CORE", *_VNNI_ISAS)


def isa_capped(need: str = "bf16") -> str | None:
    """Why a native kernel must not run although the CPU could: the ISA is capped below
    what it needs (``need``: "bf16", AVX512_BF16 for the bf16 kernels; "vnni",
    AVX512_VNNI for the int4 one; "avx512", AVX-512 for the float32 panels) by ``ONEDNN_MAX_CPU_ISA`` or ``ATEN_CPU_CAPABILITY`` (how the
    tests and a user emulate an older CPU: every path then is the one that CPU would
    take)."""
    allowed = {"bf16": _BF16_ISAS, "vnni": _VNNI_ISAS, "avx512": _AVX512_ISAS}[need]
    onednn = os.environ.get("ONEDNN_MAX_CPU_ISA", "").strip().upper()
    if onednn and onednn not in allowed:
        return f"ONEDNN_MAX_CPU_ISA={onednn}"
    aten = os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower()
    if aten in ("default", "avx2", "zvector", "vsx"):
        return f"ATEN_CPU_CAPABILITY={aten}"
    return None


def _build(out: Path) -> None:
    """Build the library into a fresh directory and move it to ``out`` whole, so that a
    start killed mid-build, or two processes building at once, never leave a half-built
    ``out`` behind (the loser of a race keeps the library it built and loaded)."""
    from torch.utils import cpp_extension

    _find_ninja()
    log.info("building Pastry's native CPU kernels into %s (once, ~15 s)", out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f"{out.name}.build-{os.getpid()}-{threading.get_ident()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        cpp_extension.load(
            name="pastry_native",
            sources=[str(SOURCE)],
            build_directory=str(tmp),
            extra_cflags=["-O2", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=False,
        )
        if out.exists() and not (out / "pastry_native.so").is_file():
            shutil.rmtree(out, ignore_errors=True)  # an older, unfinished build
        with contextlib.suppress(OSError):  # another process finished first: the same build
            os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _find_ninja() -> None:
    """Put the ``ninja`` of the PyPI package (a dependency) on ``PATH`` when none is there:
    ``cpp_extension`` runs ``ninja`` by name, and a virtual environment's ``bin`` is not on
    ``PATH`` unless activated (``.venv/bin/pastry serve``)."""
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja
    except ImportError:
        return  # cpp_extension then says that ninja is missing
    os.environ["PATH"] = os.pathsep.join(filter(None, (ninja.BIN_DIR, os.environ.get("PATH"))))


def _attention_fake(q, pool, k_layer, v_layer, kv, allow, scale):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def attention(head_dim: int) -> bool:
    """Whether the compiled decode step's attention runs natively for this head dim
    (``pastry_native::decode_attention``; requires :func:`load`)."""
    return ready and bool(torch.ops.pastry_native.attention_head_dim(head_dim))


def pack(w: torch.Tensor) -> torch.Tensor:
    """The float32 weight ``w [N, K]`` as panels ``[ceil(N/64)][K][64]`` (requires
    :data:`panels_ready`)."""
    return torch.ops.pastry_native.panel_pack(w)


def unpack(panels: torch.Tensor, n: int) -> torch.Tensor:
    """The ``[N, K]`` weight back from its panels."""
    return panels.transpose(1, 2).reshape(-1, panels.shape[1])[:n]


def panel_linear(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, n: int):
    """``x [M, K]`` times the packed weight (``[M, n]``, float32, + ``bias``)."""
    return torch.ops.pastry_native.panel_linear(x, panels, bias, n)


def q4_pack(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor):
    """int4 codes ``q [N, K]`` (0..15; ``w = (q - 8) * scale + zero`` per group of 32) in
    the int4 x int8 kernel's layout (native.cpp): ``(packed [N/16, K/8, 16, 4] uint8, sm
    [N/16, K/32, 2, 16] float32)``, the scales and ``zero - 8 * scale`` per 16 rows."""
    n, k = q.shape
    v = q.to(torch.uint8).view(n // 16, 16, k // 8, 2, 4)
    packed = (v[:, :, :, 0] | (v[:, :, :, 1] << 4)).permute(0, 2, 1, 3).contiguous()
    scale, zero = scale.float(), zero.float()
    sm = torch.stack((scale, zero - 8 * scale)).view(2, n // 16, 16, k // 32)
    return packed, sm.permute(1, 3, 0, 2).contiguous()


def q4_unpack(packed: torch.Tensor, sm: torch.Tensor) -> torch.Tensor:
    """The float32 weight ``[N, K]`` that :func:`q4_linear` multiplies by."""
    blocks, k8 = packed.shape[:2]
    codes = torch.stack((packed & 15, packed >> 4), dim=2)  # [N/16, K/8, 2, 16, 4]
    q = codes.permute(0, 3, 1, 2, 4).reshape(blocks * 16, k8 * 8).float()
    s, m = sm.permute(2, 0, 3, 1).reshape(2, blocks * 16, -1).repeat_interleave(32, dim=-1)
    return q * s + m


def q4_linear(x: torch.Tensor, packed: torch.Tensor, sm: torch.Tensor, bias=None):
    """``x [M, K]`` (float32 or bfloat16) times the packed int4 weight, the activations
    quantized to int8 per group of 32 (requires :data:`q4_ready`); in x's dtype."""
    return torch.ops.pastry_native.q4_linear(x, packed, sm, bias)


def error() -> str | None:
    """Why :func:`load` failed, if it did."""
    return _state.get("error")  # type: ignore[return-value]


def _raw(packed: torch.Tensor) -> torch.Tensor:
    """The bytes of a oneDNN tensor as a flat bfloat16 tensor sharing its memory."""
    n = torch_raw.onednn_nbytes(packed)
    buf = (ctypes.c_uint8 * n).from_address(torch.ops.mkldnn.data_ptr(packed))
    return torch.frombuffer(buf, dtype=torch.bfloat16)


def blocked_layout(w: torch.Tensor, packed: torch.Tensor) -> int | None:
    """The padded input width ``Kp`` if ``packed`` (oneDNN's reorder of the bf16 weight
    ``w [N, K]``) holds it as ``[ceil(N/64)][Kp/2][64][2]``, the layout the native kernel
    reads, checked on every element; None otherwise (another ISA, another format)."""
    n, k = w.shape
    if k % 2 or w.dtype != torch.bfloat16 or packed.dtype != torch.bfloat16:
        return None
    blocks = -(-n // BLOCK)
    nbytes = torch_raw.onednn_nbytes(packed)
    if nbytes % (blocks * BLOCK * 2 * 2):
        return None
    kp = nbytes // (blocks * BLOCK * 2)
    if kp < k:
        return None
    raw = _raw(packed).view(blocks, kp // 2, BLOCK, 2).permute(0, 2, 1, 3)
    raw = raw.reshape(blocks * BLOCK, kp)[:n, :k]  # [N, K] as the layout says
    if not torch.equal(raw.view(torch.int16), w.view(torch.int16)):
        return None
    return kp


def int4_layout(q: torch.Tensor, packed: torch.Tensor) -> bool:
    """Whether ``packed`` (``_convert_weight_to_int4pack_for_cpu`` of the codes ``q [N, K]``,
    values 0..15) is laid out as the native int4 kernel reads it: ``[N/64][K][32]`` bytes,
    byte ``i`` of (block, k) holding row ``i``'s code (low nibble) and row ``i + 32``'s
    (high). Checked on every byte; False for other shapes and layouts."""
    n, k = q.shape
    if n % BLOCK or k % 32 or packed.dtype != torch.uint8 or packed.numel() * 2 != n * k:
        return False
    halves = q.view(n // BLOCK, 2, BLOCK // 2, k)  # rows i and i + 32 of each block
    want = (halves[:, 0] | (halves[:, 1] << 4)).transpose(1, 2)  # [N/64, K, 32]
    return torch.equal(packed.reshape(n // BLOCK, k, BLOCK // 2), want)
