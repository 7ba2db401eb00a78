"""Vision-language checkpoints (LLaVA with a CLIP or a SigLIP tower): the engine's image
path against transformers' on tiny random checkpoints, ``embed_img`` through the inferlet
API (trusted and sandboxed), and the refusals."""

from __future__ import annotations

import asyncio
import base64
import io
import json

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("PIL")

from engine_util import Pages, dense, load
from inferlet_util import load_engine, result, run_all, trusted_and_sandboxed
from pastry.engine.checkpoint import load_checkpoint
from pastry.wire.calls import CallError, EmbedImg, EmbedTxt, Forward, NextDist, ids
from pastry.wire.config import CheckpointError
from pastry.wire.images import ImageError, decode_image, open_image
from vision_util import create_tiny_llava, png

A, B, C = [5, 17, 33], [40, 41], [60, 61, 62]


@pytest.fixture(scope="module", params=[("clip", "legacy"), ("siglip", "v5")], ids=str)
def ckpt(request, tmp_path_factory):
    tower, layout = request.param
    return create_tiny_llava(tmp_path_factory.mktemp("vlm"), tower, layout=layout)


@pytest.fixture(scope="module")
def tiny_llama(make_tiny):
    return make_tiny("llama", dtype="float32")


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    return create_tiny_llava(tmp_path_factory.mktemp("clip"), "clip")


def _hf(path):
    from transformers import AutoImageProcessor, LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    return model, AutoImageProcessor.from_pretrained(path)


def _hf_inputs(path, segments, images, image_tokens, image_id):
    """transformers' input ids (``image_tokens`` placeholders per image) and pixels."""
    _, processor = _hf(path)
    tokens = [t for s in segments for t in ([image_id] * image_tokens if isinstance(s, int) else s)]
    px = processor(images=[decode_image(images[s]) for s in segments if isinstance(s, int)],
                   return_tensors="pt")["pixel_values"]  # fmt: skip
    return torch.tensor([tokens]), px


def _calls(alloc: Pages, segments, images, image_tokens):
    """embed_txt / embed_img calls laying ``segments`` (token lists, image indexes) out
    from position 0; (the calls, every input slot)."""
    calls, slots, at = [], [], 0
    for s in segments:
        n = image_tokens if isinstance(s, int) else len(s)
        emb, pos = alloc.embeds(n), ids(range(at, at + n))
        if isinstance(s, int):
            calls.append(EmbedImg(np.frombuffer(images[s], np.uint8), pos, emb))
        else:
            calls.append(EmbedTxt(ids(s), pos, emb))
        slots.append(emb)
        at += n
    return calls, np.concatenate(slots)


