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
    assert "input_image" in info.traits and info.image_layout.frame == 16
    images = [png(1), png(2, (20, 50))]
    model, _ = _hf(ckpt)
    input_ids, px = _hf_inputs(ckpt, segments, images, info.image_layout.frame, info.image_token_id)
    with torch.no_grad():
        ref = torch.softmax(model(input_ids=input_ids, pixel_values=px).logits[0].float(), -1)
    alloc = Pages(eng)
    calls, ins = _calls(alloc, segments, images, info.image_layout.frame)
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
    calls2, ins2 = _calls(Pages(eng), segments, other, info.image_layout.frame)
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
    assert "input_image" not in eng.info.traits and eng.info.image_layout is None
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
    input_ids, px = _hf_inputs(clip, segments, images, info.image_layout.frame, info.image_token_id)
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
    """``Context.fill_image`` between text runs longer than a page, greedy tokens equal to
    transformers' (with the other instance's K/V from the prefix cache or without)."""
    eng = load_engine(clip)
    info = eng.info
    before, after = list(range(5, 25)), list(range(100, 140))
    images = [png(1), png(2, (20, 50))]
    steps = 6
    segments = [before, 0, after, 1, after]
    model, _ = _hf(clip)
    input_ids, px = _hf_inputs(clip, segments, images, info.image_layout.frame, info.image_token_id)
    with torch.no_grad():
        ref = model.generate(input_ids=input_ids, pixel_values=px, max_new_tokens=steps,
                             do_sample=False, eos_token_id=None, pad_token_id=0)  # fmt: skip
    want = ref[0, input_ids.shape[1] :].tolist()
    args = [json.dumps(before), json.dumps(after), str(steps), *[i.hex() for i in images]]
    for events in trusted_and_sandboxed(eng, CONTEXT_AGENT, args):
        out = json.loads(result(events))
        assert out["tokens"] == want
        assert out["placeholders"] == 2 * info.image_layout.frame
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


def _hf_greedy(path, text: str, images: list[bytes], steps: int) -> tuple[list[int], list[int]]:
    """transformers' greedy tokens after ``text`` (its "<image>" tokens the images'), and
    the expanded prompt."""
    from transformers import AutoTokenizer

    model, processor = _hf(path)
    tok = AutoTokenizer.from_pretrained(path)
    image_id, n = model.config.image_token_index, model.config.image_seq_length
    ids = tok(text)["input_ids"]
    expanded = [t for i in ids for t in ([image_id] * n if i == image_id else [i])]
    px = processor(images=[decode_image(i) for i in images], return_tensors="pt")["pixel_values"]
    input_ids = torch.tensor([expanded])
    with torch.no_grad():  # the mask given: the BOS is the pad token id
        ref = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                             pixel_values=px, max_new_tokens=steps, do_sample=False,
                             eos_token_id=None, pad_token_id=0)  # fmt: skip
    return ref[0, len(expanded) :].tolist(), expanded


def _hf_choice_scores(path, text: str, images: list[bytes], choices: list[str]) -> list[float]:
    """The mean log-probability of each choice's tokens after ``text`` (token-length
    normalised, as select scores them), by transformers."""
    from transformers import AutoTokenizer

    model, processor = _hf(path)
    tok = AutoTokenizer.from_pretrained(path)
    image_id, n = model.config.image_token_index, model.config.image_seq_length
    px = processor(images=[decode_image(i) for i in images], return_tensors="pt")["pixel_values"]

    def expand(ids):
        return [t for i in ids for t in ([image_id] * n if i == image_id else [i])]

    prompt = expand(tok(text)["input_ids"])
    scores = []
    for c in choices:
        full = expand(tok(text + c)["input_ids"])
        x = torch.tensor([full])
        with torch.no_grad():
            logits = model(input_ids=x, attention_mask=torch.ones_like(x), pixel_values=px).logits
        lp = torch.log_softmax(logits[0].float(), -1)
        k = len(prompt) - 1  # the prompt's last token scores the first choice token
        got = [lp[i, full[i + 1]].item() for i in range(k, len(full) - 1)]
        scores.append(sum(got) / len(got))
    return scores


