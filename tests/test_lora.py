"""LoRA adapters (``Forward.adapter``) against PEFT + transformers on tiny checkpoints."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from engine_util import Pages, Seq, dense, hf_model
from pastry.engine import lora
from pastry.engine.engine import Engine
from pastry.wire.calls import CallError, EmbedTxt, Forward, NextDist, ids
from pastry.wire.codec import decode_batch, encode_batch
from pastry.wire.config import CheckpointError, EngineConfig

peft = pytest.importorskip("peft")

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ARCHS = ["llama", "qwen2", "qwen3"]
POOLS = dict(num_pages=256, num_embeds=2048, num_host_pages=4, page_size=4)
# adapter name -> LoraConfig arguments (PEFT's own random init, B non-zero)
ADAPTERS = {
    "all7": dict(r=4, lora_alpha=8, target_modules=ALL),
    # q and v but not k (a gap inside the fused qkv), another rank, rsLoRA scaling
    "qv-down": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"],
                    use_rslora=True),
    "late-mlp": dict(r=2, lora_alpha=4, target_modules=["o_proj", "up_proj"],
                     layers_to_transform=[1]),
}  # fmt: skip
ATOL = 2e-5  # next-token probabilities, float32, against PEFT
LOG_ATOL = 1e-5  # and their logs: the tiny models are near uniform (probabilities ~1e-4)


def load(path, dtype="float32", **kw) -> Engine:
    return Engine.load(path, EngineConfig(dtype=dtype, **{**POOLS, **kw}))


def assert_matches(got: np.ndarray, ref: np.ndarray, msg: str = "") -> None:
    np.testing.assert_allclose(got, ref, atol=ATOL, err_msg=msg)
    np.testing.assert_allclose(np.log(got), np.log(ref), atol=LOG_ATOL, err_msg=msg)


def tokens(n: int, vocab: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


@pytest.fixture(scope="session")
def adapters(make_tiny, tmp_path_factory):
    """``adapters(arch) -> (checkpoint, {name: adapter dir})``, written by PEFT."""
    from peft import LoraConfig, get_peft_model

    made = {}

    def make(arch: str):
        if arch not in made:
            ckpt = make_tiny(arch)
            root = tmp_path_factory.mktemp(f"lora-{arch}")
            dirs = {}
            for seed, (name, kw) in enumerate(ADAPTERS.items()):
                torch.manual_seed(seed)
                cfg = LoraConfig(init_lora_weights=False, task_type="CAUSAL_LM", **kw)
                get_peft_model(hf_model(ckpt), cfg).save_pretrained(root / name)
                dirs[name] = root / name
            made[arch] = (ckpt, dirs)
        return made[arch]

    return make


def peft_probs(ckpt: Path, adapter: Path | None, toks: list[int]) -> np.ndarray:
    """Next-token probabilities at every position of ``toks`` [n, vocab], PEFT on HF."""
    from peft import PeftModel

    model = hf_model(ckpt)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).eval()
    with torch.no_grad():
        return model(torch.tensor([toks])).logits[0].double().softmax(-1).numpy()


def calls_for(seq: Seq, toks: list[int], adapter: int) -> tuple[EmbedTxt, Forward, NextDist]:
    (embed, fwd), out = seq.forward_calls(toks)
    return embed, replace(fwd, adapter=adapter), NextDist(out, k=seq.alloc.engine.info.vocab_size)


def run_items(eng: Engine, items: list[tuple[Seq, list[int], int]]) -> list[np.ndarray]:
    """One batch, forwards batched together: next-token distribution of each item."""
    parts = [calls_for(seq, toks, a) for seq, toks, a in items]
    res = eng.execute([c for i in range(3) for c in (p[i] for p in parts)])
    assert res[: 2 * len(items)] == [None] * (2 * len(items)), res
    return [dense(d, eng.info.vocab_size) for d in res[2 * len(items) :]]


# ---------------------------------------------------------------------------- against PEFT


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_and_decode_match_peft(arch, adapters):
    ckpt, dirs = adapters(arch)
    eng = load(ckpt)
    ids_ = {name: eng.load_adapter(path) for name, path in dirs.items()}
    assert eng.adapters() == list(dirs)
    v = eng.info.vocab_size
    toks = tokens(15, v, seed=3)
    base = peft_probs(ckpt, None, toks)
    for name, path in dirs.items():
        ref = peft_probs(ckpt, path, toks)
        seq = Seq(Pages(eng))
        (got,) = run_items(eng, [(seq, toks[:12], ids_[name])])  # prefill
        assert_matches(got, ref[11], name)
        assert np.abs(np.log(ref[11]) - np.log(base[11])).max() > 0.1, "the adapter has no effect"
        for i in range(12, 15):  # decode on top of the adapter's own KV
            (got,) = run_items(eng, [(seq, toks[i : i + 1], ids_[name])])
            assert_matches(got, ref[i], f"{name} step {i}")
    (got,) = run_items(eng, [(Seq(Pages(eng, 200, 1500)), toks[:12], -1)])
    assert_matches(got, base[11])


def test_mixed_batch_equals_each_alone(adapters):
    """Adapter, base model and a second adapter in one forward; then a batched decode."""
    ckpt, dirs = adapters("qwen3")
    eng = load(ckpt)
    a, b = eng.load_adapter(dirs["all7"]), eng.load_adapter(dirs["qv-down"])
    v = eng.info.vocab_size
    prompts = [tokens(n, v, seed=10 + n) for n in (7, 5, 9)]
    which = [a, -1, b]
    nxt = [tokens(2, v, seed=20 + i) for i in range(3)]

    steps = [prompts, *([t[i : i + 1] for t in nxt] for i in range(2))]  # prefill, 2 decodes

    alone_alloc = Pages(eng)
    alone = [[], [], []]  # [item][step]
    for item, w in enumerate(which):
        seq = Seq(alone_alloc)
        for toks in steps:
            alone[item] += run_items(eng, [(seq, toks[item], w)])

    alloc = Pages(eng, first_page=128, first_embed=1024)
    seqs = [Seq(alloc) for _ in prompts]
    for step, toks in enumerate(steps):  # the decodes form one single-token attention group
        mixed = run_items(eng, list(zip(seqs, toks, which, strict=True)))
        for item in range(3):
            want = alone[item][step]
            np.testing.assert_allclose(mixed[item], want, atol=1e-6, err_msg=f"{item=} {step=}")

    paths = {a: dirs["all7"], -1: None, b: dirs["qv-down"]}
    for item, (p, w, t) in enumerate(zip(prompts, which, nxt, strict=True)):
        ref = peft_probs(ckpt, paths[w], p + t)
        assert_matches(np.stack(alone[item]), ref[len(p) - 1 :], f"{item=}")


def test_same_adapter_on_rows_that_are_not_contiguous(adapters):
    """[adapter, base, adapter]: the adapter's rows are gathered and scattered."""
    ckpt, dirs = adapters("llama")
    eng = load(ckpt)
    a = eng.load_adapter(dirs["all7"])
    v = eng.info.vocab_size
    prompts = [tokens(n, v, seed=30 + n) for n in (6, 4, 3)]
    which = [a, -1, a]
    alone_alloc, alloc = Pages(eng), Pages(eng, first_page=128, first_embed=1024)
    alone = [
        run_items(eng, [(Seq(alone_alloc), p, w)])[0] for p, w in zip(prompts, which, strict=True)
    ]
    batch = run_items(eng, [(Seq(alloc), p, w) for p, w in zip(prompts, which, strict=True)])
    for got, want in zip(batch, alone, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-6)
    assert np.abs(np.log(alone[0]) - np.log(alone[1])).max() > 0.1