@pytest.mark.parametrize("segments", [[A, 0, B], [A, 0, B, 1, C]], ids=["1 image", "2 images"])
def test_logits_with_images_equal_transformers(ckpt, segments):
    eng = load(ckpt)
    info = eng.info
    assert "input_image" in info.traits and info.image_tokens == 16
    images = [png(1), png(2, (20, 50))]
    model, _ = _hf(ckpt)
    input_ids, px = _hf_inputs(ckpt, segments, images, info.image_tokens, info.image_token_id)
    with torch.no_grad():
        ref = torch.softmax(model(input_ids=input_ids, pixel_values=px).logits[0].float(), -1)
    alloc = Pages(eng)
    calls, ins = _calls(alloc, segments, images, info.image_tokens)
    n = len(ins)
    outs = alloc.embeds(n)
    fwd = Forward(in_embeds=ins, out_pages=alloc.pages(-(-n // eng.page_size)), out_embeds=outs,
                  out_indices=ids(range(n)))  # fmt: skip
    v = info.vocab_size
    res = eng.execute([*calls, fwd, *[NextDist(int(o), k=v) for o in outs]])
    assert res[: len(calls) + 1] == [None] * (len(calls) + 1), res[: len(calls) + 1]
    got = np.stack([dense(d, v) for d in res[len(calls) + 1 :]])
    np.testing.assert_allclose(got, ref.numpy(), atol=2e-5)
    assert (got.argmax(-1) == ref.numpy().argmax(-1)).all()
    # the image matters: another image gives other logits after it
    other = [png(7), png(8)]
    calls2, ins2 = _calls(Pages(eng), segments, other, info.image_tokens)
    res2 = eng.execute([*calls2, Forward(in_embeds=ins2, out_embeds=outs[-1:],
                        out_indices=ids([n - 1])), NextDist(int(outs[-1]), k=v)])  # fmt: skip
    assert np.abs(dense(res2[-1], v) - got[-1]).max() > 1e-4


def test_a_bad_image_fails_its_call_alone(clip):
    eng = load(clip)
    alloc = Pages(eng)
    good = EmbedImg(np.frombuffer(png(1), np.uint8), ids(range(16)), alloc.embeds(16))
    bad = EmbedImg(
        np.frombuffer(b"not an image at all", np.uint8), ids(range(16)), alloc.embeds(16)
    )
    short = EmbedImg(np.frombuffer(png(1), np.uint8), ids(range(3)), alloc.embeds(3))
    res = eng.execute([good, bad, short])
    assert res[0] is None
    assert isinstance(res[1], CallError) and "not an image" in res[1].message
    assert isinstance(res[2], CallError) and "takes 16 embeds" in res[2].message


def test_a_text_model_refuses_images(tiny_llama):
    eng = load(tiny_llama)
    assert "input_image" not in eng.info.traits and eng.info.image_tokens == 0
    res = eng.execute([EmbedImg(np.frombuffer(png(1), np.uint8), ids([0]), ids([0]))])
    assert isinstance(res[0], CallError) and "takes no images" in res[0].message


def test_checkpoint_errors_name_the_part(clip, tmp_path):
    raw = json.loads((clip / "config.json").read_text())
    for change, words in [
        ({"model_type": "idefics9"}, "model_type 'idefics9' is not supported"),
        ({"vision_config": {**raw["vision_config"], "model_type": "dinov2"}}, "dinov2"),
        ({"vision_feature_select_strategy": "odd"}, "vision_feature_select_strategy 'odd'"),
        ({"vision_feature_layer": 9}, "vision_feature_layer 9"),
    ]:
        d = tmp_path / "bad"
        d.mkdir(exist_ok=True)
        for f in clip.iterdir():
            (d / f.name).write_bytes(f.read_bytes())
        (d / "config.json").write_text(json.dumps({**raw, **change}))
        with pytest.raises(CheckpointError, match=words):
            load_checkpoint(d)
    (d / "config.json").write_text(json.dumps(raw))
    (d / "preprocessor_config.json").unlink()
    with pytest.raises(CheckpointError, match=r"preprocessor_config\.json is missing"):
        load(d)


def test_open_image_checks_format_and_limits():
    from PIL import Image

    data = png(3, (30, 20))
    assert open_image(data).size == (30, 20)
    assert decode_image(data).mode == "RGB"
    buf = io.BytesIO()
    Image.new("RGB", (9, 9)).save(buf, format="JPEG")
    assert decode_image(buf.getvalue()).size == (9, 9)
    for bad, words in [
        (b"", "empty"),
        (b"GIF89a-truncated", "cannot be read|not an image"),
        (b"%PDF-1.4 hello", "not an image in a format"),
        ("a string", "encoded bytes"),
    ]:
        with pytest.raises(ImageError, match=words):
            open_image(bad)
    with pytest.raises(ImageError, match="over the limit of 100"):
        open_image(data, max_bytes=100)
    with pytest.raises(ImageError, match="30x20 = 600 pixels, over the limit of 599"):
        open_image(data, max_pixels=599)
    with pytest.raises(ImageError, match="cannot be decoded"):
        decode_image(data[: len(data) // 2])


IMAGE_AGENT = """
import json
import pastry.sdk as px

async def main(args):
    segments, steps = json.loads(args[0]), int(args[1])
    images = [bytes.fromhex(a) for a in args[2:]]
    model = px.available_models()[0]
    q = px.create_queue(model)
    out = {"traits": px.available_traits(model)}
    futures, embeds, pos = [], [], 0
    for s in segments:
        if isinstance(s, int):
            n = px.num_embs_needed(q, images[s])
            e = px.alloc_embeds(q, n)
            futures.append(px.embed_img(q, images[s], pos, e))
        else:
            e = px.alloc_embeds(q, len(s))
            futures.append(px.embed_txt(q, s, list(range(pos, pos + len(s))), e))
        embeds += e
        pos += len(e)
    for f in futures:
        await f
    ps = px.get_kv_page_size(q)
    kv = px.alloc_kvpages(q, -(-(pos + steps) // ps))
    out_e = px.alloc_embeds(q, 1)
    await px.forward(q, [], 0, embeds, kv, 0, out_e)
    tokens = []
    for i in range(steps):
        t = await px.sample(q, out_e[0])
        tokens.append(t)
        n = pos + i
        await px.embed_txt(q, [t], [n], out_e)
        ctx = kv[: -(-n // ps)]
        await px.forward(q, ctx, n - (len(ctx) - 1) * ps, out_e, kv[n // ps :], n % ps, out_e)
    out["tokens"] = tokens
    errors = {}
    for name, call in [
        ("not_image", lambda: px.num_embs_needed(q, b"plain text")),
        ("count", lambda: px.embed_img(q, images[0], 0, px.alloc_embeds(q, 2))),
        ("position", lambda: px.embed_img(q, images[0], 10**9, embeds[:16])),
    ]:
        try:
            call()
        except px.ApiError as e:
            errors[name] = str(e)
    out["errors"] = errors
    return json.dumps(out)
"""


def test_embed_img_through_the_inferlet_api_trusted_and_sandboxed(clip):
    eng = load_engine(clip)
    info = eng.info
    images = [png(1), png(2, (20, 50))]
    segments, steps = [A, 0, B, 1, C], 6
    model, _ = _hf(clip)
    input_ids, px = _hf_inputs(clip, segments, images, info.image_tokens, info.image_token_id)
    with torch.no_grad():
        ref = model.generate(input_ids=input_ids, pixel_values=px, max_new_tokens=steps,
                             do_sample=False, eos_token_id=None, pad_token_id=0)  # fmt: skip
    want = ref[0, input_ids.shape[1] :].tolist()
    args = [json.dumps(segments), str(steps), *[i.hex() for i in images]]
    for events in trusted_and_sandboxed(eng, IMAGE_AGENT, args):
        out = json.loads(result(events))
        assert "input_image" in out["traits"]
        assert out["tokens"] == want
        errors = out["errors"]
        assert "num_embs_needed: not an image" in errors["not_image"]
        assert "takes 16 embeds" in errors["count"]
        assert "max_position" in errors["position"]


def test_image_quotas_and_text_models_refuse_through_the_api(tiny_llama, clip):
    src = """
import pastry.sdk as px

async def main(args):
    q = px.create_queue(px.available_models()[0])
    try:
        px.num_embs_needed(q, bytes.fromhex(args[0]))
    except px.ApiError as e:
        return str(e)
    return "accepted"
"""
    from pastry.control.quotas import Quotas

    big = png(4, (64, 64)).hex()
    (ev,), _ = asyncio.run(run_all(load_engine(tiny_llama), [(src, [big])]))
    assert "takes no images" in result(ev) and "input_image" in result(ev)

    async def with_quota():
        from inferlet_util import start
        from pastry.runtime.trusted import Program

        controller, rt, handle = await start(load_engine(clip), quotas=Quotas(image_pixels=1000))
        inst = rt.launch(Program.from_source("q", src), [big])
        evs = [e async for e in inst.events()]
        await controller.close()
        handle.close()
        return evs

    assert "64x64 = 4096 pixels, over the limit of 1000" in result(asyncio.run(with_quota()))


CONTEXT_AGENT = """
import json
import pastry.sdk as px
from pastry.sdk import Context, MaxTokens

async def main(args):
    before, after, steps = json.loads(args[0]), json.loads(args[1]), int(args[2])
    images = [bytes.fromhex(a) for a in args[3:]]
    out = {}
    ctx = Context()
    ctx.fill_tokens(before)
    ctx.fill_image(images[0])
    try:
        await ctx.generate()
    except px.ApiError as e:
        out["tail"] = str(e)
    ctx.fill_tokens(after)
    ctx.fill_image(images[1])
    ctx.fill_tokens(after)
    n = len(ctx.tokens)
    out["placeholders"] = ctx.tokens.count(px.get_image_token(ctx.queue))
    await ctx.generate(stop=MaxTokens(steps))
    out["tokens"] = ctx.tokens[n:]
    out["cached"] = ctx.cached_tokens
    try:
        ctx.fill_image(b"GIF89a but no more")
    except px.ApiError as e:
        out["bad"] = str(e)
    return json.dumps(out)
"""


def test_context_fill_image_generates_as_transformers(clip):
    """``Context.fill_image`` between text runs longer than a page (the prefix cache is
    not asked for what follows an image), greedy tokens equal to transformers'."""
    eng = load_engine(clip)
    info = eng.info
    before, after = list(range(5, 25)), list(range(100, 140))
    images = [png(1), png(2, (20, 50))]
    steps = 6
    segments = [before, 0, after, 1, after]
    model, _ = _hf(clip)
    input_ids, px = _hf_inputs(clip, segments, images, info.image_tokens, info.image_token_id)
    with torch.no_grad():
        ref = model.generate(input_ids=input_ids, pixel_values=px, max_new_tokens=steps,
                             do_sample=False, eos_token_id=None, pad_token_id=0)  # fmt: skip
    want = ref[0, input_ids.shape[1] :].tolist()
    args = [json.dumps(before), json.dumps(after), str(steps), *[i.hex() for i in images]]
    for events in trusted_and_sandboxed(eng, CONTEXT_AGENT, args):
        out = json.loads(result(events))
        assert out["tokens"] == want
        assert out["placeholders"] == 2 * info.image_tokens
        assert out["cached"] == 0
        assert "ends with an image" in out["tail"]
        assert "not an image" in out["bad"] or "cannot be read" in out["bad"]


def _data_url(data: bytes, kind: str = "png") -> str:
    return f"data:image/{kind};base64," + base64.b64encode(data).decode()


def _chat_body(parts: list, max_tokens: int = 6) -> dict:
    return {
        "model": "llava-clip-legacy-tiny",
        "messages": [{"role": "user", "content": parts}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }


def test_chat_image_url_parts_answer_as_transformers(clip, tiny_llama, tmp_path):
    """``/v1/chat/completions`` with ``image_url`` data URLs: the chat template's image
    placeholders take the images' embeddings, and the greedy reply equals transformers'
    on the same rendered prompt; bad parts are a 400 naming the part."""
    import httpx
    from transformers import AutoTokenizer

    from server_util import running_server

    images = [png(1), png(2, (20, 50))]
    parts = [
        {"type": "text", "text": "Look: "},
        {"type": "image_url", "image_url": {"url": _data_url(images[0])}},
        {"type": "text", "text": " and "},
        {"type": "image_url", "image_url": {"url": _data_url(images[1]), "detail": "auto"}},
        {"type": "text", "text": " what differs?"},
    ]
    model, processor = _hf(clip)
    tok = AutoTokenizer.from_pretrained(clip)
    template = [{"role": "user", "content": [
        {"type": "image"} if p["type"] == "image_url" else p for p in parts]}]  # fmt: skip
    text = tok.apply_chat_template(template, add_generation_prompt=True, tokenize=False)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    image_id, n = model.config.image_token_index, model.config.image_seq_length
    expanded = [t for i in ids for t in ([image_id] * n if i == image_id else [i])]
    assert expanded.count(image_id) == 2 * n
    input_ids = torch.tensor([expanded])
    px = processor(images=[decode_image(i) for i in images], return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        ref = model.generate(input_ids=input_ids, pixel_values=px, max_new_tokens=6,
                             do_sample=False, eos_token_id=None, pad_token_id=0)  # fmt: skip
    want = tok.decode(ref[0, input_ids.shape[1] :].tolist())
    with running_server(clip, tmp_path) as (url, _):
        r = httpx.post(f"{url}/v1/chat/completions", json=_chat_body(parts), timeout=120)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["message"]["content"] == want
        assert body["usage"]["prompt_tokens"] == len(expanded)
        bad = [
            ({"url": _data_url(b"plain text")}, "content[1].image_url.url", "not an image"),
            ({"url": _data_url(images[0][:200])}, "content[1].image_url.url", "cannot be"),
            ({"url": "https://example.com/cat.png"}, "content[1].image_url.url", "does not fetch"),
            ({"url": "data:image/png;base64,@@@"}, "content[1].image_url.url", "base64"),
            ({"url": _data_url(images[0]), "detail": "high"}, "image_url.detail", "only 'auto'"),
            ({"uri": "x"}, "content[1].image_url.uri", "unknown field 'uri'"),
        ]
        for spec, param, words in bad:
            one = [parts[0], {"type": "image_url", "image_url": spec}]
            r = httpx.post(f"{url}/v1/chat/completions", json=_chat_body(one), timeout=60)
            assert r.status_code == 400, (spec, r.text)
            err = r.json()["error"]
            assert err["param"].endswith(param) and words in err["message"], err
        r = httpx.post(f"{url}/v1/chat/completions", json=_chat_body(parts), timeout=120)
        assert r.json()["choices"][0]["message"]["content"] == want  # nothing was left over
        # SGLang's /generate: the image tokens in input_ids, image_data a data URL and bare
        # base64; the same greedy tokens
        gen = {"input_ids": ids, "sampling_params": {"max_new_tokens": 6, "temperature": 0,
               "ignore_eos": True}}  # fmt: skip
        data = [_data_url(images[0]), base64.b64encode(images[1]).decode()]
        r = httpx.post(f"{url}/generate", json={**gen, "image_data": data}, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["output_ids"] == ref[0, input_ids.shape[1] :].tolist()
        assert r.json()["meta_info"]["prompt_tokens"] == len(expanded)
        for image_data, words in [
            (data[:1], "2 image tokens (id 7672) for 1 images"),
            ([data[0], "/etc/passwd"], "image_data[1]': the image's base64 is not valid"),
            ([data[0], "aGVsbG8="], "image_data[1]': not an image"),
        ]:
            r = httpx.post(f"{url}/generate", json={**gen, "image_data": image_data}, timeout=60)
            assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
    with running_server(tiny_llama, tmp_path / "text") as (url, server):
        body = {**_chat_body(parts), "model": server.controller.default_model}
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 400 and "takes no images" in r.json()["error"]["message"]
        assert r.json()["error"]["param"] == "messages[0].content[1]"
