"""Image input: encode time, time to first token with 1 and 4 images, against transformers.

    python benchmarks/images.py [--quick] [--dtype bfloat16] [--family llava|idefics3]

A LLaVA checkpoint of LLaVA-1.5's shapes at small scale, random weights, made with
transformers' own classes (``tests/vision_util.py``, size "base": a ViT-B/16 CLIP tower at
224 pixels, 196 embeddings per image, on a 768-wide 12-layer llama); ``--family
idefics3``: SmolVLM's design at the same scale (a ViT-B/16 Idefics3 tower on 224-pixel
tiles, pixel shuffle 2: 49 embeddings per frame; images to 448 pixels on their longest
side, so a 640x480 image is 2 x 2 tiles and the whole image, 261 positions with the
tags). Measured on the
engine in this process (no server): ``embed_img`` of 1 and of 4 images in one batch (the
image processor and the tower), and the time to a first sampled token for a prompt of 32
text tokens, the images, and 16 more tokens (every embed, one forward, one sample). The
reference, measured in the same run on the same weights and dtype, is transformers'
``LlavaForConditionalGeneration`` (``Idefics3ForConditionalGeneration``) on the same inputs (its processor, and a forward keeping
the last position's logits). The same prompt with text in the images' places gives the
cost of the images themselves. The prefix cache's gain: through the control layer (an
inferlet on this engine, in process), a ``Context`` asks about a new image (32 tokens, the
image, a 16-token question) and, once released, another asks about the same image with
another question; the gain is the first time to a first token over the second (the
second's image and text before it come from the cache, matched by the image's SHA-256).

Prints a table per measure and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from machine import cpu_name
from pastry.engine.engine import Engine
from pastry.wire.calls import EmbedImg, EmbedTxt, Forward, Sample, ids
from pastry.wire.config import EngineConfig
from pastry.wire.images import decode_image

BEFORE, AFTER = 32, 16


def timed(fn, reps: int) -> float:
    """Median wall ms of ``fn()`` over ``reps`` runs, after one warm-up."""
    fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


class Prompt:
    """Calls laying out BEFORE tokens, ``k`` images (or as many text tokens), AFTER tokens,
    then one forward and a sample, in fresh slots and pages each time."""

    def __init__(self, eng: Engine, images: list[bytes], as_text: bool = False) -> None:
        self.eng, self.images, self.as_text = eng, images, as_text

    def calls(self) -> list:
        eng = self.eng
        n = BEFORE + sum(positions(eng, i) for i in self.images) + AFTER
        rng = np.random.default_rng(0)
        emb, pos = ids(range(n)), ids(range(n))
        calls = [EmbedTxt(ids(rng.integers(3, 1000, BEFORE)), pos[:BEFORE], emb[:BEFORE])]
        at = BEFORE
        for image in self.images:
            t = positions(eng, image)
            sl = slice(at, at + t)
            if self.as_text:
                calls.append(EmbedTxt(ids(rng.integers(3, 1000, t)), pos[sl], emb[sl]))
            else:
                calls.append(EmbedImg(np.frombuffer(image, np.uint8), pos[sl], emb[sl]))
            at += t
        calls.append(EmbedTxt(ids(rng.integers(3, 1000, AFTER)), pos[at:], emb[at:]))
        pages = ids(range(-(-n // eng.page_size)))
        out = ids([n])
        calls += [Forward(in_embeds=emb, out_pages=pages, out_embeds=out,
                          out_indices=ids([n - 1])), Sample(int(out[0]))]  # fmt: skip
        return calls

    def run(self) -> None:
        res = self.eng.execute(self.calls())
        assert all(r is None for r in res[:-1]) and isinstance(res[-1], int), res


def positions(eng: Engine, image: bytes) -> int:
    """The positions ``image`` takes on ``eng``'s model (``num_embs_needed``)."""
    return eng.info.image_layout.positions(*decode_image(image).size)


def hf_ttft(family: str, model, processor, eng: Engine, images: list[bytes], dtype) -> callable:
    """transformers' time to a first token on the prompt :class:`Prompt` lays out."""
    rng = np.random.default_rng(0)
    tokens = [*rng.integers(3, 1000, BEFORE)]
    for image in images:
        if family == "idefics3":  # the processor's expansion of one <image>
            tokens += processor(text=["<image>"], images=[[decode_image(image)]],
                                add_special_tokens=False)["input_ids"][0]  # fmt: skip
        else:
            tokens += [eng.info.image_token_id] * positions(eng, image)
    tokens += [*rng.integers(3, 1000, AFTER)]
    input_ids = torch.tensor([tokens])

    def run():
        pics = [decode_image(i) for i in images]
        if family == "idefics3":
            px = processor.image_processor(images=[pics], return_tensors="pt")
            extra = {"pixel_attention_mask": px["pixel_attention_mask"]}
        else:
            px, extra = processor(images=pics, return_tensors="pt"), {}
        with torch.inference_mode():
            logits = model(input_ids=input_ids, pixel_values=px["pixel_values"].to(dtype),
                           logits_to_keep=1, **extra).logits  # fmt: skip
        return int(logits[0, -1].argmax())

    return run


