"""A Hugging Face checkpoint directory (Llama family, safetensors): config, tokenizer, weights.

:func:`load_hf_checkpoint` reads what the control layer needs without touching the weights:
the normalised :class:`~pastry.wire.config.ModelConfig` (with BOS/EOS resolved) and the
:class:`~pastry.wire.tokenizer.Tokenizer`; :meth:`Checkpoint.load_state_dict` then reads the
weights by HF name, validated against the shapes the config implies (:func:`expected_shapes`).
A GGUF file's conversion cache (:mod:`pastry.engine.gguf`) is a directory of this form, so
the GGUF loader builds on this module; :func:`pastry.engine.checkpoint.load_checkpoint` picks
between the two. Every error is a :class:`~pastry.wire.config.CheckpointError` naming the
file and the field or tensor. Importing this module does not import torch.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safetensors import SafetensorError, safe_open

from pastry.engine.vision import language_config, vision_spec, weight_name
from pastry.engine.vision.spec import VisionSpec, weight_layout
from pastry.wire.config import CheckpointError, ModelConfig
from pastry.wire.tokenizer import Tokenizer

if TYPE_CHECKING:  # torch loads only when weights are read
    import torch

log = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Tensors some checkpoints carry that the model recomputes; never worth a warning.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", ".masked_bias", ".attn.bias")


def _expected(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    """HF tensor name -> (shape, the config.json fields that determine it)."""
    h, inter, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    hid = f"hidden_size={h}"
    q = f"num_attention_heads={cfg.num_heads} x head_dim={d}"
    kv = f"num_key_value_heads={cfg.num_kv_heads} x head_dim={d}"
    inter_s = f"intermediate_size={inter}"
    vocab = f"vocab_size={cfg.vocab_size}"
    out: dict[str, tuple[tuple[int, ...], str]] = {
        "model.embed_tokens.weight": ((cfg.vocab_size, h), f"{vocab}, {hid}")
    }
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        out[p + "self_attn.q_proj.weight"] = ((cfg.q_size, h), f"{q}, {hid}")
        out[p + "self_attn.k_proj.weight"] = ((cfg.kv_size, h), f"{kv}, {hid}")
        out[p + "self_attn.v_proj.weight"] = ((cfg.kv_size, h), f"{kv}, {hid}")
        out[p + "self_attn.o_proj.weight"] = ((h, cfg.q_size), f"{hid}, {q}")
        if cfg.attention_bias:
            out[p + "self_attn.q_proj.bias"] = ((cfg.q_size,), q)
            out[p + "self_attn.k_proj.bias"] = ((cfg.kv_size,), kv)
            out[p + "self_attn.v_proj.bias"] = ((cfg.kv_size,), kv)
        if cfg.qk_norm:
            out[p + "self_attn.q_norm.weight"] = ((d,), f"head_dim={d}")
            out[p + "self_attn.k_norm.weight"] = ((d,), f"head_dim={d}")
        out[p + "mlp.gate_proj.weight"] = ((inter, h), f"{inter_s}, {hid}")
        out[p + "mlp.up_proj.weight"] = ((inter, h), f"{inter_s}, {hid}")
        out[p + "mlp.down_proj.weight"] = ((h, inter), f"{hid}, {inter_s}")
        out[p + "input_layernorm.weight"] = ((h,), hid)
        out[p + "post_attention_layernorm.weight"] = ((h,), hid)
    out["model.norm.weight"] = ((h,), hid)
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = ((cfg.vocab_size, h), f"{vocab}, {hid}")
    return out


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model needs, by HF name, with its shape (in model order).

    ``lm_head.weight`` is left out when the config ties it to ``model.embed_tokens.weight``."""
    return {name: shape for name, (shape, _) in _expected(cfg).items()}


def weight_files(model_dir: str | Path) -> tuple[Path, dict[str, Path]]:
    """The file listing the weights (single file or shard index) and, by tensor name, the
    safetensors file holding each tensor."""
    model_dir = Path(model_dir)
    single = model_dir / SINGLE_FILE
    index = model_dir / INDEX_FILE
    if single.is_file():
        with _open(single) as f:
            return single, dict.fromkeys(f.keys(), single)
    if not index.is_file():
        raise CheckpointError(f"{model_dir}: no {SINGLE_FILE} or {INDEX_FILE}")
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        items = list(weight_map.items())
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{index}: not a valid shard index ({e!r})") from e
    files = {}
    for name, file in items:
        path = model_dir / file
        if not path.is_file():
            raise CheckpointError(
                f"{index}: weight_map names '{file}' for '{name}', which is missing"
            )
        files[name] = path
    return index, files


def load_state_dict(
    model_dir: str | Path,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    vision: bool = False,
) -> dict[str, torch.Tensor]:
    """Read the weights of ``model_dir`` by HF name, cast to ``dtype``, on ``device``.

    Every tensor of :func:`expected_shapes` must be present with that shape; other tensors
    are ignored (with a warning, except rotary ``inv_freq`` buffers and a tied ``lm_head``).
    The result holds exactly the expected tensors, in model order. A vision-language
    checkpoint's language model is read from where its layout stores it
    (:func:`~pastry.engine.vision.weight_name`); its other tensors are the image encoder's."""
    source, files = weight_files(Path(model_dir))
    if vision:
        layout = weight_layout(files)
        lm = {
            n: files[weight_name(n, layout)]
            for n in _expected(cfg)
            if weight_name(n, layout) in files
        }
        return read_weights(source, lm, cfg, dtype, device, lambda n: weight_name(n, layout))
    return read_weights(source, files, cfg, dtype, device)


