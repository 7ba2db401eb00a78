"""Tiny random-weight vision-language checkpoints, made with transformers' own classes."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from pastry.engine.tiny import create_tiny

IMAGE_SIZE, PATCH = 28, 7  # 16 patches
IMAGE = "<image>"
# ChatML with LLaVA's image parts: one "<image>" per {"type": "image"} part.
CHAT_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' %}{{- '<image>' }}"
    "{%- elif part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}{{- '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def create_tiny_llava(
    out: Path, tower: str = "clip", seed: int = 0, layout: str = "legacy", size: str = "tiny"
) -> Path:
    """A LLaVA checkpoint in ``out``: Pastry's tiny llama (its tokenizer with "<image>"
    added after its vocabulary, the image token; a ChatML template that writes it per
    image part; its text shape), a 2-layer ``tower`` ("clip" or "siglip") at
    28x28 pixels in 7-pixel patches, random weights under ``seed``. ``layout`` "v5"
    renames the tensors as transformers 5 keeps them in memory (``model.language_model.*``);
    "legacy" is what ``save_pretrained`` writes. ``size`` "base": LLaVA-1.5's shapes at a
    small scale, for benchmarks: the "small" llama (768 hidden, 12 layers) and a ViT-B/16
    tower at 224 pixels (196 embeddings per image), transformers' initialisation."""
    from tokenizers import AddedToken, Tokenizer
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        SiglipImageProcessor,
        SiglipVisionConfig,
    )

    text_dir = create_tiny(out / "text", size="small" if size == "base" else "tiny",
                           dtype="float32", seed=seed)  # fmt: skip
    text = json.loads((text_dir / "config.json").read_text())
    tok = Tokenizer.from_file(str(text_dir / "tokenizer.json"))
    image_id = tok.get_vocab_size()  # "<image>", added to the tokenizer below
    text["vocab_size"] = max(text["vocab_size"], image_id + 1)
    text_config = LlamaConfig(**{k: v for k, v in text.items() if k != "architectures"})
    side, patch = (224, 16) if size == "base" else (IMAGE_SIZE, PATCH)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, image_size=side, patch_size=patch)  # fmt: skip
    if size == "base":
        vision.update(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                      num_attention_heads=12)  # fmt: skip
    if tower == "clip":
        vision_config = CLIPVisionConfig(**vision, projection_dim=32)
        processor = CLIPImageProcessor(
            size={"shortest_edge": side}, crop_size={"height": side, "width": side}
        )
    else:
        vision_config = SiglipVisionConfig(**vision)
        processor = SiglipImageProcessor(size={"height": side, "width": side})
    config = LlavaConfig(
        vision_config=vision_config,
        text_config=text_config,
        image_token_index=image_id,
        image_seq_length=(side // patch) ** 2,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default" if tower == "clip" else "full",
    )
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config)
    if size == "tiny":
        _decisive(model)
    path = out / f"llava-{tower}-{layout}-{size}"
    model.save_pretrained(path)
    processor.save_pretrained(path)
    tok.add_special_tokens([AddedToken(IMAGE, special=True)])
    assert tok.token_to_id(IMAGE) == config.image_token_index
    _text_files(path, text_dir, tok)
    if layout == "v5":
        weights = load_file(path / "model.safetensors")
        renamed = {}
        for k, v in weights.items():
            if k.startswith("language_model.model."):
                k = "model.language_model." + k.removeprefix("language_model.model.")
            elif k == "language_model.lm_head.weight":
                k = "lm_head.weight"
            else:
                k = "model." + k
            renamed[k] = v
        save_file(renamed, path / "model.safetensors", metadata={"format": "pt"})
    return path


def _decisive(model) -> None:
    """transformers' initialisation is small: widen the matrices so that logits decide."""
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0, 0.1)


