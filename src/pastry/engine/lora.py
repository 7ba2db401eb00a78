"""LoRA adapters, applied per forward item so that items with different adapters share a batch.

An adapter is a directory as PEFT's ``save_pretrained`` writes it: ``adapter_config.json``
and ``adapter_model.safetensors`` with one ``lora_A`` ``[r, in]`` and ``lora_B`` ``[out, r]``
per adapted projection. A projection's output gains ``scale * (x @ A^T) @ B^T`` with
``scale = lora_alpha / r`` (``lora_alpha / sqrt(r)`` with ``use_rslora``).

The model fuses q/k/v and gate/up, so an adapter is stored per *site* (fused projection) of
each layer: the A matrices of the site's targets stacked into one ``[R, in]`` matrix, and one
``B`` ``[hi - lo, R]`` (block diagonal, scale folded in) that writes the output columns
``lo:hi`` its targets cover. A site costs two small matrix products per adapter in the batch.

Per forward, the engine groups the rows of the items that name an adapter by adapter and
enters :func:`use_adapters`; the model calls :func:`add_lora` after each projection. A batch
without adapter items enters no context and :func:`add_lora` returns at once: the base path
runs no extra tensor operation.
"""

from __future__ import annotations

import json
import math
import re
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open

from pastry.wire.config import CheckpointError, ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# The fused projections of a layer, in the order the model applies them.
SITES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
QKV, OUT, GATE_UP, DOWN = range(len(SITES))
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# PEFT options that change what the adapter computes at inference and that we do not run.
# Options that only matter for training or initialisation (dropout, init_lora_weights,
# loftq/eva/corda configs) are ignored.
_UNSUPPORTED = {
    "use_dora": "DoRA (weight-decomposed LoRA)",
    "lora_bias": "a bias on lora_B",
    "modules_to_save": "fully trained extra modules",
    "rank_pattern": "per-module ranks",
    "alpha_pattern": "per-module alphas",
    "exclude_modules": "excluded modules",
    "layer_replication": "layer replication",
    "trainable_token_indices": "trainable token embeddings",
    "target_parameters": "adapted parameters (not modules)",
    "alora_invocation_tokens": "activated LoRA",
    "use_qalora": "QA-LoRA",
    "use_bdlora": "BD-LoRA",
    "arrow_config": "Arrow routing",
    "velora_config": "VeLoRA",
    "kasa_config": "KaSA",
    "monteclora_config": "MonteCLoRA",
}
_TENSOR_NAME = re.compile(
    r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight"
)


@dataclass(frozen=True, slots=True, eq=False)
class SiteDelta:
    """One adapter's delta on one fused projection: ``y[:, lo:hi] += (x @ a^T) @ b^T``."""

    a: torch.Tensor  # [R, in]: the A of each target of the site, stacked
    b: torch.Tensor  # [hi - lo, R]: each target's B (times scale) in its rows and columns
    lo: int
    hi: int


@dataclass(frozen=True, eq=False)
class Adapter:
    """A LoRA adapter on the engine's device and dtype, laid out for the fused model."""

    name: str
    path: Path
    rank: int
    scale: float
    targets: tuple[str, ...]
    deltas: tuple[tuple[SiteDelta | None, ...], ...]  # [layer][site]; None: not adapted

    @classmethod
    def load(
        cls,
        path: str | Path,
        cfg: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        name: str | None = None,
    ) -> Adapter:
        """Read a PEFT LoRA directory for a model of config ``cfg``; raises
        :class:`CheckpointError` naming the file and field for anything it cannot use."""
        path = Path(path)
        if not path.is_dir():
            raise CheckpointError(f"{path}: not a directory (expected a PEFT LoRA adapter)")
        conf = _read_config(path / CONFIG_FILE)
        rank, scale, targets, layers = _parse_config(path / CONFIG_FILE, conf, cfg)
        weights = _read_weights(path / WEIGHTS_FILE, cfg, rank, targets, layers)
        layout = _layout(cfg)
        deltas = []
        for layer in range(cfg.num_layers):
            per_site = []
            for site in range(len(SITES)):
                parts = [
                    (layout[t], *weights[layer, t])
                    for t in TARGETS
                    if (layer, t) in weights and layout[t][0] == site
                ]
                per_site.append(_site_delta(parts, scale, dtype, device) if parts else None)
            deltas.append(tuple(per_site))
        return cls(
            name=name or path.name,
            path=path,
            rank=rank,
            scale=scale,
            targets=targets,
            deltas=tuple(deltas),
        )