import pastry.lang as pl  # noqa: E402  (the shipped program below reads it)


@pl.function
def two_images(s, first, second):
    s += "Look: " + pl.image(first) + " and " + pl.image(second) + " what differs?"
    s += pl.gen("answer", max_tokens=6, ignore_eos=True)
    s += " Same?" + pl.select("same", choices=[" yes", " no"])


@pl.function
def one_image(s, picture):
    s += "Look: " + pl.image(picture) + "\n what is it?" + pl.gen("answer", max_tokens=6)


def test_lang_image_and_sglang_image_answer_as_transformers(clip, tmp_path):
    """``pastry.lang``'s ``image`` (bytes sent from a client, the program sandboxed in the
    server) before a gen and a select, and SGLang's own ``sgl.image`` through
    ``RuntimeEndpoint`` (one image, as SGLang sends it): transformers' greedy tokens and
    choice."""
    from server_util import running_server

    sgl = pytest.importorskip("sglang")
    from pastry.runtime import build_pyrt

    try:
        build_pyrt.build()
    except build_pyrt.BuildError as e:
        pytest.skip(f"cannot build the Python runtime component: {e}")
    images = [png(1), png(2, (20, 50))]
    text = "Look: <image> and <image> what differs?"
    want, _ = _hf_greedy(clip, text, images, 6)
    from transformers import AutoTokenizer

    answer = AutoTokenizer.from_pretrained(clip).decode(want)
    scores = _hf_choice_scores(clip, text + answer + " Same?", images, [" yes", " no"])
    picked = [" yes", " no"][int(np.argmax(scores))]
    (tmp_path / "cat.png").write_bytes(images[0])
    with running_server(clip, tmp_path / "home") as (url, _):
        ours = pl.Endpoint(url)
        try:
            state = two_images.run(first=images[0], second=images[1], temperature=0, backend=ours)
            assert state["answer"] == answer
            assert state["same"] == picked
            assert state.text() == text + answer + " Same?" + picked
            meta = state.get_meta_info("answer")
            assert meta["prompt_tokens"] == len(_hf_greedy(clip, text, images, 1)[1])
            mine = one_image.run(picture=images[0], temperature=0, backend=ours)
            with pytest.raises(pl.ProgramError, match="num_embs_needed: not an image"):
                one_image.run(picture=b"not an image", temperature=0, backend=ours)
        finally:
            ours.close()
        theirs = sgl.RuntimeEndpoint(url, chat_template_name="chatml-llava")

        @sgl.function
        def sgl_one_image(s, path):
            s += "Look: " + sgl.image(path) + " what is it?" + sgl.gen("answer", max_tokens=6)

        state = sgl_one_image.run(path=str(tmp_path / "cat.png"), temperature=0, backend=theirs)
        want_one, _ = _hf_greedy(clip, "Look: <image>\n what is it?", images[:1], 6)
        tok = AutoTokenizer.from_pretrained(clip)
        assert state["answer"] == mine["answer"] == tok.decode(want_one, skip_special_tokens=True)


