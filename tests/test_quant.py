"""Weight-only quantization (engine/quant.py): GGUF blocks, packing, kernels, the engine."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine_util import Pages, Seq
from pastry.engine import native, quant
from pastry.engine.build import build_model
from pastry.engine.checkpoint import load_checkpoint
from pastry.engine.engine import Engine
from pastry.engine.gguf_export import export_gguf, permute_qk
from pastry.engine.hf_checkpoint import load_state_dict
from pastry.engine.quant import Int4Codes, Int4Weight, Int8Codes, Int8Weight
from pastry.wire.config import EngineConfig

gguf = pytest.importorskip("gguf")
POOLS = dict(num_pages=128, num_embeds=1024, num_host_pages=8, page_size=4)


def require_vnni() -> None:
    if not (native.load() and native.q4_ready):
        pytest.skip("the int4 x int8 kernel needs AVX512_VNNI and the native library")


@pytest.fixture
def vnni() -> None:
    require_vnni()


def relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    """The product's error relative to its size (int8 activations: ~0.5% on random data)."""
    return float((y.float() - ref).norm() / ref.norm())


def _f16_bytes(values) -> np.ndarray:
    values = np.asarray(values, dtype=np.float16)
    return values.view(np.uint8).reshape(*values.shape, 2)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_q4_blocks_are_int4_groups_exactly(qtype):
    w = np.random.default_rng(0).standard_normal((48, 256)).astype(np.float32)
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[qtype])
    codes = quant.block_codes(raw, qtype, (48, 256))
    assert isinstance(codes, Int4Codes)
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).reshape(48, 256)
    np.testing.assert_array_equal(codes.dequantize().numpy(), ref)


def test_q4_k_blocks_are_int4_groups_exactly():
    """Random super-blocks (every 6-bit scale/min pattern) against gguf's reference."""
    rng = np.random.default_rng(1)
    raw = rng.integers(0, 256, (32, 2, 144), dtype=np.uint8)
    raw[..., 0:2] = _f16_bytes(rng.uniform(1e-3, 2e-2, (32, 2)))
    raw[..., 2:4] = _f16_bytes(rng.uniform(1e-4, 2e-3, (32, 2)))
    raw = raw.reshape(32, 288)
    codes = quant.block_codes(raw, "Q4_K", (32, 512))
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_K).reshape(32, 512)
    # (q - 8) * scale + zero rounds differently from scale * q - min: within an ulp of the range
    np.testing.assert_allclose(codes.dequantize().numpy(), ref, rtol=1e-6, atol=2e-6)


def test_q8_0_is_requantized_per_channel():
    w = np.random.default_rng(2).standard_normal((16, 128)).astype(np.float32)
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
    codes = quant.block_codes(raw, "Q8_0", (16, 128))
    assert isinstance(codes, Int8Codes)
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q8_0).reshape(16, 128)
    step = np.abs(ref).max(axis=1, keepdims=True) / 127
    assert (np.abs(codes.dequantize().numpy() - ref) <= step / 2 + 1e-6).all()


def test_float_and_unknown_block_types():
    assert quant.block_codes(np.zeros((4, 16), np.uint8), "F32", (4, 4)) is None
    with pytest.raises(Exception, match=r"IQ2_XS cannot be kept quantized.*--quantize none"):
        quant.block_codes(np.zeros((4, 74), np.uint8), "IQ2_XS", (4, 256))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 5, 40])