CACHE_PROGRAM = """
import json
import time
from pastry.sdk import Context, MaxTokens

async def main(args):
    before, first, second = (json.loads(a) for a in args[:3])
    out = []
    for image in args[3:]:
        image = bytes.fromhex(image)
        times = []
        for question in (first, second):
            t0 = time.perf_counter()
            ctx = Context()
            ctx.fill_tokens(before)
            ctx.fill_image(image)
            ctx.fill_tokens(question)
            await ctx.generate(stop=MaxTokens(1))
            times.append(((time.perf_counter() - t0) * 1e3, ctx.cached_tokens))
            await ctx.release()
        out.append(times)
    return json.dumps(out)
"""


def cache_gain(eng: Engine, reps: int, t: int) -> dict:
    """Time to a first token of a new image, then of the same image with another question,
    through the control layer (a trusted inferlet on ``eng``); ``reps`` fresh images."""
    import asyncio

    from inferlet_util import result, run_all
    from vision_util import png

    rng = np.random.default_rng(1)
    text = [json.dumps(rng.integers(3, 1000, k).tolist()) for k in (BEFORE, AFTER, AFTER)]
    images = [png(100 + i, (640, 480)).hex() for i in range(reps + 1)]  # the first: warm-up
    (events,), _ = asyncio.run(run_all(eng, [(CACHE_PROGRAM, [*text, *images])]))
    runs = json.loads(result(events))[1:]
    first = statistics.median(r[0][0] for r in runs)
    second = statistics.median(r[1][0] for r in runs)
    return {
        "first_ask_ttft_ms": round(first, 2),
        "second_ask_ttft_ms": round(second, 2),
        "second_ask_cached_tokens": min(r[1][1] for r in runs),
        "prefix_cache_gain_same_image": round(first / second, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (same shapes)")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--family", default="llava", choices=("llava", "idefics3"))
    args = ap.parse_args()
    reps = 3 if args.quick else 10
    import transformers

    from vision_util import create_tiny_idefics3, create_tiny_llava, idefics3_processor, png

    dtype = getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        if args.family == "idefics3":
            path = create_tiny_idefics3(Path(tmp), size="base")
            hf_class, processor = transformers.Idefics3ForConditionalGeneration, idefics3_processor(path)  # fmt: skip
        else:
            path = create_tiny_llava(Path(tmp), "clip", size="base")
            hf_class = transformers.LlavaForConditionalGeneration
            processor = transformers.AutoImageProcessor.from_pretrained(path)
        eng = Engine.load(
            path, EngineConfig(dtype=args.dtype, num_pages=1024, num_embeds=4096, page_size=16)
        )
        hf = hf_class.from_pretrained(path, dtype=dtype).eval()
    images = [png(i, (640, 480)) for i in range(4)]
    t = positions(eng, images[0])  # every 640x480 image takes as many
    rows, out = [], {}
    for k in (1, 4):
        batch = [EmbedImg(np.frombuffer(images[i], np.uint8), ids(range(i * t, (i + 1) * t)),
                          ids(range(i * t, (i + 1) * t))) for i in range(k)]  # fmt: skip
        enc = timed(lambda b=batch: eng.execute(b), reps)
        ttft = timed(Prompt(eng, images[:k]).run, reps)
        text = timed(Prompt(eng, images[:k], as_text=True).run, reps)
        ref = timed(hf_ttft(args.family, hf, processor, eng, images[:k], dtype), reps)
        key = f"{k}_image" + ("s" if k > 1 else "")
        out |= {
            f"image_encode_ms_{key}": round(enc, 2),
            f"ttft_ms_{key}": round(ttft, 2),
            f"ttft_text_only_ms_{key}": round(text, 2),
            f"hf_ttft_ms_{key}": round(ref, 2),
            f"hf_ttft_over_pastry_{key}": round(ref / ttft, 3),
        }
        rows.append((k, BEFORE + k * t + AFTER, enc, ttft, text, ref, ref / ttft))
    shapes = ("Idefics3: ViT-B/16 tiles @224, 2 x 2 + whole" if args.family == "idefics3"
              else "LLaVA shapes: ViT-B/16 @224")  # fmt: skip
    print(f"# images.py on {cpu_name()}, {args.dtype}, {torch.get_num_threads()} threads; "
          f"{shapes} ({t} positions/image) + 768x12 llama; 640x480 PNGs")  # fmt: skip
    print("| images | prompt tokens | embed_img ms | TTFT ms | TTFT, text in their place | "
          "transformers TTFT ms | transformers / Pastry |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for k, n, enc, ttft, text, ref, ratio in rows:
        print(f"| {k} | {n} | {enc:.1f} | {ttft:.1f} | {text:.1f} | {ref:.1f} | {ratio:.2f}x |")
    gain = cache_gain(eng, reps, t)
    print(f"\nThe same image asked about twice (through the control layer, {reps} images): "
          f"first TTFT {gain['first_ask_ttft_ms']:.1f} ms, second {gain['second_ask_ttft_ms']:.1f}"
          f" ms ({gain['second_ask_cached_tokens']} of {BEFORE + t + AFTER} prompt tokens "
          f"from the cache): {gain['prefix_cache_gain_same_image']:.2f}x")  # fmt: skip
    out |= {
        **gain,
        "family": args.family,
        "image_tokens": t,
        "dtype": args.dtype,
        "cpu": cpu_name(),
        "quick": args.quick,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