def test_responses_input_image_and_anthropic_image_blocks_answer_as_chat(clip, tmp_path):
    """The Responses API's ``input_image`` parts and Anthropic's base64 ``image`` blocks
    are the chat endpoint's ``image_url`` parts (tested against transformers above): the
    same greedy answer, prompt tokens counting the images; a follow-up of a response with
    images finds them in the prefix cache; bad parts are a 400 naming the part."""
    import httpx

    from server_util import running_server

    images = [png(1), png(2, (20, 50))]
    b64 = [base64.b64encode(i).decode() for i in images]
    chat_parts = [
        {"type": "text", "text": "Look: "},
        {"type": "image_url", "image_url": {"url": _data_url(images[0])}},
        {"type": "text", "text": " and "},
        {"type": "image_url", "image_url": {"url": _data_url(images[1])}},
    ]
    resp_parts = [
        {"type": "input_text", "text": "Look: "},
        {"type": "input_image", "image_url": _data_url(images[0])},
        {"type": "input_text", "text": " and "},
        {"type": "input_image", "image_url": _data_url(images[1]), "detail": "auto"},
    ]
    blocks = [
        {"type": "text", "text": "Look: "},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64[0]}},
        {"type": "text", "text": " and "},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64[1]}},
    ]
    model = "llava-clip-legacy-tiny"
    with running_server(clip, tmp_path) as (url, _):
        post = lambda path, body: httpx.post(f"{url}{path}", json=body, timeout=120)  # noqa: E731
        chat = post("/v1/chat/completions", {"model": model, "max_tokens": 6, "temperature": 0,
                    "messages": [{"role": "user", "content": chat_parts}]})  # fmt: skip
        assert chat.status_code == 200, chat.text
        want = chat.json()["choices"][0]["message"]["content"]
        prompt_tokens = chat.json()["usage"]["prompt_tokens"]
        r = post("/v1/responses", {"model": model, "max_output_tokens": 6, "temperature": 0,
                 "input": [{"role": "user", "content": resp_parts}]})  # fmt: skip
        assert r.status_code == 200, r.text
        first = r.json()
        assert first["output"][0]["content"][0]["text"] == want
        assert first["usage"]["input_tokens"] == prompt_tokens
        r = post("/v1/responses", {"model": model, "max_output_tokens": 4, "temperature": 0,
                 "previous_response_id": first["id"], "input": "And now?"})  # fmt: skip
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["input_tokens"] > prompt_tokens
        # the conversation so far, images and all, from the prefix cache
        assert r.json()["usage"]["input_tokens_details"]["cached_tokens"] > 2 * 16
        msg = {"model": model, "max_tokens": 6, "temperature": 0,
               "messages": [{"role": "user", "content": blocks}]}  # fmt: skip
        r = post("/v1/messages", msg)
        assert r.status_code == 200, r.text
        assert r.json()["content"][0]["text"] == want
        usage = r.json()["usage"]  # the chat request's prompt came before: from the cache
        assert usage["input_tokens"] + usage["cache_read_input_tokens"] == prompt_tokens
        # all but the last token (whose output is wanted), both images included, though the
        # last page's start is inside the second image (its slots copied, not the image redone)
        assert usage["cache_read_input_tokens"] == prompt_tokens - 1
        r = post("/v1/messages/count_tokens", {k: msg[k] for k in ("model", "messages")})
        assert r.json()["input_tokens"] == prompt_tokens
        bad_responses = [
            ({"type": "input_image", "file_id": "file-1"}, "input[0].content[1].file_id", "Files API"),
            ({"type": "input_image", "image_url": _data_url(images[0]), "detail": "high"}, "input[0].content[1].detail", "only 'auto'"),
            ({"type": "input_image", "image_url": _data_url(b"text")}, "input[0].content[1].image_url", "not an image"),
            ({"type": "input_image", "image_url": "https://example.com/a.png"}, "input[0].content[1].image_url", "does not fetch"),
            ({"type": "input_file", "file_id": "x"}, "input[0].content[1].type", "input_text and input_image"),
        ]  # fmt: skip
        for part, param, words in bad_responses:
            body = {"model": model, "input": [{"role": "user", "content": [resp_parts[0], part]}]}
            r = post("/v1/responses", body)
            assert r.status_code == 400, (part, r.text)
            err = r.json()["error"]
            assert err["param"] == param and words in err["message"], err
        src = blocks[1]["source"]
        bad_blocks = [
            ({"type": "url", "url": "https://example.com/a.png"}, "source", "base64 image sources"),
            ({**src, "media_type": "image/tiff"}, "source.media_type", "image/jpeg"),
            ({**src, "data": base64.b64encode(b"text").decode()}, "source.data", "not an image"),
        ]  # fmt: skip
        for source, param, words in bad_blocks:
            content = [blocks[0], {"type": "image", "source": source}]
            r = post("/v1/messages", {**msg, "messages": [{"role": "user", "content": content}]})
            assert r.status_code == 400, (source, r.text)
            err = r.json()["error"]
            where = f"'messages[0].content[1].{param}'"
            assert err["message"].startswith(where) and words in err["message"], err
        # nothing was left over
        assert post("/v1/messages", msg).json()["content"][0]["text"] == want


