"""Idefics3 / SmolVLM: images cut into tiles, each image a span of its own length (tags,
newlines and the frames' embeddings), against transformers' processor and model on tiny
random checkpoints; through the engine, the inferlet API (trusted and sandboxed), chat and
SGLang's ``/generate``."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("PIL")

from engine_util import Pages, dense, load
from inferlet_util import load_engine, result, trusted_and_sandboxed
from pastry.wire.calls import CallError, EmbedImg, EmbedTxt, Forward, NextDist, ids
from pastry.wire.images import ImageLayout, decode_image
from test_vision import CACHE_AGENT, CONTEXT_AGENT
from vision_util import IMAGE, create_tiny_idefics3, idefics3_processor, png

A, B, C = [5, 17, 33], [40, 41], [60, 61, 62]
# (width, height): 2 x 2 tiles, 2 x 1, 1 x 2, and the 4 x 1 of a long strip
SIZES = [(40, 33), (20, 50), (64, 8), (33, 40), (300, 70), (1, 1)]


@pytest.fixture(scope="module", params=[True, False], ids=["tiled", "whole"])
def ckpt(request, tmp_path_factory):
    return create_tiny_idefics3(tmp_path_factory.mktemp("idefics3"), split=request.param)


@pytest.fixture(scope="module")
def tiled(tmp_path_factory):
    return create_tiny_idefics3(tmp_path_factory.mktemp("idefics3-tiled"))


def _hf(path):
    from transformers import Idefics3ForConditionalGeneration

    return Idefics3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()


def _expansion(processor, image: bytes) -> list[int]:
    """transformers' tokens for one ``<image>`` with ``image``."""
    out = processor(text=[IMAGE], images=[[decode_image(image)]], add_special_tokens=False)
    return list(out["input_ids"][0])


def test_grid_and_span_are_the_processors(ckpt):
    """The layout the engine reports cuts every image into the grid transformers'
    processor cuts it into, and its span is the processor's expansion of ``<image>``, token
    for token; the real checkpoints' geometries (Idefics3-8B: 1456 / 364, SmolVLM: 2048 /
    512) agree with ``get_number_of_image_patches`` over sizes of every shape."""
    from transformers import Idefics3ImageProcessorPil

    layout = load(ckpt).info.image_layout
    assert not layout.fixed and layout.frame == 4
    processor = idefics3_processor(ckpt)
    for w, h in SIZES:
        image = png(w * h, (w, h))
        span = _expansion(processor, image)
        assert layout.span(*layout.grid(w, h)) == span, (w, h)
        assert layout.positions(w, h) == len(span)
    for edge, tile in [(1456, 364), (2048, 512)]:
        hf = Idefics3ImageProcessorPil(size={"longest_edge": edge},
                                       max_image_size={"longest_edge": tile})  # fmt: skip
        mine = ImageLayout(1, 64, tile=tile, longest_edge=edge, split=True)
        for w in [1, 7, 100, 363, 364, 365, 511, 512, 513, 1000, 1456, 2047, 2048, 5000, 9000]:
            for h in [1, 50, 364, 512, 700, 1456, 3000, 8000]:
                _, rows, cols = hf.get_number_of_image_patches(h, w)
                assert mine.grid(w, h) == (rows, cols), (edge, w, h)
    # a large image through the processor itself, SmolVLM's geometry
    hf = Idefics3ImageProcessorPil(size={"longest_edge": 2048}, max_image_size={"longest_edge": 512})  # fmt: skip
    mine = ImageLayout(1, 64, tile=512, longest_edge=2048, split=True)
    for w, h in [(1000, 300), (640, 480), (300, 1700)]:
        out = hf(images=[[decode_image(png(1, (w, h)))]], return_row_col_info=True)
        assert mine.grid(w, h) == (out["rows"][0][0], out["cols"][0][0]), (w, h)


def _reference(path, segments, images):
    """transformers' probabilities over ``segments`` (token lists and image indexes)."""
    processor = idefics3_processor(path)
    tokens = [t for s in segments for t in (_expansion(processor, images[s]) if isinstance(s, int) else s)]  # fmt: skip
    pics = [decode_image(images[s]) for s in segments if isinstance(s, int)]
    px = processor.image_processor(images=[pics], return_tensors="pt")
    with torch.no_grad():
        logits = _hf(path)(input_ids=torch.tensor([tokens]), pixel_values=px["pixel_values"],
                           pixel_attention_mask=px["pixel_attention_mask"]).logits  # fmt: skip
    return tokens, torch.softmax(logits[0].float(), -1).numpy()