def test_plan_groups_rows_by_adapter(adapters):
    ckpt, dirs = adapters("llama")
    eng = load(ckpt)
    for name in ("all7", "qv-down"):
        eng.load_adapter(dirs[name])
    assert lora.plan_adapters([], eng._adapters, eng.device) is None
    plan = lora.plan_adapters([(0, 3, 1), (3, 2, 1), (5, 1, 0), (9, 2, 1)], eng._adapters, "cpu")
    (a1, rows1), (a0, rows0) = plan.groups
    assert (a1.name, a0.name) == ("qv-down", "all7")
    assert rows1.tolist() == [0, 1, 2, 3, 4, 9, 10] and rows0 == slice(5, 6)
    plan = lora.plan_adapters([(2, 3, 0), (5, 4, 0)], eng._adapters, "cpu")
    assert plan.groups[0][1] == slice(2, 9)  # adjacent items: one slice, no gather


def test_base_batches_run_no_extra_ops(adapters):
    """Loading adapters adds no torch call to a batch in which no item uses one."""
    from torch.overrides import TorchFunctionMode

    class Count(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.calls = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.calls.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    ckpt, dirs = adapters("llama")
    eng = load(ckpt)
    toks = tokens(6, eng.info.vocab_size, seed=5)

    def count(first_page, adapter=-1):
        with Count() as c:
            run_items(eng, [(Seq(Pages(eng, first_page, 10 * first_page)), toks, adapter)])
        return c.calls

    before = count(0)
    a = eng.load_adapter(dirs["all7"])
    assert count(50) == before
    assert len(count(100, a)) > len(before)  # the count sees the adapter's work


def test_bfloat16_close_to_float32(adapters):
    ckpt, dirs = adapters("qwen2")
    results = {}
    for dtype in ("float32", "bfloat16"):
        eng = load(ckpt, dtype=dtype)
        a = eng.load_adapter(dirs["all7"])
        v = eng.info.vocab_size
        prompts = [tokens(5, v, seed=50), tokens(5, v, seed=50), tokens(3, v, seed=51)]
        alloc = Pages(eng)
        results[dtype] = run_items(
            eng, [(Seq(alloc), p, w) for p, w in zip(prompts, [a, -1, a], strict=True)]
        )
    for f32, bf16 in zip(results["float32"], results["bfloat16"], strict=True):
        np.testing.assert_allclose(np.log(bf16), np.log(f32), atol=0.03)  # measured 0.011
    adapted, base = np.log(results["float32"][0]), np.log(results["float32"][1])
    assert np.abs(adapted - base).max() > 0.5  # well above the bfloat16 error (measured 1.1)


# ---------------------------------------------------------------------------- validation


def test_bad_adapter_id_rejects_only_that_call(adapters):
    ckpt, dirs = adapters("llama")
    eng = load(ckpt)
    v = eng.info.vocab_size
    toks = tokens(5, v, seed=6)
    alloc = Pages(eng)
    res = eng.execute(list(calls_for(Seq(alloc), toks, 0)[:2]))
    assert isinstance(res[1], CallError) and "no adapter is loaded" in res[1].message
    a = eng.load_adapter(dirs["all7"])
    want = run_items(eng, [(Seq(alloc), toks, a)])[0]
    bad = [calls_for(Seq(alloc), toks, x)[1] for x in (1, -2, True, 1.0)]
    embed, good, dist = calls_for(Seq(alloc), toks, a)
    res = eng.execute([embed, *bad, good, dist])
    for r in res[1:5]:
        assert isinstance(r, CallError) and "adapter" in r.message, r
    assert "adapter 1 is not loaded" in res[1].message and "0..0" in res[1].message
    assert res[5] is None
    np.testing.assert_allclose(dense(res[6], v), want, atol=1e-6)


def test_engine_adapter_api(adapters):
    ckpt, dirs = adapters("qwen2")
    eng = load(ckpt)
    assert "forward_with_adapter" in eng.info.traits and eng.adapters() == []
    assert eng.load_adapter(dirs["all7"]) == 0
    assert eng.load_adapter(dirs["all7"], name="again") == 1
    with pytest.raises(ValueError, match="'all7' is already loaded \\(id 0\\)"):
        eng.load_adapter(dirs["qv-down"], name="all7")
    assert eng.adapters() == ["all7", "again"]
    ad = eng._adapters[0]
    assert (ad.rank, ad.scale, ad.targets) == (4, 2.0, tuple(ALL))
    assert eng._adapters[1].deltas[0][lora.QKV].a.dtype == torch.float32
    bf = load(ckpt, dtype="bfloat16")
    bf.load_adapter(dirs["qv-down"])
    d = bf._adapters[0].deltas[1][lora.QKV]
    assert d.a.dtype == d.b.dtype == torch.bfloat16 and d.a.shape == (16, 64)
    assert (d.lo, d.hi) == (0, eng.cfg.q_size + 2 * eng.cfg.kv_size)
    assert bf._adapters[0].scale == pytest.approx(16 / 8**0.5)
    assert bf._adapters[0].deltas[0][lora.GATE_UP] is None


def test_forward_adapter_roundtrips_the_codec():
    calls = [Forward(in_embeds=ids([1, 2]), adapter=3), Forward(in_embeds=ids([3]))]
    out = decode_batch([bytes(memoryview(f).cast("B")) for f in encode_batch(calls)])
    assert [c.adapter for c in out] == [3, -1]


def rewrite_config(d: Path, **changes):
    conf = json.loads((d / lora.CONFIG_FILE).read_text())
    conf.update(changes)
    (d / lora.CONFIG_FILE).write_text(json.dumps(conf))


def rewrite_tensors(d: Path, edit):
    from safetensors.torch import load_file, save_file

    file = d / lora.WEIGHTS_FILE
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file)