def test_lang_image_sources_and_bytes_arguments(tmp_path):
    """``image()`` takes bytes, a base64 data URL or a path, and refuses URLs it would have
    to fetch; bytes arguments of a shipped run survive the JSON launch argument."""
    from pastry.lang.expr import Image
    from pastry.lang.inferlet import decode_arguments, encode_arguments

    data = png(3)
    (tmp_path / "a.png").write_bytes(data)
    for source in (data, bytearray(data), _data_url(data), str(tmp_path / "a.png")):
        got = pl.image(source)
        assert isinstance(got, Image) and got.data == data
    with pytest.raises(ValueError, match="does not fetch"):
        pl.image("https://example.com/a.png")
    with pytest.raises(ValueError, match="base64 is not valid"):
        pl.image("data:image/png;base64,@@@")
    with pytest.raises(ValueError, match="must be base64"):
        pl.image("data:image/png,rawdata")
    with pytest.raises(TypeError, match="bytes, a data: URL or a path"):
        pl.image(3)
    args = {"picture": data, "more": [b"\x00\x01", {"deep": b"x"}], "n": 1, "s": "text"}
    sent = json.loads(json.dumps(encode_arguments(args)))
    assert decode_arguments(sent) == args


CACHE_AGENT = """
import json
import sys
import pastry.sdk as px
from pastry.sdk import Context, MaxTokens

async def main(args):
    before, after = json.loads(args[0]), json.loads(args[1])
    images = [bytes.fromhex(a) for a in args[2:]]
    if sys.platform == "wasi":  # the sandboxed instance asks about its own images
        images = images[2:]
    out = {}
    for name, image in (("first", images[0]), ("again", images[0]), ("other", images[1])):
        ctx = Context()
        ctx.fill_tokens(before)
        ctx.fill_image(image)
        ctx.fill_tokens(after)
        n = len(ctx.tokens)
        await ctx.generate(stop=MaxTokens(5))
        out[name] = {"tokens": ctx.tokens[n:], "cached": ctx.cached_tokens}
        await ctx.release()  # its pages enter the prefix cache
    return json.dumps(out)
"""


def test_the_same_image_again_comes_from_the_prefix_cache(clip):
    """An image's K/V (and what follows it) is matched by the image's SHA-256: the same
    image after the same text is not computed again (the same greedy tokens), another
    image is; trusted and sandboxed."""
    eng = load_engine(clip)
    before, after = list(range(5, 25)), list(range(100, 140))
    n = eng.info.image_layout.frame
    images = [png(11), png(12), png(13), png(14)]
    args = [json.dumps(before), json.dumps(after), *[i.hex() for i in images]]
    for events in trusted_and_sandboxed(eng, CACHE_AGENT, args):
        out = json.loads(result(events))
        assert out["again"]["tokens"] == out["first"]["tokens"]
        assert out["first"]["cached"] <= len(before)  # (the other instance's text, at most)
        # everything but the last page's partial tail: past the image and into the text
        assert out["again"]["cached"] >= len(before) + n + 16, out
        assert out["other"]["cached"] <= len(before), out


BROKEN_AGENT = """
import json
import pastry.sdk as px
from pastry.sdk import Context, MaxTokens

async def main(args):
    before, image = json.loads(args[0]), bytes.fromhex(args[1])
    out = []
    for _ in range(2):
        ctx = Context()
        ctx.fill_tokens(before)
        ctx.fill_image(image)  # the header reads: the engine finds the pixels cut short
        ctx.fill_tokens(before)
        try:
            await ctx.generate(stop=MaxTokens(2))
            out.append("generated")
        except px.ApiError as e:
            out.append(str(e))
        await ctx.release()
    return json.dumps(out)
"""