@pytest.mark.parametrize("segments", [[A, 0, B], [A, 0, B, 1, C]], ids=["1 image", "2 images"])
def test_logits_with_images_equal_transformers(ckpt, segments):
    eng = load(ckpt)
    info, v = eng.info, eng.info.vocab_size
    images = [png(1), png(2, (20, 50))]
    tokens, ref = _reference(ckpt, segments, images)
    alloc, calls, slots, at = Pages(eng), [], [], 0
    for s in segments:
        w, h = decode_image(images[s]).size if isinstance(s, int) else (0, 0)
        n = info.image_layout.positions(w, h) if isinstance(s, int) else len(s)
        emb, pos = alloc.embeds(n), ids(range(at, at + n))
        calls.append(EmbedImg(np.frombuffer(images[s], np.uint8), pos, emb) if isinstance(s, int)
                     else EmbedTxt(ids(s), pos, emb))  # fmt: skip
        slots.append(emb)
        at += n
    ins = np.concatenate(slots)
    assert len(ins) == len(tokens)
    outs = alloc.embeds(len(ins))
    fwd = Forward(in_embeds=ins, out_pages=alloc.pages(-(-len(ins) // eng.page_size)),
                  out_embeds=outs, out_indices=ids(range(len(ins))))  # fmt: skip
    res = eng.execute([*calls, fwd, *[NextDist(int(o), k=v) for o in outs]])
    assert res[: len(calls) + 1] == [None] * (len(calls) + 1), res[: len(calls) + 1]
    got = np.stack([dense(d, v) for d in res[len(calls) + 1 :]])
    np.testing.assert_allclose(got, ref, atol=2e-5)
    assert (got.argmax(-1) == ref.argmax(-1)).all()


def test_an_image_given_the_wrong_number_of_slots_fails_alone(tiled):
    eng = load(tiled)
    layout, alloc = eng.info.image_layout, Pages(eng)
    n = layout.positions(40, 33)
    good = EmbedImg(np.frombuffer(png(1), np.uint8), ids(range(n)), alloc.embeds(n))
    short = EmbedImg(np.frombuffer(png(1), np.uint8), ids(range(4)), alloc.embeds(4))
    res = eng.execute([good, short])
    assert res[0] is None
    assert (
        isinstance(res[1], CallError) and f"takes {n} embeds on this model, got 4" in res[1].message
    )


def test_context_fill_image_generates_as_transformers(tiled):
    """``Context.fill_image``: each image takes its own span; the greedy tokens equal
    transformers' (trusted and sandboxed)."""
    eng = load_engine(tiled)
    before, after = list(range(5, 25)), list(range(100, 140))
    images, steps = [png(1), png(2, (20, 50))], 6
    segments = [before, 0, after, 1, after]
    processor = idefics3_processor(tiled)
    tokens = [t for s in segments for t in (_expansion(processor, images[s]) if isinstance(s, int) else s)]  # fmt: skip
    px = processor.image_processor(images=[[decode_image(i) for i in images]], return_tensors="pt")
    with torch.no_grad():
        ref = _hf(tiled).generate(input_ids=torch.tensor([tokens]), **px, max_new_tokens=steps,
                                  do_sample=False, eos_token_id=None, pad_token_id=0)  # fmt: skip
    want = ref[0, len(tokens) :].tolist()
    spans = sum(eng.info.image_layout.positions(*decode_image(i).size) for i in images)
    args = [json.dumps(before), json.dumps(after), str(steps), *[i.hex() for i in images]]
    for events in trusted_and_sandboxed(eng, CONTEXT_AGENT, args):
        out = json.loads(result(events))
        assert out["tokens"] == want
        assert out["placeholders"] == spans


def test_the_same_image_again_comes_from_the_prefix_cache(tiled):
    eng = load_engine(tiled)
    before, after = list(range(5, 25)), list(range(100, 140))
    images = [png(11), png(12), png(13), png(14)]
    n = eng.info.image_layout.positions(*decode_image(images[0]).size)
    args = [json.dumps(before), json.dumps(after), *[i.hex() for i in images]]
    for events in trusted_and_sandboxed(eng, CACHE_AGENT, args):
        out = json.loads(result(events))
        assert out["again"]["tokens"] == out["first"]["tokens"]
        assert out["again"]["cached"] >= len(before) + n + 16, out
        assert out["other"]["cached"] <= len(before), out


def _data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def test_chat_and_generate_answer_as_transformers(tiled, tmp_path):
    """``/v1/chat/completions`` with two images of different grids and SGLang's
    ``/generate`` with ``image_data``: the greedy reply equals transformers' on the
    processor's expansion of the rendered prompt, the usage counts each image's span."""
    import httpx
    from transformers import AutoTokenizer

    from server_util import running_server

    images = [png(1), png(2, (20, 50))]
    parts = [
        {"type": "text", "text": "Look: "},
        {"type": "image_url", "image_url": {"url": _data_url(images[0])}},
        {"type": "text", "text": " and "},
        {"type": "image_url", "image_url": {"url": _data_url(images[1])}},
        {"type": "text", "text": " what differs?"},
    ]
    tok = AutoTokenizer.from_pretrained(tiled)
    template = [{"role": "user", "content": [
        {"type": "image"} if p["type"] == "image_url" else p for p in parts]}]  # fmt: skip
    text = tok.apply_chat_template(template, add_generation_prompt=True, tokenize=False)
    processor = idefics3_processor(tiled)
    hf_in = processor(text=[text], images=[[decode_image(i) for i in images]],
                      add_special_tokens=False, return_tensors="pt")  # fmt: skip
    with torch.no_grad():
        ref = _hf(tiled).generate(**hf_in, max_new_tokens=6, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)  # fmt: skip
    n_in = hf_in["input_ids"].shape[1]
    want = ref[0, n_in:].tolist()
    body = {"model": tiled.name, "messages": [{"role": "user", "content": parts}],
            "max_tokens": 6, "temperature": 0, "ignore_eos": True}  # fmt: skip
    with running_server(tiled, tmp_path) as (url, _):
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == tok.decode(want)
        assert r.json()["usage"]["prompt_tokens"] == n_in
        ids_ = tok(text, add_special_tokens=False)["input_ids"]
        gen = {"input_ids": ids_, "image_data": [_data_url(i) for i in images],
               "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}  # fmt: skip
        r = httpx.post(f"{url}/generate", json=gen, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["output_ids"] == want
        assert r.json()["meta_info"]["prompt_tokens"] == n_in


PREFILLS = """
import hashlib
import json
import pastry.sdk as px

async def main(args):
    image = bytes.fromhex(args[0])
    q = px.create_queue(px.available_models()[0])
    n, mark = px.num_embs_needed(q, image), px.get_image_token(q)
    digest = hashlib.sha256(image).digest()
    tokens = [5, 6] + [mark] * n + [7, 8]
    [out] = px.alloc_embeds(q, 1)
    out_ = {"n": n}
    for name, lens in {"none": [], "wrong": [n + 1], "two": [n, n]}.items():
        try:
            px.prefill(q, tokens, 0, [], [out], 0, [2], [digest], [image], lens)
            out_[name] = "accepted"
        except px.ApiError as e:
            out_[name] = str(e)
    pages, cached = px.prefill(q, tokens, 0, [], [out], 0, [2], [digest], [image], [n])
    out_["cached"] = await cached
    # the image is in the pages now: its length names it, its bytes stay out
    more, cached = px.prefill(q, tokens + [9, 10], len(tokens), pages, [out], 0, [2], [digest], [], [n])  # fmt: skip
    out_["more"] = await cached
    return json.dumps(out_)
"""


def test_prefill_takes_each_images_length(tiled):
    """On a model whose images take positions by their size, ``prefill`` needs
    ``image_lens``, checks it against the bytes it has, and takes it for the images
    already in the pages (trusted and sandboxed)."""
    image = png(51)
    n = load(tiled).info.image_layout.positions(*decode_image(image).size)
    for events in trusted_and_sandboxed(load_engine(tiled), PREFILLS, [image.hex()]):
        out = json.loads(result(events))
        assert out["n"] == n
        assert "image_lens is needed on this model" in out["none"]
        assert f"image_lens[0] is {n + 1}, but images[0] takes {n} positions" in out["wrong"]
        assert "2 image_lens for 1 images" in out["two"]
        assert out["cached"] == 0 and out["more"] == 0


def test_checkpoint_configs_as_transformers_4_saved_them(tiled):
    """SmolVLM's checkpoints (saved by transformers 4.4x) name the tower ``idefics3`` or not
    at all; another tower, or a pixel shuffle that does not divide the patches, is refused
    naming it."""
    from pastry.engine.vision import vision_spec
    from pastry.wire.config import CheckpointError

    raw = json.loads((tiled / "config.json").read_text())
    tower = {k: v for k, v in raw["vision_config"].items() if k != "model_type"}
    for vision in [tower, {**tower, "model_type": "idefics3"}]:
        spec = vision_spec({**raw, "vision_config": vision})
        assert spec.family == "idefics3" and spec.frame == 4
    clip = {**tower, "model_type": "clip_vision_model"}
    for change, words in [
        ({"vision_config": clip}, "'clip_vision_model' is not supported for idefics3"),
        ({"scale_factor": 3}, "scale_factor 3 does not divide the tower's 4 x 4 patches"),
    ]:
        with pytest.raises(CheckpointError, match=words):
            vision_spec({**raw, **change})
