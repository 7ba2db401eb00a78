"""The vision half of a vision-language ``config.json``, normalised once (no torch here)."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from pastry.wire.config import CheckpointError

FAMILIES = ("llava", "idefics3")
# Image towers by their ``vision_config.model_type``: whether the tower's first output is a
# class token (CLIP's ViT prepends one; SigLIP has none).
TOWERS = {"clip_vision_model": True, "siglip_vision_model": False}
# The tower each family's checkpoints name (LLaVA takes any of TOWERS; checkpoints saved by
# transformers 4.4x, SmolVLM's among them, name Idefics3's tower "idefics3" or nothing).
FAMILY_TOWERS = {"llava": tuple(TOWERS), "idefics3": ("idefics3_vision", "idefics3")}
_SELECT = ("default", "full")  # LLaVA: "default" drops the tower's first output, "full" keeps it


@dataclass(frozen=True, eq=False)
class VisionSpec:
    """How a checkpoint turns an image into language-model embeddings."""

    family: str  # one of FAMILIES
    tower: dict[str, Any]  # the checkpoint's vision_config (model_type one of TOWERS)
    feature_layers: tuple[int, ...]  # tower hidden states taken (concatenated), by index
    feature_select: str  # "default": without the first output, "full": all of them
    projector_act: str  # the projector's activation (transformers' ACT2FN name)
    projector_bias: bool
    text_hidden: int  # the language model's hidden size: the projector's output
    image_token_id: int  # the placeholder token a chat template writes per embedding
    image_size: int  # the tower's input, square, in pixels
    scale_factor: int = 1  # Idefics3's pixel shuffle: scale_factor**2 patches per embedding

    @property
    def frame(self) -> int:
        """Embeddings one frame takes: a LLaVA image, an Idefics3 tile or whole image."""
        patches = (self.image_size // int(self.tower["patch_size"])) ** 2
        if self.family == "idefics3":
            return patches // self.scale_factor**2
        n = patches + TOWERS[self.tower["model_type"]]
        return n - (self.feature_select == "default")


def vision_spec(raw: dict[str, Any], source: str = "config.json") -> VisionSpec | None:
    """The :class:`VisionSpec` of a ``config.json`` (``None`` when it has no
    ``vision_config``); a family, tower or option Pastry does not run is a
    :class:`CheckpointError` naming it."""
    if "vision_config" not in raw:
        return None
    family = raw.get("model_type")
    if family not in FAMILIES:
        raise CheckpointError(
            f"{source}: vision-language model_type '{family}' is not supported "
            f"(supported: {', '.join(FAMILIES)})"
        )
    tower, towers = raw["vision_config"], FAMILY_TOWERS[family]
    default = towers[0] if family == "idefics3" else None  # its configs may leave it out
    if not isinstance(tower, dict) or tower.get("model_type", default) not in towers:
        kind = tower.get("model_type") if isinstance(tower, dict) else tower
        raise CheckpointError(
            f"{source}: vision_config.model_type '{kind}' is not supported for {family} "
            f"(supported: {', '.join(towers)})"
        )
    tower = {"model_type": towers[0], **tower}
    for key in ("hidden_size", "image_size", "patch_size", "num_hidden_layers"):
        if not isinstance(tower.get(key), int):
            raise CheckpointError(f"{source}: vision_config.{key} is missing or not an integer")
    if family == "idefics3":
        return _idefics3(raw, tower, source)
    select = raw.get("vision_feature_select_strategy", "default")
    if select not in _SELECT:
        raise CheckpointError(
            f"{source}: vision_feature_select_strategy '{select}' is not supported "
            f"(supported: {', '.join(_SELECT)})"
        )
    layers = raw.get("vision_feature_layer", -2)
    layers = tuple(layers) if isinstance(layers, list) else (layers,)
    depth = tower["num_hidden_layers"]
    if not layers or not all(isinstance(i, int) and -depth - 1 <= i <= depth for i in layers):
        raise CheckpointError(
            f"{source}: vision_feature_layer {raw.get('vision_feature_layer')!r} is not a "
            f"hidden state of the {depth}-layer tower"
        )
    token = raw.get("image_token_index", raw.get("image_token_id"))
    if not isinstance(token, int):
        raise CheckpointError(f"{source}: image_token_index is missing")
    text = language_config(raw, source)
    return VisionSpec(
        family=family,
        tower=dict(tower),
        feature_layers=layers,
        feature_select=select,
        projector_act=str(raw.get("projector_hidden_act", "gelu")),
        projector_bias=bool(raw.get("multimodal_projector_bias", True)),
        text_hidden=int(text["hidden_size"]),
        image_token_id=token,
        image_size=tower["image_size"],
    )


def _idefics3(raw: dict[str, Any], tower: dict[str, Any], source: str) -> VisionSpec:
    """Idefics3 / SmolVLM: a SigLIP-style tower's last hidden state (post-layernorm), a
    pixel shuffle by ``scale_factor`` and one linear (the connector)."""
    scale = raw.get("scale_factor", 2)
    side = tower["image_size"] // tower["patch_size"]
    if not isinstance(scale, int) or scale < 1 or side % scale:
        raise CheckpointError(
            f"{source}: scale_factor {scale!r} does not divide the tower's {side} x {side} patches"
        )
    token = raw.get("image_token_id", raw.get("image_token_index"))
    if not isinstance(token, int):
        raise CheckpointError(f"{source}: image_token_id is missing")
    return VisionSpec(
        family="idefics3",
        tower=tower,
        feature_layers=(-1,),
        feature_select="full",
        projector_act="",
        projector_bias=False,
        text_hidden=int(language_config(raw, source)["hidden_size"]),
        image_token_id=token,
        image_size=tower["image_size"],
        scale_factor=scale,
    )


def language_config(raw: dict[str, Any], source: str = "config.json") -> dict[str, Any]:
    """The language model's part of a ``config.json``: ``text_config`` for a
    vision-language checkpoint (with the file's name and dtype where it has none), the
    whole of it otherwise."""
    if "vision_config" not in raw:
        return raw
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise CheckpointError(f"{source}: a vision-language config needs a text_config object")
    inherited = {k: raw[k] for k in ("_name_or_path", "torch_dtype", "dtype") if k in raw}
    return {**inherited, **text}


def weight_layout(names: Collection[str]) -> str:
    """How a vision-language checkpoint's files name its tensors: ``"idefics3"``
    (``model.text_model.*``, ``model.vision_model.*``, ``model.connector.*``), ``"v5"`` (transformers 5:
    ``model.language_model.*``, ``model.vision_tower.*``, ``lm_head.weight``) or
    ``"legacy"`` (``language_model.model.*``, ``language_model.lm_head.weight``,
    ``vision_tower.*``)."""
    if any(n.startswith("model.text_model.") for n in names):
        return "idefics3"
    return "v5" if any(n.startswith("model.language_model.") for n in names) else "legacy"


def weight_name(name: str, layout: str) -> str:
    """Where a checkpoint of ``layout`` (:func:`weight_layout`) stores tensor ``name``: a
    language-model name as a text checkpoint has it (``model.layers.0...``,
    ``lm_head.weight``) or a ``vision_tower.*`` / ``multi_modal_projector.*`` one."""
    if layout == "idefics3":  # model.{text_model,vision_model,connector}.*, lm_head.weight
        if name.startswith("model."):
            return "model.text_model." + name.removeprefix("model.")
        return name if name == "lm_head.weight" else "model." + name
    lm = not name.startswith(("vision_tower.", "multi_modal_projector."))
    if layout == "legacy":
        return "language_model." + name if lm else name
    if not lm:
        return "model." + name
    return (
        "model.language_model." + name.removeprefix("model.") if name.startswith("model.") else name
    )