def test_kernels_compute_the_dequantized_product(dtype, m):
    torch.manual_seed(0)
    w = torch.randn(96, 128)
    x = torch.randn(m, 128).to(dtype)
    tol = 1e-4 if dtype == torch.float32 else 0.08
    for codes, packed in (
        (c4 := quant.quantize_int4(w), Int4Weight(c4, dtype, kernel="torch")),
        (c8 := Int8Codes.from_dense(w), Int8Weight(c8, dtype)),
    ):
        ref = x.float() @ codes.dequantize().to(dtype).float().t()
        torch.testing.assert_close(packed.matmul(x).float(), ref, atol=tol, rtol=tol)
        torch.testing.assert_close(
            packed.dequantize().float(), codes.dequantize().to(dtype).float(), atol=tol, rtol=0
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 5, 40, 200])
def test_vnni_kernel_computes_the_dequantized_product(vnni, dtype, m):
    """The int4 x int8 kernel: the activations quantized per group of 32 (llama.cpp's
    Q8 rounding), the weight exactly the codes' dequantization; with a bias."""
    torch.manual_seed(m)
    w = torch.randn(4 * 16 * 3, 32 * 5)  # 192 x 160: several blocks of 16 rows, 5 groups
    codes = quant.quantize_int4(w)
    q = Int4Weight(codes, dtype, kernel="vnni")
    assert q.vnni and not hasattr(q, "packed")
    assert q.nbytes == 192 * 160 // 2 + 192 * 5 * 2 * 4  # nibbles, float32 scale and min
    exact = codes.dequantize()
    torch.testing.assert_close(q.dequantize().float(), exact.to(dtype).float(), rtol=0,
                               atol=1e-5 if dtype == torch.float32 else 0.02)  # fmt: skip
    x = torch.randn(m, 160).to(dtype)
    y = q.matmul(x)
    assert y.dtype == dtype and y.shape == (m, 192)
    ref = x.float() @ exact.t()
    assert relative_error(y, ref) < 0.015
    # the error is the activations' rounding, not the weight's: integers up to 127 in
    # every group (the int8 scale 1) multiply exactly
    xs = torch.randint(-127, 128, (m, 160)).float()
    xs[:, ::32] = 127
    ys = native.q4_linear(xs, q.q4, q.q4_scales)
    torch.testing.assert_close(ys, xs @ exact.t(), rtol=1e-4, atol=1e-2)
    bias = torch.randn(192).to(dtype)
    torch.testing.assert_close(native.q4_linear(x, q.q4, q.q4_scales, bias), y + bias,
                               rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-2)  # fmt: skip


def test_q4_layout_round_trips(vnni):
    codes = quant.quantize_int4(torch.randn(48, 96))
    packed, sm = native.q4_pack(codes.q, codes.scale, codes.zero)
    assert packed.shape == (3, 12, 16, 4) and packed.dtype == torch.uint8
    assert sm.shape == (3, 3, 2, 16) and sm.dtype == torch.float32
    torch.testing.assert_close(native.q4_unpack(packed, sm), codes.dequantize(), rtol=0, atol=1e-6)


def test_the_int4_kernel_is_chosen_or_refused(monkeypatch):
    codes = quant.quantize_int4(torch.randn(32, 64))
    with pytest.raises(ValueError, match="auto, vnni or torch, got 'fast'"):
        Int4Weight(codes, torch.float32, kernel="fast")
    assert not Int4Weight(codes, torch.float32, kernel="torch").vnni
    monkeypatch.setenv("PASTRY_INT4_KERNEL", "torch")
    assert not Int4Weight(codes, torch.float32).vnni
    monkeypatch.setenv("PASTRY_INT4_KERNEL", "auto")
    assert Int4Weight(codes, torch.float32).vnni == (native.load() and native.q4_ready)
    monkeypatch.setattr(native, "q4_ready", False)  # a CPU without AVX512_VNNI
    assert not Int4Weight(codes, torch.bfloat16).vnni
    with pytest.raises(ValueError, match="vnni int4 kernel does not run here"):
        Int4Weight(codes, torch.bfloat16, kernel="vnni")


def test_int4_quantization_error_is_half_a_step():
    w = torch.randn(32, 256)
    c = quant.quantize_int4(w)
    err = (c.dequantize() - w).abs().view(32, 8, 32)
    assert (err <= c.scale.unsqueeze(-1) / 2 + 1e-6).all()