L0Q = "base_model.model.model.layers.0.self_attn.q_proj"
BROKEN = {
    "no config": (lambda d: (d / lora.CONFIG_FILE).unlink(), "adapter_config.json: missing"),
    "bad json": (lambda d: (d / lora.CONFIG_FILE).write_text("{"), "not valid JSON"),
    "no weights": (
        lambda d: (d / lora.WEIGHTS_FILE).rename(d / "adapter_model.bin"),
        "adapter_model.safetensors: missing .*safe_serialization",
    ),
    "dora": (lambda d: rewrite_config(d, use_dora=True), "use_dora=True .*DoRA"),
    "bias": (lambda d: rewrite_config(d, bias="lora_only"), "bias='lora_only'"),
    "lora_bias": (lambda d: rewrite_config(d, lora_bias=True), "lora_bias"),
    "modules_to_save": (
        lambda d: rewrite_config(d, modules_to_save=["lm_head"]),
        "modules_to_save",
    ),
    "fan_in_fan_out": (lambda d: rewrite_config(d, fan_in_fan_out=True), "fan_in_fan_out"),
    "unknown target": (
        lambda d: rewrite_config(d, target_modules=["q_proj", "lm_head"]),
        "target_modules has 'lm_head'",
    ),
    "regex targets": (lambda d: rewrite_config(d, target_modules=".*proj"), "target_modules"),
    "not lora": (lambda d: rewrite_config(d, peft_type="IA3"), "peft_type is 'IA3'"),
    "rank": (
        lambda d: rewrite_config(d, r=8),
        "lora_A.weight' has rank 4, not r=8 from adapter_config.json",
    ),
    "bad layer": (
        lambda d: rewrite_config(d, layers_to_transform=[0, 5]),
        "layers_to_transform names layer 5, but the model has 2 layers",
    ),
    "missing tensor": (
        lambda d: rewrite_tensors(d, lambda t: t.pop(f"{L0Q}.lora_B.weight")),
        f"'{L0Q}.lora_B.weight' is missing",
    ),
    "untargeted tensor": (
        lambda d: rewrite_config(d, target_modules=["q_proj"]),
        "adapts layer 0 down_proj, which adapter_config.json does not target",
    ),
    "extra tensor": (
        lambda d: rewrite_tensors(
            d, lambda t: t.update({"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64)})
        ),
        "'base_model.model.lm_head.lora_A.weight' is not a LoRA weight",
    ),
    "wrong shape": (
        lambda d: rewrite_tensors(
            d, lambda t: t.update({f"{L0Q}.lora_B.weight": torch.zeros(32, 4)})
        ),
        "has shape \\(32, 4\\), expected \\(64, 4\\).*another model",
    ),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_broken_adapters_raise_checkpoint_errors(case, adapters, tmp_path):
    ckpt, dirs = adapters("llama")
    eng = load(ckpt)
    d = tmp_path / "adapter"
    shutil.copytree(dirs["all7"], d)
    edit, match = BROKEN[case]
    edit(d)
    with pytest.raises(CheckpointError, match=match):
        eng.load_adapter(d)
    assert eng.adapters() == []
    with pytest.raises(CheckpointError, match="not a directory"):
        eng.load_adapter(tmp_path / "nowhere")


def test_adapter_for_another_model_is_rejected(adapters):
    _, dirs = adapters("qwen3")  # head_dim 32: q_proj is [128, 64], not llama's [64, 64]
    ckpt, _ = adapters("llama")
    with pytest.raises(CheckpointError, match="another model"):
        load(ckpt).load_adapter(dirs["all7"])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_mixed_batch_matches_peft(adapters):
    ckpt, dirs = adapters("qwen2")
    eng = load(ckpt, device="cuda")
    a, b = eng.load_adapter(dirs["all7"]), eng.load_adapter(dirs["late-mlp"])
    v = eng.info.vocab_size
    prompts = [tokens(n, v, seed=40 + n) for n in (8, 3, 8)]
    which = [a, -1, b]
    alloc = Pages(eng)
    got = run_items(eng, [(Seq(alloc), p, w) for p, w in zip(prompts, which, strict=True)])
    refs = [None, None, None]
    for i, (p, path) in enumerate(
        zip(prompts, [dirs["all7"], None, dirs["late-mlp"]], strict=True)
    ):
        refs[i] = peft_probs(ckpt, path, p)[-1]
        assert_matches(got[i], refs[i], f"{i=}")
