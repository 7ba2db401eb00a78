"""Pastry's native CPU kernels (engine/native.py, engine/data/native.cpp).

The few-row bf16 product over oneDNN's packed weight equals oneDNN's product up to float32
summation order (one bf16 rounding: a unit in the last place of a few outputs, more only
near cancellation), and is what Linear.forward runs below SMALL_M rows; the float32 product
over Pastry's panels equals sgemm's to float32 summation order at every row count; the
C++ kernel of pastry::linear multiplies exactly as Linear.forward does for every kind of
weight; and without the library (no compiler, PASTRY_NATIVE=0) an engine starts, compiles
and decodes as before.

The library is built once per source into $PASTRY_HOME/native (~15 s the first time).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pastry.engine import native
from pastry.engine.layers import Linear, native_projections
from pastry.engine.quant import (
    INT4_DENSE_FROM_M,
    INT4_EXPAND_FROM_M,
    INT8_DENSE_FROM_M,
    Int4Weight,
    Int8Codes,
    pack,
    quantize_int4,
)

MKLDNN = torch.backends.mkldnn.is_available()


@pytest.fixture(scope="module")
def lib() -> None:
    if not native.load():
        pytest.skip(f"the native library could not be built here: {native.error()}")


def packed_linear(
    n: int, k: int, bias: bool = False, seed: int = 0, require: bool = True
) -> tuple[Linear, torch.Tensor]:
    """A prepacked bf16 Linear and its weight; where oneDNN has no bf16 on this CPU (AVX2:
    Linear then keeps the plain product, tests/test_isa.py), the test is skipped, or with
    ``require=False`` the Linear stays unpacked."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(torch.bfloat16)
    lin = Linear(k, n, bias=bias).to(torch.bfloat16)
    lin.weight.data.copy_(w)
    if bias:
        lin.bias.data.copy_(torch.randn(n, generator=g).to(torch.bfloat16))
    if not native.cpu_bf16():
        if require:
            pytest.skip("oneDNN has no bf16 on this CPU (AVX2): no packed weights")
        return lin, w
    assert lin.prepack()
    return lin, w


def onednn(lin: Linear, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, lin.packed, lin.bias, "none", [], "")


def ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many bf16 representable steps apart two bf16 tensors of one sign pattern are."""
    ia, ib = a.view(torch.int16).int(), b.view(torch.int16).int()
    return (ia - ib).abs()


@pytest.mark.skipif(not MKLDNN, reason="no oneDNN in this torch build")
@pytest.mark.parametrize(
    ("n", "k"),
    [(960, 576), (576, 1536), (100, 70), (130, 64), (49152 // 16, 576), (48, 32)],
)
def test_blocked_product_equals_onednn(lib, n, k):
    """Shapes that fill the 64-row blocks and shapes that pad them (rows and inputs)."""
    lin, w = packed_linear(n, k, bias=n % 3 == 0, seed=n + k)
    if lin.blocked_kp is None:
        pytest.skip("oneDNN chose another layout for this shape on this CPU")
    assert lin.blocked_kp >= k
    g = torch.Generator().manual_seed(k)
    for m in range(1, native.SMALL_M):
        x = torch.randn(m, k, generator=g).to(torch.bfloat16)
        ours = torch.ops.pastry_native.blocked_linear(x, lin.packed, lin.bias, n, lin.blocked_kp)
        theirs = onednn(lin, x)
        assert ours.shape == theirs.shape == (m, n)
        assert within_one_rounding(ours, x, w, lin.bias)
        assert within_one_rounding(theirs, x, w, lin.bias)  # the bound holds for oneDNN too
        # the two sum in different orders: mostly the same bf16 value, a unit apart at most
        # where the float32 sums straddle a rounding boundary (more only near cancellation)
        assert (ulps_apart(ours, theirs) <= 1).float().mean() >= 0.99


def within_one_rounding(
    y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None
) -> bool:
    """Whether ``y`` is the product ``x w^T (+ bias)`` summed in float32, in any order, and
    rounded to bf16 once: within half a bf16 unit (2^-8 relative) plus the float32 summation
    error of ``y``'s sum and of the reference's (each at most k + 1 units of 2^-24 of the
    terms' magnitudes, in any order)."""
    xf, wf = x.float(), w.float()
    b = bias.float() if bias is not None else torch.zeros(w.shape[0])
    ref = xf @ wf.t() + b
    summed = 2.0**-24 * (w.shape[1] + 1) * (xf.abs() @ wf.abs().t() + b.abs())
    return bool(((y.float() - ref).abs() <= (ref.abs() + 2 * summed) * 2.0**-8 + 2 * summed).all())


@pytest.mark.skipif(not MKLDNN, reason="no oneDNN in this torch build")
def test_linear_forward_uses_the_native_product_below_small_m(lib):
    lin, _ = packed_linear(256, 192, bias=True)
    if lin.blocked_kp is None or not native.ready:
        pytest.skip("oneDNN chose another layout, or no AVX512_BF16")
    x = torch.randn(native.SMALL_M + 3, 192).to(torch.bfloat16)
    for m in (1, native.SMALL_M - 1):
        want = torch.ops.pastry_native.blocked_linear(x[:m], lin.packed, lin.bias, 256, 192)
        assert torch.equal(lin(x[:m]), want)
    assert torch.equal(lin(x), onednn(lin, x))  # from SMALL_M rows on: oneDNN's product
    # a non-contiguous activation (a column slice) reads the same values
    wide = torch.randn(2, 400).to(torch.bfloat16)
    assert torch.equal(lin(wide[:, 8:200]), lin(wide[:, 8:200].contiguous()))


def test_blocked_layout_rejects_a_different_weight():
    """The layout check compares every element: a packed weight of other values fails."""
    if not MKLDNN:
        pytest.skip("no oneDNN in this torch build")
    lin, w = packed_linear(128, 64)
    if lin.blocked_kp is None:
        pytest.skip("oneDNN chose another layout on this CPU")
    other = w.clone()
    other[77, 33] += 1
    assert native.blocked_layout(other, lin.packed) is None
    assert native.blocked_layout(w, lin.packed) == lin.blocked_kp


def linears_of_every_kind() -> list[Linear]:
    """A float32 dense Linear, a bf16 packed one with a bias, an int4 one with a dense copy
    for large batches (int4-hybrid), an int8 one, an int4 one without a copy (expanded
    for large batches), where the CPU has AVX-512 a float32 one in panels with a bias and,
    where it has VNNI, int4 ones on the int4 x int8 kernel (float32 with a bias and bf16
    with a dense copy); each 64 x 96."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(64, 96, generator=g) / 10
    dense = Linear(96, 64, bias=True)
    dense.weight.data.copy_(w)
    dense.bias.data.copy_(torch.randn(64, generator=g))
    packed, _ = packed_linear(64, 96, bias=True, seed=5, require=False)
    int4 = Linear(96, 64).to(torch.bfloat16)
    int4.set_quantized(Int4Weight(quantize_int4(w), torch.bfloat16, kernel="torch"))
    int4.quantized.keep_dense()
    int8 = Linear(96, 64).to(torch.bfloat16)
    int8.set_quantized(pack(Int8Codes.from_dense(w), torch.bfloat16))
    plain4 = Linear(96, 64, bias=True).to(torch.bfloat16)
    plain4.bias.data.copy_(torch.randn(64, generator=g).to(torch.bfloat16))
    plain4.set_quantized(Int4Weight(quantize_int4(w), torch.bfloat16, kernel="torch"))
    lins = [dense, packed, int4, int8, plain4]
    if native.q4_ready:
        vnni = Linear(96, 64, bias=True)
        vnni.bias.data.copy_(torch.randn(64, generator=g))
        vnni.set_quantized(Int4Weight(quantize_int4(w), torch.float32, kernel="vnni"))
        hybrid = Linear(96, 64).to(torch.bfloat16)
        hybrid.set_quantized(Int4Weight(quantize_int4(w), torch.bfloat16, kernel="vnni"))
        hybrid.quantized.keep_dense()
        lins += [vnni, hybrid]
    if native.panels_ready:
        panels = Linear(96, 64, bias=True)
        panels.weight.data.copy_(w)
        panels.bias.data.copy_(torch.randn(64, generator=g))
        assert panels.prepack() and panels.kind == "panels"
        lins.append(panels)
    return lins


def test_projections_multiply_as_linear_forward(lib):
    """pastry::linear's C++ kernel gives Linear.forward's results, bit for bit, for every
    kind of weight and on both sides of each kind's row threshold."""
    lins = linears_of_every_kind()
    p = native_projections(lins)
    assert p.size() == len(lins)
    for i, lin in enumerate(lins):
        dtype = lin.dtype  # the projection's own (pastry::linear gets it in the graph)
        rows = (1, 3, native.SMALL_M, INT4_DENSE_FROM_M + 1, INT4_EXPAND_FROM_M)
        for m in (*rows, INT8_DENSE_FROM_M):
            x = torch.randn(m, 96).to(dtype)
            assert torch.equal(torch.ops.pastry_native.call(p, i, x), lin(x)), (lin.kind, m)


def panels_linear(n: int, k: int, bias: bool, seed: int = 0) -> tuple[Linear, torch.Tensor]:
    """A float32 Linear, unpacked, and its weight."""
    g = torch.Generator().manual_seed(seed)
    lin = Linear(k, n, bias=bias)
    lin.weight.data.copy_(torch.randn(n, k, generator=g) / k**0.5)
    if bias:
        lin.bias.data.copy_(torch.randn(n, generator=g))
    return lin, lin.weight.detach().clone()


@pytest.mark.parametrize(("n", "k"), [(64, 96), (100, 576), (960, 576), (576, 1536), (7, 33)])
@pytest.mark.parametrize("bias", [False, True])
def test_float32_panels_multiply_as_sgemm(lib, n, k, bias):
    """Linear.prepack packs a float32 weight into panels where the CPU has AVX-512 (and
    keeps the plain weight elsewhere); the product over them equals F.linear's to float32
    summation order at every row count (partial panels, partial row blocks, many rows), and
    the weight reads back exactly."""
    lin, w = panels_linear(n, k, bias)
    xs = [torch.randn(m, k) for m in (0, 1, 5, 6, 7, 13, 64, 300)]
    refs = [lin(x) for x in xs]
    if not native.panels_ready:
        assert not lin.prepack() and lin.kind == "dense"
        return
    assert lin.prepack() and lin.kind == "panels" and lin.weight is None
    assert torch.equal(lin.dense_weight(), w)
    for x, ref in zip(xs, refs, strict=True):
        y = lin(x)
        assert y.shape == ref.shape and y.dtype == torch.float32 and y.is_contiguous()
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    wide = torch.randn(9, 2 * k)[:, ::2]  # rows that are not contiguous
    torch.testing.assert_close(lin(wide), F.linear(wide, w, lin.bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("n", "k"), [(128, 64), (960, 576), (4096 + 192, 96)])
def test_int4_expanded_from_many_rows_equals_the_dense_copy(lib, n, k):
    """From INT4_EXPAND_FROM_M rows a plain int4 weight is expanded per call: exactly the
    weight int4-hybrid keeps (dequantize()), multiplied by the same packed product, in
    chunks of 4096 rows for tall weights."""
    if not native.ready:
        pytest.skip("no AVX512_BF16")
    g = torch.Generator().manual_seed(n)
    w = torch.randn(n, k, generator=g) / 10
    q = Int4Weight(quantize_int4(w), torch.bfloat16, kernel="torch")
    if not q.expandable:
        # On AMX CPUs PyTorch's int4 pack (and oneDNN's bf16 layout) is not the one the
        # expansion reads: the logged fallback is PyTorch's kernel at every row count.
        x = torch.randn(INT4_EXPAND_FROM_M + 5, k, generator=g).to(torch.bfloat16)
        assert torch.equal(q.matmul(x), q._kernel(x))
        pytest.skip("int4 expansion unavailable on this CPU (layout); the fallback checked")
    dense = q.dequantize()
    assert torch.equal(torch.ops.pastry_native.int4_expand(q.packed, q.scale_zeros), dense)
    packed = torch.ops.mkldnn._reorder_linear_weight(dense, 1)
    x = torch.randn(INT4_EXPAND_FROM_M + 5, k, generator=g).to(torch.bfloat16)
    bias = torch.randn(n, generator=g).to(torch.bfloat16)
    want = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    assert torch.equal(q.matmul(x), want)
    with_bias = torch.ops.pastry_native.int4_expanded(x, q.packed, q.scale_zeros, bias)
    want = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    assert torch.equal(with_bias, want)
    # below the threshold: PyTorch's int4 kernel, as before
    assert torch.equal(q.matmul(x[:3]), q._kernel(x[:3]))


def attention_reference(q, pool, k_layer, v_layer, kv, allow, scale):
    """The compiled step's formulation: gathered rows, masked float32 softmax, products."""
    b, hq, d = q.shape
    hkv, slots = pool.shape[1], pool.shape[2]
    rep = hq // hkv
    k = pool[k_layer].reshape(hkv * slots, d)[kv].float()  # [Hkv, B, L, D]
    v = pool[v_layer].reshape(hkv * slots, d)[kv].float()
    qg = q.view(b, hkv, rep, d).transpose(0, 1).float()  # [Hkv, B, rep, D]
    scores = (qg @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allow.view(1, b, 1, -1), float("-inf"))
    o = scores.softmax(-1) @ v  # [Hkv, B, rep, D]
    return o.transpose(0, 1).reshape(b, hq, d)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("hq", "hkv", "d"),
    [(9, 3, 64), (4, 4, 16), (8, 2, 128), (16, 2, 64), (5, 1, 32), (4, 1, 256)],
)
@pytest.mark.parametrize("length", [37, 100])
def test_decode_attention_equals_the_gathered_softmax(lib, dtype, hq, hkv, d, length):
    """Per item its own rows and mask (masked rows may hold anything, even NaN: they do
    not count), grouped and ungrouped heads (query heads per KV head 1, 3, 4, 5 and 8: the
    kernel takes them four at a time), the head dims the kernel takes, contexts of several
    16-key blocks with a tail, and an item whose first blocks are all masked (the online
    softmax starts at its first allowed key)."""
    if not native.attention(d):
        pytest.skip("no AVX512_BF16")
    g = torch.Generator().manual_seed(hq * d + length)
    layers, slots, b = 3, 512, 5
    pool = torch.randn(2 * layers, hkv, slots, d, generator=g).to(dtype)
    # distinct slots for every (item, key), head-major rows
    kv = torch.stack([torch.randperm(slots, generator=g)[: b * length] for _ in range(hkv)])
    kv = kv.view(hkv, b, length) + torch.arange(hkv).view(hkv, 1, 1) * slots
    allow = torch.rand(b, length, generator=g) < 0.7
    allow[:, -1] = True
    allow[0, : length - 3] = False  # item 0: whole blocks masked, then three keys
    for layer in (1, layers + 1):  # K and V rows only masked keys use
        pool[layer].view(-1, d)[kv[:, ~allow]] = float("nan")
    q = torch.randn(b, hq, d, generator=g).to(dtype)
    ours = torch.ops.pastry_native.decode_attention(q, pool, 1, layers + 1, kv, allow, d**-0.5)
    for layer in (1, layers + 1):
        pool[layer].view(-1, d)[kv[:, ~allow]] = 0.0
    want = attention_reference(q, pool, 1, layers + 1, kv, allow, d**-0.5)
    assert ours.dtype == dtype and ours.shape == (b, hq, d) and not ours.isnan().any()
    if dtype == torch.float32:
        torch.testing.assert_close(ours, want, atol=1e-6, rtol=1e-5)
    else:  # the float32 result rounded once to bf16 (a relative 2^-8), summed in another order
        assert ((ours.float() - want).abs() <= 2**-8 * want.abs() + 1e-5).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("hq", "hkv", "d"), [(9, 3, 64), (8, 4, 32), (16, 2, 128)])