def _layout(cfg: ModelConfig) -> dict[str, tuple[int, int, int, int]]:
    """target -> (site, first output column in the fused projection, out_features, in_features)."""
    h, q, kv, i = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    return {
        "q_proj": (QKV, 0, q, h),
        "k_proj": (QKV, q, kv, h),
        "v_proj": (QKV, q + kv, kv, h),
        "o_proj": (OUT, 0, h, q),
        "gate_proj": (GATE_UP, 0, i, h),
        "up_proj": (GATE_UP, i, i, h),
        "down_proj": (DOWN, 0, h, i),
    }


def _site_delta(parts, scale: float, dtype: torch.dtype, device: torch.device) -> SiteDelta:
    lo = min(col for (_, col, _, _), _, _ in parts)
    hi = max(col + out for (_, col, out, _), _, _ in parts)
    a = torch.cat([a for _, a, _ in parts]).to(device=device, dtype=dtype)
    b = torch.zeros(hi - lo, len(a), dtype=torch.float32)
    r0 = 0
    for (_, col, out, _), _, b_t in parts:
        r = b_t.shape[1]
        b[col - lo : col - lo + out, r0 : r0 + r] = b_t.float() * scale
        r0 += r
    return SiteDelta(a=a, b=b.to(device=device, dtype=dtype), lo=lo, hi=hi)


def _read_config(file: Path) -> dict[str, Any]:
    if not file.is_file():
        raise CheckpointError(f"{file}: missing (a PEFT adapter directory has {CONFIG_FILE})")
    try:
        conf = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file}: not valid JSON ({e})") from e
    if not isinstance(conf, dict):
        raise CheckpointError(f"{file}: expected a JSON object")
    return conf


def _parse_config(
    file: Path, conf: dict[str, Any], cfg: ModelConfig
) -> tuple[int, float, tuple[str, ...], tuple[int, ...]]:
    """(rank, scale, targets, adapted layers) of a validated ``adapter_config.json``."""
    _check_plain_lora(file, conf)
    rank, scale = _rank_and_scale(file, conf)
    return rank, scale, _targets(file, conf), _layers(file, conf, cfg)


def _check_plain_lora(file: Path, conf: dict[str, Any]) -> None:
    """:class:`CheckpointError` for an adapter that computes anything but plain LoRA."""
    peft_type = conf.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise CheckpointError(f"{file}: peft_type is {peft_type!r}; only LORA adapters load")
    for key, what in _UNSUPPORTED.items():
        if conf.get(key):
            raise CheckpointError(
                f"{file}: {key}={conf[key]!r:.80} ({what}) is not supported; "
                "only plain LoRA adapters load"
            )
    if conf.get("bias", "none") != "none":
        raise CheckpointError(
            f"{file}: bias={conf['bias']!r} is not supported (trained biases); need 'none'"
        )
    if conf.get("fan_in_fan_out", False):
        raise CheckpointError(
            f"{file}: fan_in_fan_out=true is for Conv1D (GPT-2) layers; need false"
        )


def _rank_and_scale(file: Path, conf: dict[str, Any]) -> tuple[int, float]:
    """``r`` and the delta's scale: ``lora_alpha / r`` (``/ sqrt(r)`` with ``use_rslora``)."""
    rank = conf.get("r")
    if type(rank) is not int or rank < 1:
        raise CheckpointError(f"{file}: r must be a positive integer, got {rank!r}")
    alpha = conf.get("lora_alpha", 8)
    if type(alpha) not in (int, float) or not math.isfinite(alpha):
        raise CheckpointError(f"{file}: lora_alpha must be a number, got {alpha!r}")
    scale = alpha / math.sqrt(rank) if conf.get("use_rslora", False) else alpha / rank
    return rank, scale


