"""Weight-only quantized linear weights, served by PyTorch's CPU kernels.

Two formats, each the layout of one kernel:

- **int4** in groups of 32 along the input dimension: ``w = (q - 8) * scale + zero`` with a
  code ``q`` in 0..15 and a scale and zero per group (asymmetric, as GGUF's Q4_1).
  ``aten._weight_int4pack_mm_for_cpu`` multiplies by the packed codes without expanding them.
- **int8** per output channel: ``w = q * scale`` with ``q`` in -127..127
  (``aten._weight_int8pack_mm``).

Weights reach these formats as *codes*, an unpacked intermediate that fused projections
concatenate before packing: :class:`Int4Codes` and :class:`Int8Codes`. Codes come from a dense
weight (:func:`quantize`, for ``--quantize int4|int8`` on any checkpoint) or straight from a
GGUF file's blocks (:func:`gguf_codes`): Q4_0, Q4_1 and Q4_K blocks are int4 groups of 32
exactly (their scales and mins become the group's scale and zero); Q8_0, Q5_x and Q6_K blocks
are requantized to int8 per channel (the int8 kernel has no per-block scales, so this is the
one lossy repacking; quality is measured in ``benchmarks/RESULTS.md``).

Scales are kept in float32 until packing; the packed weight holds them in the activation
dtype (the kernels' requirement), so in bfloat16 they round to 8 significant bits.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from pastry.engine import native, torch_raw
from pastry.wire.config import CheckpointError

if TYPE_CHECKING:
    from pastry.wire.config import ModelConfig

log = logging.getLogger(__name__)

QUANT_MODES = ("auto", "none", "int8", "int4", "int4-hybrid")
QUANTIZED_MODES = ("int8", "int4", "int4-hybrid")
GROUP = 32  # int4 group size along in_features (GGUF's block size)
_INT4_N_MULTIPLE = 16  # the int4 packing needs out_features divisible by 16
# Batch sizes from which int8 weights are expanded to the activation dtype for one dense
# product instead of running the int8 kernel. The expansion is paid per call, in proportion
# to the weight: on the 2-core Zen 5 the kernel wins below ~100 rows for SmolLM2's decoder
# shapes (960x576 at 32 rows: 0.12 ms vs 0.18) and at every measured size for its
# 49152x576 head (32 rows: 9.7 ms vs 46.8, 128 rows: 33.7 vs 53.1; issue 15 session 4).
# At 16, the int8 head of --quantize int4/int8 cost ~40 ms a step from batch 16 on.
INT8_DENSE_FROM_M = 128
# Batch sizes from which an int4 weight with a dense copy (``--quantize int4-hybrid``) multiplies
# by the copy: the int4 kernel's cost grows by ~0.6 ms per row over SmolLM2-135M's
# projections, oneDNN's bf16 by ~0.2 ms from a higher base; they cross between 12 and 16 rows
# on the 2-core Zen 5 (benchmarks/quant_kernels.py).
INT4_DENSE_FROM_M = 16
# Batch sizes from which an int4 weight *without* a dense copy (plain ``--quantize int4``) is
# expanded to bf16 on every call and multiplied by oneDNN's packed product
# (``engine/native.py``: the expansion goes into a per-thread scratch that stays in the
# last-level cache; the result equals int4-hybrid's). On the 2-core Zen 4, over SmolLM2-135M's
# 120 projections: 32 rows 45.5 -> 29.3 ms, a 512-row prefill chunk 682 -> 327 ms; the int4
# kernel still wins at 8 rows (11.3 vs 16.6), the two meet at ~16 (RESULTS, session 5).
INT4_EXPAND_FROM_M = 24


def check_mode(mode: str) -> str:
    if mode not in QUANT_MODES:
        raise ValueError(f"quantize must be one of {', '.join(QUANT_MODES)}, got {mode!r}")
    return mode


# ---------------------------------------------------------------------------- codes


@dataclass(frozen=True, eq=False)
class Int4Codes:
    """``w[n, k] = (q[n, k] - 8) * scale[n, k // GROUP] + zero[n, k // GROUP]``."""

    q: torch.Tensor  # uint8 [N, K], values 0..15
    scale: torch.Tensor  # float32 [N, K / GROUP]
    zero: torch.Tensor  # float32 [N, K / GROUP]

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def dequantize(self) -> torch.Tensor:
        """float32 ``[N, K]``."""
        n, k = self.q.shape
        w = (self.q.float() - 8).view(n, k // GROUP, GROUP)
        return (w * self.scale.unsqueeze(-1) + self.zero.unsqueeze(-1)).view(n, k)

    def rows(self, index: torch.Tensor) -> Int4Codes:
        return Int4Codes(*(t.index_select(0, index) for t in (self.q, self.scale, self.zero)))

    def to_int8(self) -> Int8Codes:
        return Int8Codes.from_dense(self.dequantize())


@dataclass(frozen=True, eq=False)
class Int8Codes:
    """``w[n, k] = q[n, k] * scale[n]``."""

    q: torch.Tensor  # int8 [N, K], values -127..127
    scale: torch.Tensor  # float32 [N]

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def dequantize(self) -> torch.Tensor:
        return self.q.float() * self.scale.unsqueeze(1)

    def rows(self, index: torch.Tensor) -> Int8Codes:
        return Int8Codes(self.q.index_select(0, index), self.scale.index_select(0, index))

    def to_int8(self) -> Int8Codes:
        return self

    @staticmethod
    def from_dense(w: torch.Tensor) -> Int8Codes:
        """Symmetric per-channel int8 of a float ``[N, K]`` weight."""
        w = w.float()
        scale = w.abs().amax(dim=1) / 127
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round(w / scale.unsqueeze(1)).clamp_(-127, 127).to(torch.int8)
        return Int8Codes(q, scale)


Codes = Int4Codes | Int8Codes


def int4_fits(out_features: int, in_features: int) -> bool:
    """Whether the int4 kernel takes a weight of this shape."""
    return out_features % _INT4_N_MULTIPLE == 0 and in_features % GROUP == 0


def quantize_int4(w: torch.Tensor) -> Int4Codes:
    """Asymmetric int4 in groups of :data:`GROUP` of a float ``[N, K]`` weight (min/max per
    group, as GGUF's Q4_1)."""
    n, k = w.shape
    g = w.float().view(n, k // GROUP, GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = (hi - lo) / 15
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round((g - lo.unsqueeze(-1)) / scale.unsqueeze(-1)).clamp_(0, 15)
    return Int4Codes(q.to(torch.uint8).view(n, k), scale, lo + 8 * scale)


def quantize(w: torch.Tensor, mode: str) -> Codes:
    """Codes of a dense weight for ``mode`` ("int4" or "int8"); int4 falls back to int8 for
    shapes the int4 kernel does not take (out_features % 16 or in_features % 32 != 0)."""
    if mode == "int4" and int4_fits(*w.shape):
        return quantize_int4(w)
    if mode in ("int4", "int8"):
        return Int8Codes.from_dense(w)
    raise ValueError(f"cannot quantize to {mode!r} (expected int4 or int8)")


def cat_codes(parts: Sequence[Codes]) -> Codes:
    """Concatenate codes along out_features (fused projections). Parts of different formats,
    or int4 parts whose sum the int4 kernel cannot take, become int8 (lossy for the int4
    parts: they are requantized per channel)."""
    if all(isinstance(p, Int4Codes) for p in parts):
        n = sum(p.shape[0] for p in parts)
        if int4_fits(n, parts[0].shape[1]):
            return Int4Codes(
                torch.cat([p.q for p in parts]),
                torch.cat([p.scale for p in parts]),
                torch.cat([p.zero for p in parts]),
            )
    int8 = [p.to_int8() for p in parts]
    return Int8Codes(torch.cat([p.q for p in int8]), torch.cat([p.scale for p in int8]))


# ---------------------------------------------------------------------------- packed weights


class QuantizedWeight:
    """A packed weight that multiplies 2-D activations: ``matmul(x [M, K]) -> [M, N]``."""

    out_features: int
    in_features: int
    kind: str

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dequantize(self) -> torch.Tensor:
        """The weight in the activation dtype, ``[N, K]`` (tests, non-CPU fallbacks)."""
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        raise NotImplementedError


def _vnni(kernel: str, dtype: torch.dtype) -> bool:
    """Whether an int4 weight multiplies with the int4 x int8 kernel (see Int4Weight)."""
    if kernel not in ("auto", "vnni", "torch"):
        raise ValueError(f"the int4 kernel is auto, vnni or torch, got {kernel!r}")
    vnni = kernel != "torch" and dtype in (torch.float32, torch.bfloat16)
    vnni = vnni and native.load() and native.q4_ready
    if kernel == "vnni" and not vnni:
        raise ValueError("the vnni int4 kernel does not run here (AVX512_VNNI, native kernels)")
    _log_int4_kernel(vnni)
    return vnni


@functools.cache
def _log_int4_kernel(vnni: bool) -> None:
    log.info(
        "int4 weights: %s", "int8 activations on AVX512_VNNI (native)" if vnni
        else "PyTorch's int4 kernel (bf16/float32 activations)",
    )  # fmt: skip


@functools.cache
def _log_no_expansion() -> None:
    log.info(
        "int4 weights: this CPU packs them (or oneDNN lays bf16 out) other than the native "
        "expansion reads (AMX CPUs); PyTorch's int4 kernel multiplies at every batch size"
    )


class Int4Weight(QuantizedWeight):
    """int4 codes (scale and zero per group) for one of two kernels (``kernel``): where the
    CPU has AVX512_VNNI, Pastry's int4 x int8 product (``"vnni"``: the activations
    quantized to int8 per group, as llama.cpp does; 1.7-3.5x PyTorch's int4 kernel at 1-32
    rows and ahead of a dense bf16 product up to 512 on the Zen 5, benchmarks/RESULTS.md),
    else PyTorch's ``_weight_int4pack_mm_for_cpu`` (``"torch"``). ``"auto"`` (the default,
    or ``$PASTRY_INT4_KERNEL``) takes the first this CPU runs."""

    kind = "int4"

    def __init__(self, codes: Int4Codes, dtype: torch.dtype, kernel: str | None = None) -> None:
        n, k = codes.shape
        if not int4_fits(n, k):
            raise ValueError(f"int4 weight of shape {(n, k)} does not fit the kernel")
        self.out_features, self.in_features = n, k
        self.dtype = dtype  # of the activations it multiplies
        self.dense: torch.Tensor | None = None  # see keep_dense
        self.vnni = _vnni(kernel or os.environ.get("PASTRY_INT4_KERNEL", "auto"), dtype)
        self.expandable = False
        if self.vnni:
            self.q4, self.q4_scales = native.q4_pack(codes.q, codes.scale, codes.zero)
            return
        self.packed = torch_raw.int4_pack(codes.q.to(torch.int32))
        # [K / GROUP, N, 2]: the kernel's layout of scales and zeros
        self.scale_zeros = torch.stack((codes.scale.t(), codes.zero.t()), dim=-1).to(dtype)
        self.scale_zeros = self.scale_zeros.contiguous()
        # the native kernels can expand it (bf16, a layout they read; engine/native.py)
        self.expandable = (
            dtype == torch.bfloat16
            and native.ready
            and native.int4_layout(codes.q, self.packed)
            and bool(torch.ops.pastry_native.int4_expandable(k))
        )
        if dtype == torch.bfloat16 and native.ready and not self.expandable:
            _log_no_expansion()

    def keep_dense(self) -> None:
        """Also hold the weight expanded (oneDNN-packed in bfloat16) and multiply by it from
        :data:`INT4_DENSE_FROM_M` rows on, where the int4 kernel is slower than a dense
        product: the expansion of exactly the weight the kernel multiplies by (its scales
        rounded to the activation dtype), at the memory cost of a dense copy."""
        w = self.dequantize()
        if w.dtype == torch.bfloat16 and native.cpu_bf16():  # no bf16 reorder on AVX2
            self.dense = torch_raw.onednn_pack(w.contiguous())
            self._dense_mm = self._packed_mm
        else:
            self.dense = w.contiguous()
            self._dense_mm = F.linear

    @staticmethod
    def _packed_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch_raw.onednn_linear(x, w, None)

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        return torch_raw.int4_mm(x.contiguous(), self.packed, GROUP, self.scale_zeros)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.dense is not None and x.shape[0] >= INT4_DENSE_FROM_M:
            return self._dense_mm(x, self.dense)
        if self.vnni:
            return native.q4_linear(x, self.q4, self.q4_scales)
        if self.expandable and x.shape[0] >= INT4_EXPAND_FROM_M:
            return torch.ops.pastry_native.int4_expanded(x, self.packed, self.scale_zeros, None)
        return self._kernel(x)

    def dequantize(self) -> torch.Tensor:
        if self.vnni:
            return native.q4_unpack(self.q4, self.q4_scales).to(self.dtype)
        eye = torch.eye(self.in_features, dtype=self.scale_zeros.dtype)
        return self._kernel(eye).t().contiguous()

    @property
    def nbytes(self) -> int:
        """Bytes a product below :data:`INT4_DENSE_FROM_M` rows reads (the int4 weight)."""
        if self.vnni:
            return self.q4.nbytes + self.q4_scales.nbytes
        return self.packed.nbytes + self.scale_zeros.nbytes

    @property
    def dense_nbytes(self) -> int:
        """Bytes of the dense copy (0 without one)."""
        if self.dense is None:
            return 0
        return self.out_features * self.in_features * self.dtype.itemsize


class Int8Weight(QuantizedWeight):
    """int8 per-channel codes for ``_weight_int8pack_mm``; from :data:`INT8_DENSE_FROM_M`
    rows on, one dense product over the expanded weight is faster and is used instead."""

    kind = "int8"

    def __init__(self, codes: Int8Codes, dtype: torch.dtype) -> None:
        self.out_features, self.in_features = codes.shape
        self.dtype = dtype  # of the activations it multiplies
        self.q = codes.q.contiguous()
        self.scale = codes.scale.to(dtype)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] >= INT8_DENSE_FROM_M:
            return F.linear(x, self.dequantize())
        return torch_raw.int8_mm(x.contiguous(), self.q, self.scale)

    def dequantize(self) -> torch.Tensor:
        return self.q.to(self.scale.dtype) * self.scale.unsqueeze(1)

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scale.nbytes


def pack(codes: Codes, dtype: torch.dtype) -> QuantizedWeight:
    """The kernel-layout weight of ``codes`` for activations of ``dtype``."""
    if isinstance(codes, Int4Codes):
        return Int4Weight(codes, dtype)
    return Int8Weight(codes, dtype)


# ---------------------------------------------------------------------------- GGUF blocks

_Q4_BLOCK = 32


def _f16(raw: np.ndarray, offset: int) -> np.ndarray:
    """float32 of the little-endian float16 at byte ``offset`` of each block ``[..., bytes]``."""
    return raw[..., offset : offset + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def _nibbles_32(qs: np.ndarray) -> np.ndarray:
    """GGUF's 32-element nibble order: byte j holds element j (low) and j + 16 (high)."""
    return np.concatenate((qs & 0x0F, qs >> 4), axis=-1)


def _q4_0(raw: np.ndarray) -> Int4Codes:
    d = _f16(raw, 0)
    q = _nibbles_32(raw[..., 2:18])
    return _int4(q, d, np.zeros_like(d))


def _q4_1(raw: np.ndarray) -> Int4Codes:
    d, m = _f16(raw, 0), _f16(raw, 2)
    q = _nibbles_32(raw[..., 4:20])
    return _int4(q, d, m + 8 * d)  # q * d + m == (q - 8) * d + (m + 8d)


def _q4_k(raw: np.ndarray) -> Int4Codes:
    """Super-blocks of 256: d, dmin, 12 bytes of 6-bit scales/mins for 8 groups of 32, then
    128 bytes whose 32-byte chunk c holds group 2c (low nibbles) and 2c + 1 (high)."""
    d, dmin = _f16(raw, 0), _f16(raw, 2)
    s = raw[..., 4:16].astype(np.int32)
    sc = np.concatenate((s[..., 0:4] & 63, (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)), -1)
    mn = np.concatenate((s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)), -1)
    qs = raw[..., 16:144].reshape(*raw.shape[:-1], 4, 32)
    q = np.stack((qs & 0x0F, qs >> 4), axis=-2)  # [..., 4, 2, 32]: group 2c + h
    scale = d[..., None] * sc
    return _int4(q.reshape(*raw.shape[:-1], 8, 32), scale, 8 * scale - dmin[..., None] * mn)


def _int4(q: np.ndarray, scale: np.ndarray, zero: np.ndarray) -> Int4Codes:
    """Codes from per-block arrays: ``q [N, blocks(, groups), 32]``, scale/zero alike."""
    n = q.shape[0]
    return Int4Codes(
        torch.from_numpy(np.ascontiguousarray(q.reshape(n, -1), dtype=np.uint8)),
        torch.from_numpy(np.ascontiguousarray(scale.reshape(n, -1), dtype=np.float32)),
        torch.from_numpy(np.ascontiguousarray(zero.reshape(n, -1), dtype=np.float32)),
    )


_INT4_TYPES = {"Q4_0": (_q4_0, 32, 18), "Q4_1": (_q4_1, 32, 20), "Q4_K": (_q4_k, 256, 144)}
_INT8_TYPES = ("Q8_0", "Q5_0", "Q5_1", "Q5_K", "Q6_K")


def block_codes(raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> Codes | None:
    """Codes of one GGUF tensor from its raw blocks (``uint8 [N, bytes per row]``) of type
    ``type_name`` and HF ``shape`` ``(N, K)``; None for float types (F32/F16/BF16), which
    stay dense. Raises :class:`CheckpointError` for types it cannot keep quantized."""
    import gguf

    n, k = shape
    if type_name in _INT4_TYPES:
        fn, block, size = _INT4_TYPES[type_name]
        if raw.shape != (n, k // block * size):
            raise CheckpointError(f"{type_name} tensor of shape {shape} has {raw.shape} bytes")
        return fn(raw.reshape(n, k // block, size))
    if type_name in _INT8_TYPES:
        qtype = gguf.GGMLQuantizationType[type_name]
        dense = gguf.quants.dequantize(raw, qtype).reshape(n, k)
        return Int8Codes.from_dense(torch.from_numpy(dense))
    if type_name in ("F32", "F16", "BF16"):
        return None
    raise CheckpointError(
        f"GGUF tensor type {type_name} cannot be kept quantized (supported: "
        f"{', '.join([*_INT4_TYPES, *_INT8_TYPES])}); load with --quantize none to expand it"
    )


def _unpermute(codes: Codes, n_head: int) -> Codes:
    """Undo llama.cpp's q/k row order (interleaved RoPE pairs) back to HF's rotate-half."""
    n = codes.shape[0]
    half = n // n_head // 2
    index = torch.arange(n).view(n_head, half, 2).transpose(1, 2).reshape(n)
    return codes.rows(index)


def gguf_codes(path: str | Path, cfg: ModelConfig, lossy: bool = True) -> dict[str, Codes]:
    """Codes of every quantized projection of a llama-architecture GGUF, by HF tensor name
    (``model.layers.{i}.self_attn.q_proj.weight``, ..., ``lm_head.weight``; the tied
    embedding's codes serve as ``lm_head.weight``). Float tensors are left out, and so are
    the types requantized to int8 (Q8_0, Q5_x, Q6_K) unless ``lossy``."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    names = {
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    }
    out: dict[str, Codes] = {}
    for t in reader.tensors:
        parts = t.name.split(".")
        if t.name == "output.weight" or (t.name == "token_embd.weight" and cfg.tie_word_embeddings):
            hf = "lm_head.weight"
        elif len(parts) == 4 and parts[0] == "blk" and parts[2] in names and parts[3] == "weight":
            hf = f"model.layers.{parts[1]}.{names[parts[2]]}.weight"
        else:
            continue
        if not lossy and t.tensor_type.name not in _INT4_TYPES:
            continue
        shape = (int(t.shape[1]), int(t.shape[0]))  # GGUF lists ne0 (row length) first
        codes = block_codes(np.asarray(t.data), t.tensor_type.name, shape)
        if codes is None:
            continue
        if parts[-2:-1] == ["attn_q"]:
            codes = _unpermute(codes, cfg.num_heads)
        elif parts[-2:-1] == ["attn_k"]:
            codes = _unpermute(codes, cfg.num_kv_heads)
        if hf == "lm_head.weight" and t.name == "token_embd.weight" and "lm_head.weight" in out:
            continue  # an explicit output.weight wins
        out[hf] = codes
    return out


def kept_codes(
    path: str | Path, cfg: ModelConfig, mode: str, device: torch.device
) -> dict[str, Codes]:
    """The quantized projections of checkpoint ``path`` to serve as they are (codes by HF
    name, for :func:`~pastry.engine.build.build_model` over the dense weights).

    With ``mode`` "int4", "int4-hybrid" or "int8" on the CPU, a GGUF file's blocks: Q4_0, Q4_1 and Q4_K
    exactly as int4 (never requantized, whatever the mode), Q8_0, Q5_x and Q6_K requantized
    to int8 per channel; the mode then applies to the file's float projections. With
    "auto" and "none" nothing: the blocks are expanded to the model's dtype, which serves
    batches of ~8 and more faster on the CPU (``benchmarks/vs_llamacpp.py``), the common
    case of a server. Empty for other checkpoints and devices."""
    path = Path(path)
    if check_mode(mode) not in QUANTIZED_MODES or device.type != "cpu" or not path.is_file():
        return {}
    if path.suffix.lower() != ".gguf":
        return {}
    return gguf_codes(path, cfg)
