"""Idefics3's image encoder (SmolVLM): tiles, a SigLIP-style tower, pixel shuffle, one linear.

The checkpoint's image processor (``Idefics3ImageProcessor`` through
``transformers.AutoImageProcessor``) resizes an image so that its longest side is
``size.longest_edge``, cuts it into ``max_image_size`` tiles and adds the whole image at a
tile's size; every frame goes through the tower (``transformers``' own
``Idefics3VisionTransformer``) and the connector (``Idefics3Connector``: a pixel shuffle
by ``scale_factor`` and a linear), all the frames of a call batch at once. An image's
positions are its span (:class:`~pastry.wire.images.ImageLayout`): the frames'
embeddings between the text tokens the processor writes around them (a tile's
``<row_r_col_c>`` tag, newlines, ``<global-img>``), whose embeddings are the language
model's. This is ``Idefics3ForConditionalGeneration``'s image path, which the tests hold
it to.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from pastry.engine.vision.common import check_processor_config, load_module, transformers_module
from pastry.engine.vision.spec import VisionSpec, weight_layout, weight_name
from pastry.wire.config import CheckpointError
from pastry.wire.images import ImageLayout

if TYPE_CHECKING:
    from collections.abc import Callable

    from PIL.Image import Image

    from pastry.wire.tokenizer import Tokenizer

log = logging.getLogger(__name__)

_GRID = 6  # the row/column tags Idefics3's processor names
_TOWER, _CONNECTOR = "vision_model.", "connector."


class Idefics3Encoder(nn.Module):
    """Decoded images to their spans' embeddings (one ``[positions, hidden]`` each)."""

    def __init__(self, spec: VisionSpec, processor, tower: nn.Module, connector: nn.Module,
                 layout: ImageLayout):  # fmt: skip
        super().__init__()
        self.spec, self.processor, self.layout = spec, processor, layout
        self.tower, self.connector = tower, connector

    @classmethod
    def load(
        cls,
        model_dir: Path,
        spec: VisionSpec,
        dtype: torch.dtype,
        device: torch.device,
        tokenizer: Tokenizer,
    ) -> Idefics3Encoder:
        """The encoder of the Idefics3 checkpoint at ``model_dir`` (``tokenizer``: its
        tokenizer, which names the tags of a span)."""
        from transformers.models.idefics3.modeling_idefics3 import Idefics3Connector

        from pastry.engine.hf_checkpoint import weight_files

        tf = transformers_module()
        check_processor_config(model_dir)
        files = weight_files(model_dir)[1]
        layout_name = weight_layout(files)
        processor = tf.AutoImageProcessor.from_pretrained(str(model_dir))
        config = tf.AutoConfig.from_pretrained(str(model_dir))
        tower = tf.AutoModel.from_config(config.vision_config, attn_implementation="sdpa")
        connector = Idefics3Connector(config)
        parts = {_TOWER: ({}, tower, "vision tower"), _CONNECTOR: ({}, connector, "connector")}
        for prefix, (named, _, _) in parts.items():
            at = weight_name(prefix, layout_name)
            for name, path in files.items():
                if name.startswith(at):
                    named[name.removeprefix(at)] = (name, path)
        for named, module, what in parts.values():
            load_module(module, named, model_dir, what)
        layout = image_layout(spec, processor, tokenizer, model_dir)
        encoder = cls(spec, processor, tower, connector, layout)
        encoder = encoder.to(device=device, dtype=dtype).eval()
        log.info(
            "image encoder: idefics3 tower (%d layers), %d embeddings per %dx%d frame, "
            "images to %s pixels on the longest side, %s",
            spec.tower["num_hidden_layers"], spec.frame, spec.image_size, spec.image_size,
            layout.longest_edge or "their own", "tiled" if layout.split else "not tiled",
        )  # fmt: skip
        return encoder

    @property
    def dtype(self) -> torch.dtype:
        return self.connector.modality_projection.proj.weight.dtype

    def spans(self, images: list[Image], embed_tokens: Callable) -> list[torch.Tensor]:
        """Each image's span (``layout.span`` of the grid the processor cut it into):
        frame embeddings at the image token, ``embed_tokens`` of the tags elsewhere."""
        out = self.processor(images=[[im] for im in images], return_tensors="pt",
                             return_row_col_info=True)  # fmt: skip
        grids = [(r[0], c[0]) for r, c in zip(out["rows"], out["cols"], strict=True)]
        frames = [r * c + 1 for r, c in grids]
        px = out["pixel_values"]  # [images, most frames, 3, tile, tile]; zero frames pad
        weight = self.connector.modality_projection.proj.weight
        pixels = torch.cat([px[i, :f] for i, f in enumerate(frames)])
        feats = self(pixels.to(weight.device, self.dtype))  # [frames, frame, text hidden]
        spans, at = [], 0
        for (rows, cols), f in zip(grids, frames, strict=True):
            tokens = torch.tensor(self.layout.span(rows, cols), device=weight.device)
            span = embed_tokens(tokens).clone()
            span[tokens == self.layout.token] = feats[at : at + f].flatten(0, 1).to(span.dtype)
            spans.append(span)
            at += f
        return spans

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Frames (``[frames, 3, tile, tile]``) to their embeddings."""
        return self.connector(self.tower(pixel_values=pixel_values).last_hidden_state)


def image_layout(spec: VisionSpec, processor, tokenizer: Tokenizer, model_dir: Path) -> ImageLayout:
    """The :class:`ImageLayout` of an Idefics3 checkpoint: its processor's geometry and its
    tokenizer's tags; a :class:`CheckpointError` for a processor whose tiles are not the
    tower's input, or a tag the tokenizer lacks."""
    tile = _edge(processor.max_image_size)
    if tile != spec.image_size:
        raise CheckpointError(
            f"{model_dir}/preprocessor_config.json: max_image_size is {tile} pixels, the "
            f"tower takes {spec.image_size}"
        )
    edge = _edge(processor.size) if processor.do_resize else 0
    split = bool(processor.do_image_splitting)
    grid = math.ceil(min(edge or 4096, 4096) / tile) if split else 0
    if grid > _GRID:
        raise CheckpointError(
            f"{model_dir}/preprocessor_config.json: images cut into up to {grid} x {grid} "
            f"tiles, but Idefics3's tags name {_GRID} x {_GRID}"
        )

    def tag(name: str) -> int:
        i = tokenizer.token_to_id(name)
        if i is None:
            raise CheckpointError(f"{model_dir}: the tokenizer has no '{name}' token")
        return i

    cells = tuple(
        tag(f"<row_{r}_col_{c}>") if r <= grid and c <= grid else -1
        for r in range(1, _GRID + 1)
        for c in range(1, _GRID + 1)
    )
    return ImageLayout(
        token=spec.image_token_id, frame=spec.frame, tile=tile, longest_edge=edge,
        split=split, wrap=tag("<fake_token_around_image>"), whole=tag("<global-img>"),
        cells=cells, row_end=tuple(tokenizer.encode("\n")),
        grid_end=tuple(tokenizer.encode("\n\n")),
    )  # fmt: skip


def _edge(size) -> int:
    """``longest_edge`` of a processor's size setting (a dict or transformers' SizeDict)."""
    edge = (
        size.get("longest_edge") if isinstance(size, dict) else getattr(size, "longest_edge", None)
    )
    if not isinstance(edge, int):
        raise CheckpointError(f"preprocessor_config.json: a size of {size!r} has no longest_edge")
    return edge