def read_weights(
    source: Path,
    files: dict[str, Path],
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    stored: Callable[[str], str] | None = None,
) -> dict[str, torch.Tensor]:
    """:func:`load_state_dict` over ``files`` (tensor name -> safetensors file), which
    ``source`` (the file listing them, named in errors) describes; ``stored`` maps a name
    to the one its file has (default: the same)."""
    at = stored or (lambda n: n)
    expected = _expected(cfg)
    for name in expected:
        if name not in files:
            raise CheckpointError(_missing(source, at(name)))
    unexpected = sorted(
        n
        for n in files
        if n not in expected
        and not n.endswith(_IGNORED_SUFFIXES)
        and not (n == "lm_head.weight" and cfg.tie_word_embeddings)
    )
    if unexpected:
        log.warning(
            "%s: ignoring %d tensors the config does not use: %s",
            source,
            len(unexpected),
            ", ".join(unexpected[:5]) + (", ..." if len(unexpected) > 5 else ""),
        )
    by_file: dict[Path, list[str]] = {}
    for name in expected:
        by_file.setdefault(files[name], []).append(name)
    for path, names in by_file.items():  # check every header before reading any tensor
        with _open(path) as f:
            present = set(f.keys())
            for name in names:
                if at(name) not in present:
                    raise CheckpointError(
                        f"{path}: tensor '{at(name)}' is missing ({source.name} lists it here)"
                    )
                shape, why = expected[name]
                got = tuple(f.get_slice(at(name)).get_shape())
                if got != shape:
                    raise CheckpointError(
                        f"{path}: tensor '{at(name)}' has shape {got}, expected {shape} "
                        f"from config.json ({why})"
                    )
    loaded: dict[str, torch.Tensor] = {}
    for path, names in by_file.items():
        with _open(path, device) as f:
            for name in names:
                loaded[name] = f.get_tensor(at(name)).to(dtype)
    return {name: loaded[name] for name in expected}


def _open(path: Path, device: str | torch.device = "cpu") -> Any:
    try:
        return safe_open(path, framework="pt", device=str(device))
    except SafetensorError as e:
        raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from e


def _missing(source: Path, name: str) -> str:
    if name == "lm_head.weight":
        return (
            f"{source}: tensor 'lm_head.weight' is missing and config.json has "
            "tie_word_embeddings=false (set it to true if the model ties lm_head to the "
            "embedding)"
        )
    return f"{source}: tensor '{name}' is missing (expected from config.json)"


@dataclass(frozen=True, eq=False)
class Checkpoint:
    """A checkpoint (``path``: its directory, or its GGUF file) with its config and tokenizer;
    weights come from :meth:`load_state_dict`."""

    path: Path
    config: ModelConfig
    tokenizer: Tokenizer
    name: str
    # a vision-language checkpoint's image half
    vision: VisionSpec | None = dataclasses.field(default=None, kw_only=True)

    def load_state_dict(
        self, dtype: torch.dtype, device: str | torch.device = "cpu"
    ) -> dict[str, torch.Tensor]:
        """:func:`load_state_dict` of this checkpoint (its language model)."""
        return load_state_dict(self.path, self.config, dtype, device, self.vision is not None)


def load_hf_checkpoint(model_dir: str | Path) -> Checkpoint:
    """Read ``config.json``, the tokenizer and ``generation_config.json`` of ``model_dir``.

    BOS/EOS ids: ``generation_config.json`` wins, then ``config.json``, then the tokenizer's
    ``bos_token`` / ``eos_token``. The name is ``_name_or_path`` or the directory name."""
    model_dir = Path(os.path.abspath(model_dir))  # keeps a symlinked directory's own name
    config_file = model_dir / "config.json"
    if not config_file.is_file():
        ModelConfig.from_file(config_file)  # (raises: says what a checkpoint needs)
    raw = _read_json(config_file)
    vision = vision_spec(raw, str(config_file))
    cfg = ModelConfig.from_dict(language_config(raw, str(config_file)), source=str(config_file))
    tokenizer = Tokenizer.from_dir(model_dir)
    if tokenizer.vocab_size > cfg.vocab_size:
        raise CheckpointError(
            f"{model_dir / 'tokenizer.json'}: has token ids up to {tokenizer.vocab_size - 1}, "
            f"but config.json has vocab_size={cfg.vocab_size}"
        )
    gen_file = model_dir / "generation_config.json"
    gen = _read_json(gen_file) if gen_file.is_file() else {}
    bos = _first(gen.get("bos_token_id"), cfg.bos_token_id, tokenizer.bos_token_id)
    eos = _ids(gen.get("eos_token_id"), gen_file) or cfg.eos_token_ids or tokenizer.eos_token_ids
    name = cfg.name or model_dir.name
    cfg = dataclasses.replace(
        cfg,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(int(i) for i in eos),
        name=name,
    )
    return Checkpoint(path=model_dir, config=cfg, tokenizer=tokenizer, name=name, vision=vision)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


def _ids(value: Any, source: Path) -> tuple[int, ...]:
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) for v in values):
        raise CheckpointError(f"{source}: eos_token_id must be an int or a list of ints")
    return tuple(values)
