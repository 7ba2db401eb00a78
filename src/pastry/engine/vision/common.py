"""What the image encoders of every family share: transformers on demand, the processor's
file, and filling a module from a checkpoint's tensors with every shape checked."""

from __future__ import annotations

import logging
from pathlib import Path

from safetensors import safe_open
from torch import nn

from pastry.wire.config import CheckpointError

log = logging.getLogger(__name__)


def transformers_module():
    """``transformers``, or a :class:`CheckpointError` saying how to install it."""
    try:
        import transformers
    except ImportError:
        raise CheckpointError(
            "serving a vision-language checkpoint needs transformers and Pillow: "
            "pip install 'pastry[vision]'"
        ) from None
    return transformers


def check_processor_config(model_dir: Path) -> None:
    """A :class:`CheckpointError` unless ``model_dir`` ships its image processor's file."""
    if not (model_dir / "preprocessor_config.json").is_file():
        raise CheckpointError(
            f"{model_dir}: preprocessor_config.json is missing (a vision-language "
            "checkpoint ships its image processor's settings there)"
        )


def load_module(module: nn.Module, named: dict[str, tuple[str, Path]], model_dir: Path, what: str):
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