def test_fused_codes_concatenate_or_fall_back_to_int8():
    a, b = quant.quantize_int4(torch.randn(32, 64)), quant.quantize_int4(torch.randn(16, 64))
    both = quant.cat_codes([a, b])
    assert isinstance(both, Int4Codes) and both.shape == (48, 64)
    torch.testing.assert_close(both.dequantize()[32:], b.dequantize())
    mixed = quant.cat_codes([a, Int8Codes.from_dense(torch.randn(16, 64))])
    assert isinstance(mixed, Int8Codes) and mixed.shape == (48, 64)
    odd = quant.quantize(torch.randn(24, 64), "int4")  # 24 rows: not a multiple of 16
    assert isinstance(odd, Int8Codes)


def _weights(path) -> tuple:
    ck = load_checkpoint(path)
    sd = load_state_dict(ck.path, ck.config, dtype=torch.float32, device=torch.device("cpu"))
    return ck.config, sd


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0"])
def test_gguf_codes_map_names_and_undo_the_qk_permutation(make_tiny, tmp_path, qtype):
    """A GGUF written from a checkpoint gives back each projection's codes under its HF name,
    rows in HF order, equal to the checkpoint's weight up to the block quantization."""
    cfg, sd = _weights(make_tiny("llama"))
    path = export_gguf(tmp_path / "m.gguf", cfg, {k: v.numpy() for k, v in sd.items()}, qtype)
    codes = quant.gguf_codes(path, cfg)
    per_layer = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    want = {
        f"model.layers.{i}.{'self_attn' if p[0] in 'qkvo' else 'mlp'}.{p}.weight"
        for i in range(cfg.num_layers)
        for p in per_layer
    }
    want.add("lm_head.weight")
    assert set(codes) == want
    # each code equals the file's tensor (gguf's own dequantization), rows back in HF order
    reader = gguf.GGUFReader(str(path))
    by_name = {t.name: t for t in reader.tensors}
    hf_to_gguf = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v"}
    hf_to_gguf.update(o_proj="attn_output", gate_proj="ffn_gate", up_proj="ffn_up")
    hf_to_gguf.update(down_proj="ffn_down")
    for name, c in codes.items():
        if name == "lm_head.weight":
            t, heads = by_name["output.weight"], None
        else:
            _, _, i, _, proj, _ = name.split(".")
            t = by_name[f"blk.{i}.{hf_to_gguf[proj]}.weight"]
            heads = {"q_proj": cfg.num_heads, "k_proj": cfg.num_kv_heads}.get(proj)
        ref = gguf.quants.dequantize(t.data, t.tensor_type).reshape(c.shape)
        ours = c.dequantize().numpy()
        if heads:
            ours = permute_qk(ours, heads)
        if qtype == "Q4_0":
            np.testing.assert_array_equal(ours, ref, err_msg=name)
        else:  # requantized per channel: within half a step of the channel's int8 scale
            step = np.abs(ref).max(axis=1, keepdims=True) / 127
            assert (np.abs(ours - ref) <= step / 2 + 1e-7).all(), name
    # the row permutation round-trips exactly
    rows = torch.arange(48, dtype=torch.float32).view(48, 1).expand(48, 4)
    permuted = torch.from_numpy(permute_qk(rows.numpy(), 3).copy())
    back = quant._unpermute(Int8Codes(permuted.to(torch.int8), torch.ones(48)), 3)
    torch.testing.assert_close(back.dequantize(), rows)