def test_decode_attention_over_a_shared_prefix_equals_the_gathered_softmax(lib, dtype, hq, hkv, d):
    """Items whose first keys are the same rows (one cached prompt under several
    sequences, which the kernel's KV-head-major order keeps in cache from one item to the
    next) and items padded at the end: the same result. Items 0-5 share 70 keys, item 6
    too but with a masked key at 10, item 7 only the first 30, item 8 has its own rows;
    items 9-12 share 90 keys of another prompt and item 12's last keys are masked; masked
    rows hold NaN."""
    g = torch.Generator().manual_seed(hq * d)
    layers, slots, b, length = 2, 4096, 13, 150
    pool = torch.randn(2 * layers, hkv, slots, d, generator=g).to(dtype)
    perm = torch.randperm(slots, generator=g)
    own = perm[: b * length].view(b, length).clone()
    spare = perm[b * length :]
    prompt_a, prompt_b = spare[:70], spare[70:160]
    for i in range(7):
        own[i, :70] = prompt_a
    own[7, :30] = prompt_a[:30]
    for i in range(9, 13):
        own[i, :90] = prompt_b
    kv = own.unsqueeze(0) + torch.arange(hkv).view(hkv, 1, 1) * slots  # [Hkv, B, L]
    allow = torch.rand(b, length, generator=g) < 0.8
    allow[:, :90] = True
    allow[6, 10] = False
    allow[12, 120:] = False
    allow[:, -1] = True
    masked = kv[:, ~allow]
    masked = masked[~torch.isin(masked, kv[:, allow])]  # rows no allowed key reads
    for layer in (1, layers + 1):
        pool[layer].view(-1, d)[masked] = float("nan")
    q = torch.randn(b, hq, d, generator=g).to(dtype)
    ours = torch.ops.pastry_native.decode_attention(q, pool, 1, layers + 1, kv, allow, d**-0.5)
    for layer in (1, layers + 1):
        pool[layer].view(-1, d)[masked] = 0.0
    want = attention_reference(q, pool, 1, layers + 1, kv, allow, d**-0.5)
    assert not ours.isnan().any()
    if dtype == torch.float32:
        torch.testing.assert_close(ours, want, atol=1e-6, rtol=1e-5)
    else:
        assert ((ours.float() - want).abs() <= 2**-8 * want.abs() + 1e-5).all()