def _targets(file: Path, conf: dict[str, Any]) -> tuple[str, ...]:
    """``target_modules`` as a subset of :data:`TARGETS`, in their order."""
    raw = conf.get("target_modules")
    if raw == "all-linear":
        return TARGETS
    if isinstance(raw, list) and raw and all(isinstance(t, str) for t in raw):
        unknown = sorted(set(raw) - set(TARGETS))
        if unknown:
            raise CheckpointError(
                f"{file}: target_modules has {', '.join(map(repr, unknown))}; supported "
                f"targets are {', '.join(TARGETS)}"
            )
        return tuple(t for t in TARGETS if t in raw)
    raise CheckpointError(
        f"{file}: target_modules must be a non-empty list of module names (from "
        f"{', '.join(TARGETS)}) or 'all-linear', got {raw!r:.80}"
    )


def _layers(file: Path, conf: dict[str, Any], cfg: ModelConfig) -> tuple[int, ...]:
    """The adapted layers (``layers_to_transform``, else all), sorted."""
    chosen = conf.get("layers_to_transform")
    if chosen is None:
        return tuple(range(cfg.num_layers))
    chosen = [chosen] if type(chosen) is int else chosen
    if not isinstance(chosen, list) or not all(type(i) is int for i in chosen):
        raise CheckpointError(
            f"{file}: layers_to_transform must be an int or a list of ints, got {chosen!r}"
        )
    bad = [i for i in chosen if not 0 <= i < cfg.num_layers]
    if bad:
        raise CheckpointError(
            f"{file}: layers_to_transform names layer {bad[0]}, but the model has "
            f"{cfg.num_layers} layers"
        )
    return tuple(sorted(set(chosen)))


