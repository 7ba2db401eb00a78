"""What ``--ray-engine-resources`` and ``--ray-placement`` ask for, checked: the Ray
resource bundle of each engine and the placement group's strategy. Plain data and
validation, no Ray import (``ServerConfig`` checks its flags with it;
:mod:`pastry.server.ray_engines` places the engines)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

STRATEGIES = ("SPREAD", "STRICT_SPREAD", "PACK", "STRICT_PACK")
"""Ray's placement-group strategies: SPREAD (distinct nodes where they fit, else shared),
STRICT_SPREAD (distinct nodes or not at all), PACK (as few nodes as fit), STRICT_PACK
(one node)."""
DEFAULT_BUNDLE: Mapping[str, float] = {"CPU": 1.0}


def parse_engine_resources(text: str) -> dict[str, float]:
    """One ``--ray-engine-resources`` value: a JSON object of Ray resources, e.g.
    ``{"CPU": 2, "pastry_host_a": 1}``, as the bundle of one engine (``CPU`` defaults to
    1). Raises :class:`ValueError` saying what is wrong."""
    flag = "--ray-engine-resources"
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag}: not JSON ({e.msg}): {text!r}; e.g. '{{\"CPU\": 2}}'") from None
    if not isinstance(value, dict) or not value:
        raise ValueError(
            f"{flag}: want a non-empty JSON object of resource amounts, e.g. "
            f'\'{{"CPU": 2, "pastry_host_a": 1}}\', got {text!r}'
        )
    return check_bundle(value)


def check_bundle(bundle: Mapping[str, Any]) -> dict[str, float]:
    """``bundle`` with ``CPU`` filled in (1), or :class:`ValueError` naming the bad entry:
    names are non-empty strings, amounts finite numbers > 0, ``CPU`` a whole number (the
    engine's threads); ``GPU`` is refused (engines under Ray run on CPU)."""
    flag = "--ray-engine-resources"
    out: dict[str, float] = {}
    for name, amount in bundle.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"{flag}: a resource name must be a non-empty string, got {name!r}")
        if isinstance(amount, bool) or not isinstance(amount, int | float):
            raise ValueError(f"{flag}: {name!r} must be a number, got {amount!r}")
        if not (math.isfinite(amount) and amount > 0):
            raise ValueError(f"{flag}: {name!r} must be > 0, got {amount!r}")
        out[name] = float(amount)
    if "GPU" in out:
        raise ValueError(f"{flag}: engines placed by Ray run on CPU; a GPU bundle is not served")
    cpus = out.setdefault("CPU", DEFAULT_BUNDLE["CPU"])
    if cpus != int(cpus):
        raise ValueError(
            f"{flag}: 'CPU' is the engine's cores (its torch threads): a whole number >= 1, "
            f"got {cpus:g}"
        )
    return out


def engine_bundles(resources: Sequence[Mapping[str, float]], n: int) -> list[dict[str, float]]:
    """The bundle of each of ``n`` engines: ``resources`` given once is every engine's,
    ``n`` times engine ``i``'s; none is :data:`DEFAULT_BUNDLE` each."""
    if not resources:
        return [dict(DEFAULT_BUNDLE) for _ in range(n)]
    if len(resources) == 1:
        return [check_bundle(resources[0]) for _ in range(n)]
    if len(resources) != n:
        raise ValueError(
            f"--ray-engine-resources given {len(resources)} times for --engines {n}: give it "
            "once (every engine's) or once per engine (in rank order)"
        )
    return [check_bundle(r) for r in resources]


def check_strategy(strategy: str) -> str:
    if strategy not in STRATEGIES:
        raise ValueError(
            f"--ray-placement must be one of {', '.join(STRATEGIES)}, got {strategy!r}"
        )
    return strategy