def test_an_image_the_engine_cannot_decode_fails_the_prefill_and_is_never_cached(clip):
    """A truncated PNG passes the header check and fails in the engine: the prefill that
    embeds it fails, and nothing forwarded over its slots enters the cache (the second
    context embeds it again, and fails again, instead of reading stale K/V)."""
    eng = load_engine(clip)
    args = [json.dumps(list(range(5, 25))), png(21, (64, 64))[:300].hex()]
    for events in trusted_and_sandboxed(eng, BROKEN_AGENT, args):
        out = json.loads(result(events))
        assert len(out) == 2 and all("EmbedImg" in o for o in out), out


def test_image_urls_are_fetched_only_from_allowed_hosts(clip, tmp_path):
    """``--image-url-allow``: image URLs of chat, Responses, Anthropic and /generate
    requests are fetched from the allowed hosts and answer as the same image inline; an
    unallowed host, a 404 or a redirect is a 400 naming the part."""
    import http.server
    import threading

    import httpx

    from server_util import running_server

    site = tmp_path / "site"
    site.mkdir()
    image = png(31)
    (site / "cat.png").write_bytes(image)

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *a, **kw):
            super().__init__(*a, directory=str(site), **kw)

        def log_message(self, *a):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{httpd.server_address[1]}"
    model = "llava-clip-legacy-tiny"

    def chat(url):
        parts = [
            {"type": "text", "text": "Look: "},
            {"type": "image_url", "image_url": {"url": url}},
        ]
        return {"model": model, "max_tokens": 4, "temperature": 0,
                "messages": [{"role": "user", "content": parts}]}  # fmt: skip

    try:
        with running_server(clip, tmp_path / "home", image_url_allow=("127.0.0.1",)) as (url, _):
            post = lambda path, body: httpx.post(f"{url}{path}", json=body, timeout=120)  # noqa: E731
            inline = post("/v1/chat/completions", chat(_data_url(image)))
            want = inline.json()["choices"][0]["message"]["content"]
            r = post("/v1/chat/completions", chat(f"{base}/cat.png"))
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"] == want
            resp = {"model": model, "max_output_tokens": 4, "temperature": 0, "input": [{"role": "user", "content": [
                {"type": "input_text", "text": "Look: "}, {"type": "input_image", "image_url": f"{base}/cat.png"}]}]}  # fmt: skip
            r = post("/v1/responses", resp)
            assert r.status_code == 200 and r.json()["output"][0]["content"][0]["text"] == want, (
                r.text
            )
            msg = {"model": model, "max_tokens": 4, "temperature": 0, "messages": [{"role": "user", "content": [
                {"type": "text", "text": "Look: "}, {"type": "image", "source": {"type": "url", "url": f"{base}/cat.png"}}]}]}  # fmt: skip
            r = post("/v1/messages", msg)
            assert r.status_code == 200 and r.json()["content"][0]["text"] == want, r.text
            gen = {"text": "Look: <image>", "image_data": f"{base}/cat.png",
                   "sampling_params": {"max_new_tokens": 4, "temperature": 0}}  # fmt: skip
            r = post("/generate", gen)
            assert r.status_code == 200, r.text
            for bad, words in [
                (f"{base}/missing.png", "answered 404"),
                (
                    f"http://localhost:{httpd.server_address[1]}/cat.png",
                    "not one this server fetches",
                ),
            ]:
                r = post("/v1/chat/completions", chat(bad))
                assert r.status_code == 400, r.text
                err = r.json()["error"]
                assert (
                    err["param"] == "messages[0].content[1].image_url.url"
                    and words in err["message"]
                ), err
            r = post("/generate", {**gen, "image_data": f"{base}/missing.png"})
            assert r.status_code == 400 and "'image_data': the image URL answered 404" in r.text, (
                r.text
            )
    finally:
        httpd.shutdown()


