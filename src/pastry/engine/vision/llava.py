"""LLaVA's image encoder: processor, tower, feature selection and projector.

An image becomes ``spec.image_tokens`` embeddings in the language model's hidden space:
the checkpoint's image processor (resize, crop, normalise) gives the tower's pixels; the
tower (``transformers``' CLIP or SigLIP vision model, built from ``vision_config``) runs
over every image of a call batch at once; the hidden states of ``vision_feature_layer``
(concatenated when it lists several), without the first output under the ``default``
strategy, go through the projector ``linear_2(act(linear_1(x)))``. This is
``LlavaForConditionalGeneration``'s image path, which the tests hold it to.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from pastry.engine.vision.common import check_processor_config, load_module, transformers_module
from pastry.engine.vision.spec import VisionSpec, weight_layout, weight_name
from pastry.wire.config import CheckpointError
from pastry.wire.images import ImageLayout

if TYPE_CHECKING:
    from PIL.Image import Image

log = logging.getLogger(__name__)

_TOWER, _PROJECTOR = "vision_tower.", "multi_modal_projector."


class Projector(nn.Module):
    """LLaVA's multi-modal projector: two linears with an activation between."""

    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        act = transformers_module().activations.ACT2FN
        if spec.projector_act not in act:
            raise CheckpointError(
                f"config.json: projector_hidden_act '{spec.projector_act}' is not an activation "
                "transformers knows"
            )
        features = spec.tower["hidden_size"] * len(spec.feature_layers)
        self.linear_1 = nn.Linear(features, spec.text_hidden, bias=spec.projector_bias)
        self.act = act[spec.projector_act]
        self.linear_2 = nn.Linear(spec.text_hidden, spec.text_hidden, bias=spec.projector_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class ImageEncoder(nn.Module):
    """Decoded images to language-model embeddings (``[images, spec.frame, hidden]``)."""

    def __init__(self, spec: VisionSpec, processor, tower: nn.Module, projector: Projector):
        super().__init__()
        self.spec, self.processor = spec, processor
        self.tower, self.projector = tower, projector
        self.layout = ImageLayout(spec.image_token_id, spec.frame)

    @classmethod
    def load(
        cls,
        model_dir: Path,
        spec: VisionSpec,
        dtype: torch.dtype,
        device: torch.device,
        tokenizer=None,
    ) -> ImageEncoder:
        """The encoder of the vision-language checkpoint at ``model_dir`` (``tokenizer`` is
        not needed: a LLaVA image's positions are all the tower's)."""
        from pastry.engine.hf_checkpoint import weight_files

        tf = transformers_module()
        files = weight_files(model_dir)[1]
        layout = weight_layout(files)
        check_processor_config(model_dir)
        processor = tf.AutoImageProcessor.from_pretrained(str(model_dir))
        config = tf.AutoConfig.for_model(**spec.tower)
        tower = tf.AutoModel.from_config(config, attn_implementation="sdpa")
        projector = Projector(spec)
        own = tower.state_dict()
        nested = any(k.startswith("vision_model.") for k in own)  # transformers 4 nests it
        tower_sd, projector_sd = {}, {}
        tower_at = weight_name(_TOWER, layout)
        projector_at = weight_name(_PROJECTOR, layout)
        for name, path in files.items():
            if name.startswith(tower_at):
                key = name.removeprefix(tower_at).removeprefix("vision_model.")
                tower_sd[("vision_model." if nested else "") + key] = (name, path)
            elif name.startswith(projector_at):
                projector_sd[name.removeprefix(projector_at)] = (name, path)
        load_module(tower, tower_sd, model_dir, "vision tower")
        load_module(projector, projector_sd, model_dir, "multi-modal projector")
        encoder = cls(spec, processor, tower, projector).to(device=device, dtype=dtype).eval()
        size = _processed_size(processor, spec)
        if size != spec.image_size:
            raise CheckpointError(
                f"{model_dir}/preprocessor_config.json: the processor makes {size}-pixel "
                f"images, the tower takes {spec.image_size}"
            )
        log.info(
            "image encoder: %s tower (%d layers), %d embeddings per %dx%d image",
            spec.tower["model_type"],
            spec.tower["num_hidden_layers"],
            spec.frame,
            spec.image_size,
            spec.image_size,
        )
        return encoder

    @property
    def dtype(self) -> torch.dtype:
        return self.projector.linear_1.weight.dtype

    def pixels(self, images: list[Image]) -> torch.Tensor:
        """The tower's input for decoded ``images`` (:func:`~pastry.wire.images.decode_image`)."""
        px = self.processor(images=images, return_tensors="pt")["pixel_values"]
        return px.to(device=self.projector.linear_1.weight.device, dtype=self.dtype)

    def spans(self, images: list[Image], embed_tokens) -> list[torch.Tensor]:
        """Each image's embeddings (``layout.frame`` rows); ``embed_tokens`` is unused:
        a LLaVA image's positions are all the tower's."""
        return list(self(self.pixels(images)))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        out = self.tower(pixel_values=pixel_values, output_hidden_states=True)
        start = 1 if self.spec.feature_select == "default" else 0
        feats = [out.hidden_states[i][:, start:] for i in self.spec.feature_layers]
        return self.projector(torch.cat(feats, dim=-1))


def _processed_size(processor, spec: VisionSpec) -> int:
    """The side of the square images ``processor`` makes (run once on a blank image)."""
    from PIL import Image

    blank = Image.new("RGB", (spec.image_size + 7, spec.image_size + 3))
    px = processor(images=[blank], return_tensors="pt")["pixel_values"]
    h, w = px.shape[-2:]
    return int(h) if h == w else -1