@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_quantized_engine_is_the_dequantized_model(make_tiny, mode, monkeypatch):
    """--quantize computes exactly the model whose weights are the dequantized codes (with
    PyTorch's int4 kernel: the VNNI one rounds the activations too, tested below)."""
    monkeypatch.setenv("PASTRY_INT4_KERNEL", "torch")
    path = make_tiny("llama")
    q = Engine.load(path, EngineConfig(dtype="float32", quantize=mode, **POOLS))
    kinds = {lin.kind for lin in q.model.linears()}
    assert kinds == ({"int4", "int8"} if mode == "int4" else {"int8"})
    assert q.model.lm_head.kind == "int8"
    cfg, sd = _weights(path)
    ref_weights = dict(sd)
    model = q.model
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        a, m = layer.self_attn, layer.mlp
        qkv = a.qkv_proj.quantized.dequantize().float()
        ref_weights[p + "self_attn.q_proj.weight"] = qkv[: cfg.q_size]
        ref_weights[p + "self_attn.k_proj.weight"] = qkv[cfg.q_size : cfg.q_size + cfg.kv_size]
        ref_weights[p + "self_attn.v_proj.weight"] = qkv[cfg.q_size + cfg.kv_size :]
        ref_weights[p + "self_attn.o_proj.weight"] = a.o_proj.quantized.dequantize().float()
        gu = m.gate_up_proj.quantized.dequantize().float()
        ref_weights[p + "mlp.gate_proj.weight"] = gu[: cfg.intermediate_size]
        ref_weights[p + "mlp.up_proj.weight"] = gu[cfg.intermediate_size :]
        ref_weights[p + "mlp.down_proj.weight"] = m.down_proj.quantized.dequantize().float()
    ref_weights["lm_head.weight"] = model.lm_head.quantized.dequantize().float()
    ref_model = build_model(cfg, torch.float32, torch.device("cpu"), ref_weights, "auto")
    ref = Engine(ref_model, EngineConfig(dtype="float32", **POOLS))
    toks = np.random.default_rng(0).integers(0, q.info.vocab_size, 14).tolist()
    sq, sr = Seq(Pages(q)), Seq(Pages(ref))
    np.testing.assert_allclose(sq.step(toks), sr.step(toks), atol=1e-5)
    for t in (3, 1, 4):
        np.testing.assert_allclose(sq.step([t]), sr.step([t]), atol=1e-5)


def test_gguf_codes_load_into_the_model(make_tiny, tmp_path):
    """Codes from a GGUF load straight into the fused projections (int4 kept int4)."""
    cfg, sd = _weights(make_tiny("llama"))
    path = export_gguf(tmp_path / "m.gguf", cfg, {k: v.numpy() for k, v in sd.items()}, "Q4_1")
    weights = {**sd, **quant.gguf_codes(path, cfg)}
    model = build_model(cfg, torch.bfloat16, torch.device("cpu"), weights)
    assert [lin.kind for lin in model.linears()] == ["int4"] * 4 * cfg.num_layers + ["int8"]
    dense = build_model(cfg, torch.bfloat16, torch.device("cpu"), weights, "none")
    # oneDNN-packed where the CPU multiplies bf16, the plain product where not (AVX2)
    assert {lin.kind for lin in dense.linears()} == {"packed" if native.cpu_bf16() else "dense"}


def test_quantize_needs_the_cpu(make_tiny):
    cfg, sd = _weights(make_tiny("llama"))
    with pytest.raises(ValueError, match="CPU only"):
        build_model(cfg, torch.float32, torch.device("meta"), sd, "int4")
    with pytest.raises(ValueError, match="quantize must be one of"):
        EngineConfig(quantize="int3")


def test_the_engine_keeps_a_gguf_file_s_blocks_when_asked(make_tiny, tmp_path):
    """What Engine.load serves quantized from a checkpoint: a GGUF's blocks with int8 or int4
    on the CPU (int4 blocks stay int4 in both modes); nothing with auto or none, on another
    device, or from an HF directory."""
    path = make_tiny("llama")
    cfg, sd = _weights(path)
    dense = {k: v.numpy() for k, v in sd.items()}
    q4 = export_gguf(tmp_path / "q4.gguf", cfg, dense, "Q4_0")
    cpu = torch.device("cpu")
    everything = quant.gguf_codes(q4, cfg)
    for mode in ("int8", "int4"):
        kept = quant.kept_codes(q4, cfg, mode, cpu)
        assert set(kept) == set(everything), mode
        assert isinstance(kept["model.layers.0.mlp.up_proj.weight"], quant.Int4Codes)
    for mode in ("auto", "none"):
        assert quant.kept_codes(q4, cfg, mode, cpu) == {}
    assert quant.kept_codes(q4, cfg, "int4", torch.device("meta")) == {}
    assert quant.kept_codes(path, cfg, "int4", cpu) == {}
    with pytest.raises(ValueError, match="quantize must be one of"):
        quant.kept_codes(q4, cfg, "int3", cpu)
    # through Engine.load (issue 9's GGUF loader): the file's blocks, served as int4
    eng = Engine.load(q4, EngineConfig(dtype="float32", quantize="int4", **POOLS))
    assert eng.model.layers[0].mlp.gate_up_proj.kind == "int4"
    ref = build_model(cfg, torch.float32, cpu, {**sd, **everything})
    torch.testing.assert_close(
        eng.model.layers[0].mlp.gate_up_proj.quantized.dequantize(),
        ref.layers[0].mlp.gate_up_proj.quantized.dequantize(),
        rtol=0,
        atol=0,
    )