ONE_ASK = """
import json
from pastry.sdk import Context, MaxTokens

async def main(args):
    ctx = Context()
    ctx.fill_tokens(json.loads(args[0]))
    ctx.fill_image(bytes.fromhex(args[1]))
    ctx.fill_tokens(json.loads(args[0]))
    await ctx.generate(stop=MaxTokens(2))
    await ctx.release()
    return json.dumps(ctx.cached_tokens)
"""


def test_users_never_match_each_others_cached_images(clip):
    """The same image and text from two users: each user's second ask is cached past
    the image, the other user's first is not (one tree per user, docs/security.md)."""
    from inferlet_util import start
    from pastry.runtime.trusted import Program

    eng = load_engine(clip)
    args = [json.dumps(list(range(5, 25))), png(41).hex()]

    async def go():
        controller, rt, handle = await start(eng)
        prog = Program.from_source("ask", ONE_ASK)
        got = []
        for user in ("alice", "bob", "alice", "bob"):
            events = [ev async for ev in rt.launch(prog, args, user=user).events()]
            got.append(json.loads(result(events)))
        await controller.close()
        handle.close()
        return got

    a1, b1, a2, b2 = asyncio.run(go())
    assert a1 == 0 and b1 == 0
    assert a2 > 20 + eng.info.image_layout.frame and b2 == a2


BAD_PREFILLS = """
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
    cases = {
        "count": ([2], [], [image]),
        "bytes": ([2], [digest], []),
        "digest": ([2], [hashlib.sha256(b"x").digest()], [image]),
        "place": ([1], [digest], [image]),
        "overlap": ([2, 3], [digest, digest], [image, image]),
        "short": ([2], [digest[:8]], [image]),
        "not_image": ([2], [hashlib.sha256(b"x").digest()], [b"x"]),
    }
    errors = {}
    for name, (at, digests, images) in cases.items():
        try:
            px.prefill(q, tokens, 0, [], [out], 0, at, digests, images)
            errors[name] = "accepted"
        except px.ApiError as e:
            errors[name] = str(e)
    pages, cached = px.prefill(q, tokens, 0, [], [out], 0, [2], [digest], [image])
    await cached
    try:  # the image's positions hold K/V now: nothing of it is new, so its bytes are not
        px.prefill(q, tokens + [9, 10], len(tokens), pages, [out], 0, [2], [digest], [image])
    except px.ApiError as e:
        errors["extra"] = str(e)
    return json.dumps(errors)
"""


def test_prefill_refuses_image_arguments_that_do_not_add_up(clip, tiny_llama):
    """``prefill``'s image arguments are checked before anything is queued, each refusal
    naming what is wrong; a text model refuses them."""
    image = png(51).hex()
    for events in trusted_and_sandboxed(load_engine(clip), BAD_PREFILLS, [image]):
        errors = json.loads(result(events))
        assert "1 image positions (image_at) for 0 image_digests" in errors["count"]
        assert "need their bytes; 0 images given" in errors["bytes"]
        assert "image_digests[0] is not the SHA-256 of images[0]" in errors["digest"]
        assert "must hold the image token" in errors["place"]
        assert "in order" in errors["overlap"]
        assert "an image digest is 32 bytes" in errors["short"]
        assert "not an image" in errors["not_image"]
        assert "1 images given" in errors["extra"]
    text_model = """
import pastry.sdk as px

async def main(args):
    q = px.create_queue(px.available_models()[0])
    [out] = px.alloc_embeds(q, 1)
    try:
        px.prefill(q, [5, 6, 7], 0, [], [out], 0, [1], [bytes(32)], [bytes.fromhex(args[0])])
    except px.ApiError as e:
        return str(e)
    return "accepted"
"""
    (ev,), _ = asyncio.run(run_all(load_engine(tiny_llama), [(text_model, [image])]))
    assert "prefill: the model" in result(ev) and "takes no images" in result(ev)