def test_pastry_linear_resolves_the_thread_s_projections(lib):
    """Outside a step pastry::linear has no projections to call; inside, the current ones."""
    from pastry.engine import compiled

    assert compiled._kernel() == "native"
    lins = linears_of_every_kind()
    p = native_projections(lins)
    x = torch.randn(2, 96)
    with pytest.raises(RuntimeError, match="outside CompiledDecode"):
        torch.ops.pastry.linear(x, 0, 64)
    with compiled._running([], p):
        assert torch.equal(torch.ops.pastry.linear(x, 0, 64), lins[0](x))
    with pytest.raises(RuntimeError, match="outside CompiledDecode"):
        torch.ops.pastry.linear(x, 0, 64)


def test_without_the_library_an_engine_compiles_and_decodes_as_before(make_tiny, tmp_path):
    """PASTRY_NATIVE=0 (as without a compiler): the engine says why, pastry::linear gets
    its Python kernel, and the compiled decode equals the eager one."""
    path = make_tiny("llama")
    script = tmp_path / "run.py"
    script.write_text(
        f"""
import logging, sys
logging.basicConfig(level=logging.INFO)
sys.path.insert(0, {str(Path(__file__).parent)!r})
from engine_util import Pages, Seq
from pastry.engine import compiled, native
from pastry.wire.config import EngineConfig
from pastry.engine.engine import Engine
kw = dict(dtype="float32", num_pages=64, num_embeds=256, num_host_pages=1, page_size=4)
comp = Engine.load({str(path)!r}, EngineConfig(compile=True, **kw))
eager = Engine.load({str(path)!r}, EngineConfig(**kw))
toks = [5, 9, 2, 7, 1]
a, b = Seq(Pages(comp)).greedy(toks, 6), Seq(Pages(eager)).greedy(toks, 6)
assert comp.compiled.kernel == "python" and not native.ready, comp.compiled.kernel
assert comp.compiled.steps == 5 and a == b, (a, b)
print("OK", native.error())
"""
    )
    env = {**os.environ, "PASTRY_NATIVE": "0"}
    out = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "OK RuntimeError: turned off by PASTRY_NATIVE=0" in out.stdout
    assert "native CPU kernels are unavailable" in out.stderr