@pytest.mark.parametrize("kernel", ["torch", "vnni"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_with_a_dense_copy_switches_kernels_by_rows(dtype, kernel):
    """keep_dense: below INT4_DENSE_FROM_M rows the int4 kernel (bit for bit), from it on
    the dense copy of exactly the weight the kernel multiplies by."""
    if kernel == "vnni":
        require_vnni()
    torch.manual_seed(0)
    w = torch.randn(96, 128)
    lean, hybrid = (Int4Weight(quant.quantize_int4(w), dtype, kernel) for _ in range(2))
    hybrid.keep_dense()
    assert lean.dense is None and lean.dense_nbytes == 0
    assert hybrid.dense_nbytes == 96 * 128 * torch.finfo(dtype).bits // 8
    assert hybrid.nbytes == lean.nbytes  # a batch-1 product still streams the int4 weight
    exact = lean.dequantize().float()
    below, at = quant.INT4_DENSE_FROM_M - 1, quant.INT4_DENSE_FROM_M
    for m in (1, below, at, 3 * at):
        x = torch.randn(m, 128).to(dtype)
        y = hybrid.matmul(x)
        if m < at:
            assert torch.equal(y, lean.matmul(x))
        if m >= at or kernel == "torch":  # the dense copy, or bf16/float32 activations
            tol = 1e-4 if dtype == torch.float32 else 0.08
            torch.testing.assert_close(y.float(), x.float() @ exact.t(), atol=tol, rtol=tol)
        else:  # int8 activations
            assert relative_error(y, x.float() @ exact.t()) < 0.015


def test_int4_hybrid_engine(make_tiny, tmp_path):
    """--quantize int4-hybrid: int4 projections (a GGUF's Q4 blocks kept) with dense copies;
    batches of 16+ rows run the dense copies, smaller ones the int4 kernel, with the int4
    engine's results up to float rounding."""
    cfg, sd = _weights(make_tiny("llama"))
    q4 = export_gguf(tmp_path / "q4.gguf", cfg, {k: v.numpy() for k, v in sd.items()}, "Q4_0")
    engines = {
        mode: Engine.load(q4, EngineConfig(dtype="float32", quantize=mode, **POOLS))
        for mode in ("int4", "int4-hybrid")
    }
    hyb = engines["int4-hybrid"].model
    int4 = [lin for lin in hyb.linears() if lin.kind == "int4"]
    assert len(int4) == 4 * cfg.num_layers and all(lin.quantized.dense is not None for lin in int4)
    assert hyb.lm_head.kind == "int8"
    dense_rows = []
    for lin in int4:
        mm = lin.quantized._dense_mm
        lin.quantized._dense_mm = lambda x, w, mm=mm: dense_rows.append(len(x)) or mm(x, w)
    toks = np.random.default_rng(0).integers(0, cfg.vocab_size, 20).tolist()
    seqs = {mode: Seq(Pages(e)) for mode, e in engines.items()}
    # a 20-token prefill (dense copies) agrees within rounding; one-token steps exactly
    np.testing.assert_allclose(seqs["int4-hybrid"].step(toks), seqs["int4"].step(toks), atol=1e-4)
    assert dense_rows == [20] * len(int4)
    for t in (3, 1, 4):
        np.testing.assert_allclose(seqs["int4-hybrid"].step([t]), seqs["int4"].step([t]), atol=1e-4)
    assert dense_rows == [20] * len(int4)  # one-token steps ran the int4 kernel
