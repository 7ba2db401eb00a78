"""The one door to the part of PyTorch's API that PyTorch keeps private.

The engine's CPU paths use kernels PyTorch ships but binds only under private names: the
oneDNN-packed linear product that ``torch.compile`` with ``freezing`` uses
(``mkldnn._reorder_linear_weight`` / ``mkldnn._linear_pointwise``), the weight-only int4 and
int8 products (``aten._weight_int4pack_mm_for_cpu``, ``aten._weight_int8pack_mm``), and
dynamo's knobs for marking dimensions dynamic and raising its recompile limit. Every such
use in Pastry goes through this module and no other (``tests/test_layout.py`` keeps it
so): a new PyTorch is checked here, and each function below is exercised by
``tests/test_native.py``, ``tests/test_quant.py`` and ``tests/test_compiled.py``.

Nothing is looked up at import: a build without oneDNN imports this module too, and
``torch._dynamo`` (slow to import) loads only when the decode step is compiled.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def onednn_linear_available() -> bool:
    """Whether this PyTorch has oneDNN and its packed linear product."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def onednn_bf16_supported() -> bool:
    """Whether oneDNN multiplies bfloat16 on this CPU (``ONEDNN_MAX_CPU_ISA`` caps it)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def onednn_pack(w: torch.Tensor) -> torch.Tensor:
    """``w [N, K]`` reordered into oneDNN's blocked layout for products of few rows."""
    return torch.ops.mkldnn._reorder_linear_weight(w, 1)


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x packed^T + bias`` over a weight packed by :func:`onednn_pack`."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def onednn_linear_op() -> Callable[..., torch.Tensor]:
    """The overload :func:`onednn_linear` calls, taking ``(x, packed, bias, "none", [], "")``:
    for callers that bind it once and skip the dispatch through the packet."""
    return torch.ops.mkldnn._linear_pointwise.default


def onednn_nbytes(packed: torch.Tensor) -> int:
    """The bytes of a oneDNN tensor's own (padded) buffer."""
    return int(torch.ops.mkldnn._nbytes(packed))


def int4_pack(codes: torch.Tensor) -> torch.Tensor:
    """int4 codes ``[N, K]`` (int32, values 0..15) packed for :func:`int4_mm`."""
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)


def int4_mm(
    x: torch.Tensor, packed: torch.Tensor, group: int, scale_zeros: torch.Tensor
) -> torch.Tensor:
    """``x`` times the int4 weight ``packed`` with per-``group`` scales and zeros
    ``[K / group, N, 2]``, without expanding the weight."""
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, scale_zeros)


def int8_mm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x`` times the int8 weight ``q [N, K]`` with per-row ``scale``."""
    return torch.ops.aten._weight_int8pack_mm(x, q, scale)


def cxx11_abi() -> bool:
    """Whether this PyTorch was built with the C++11 ABI (what an extension must match)."""
    return bool(torch._C._GLIBCXX_USE_CXX11_ABI)


def raise_recompile_limit(limit: int) -> None:
    """Let dynamo compile at least ``limit`` graphs of one function (its default is 8)."""
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, limit)


def mark_dynamic(t: torch.Tensor, dim: int) -> None:
    """Compile ``t``'s dimension ``dim`` as symbolic where dynamo can (a hint, not a demand)."""
    torch._dynamo.maybe_mark_dynamic(t, dim)


def compile_error() -> type[Exception]:
    """The base class of dynamo's errors: a graph that failed to compile (nothing ran).
    A function, for ``except`` clauses (evaluated only when something was raised)."""
    return torch._dynamo.exc.TorchDynamoException
