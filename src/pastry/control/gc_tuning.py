"""Garbage-collector settings for a serving process: keep the control loop's cost flat.

Every inferlet step allocates a few dozen small container objects (commands, futures,
closures, the arrays' lists) that live until its batch completes. With CPython's default
thresholds (700, 10, 10) a young collection runs every 700 allocations; at hundreds of
inferlets a batch cycle spans many of them, so the in-flight objects of every step survive
into the oldest generation, and full collections, each rescanning every live object (the
inferlets' coroutines and contexts, the tokenizer, an in-process model), run again and
again. Measured on the stub-engine profile of ``benchmarks/overhead.py``: about a third of
the control layer's time at 512 inferlets and half at 1024, growing with the number of
inferlets.

:func:`tune_for_serving` is what the server does once its engines and controller exist:
collect once, *freeze* what is alive (``gc.freeze``: later collections skip it), and raise
the young generation's threshold so that a batch cycle's objects mostly die (by reference
counting) before a collection sees them. Cyclic garbage is still collected, in larger and
rarer young collections. :func:`restore` undoes it (for benchmarks and tests).
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

YOUNG_THRESHOLD = 100_000
"""Allocations between young collections while serving (CPython's default: 700)."""


@dataclass(frozen=True)
class GcSettings:
    """The collector's settings before :func:`tune_for_serving` changed them."""

    thresholds: tuple[int, int, int]
    frozen: int  # objects that were already in the permanent generation


def tune_for_serving(young_threshold: int = YOUNG_THRESHOLD) -> GcSettings:
    """Collect, freeze every live object out of later collections, and collect the young
    generation every ``young_threshold`` allocations (the older generations' thresholds
    stay). Returns the previous settings for :func:`restore`. Call it once the long-lived
    state exists (engines loaded, controller made); calling it again freezes what was
    created since."""
    if not isinstance(young_threshold, int) or young_threshold < 1:
        raise ValueError(
            f"young_threshold must be a positive integer (allocations between young "
            f"collections; CPython's default is 700), got {young_threshold!r}"
        )
    before = GcSettings(gc.get_threshold(), gc.get_freeze_count())
    gc.collect()
    gc.freeze()
    gc.set_threshold(young_threshold, *before.thresholds[1:])
    return before


def restore(settings: GcSettings) -> None:
    """Put the thresholds of ``settings`` back and thaw what :func:`tune_for_serving`
    froze. The permanent generation thaws only as a whole: if objects were frozen before
    (``settings.frozen > 0``), everything stays frozen."""
    gc.set_threshold(*settings.thresholds)
    if settings.frozen == 0:
        gc.unfreeze()
