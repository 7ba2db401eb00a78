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
from safetensors import safe_open
from torch import nn

from pastry.engine.vision.spec import VisionSpec, weight_layout, weight_name
from pastry.wire.config import CheckpointError

if TYPE_CHECKING:
    from PIL.Image import Image

log = logging.getLogger(__name__)

_TOWER, _PROJECTOR = "vision_tower.", "multi_modal_projector."


def _transformers():
    try:
        import transformers
    except ImportError:
        raise CheckpointError(
            "serving a vision-language checkpoint needs transformers and Pillow: "
            "pip install 'pastry[vision]'"
        ) from None
    return transformers


class Projector(nn.Module):
    """LLaVA's multi-modal projector: two linears with an activation between."""

    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        act = _transformers().activations.ACT2FN
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
    """Encoded images to language-model embeddings (``[images, image_tokens, hidden]``)."""

    def __init__(self, spec: VisionSpec, processor, tower: nn.Module, projector: Projector):
        super().__init__()
        self.spec, self.processor = spec, processor
        self.tower, self.projector = tower, projector

    @classmethod
    def load(
        cls,
        model_dir: Path,
        spec: VisionSpec,
        dtype: torch.dtype,
        device: torch.device,
    ) -> ImageEncoder:
        """The encoder of the vision-language checkpoint at ``model_dir``."""
        from pastry.engine.hf_checkpoint import weight_files

        tf = _transformers()
        files = weight_files(model_dir)[1]
        layout = weight_layout(files)
        if not (model_dir / "preprocessor_config.json").is_file():
            raise CheckpointError(
                f"{model_dir}: preprocessor_config.json is missing (a vision-language "
                "checkpoint ships its image processor's settings there)"
            )
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
        _load(tower, tower_sd, model_dir, "vision tower")
        _load(projector, projector_sd, model_dir, "multi-modal projector")
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
            spec.image_tokens,
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

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        out = self.tower(pixel_values=pixel_values, output_hidden_states=True)
        start = 1 if self.spec.feature_select == "default" else 0
        feats = [out.hidden_states[i][:, start:] for i in self.spec.feature_layers]
        return self.projector(torch.cat(feats, dim=-1))


def _load(module: nn.Module, named: dict[str, tuple[str, Path]], model_dir: Path, what: str):
    """Fill ``module`` from ``named`` (its parameter name -> (tensor name, file)), every
    parameter present with its shape."""
    own = module.state_dict()
    missing = [k for k in own if k not in named and not k.endswith("position_ids")]
    if missing:
        raise CheckpointError(
            f"{model_dir}: the {what}'s tensor '{missing[0]}' is missing "
            f"({len(missing)} missing in all)"
        )
    extra = sorted(k for k in named if k not in own)
    if extra:
        log.warning("%s: ignoring %d %s tensors: %s", model_dir, len(extra), what, extra[:3])
    by_file: dict[Path, list[tuple[str, str]]] = {}
    for key, (name, path) in named.items():
        if key in own:
            by_file.setdefault(path, []).append((key, name))
    weights = {}
    for path, keys in by_file.items():
        with safe_open(path, framework="pt") as f:
            for key, name in keys:
                t = f.get_tensor(name)
                if tuple(t.shape) != tuple(own[key].shape):
                    raise CheckpointError(
                        f"{path}: tensor '{name}' has shape {tuple(t.shape)}, the {what} "
                        f"from config.json expects {tuple(own[key].shape)}"
                    )
                weights[key] = t
    module.load_state_dict(weights, strict=False)


def _processed_size(processor, spec: VisionSpec) -> int:
    """The side of the square images ``processor`` makes (run once on a blank image)."""
    from PIL import Image

    blank = Image.new("RGB", (spec.image_size + 7, spec.image_size + 3))
    px = processor(images=[blank], return_tensors="pt")["pixel_values"]
    h, w = px.shape[-2:]
    return int(h) if h == w else -1