def _read_weights(
    file: Path,
    cfg: ModelConfig,
    rank: int,
    targets: tuple[str, ...],
    layers: tuple[int, ...],
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """``(layer, target) -> (A, B)`` on the CPU, every expected pair present and shaped."""
    tensors = _read_tensors(file)
    layout = _layout(cfg)
    found: dict[tuple[int, str, str], torch.Tensor] = {}
    for name, t in tensors.items():
        found[_check_tensor(file, name, t, layout, rank, targets, layers)] = t
    weights = {}
    for layer in layers:
        for target in targets:
            for which in "AB":
                if (layer, target, which) not in found:
                    raise CheckpointError(
                        f"{file}: tensor 'base_model.model.model.layers.{layer}."
                        f"{_block(layout, target)}.{target}."
                        f"lora_{which}.weight' is missing (expected from {CONFIG_FILE})"
                    )
            weights[layer, target] = (found[layer, target, "A"], found[layer, target, "B"])
    return weights


def _read_tensors(file: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the adapter's safetensors file, by name, on the CPU."""
    if not file.is_file():
        hint = ""
        if (file.parent / "adapter_model.bin").is_file():
            hint = (
                " (adapter_model.bin is a pickle, which is not loaded; re-save the adapter "
                "with save_pretrained(..., safe_serialization=True))"
            )
        raise CheckpointError(f"{file}: missing{hint}")
    try:
        with safe_open(file, framework="pt", device="cpu") as f:
            return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    except SafetensorError as e:
        raise CheckpointError(f"{file}: not a readable safetensors file ({e})") from e


def _block(layout: dict[str, tuple[int, int, int, int]], target: str) -> str:
    """The decoder-layer block (``self_attn`` or ``mlp``) a target projection is in."""
    return "self_attn" if layout[target][0] in (QKV, OUT) else "mlp"


def _check_tensor(
    file: Path,
    name: str,
    t: torch.Tensor,
    layout: dict[str, tuple[int, int, int, int]],
    rank: int,
    targets: tuple[str, ...],
    layers: tuple[int, ...],
) -> tuple[int, str, str]:
    """``(layer, target, "A" or "B")`` of tensor ``name``, checked against the config."""
    m = _TENSOR_NAME.fullmatch(name)
    if m is None:
        raise CheckpointError(
            f"{file}: tensor '{name}' is not a LoRA weight of a decoder-layer projection "
            "(expected base_model.model.model.layers.<i>.<self_attn|mlp>.<target>."
            "lora_<A|B>.weight)"
        )
    layer, block, target, which = int(m[1]), m[2], m[3], m[4]
    if target not in targets or layer not in layers:
        raise CheckpointError(
            f"{file}: tensor '{name}' adapts layer {layer} {target}, which "
            f"{CONFIG_FILE} does not target (target_modules / layers_to_transform)"
        )
    if block != _block(layout, target):
        raise CheckpointError(f"{file}: tensor '{name}': {target} is not under {block}")
    if not t.is_floating_point():
        raise CheckpointError(f"{file}: tensor '{name}' has dtype {t.dtype}, not a float")
    _, _, out, inp = layout[target]
    want = (rank, inp) if which == "A" else (out, rank)
    rank_dim = 0 if which == "A" else 1
    other = 1 - rank_dim
    if t.dim() == 2 and t.shape[other] == want[other] and t.shape[rank_dim] != rank:
        raise CheckpointError(
            f"{file}: tensor '{name}' has rank {t.shape[rank_dim]}, not r={rank} from {CONFIG_FILE}"
        )
    if tuple(t.shape) != want:
        dims = "[r, in_features]" if which == "A" else "[out_features, r]"
        raise CheckpointError(
            f"{file}: tensor '{name}' has shape {tuple(t.shape)}, expected {want} = {dims} "
            f"from r={rank} in {CONFIG_FILE} and the base model's config.json "
            "(is the adapter for another model?)"
        )
    return layer, target, which


# ---------------------------------------------------------------------------- per forward


@dataclass(slots=True)
class AdapterBatch:
    """Which rows of a forward each adapter applies to: a slice when they are contiguous."""

    groups: list[tuple[Adapter, slice | torch.Tensor]]


class _Local(threading.local):
    batch: AdapterBatch | None = None  # per thread: in-process engines each have their own


_local = _Local()


def plan_adapters(
    spans: Sequence[tuple[int, int, int]], adapters: Sequence[Adapter], device: torch.device
) -> AdapterBatch | None:
    """Group ``(row0, n, adapter id)`` spans (in row order) by adapter; None when empty."""
    if not spans:
        return None
    by_id: dict[int, list[tuple[int, int]]] = {}
    for row0, n, aid in spans:
        by_id.setdefault(aid, []).append((row0, n))
    groups: list[tuple[Adapter, slice | torch.Tensor]] = []
    for aid, ranges in by_id.items():
        if all(r0 == p0 + pn for (p0, pn), (r0, _) in pairwise(ranges)):
            rows: slice | torch.Tensor = slice(ranges[0][0], ranges[-1][0] + ranges[-1][1])
        else:
            idx = np.concatenate([np.arange(r0, r0 + n) for r0, n in ranges])
            rows = torch.from_numpy(idx).to(device)
        groups.append((adapters[aid], rows))
    return AdapterBatch(groups)


@contextmanager
def use_adapters(batch: AdapterBatch | None) -> Iterator[None]:
    """Apply ``batch``'s adapters in the forwards run inside (None: no adapter)."""
    _local.batch = batch
    try:
        yield
    finally:
        _local.batch = None


def add_lora(y: torch.Tensor, x: torch.Tensor, layer: int, site: int) -> torch.Tensor:
    """Add the deltas of the current batch's adapters to the output ``y`` of projection
    ``site`` of ``layer`` (input ``x``), in place; returns ``y``."""
    batch = _local.batch
    if batch is None:
        return y
    for adapter, rows in batch.groups:
        d = adapter.deltas[layer][site]
        if d is None:
            continue
        if isinstance(rows, slice) and x.dtype == y.dtype == d.a.dtype:
            y[rows, d.lo : d.hi].addmm_(F.linear(x[rows], d.a), d.b.t())
        elif isinstance(rows, slice):  # float32 activations over bf16 adapters
            delta = F.linear(F.linear(x[rows].to(d.a.dtype), d.a), d.b)
            y[rows, d.lo : d.hi] += delta.to(y.dtype)
        else:
            delta = F.linear(F.linear(x.index_select(0, rows).to(d.a.dtype), d.a), d.b)
            y[:, d.lo : d.hi].index_add_(0, rows, delta.to(y.dtype))
    return y