def _text_files(path: Path, text_dir: Path, tok) -> None:
    """The tokenizer (``tok``, with the image tokens), the text model's generation config
    and its tokenizer config with :data:`CHAT_TEMPLATE`, into checkpoint ``path``."""
    shutil.copy(text_dir / "generation_config.json", path / "generation_config.json")
    tok.save(str(path / "tokenizer.json"))
    tok_config = json.loads((text_dir / "tokenizer_config.json").read_text())
    tok_config["chat_template"] = CHAT_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config))


def png(seed: int, size: tuple[int, int] = (40, 33)) -> bytes:
    """A random RGB image, PNG-encoded."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


TILE, IDEFICS_EDGE = 32, 64  # 32-pixel tiles (8-pixel patches: 16, shuffled to 4 embeddings)
TAGS = ["<fake_token_around_image>", IMAGE, "<global-img>", "<end_of_utterance>"] + [
    f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)
]


def create_tiny_idefics3(out: Path, seed: int = 0, split: bool = True, size: str = "tiny") -> Path:
    """An Idefics3 (SmolVLM) checkpoint in ``out``: Pastry's tiny llama (its tokenizer with
    Idefics3's tokens added: ``<fake_token_around_image>``, ``<image>``, ``<global-img>``,
    ``<end_of_utterance>`` and the 36 ``<row_r_col_c>`` tags; the ChatML template with an
    ``<image>`` per image part), a 2-layer Idefics3 tower on 32-pixel tiles in 8-pixel
    patches with pixel shuffle 2 (4 embeddings per frame), and Idefics3's processor
    resizing images to 64 pixels on their longest side and (``split``) cutting them into
    up to 2 x 2 tiles plus the whole image; random weights under ``seed``. ``size``
    "base", for benchmarks: SmolVLM's shapes at a small scale, the "small" llama (768
    hidden, 12 layers) and a ViT-B/16 tower on 224-pixel tiles (49 embeddings per frame),
    images to 448 pixels on their longest side (up to 2 x 2 tiles), transformers'
    initialisation."""
    from tokenizers import AddedToken, Tokenizer
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessorPil,
        Idefics3VisionConfig,
        LlamaConfig,
    )

    base = size == "base"
    text_dir = create_tiny(out / "text", size="small" if base else "tiny", dtype="float32",
                           seed=seed)  # fmt: skip
    text = json.loads((text_dir / "config.json").read_text())
    tok = Tokenizer.from_file(str(text_dir / "tokenizer.json"))
    first = tok.get_vocab_size()
    tok.add_special_tokens([AddedToken(t, special=True) for t in TAGS])
    text["vocab_size"] = max(text["vocab_size"], first + len(TAGS))
    tile, edge = (224, 448) if base else (TILE, IDEFICS_EDGE)
    tower = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=2, image_size=tile, patch_size=8)  # fmt: skip
    if base:
        tower.update(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                     num_attention_heads=12, patch_size=16)  # fmt: skip
    config = Idefics3Config(
        vision_config=Idefics3VisionConfig(**tower),
        text_config=LlamaConfig(**{k: v for k, v in text.items() if k != "architectures"}),
        image_token_id=tok.token_to_id(IMAGE),
        scale_factor=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config)
    if not base:
        _decisive(model)
    path = out / f"idefics3-{'split' if split else 'whole'}-{size}"
    model.save_pretrained(path)
    Idefics3ImageProcessorPil(
        size={"longest_edge": edge}, max_image_size={"longest_edge": tile},
        do_image_splitting=split,
    ).save_pretrained(path)  # fmt: skip
    _text_files(path, text_dir, tok)
    return path


def idefics3_processor(path: Path):
    """transformers' ``Idefics3Processor`` for a :func:`create_tiny_idefics3` checkpoint."""
    from transformers import AutoImageProcessor, Idefics3Processor, PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"))
    tower = json.loads((path / "config.json").read_text())["vision_config"]
    frame = (tower["image_size"] // tower["patch_size"]) ** 2 // 4
    return Idefics3Processor(AutoImageProcessor.from_pretrained(path), tok, image_seq_len=frame)
