"""The serving process's collector settings (pastry.control.gc_tuning)."""

from __future__ import annotations

import gc

import pytest

from pastry.control.gc_tuning import YOUNG_THRESHOLD, GcSettings, restore, tune_for_serving


@pytest.fixture
def clean_gc():
    """Run with nothing frozen (a server test may have frozen the heap: thawing it only
    makes later collections scan more) and the thresholds put back afterwards."""
    gc.unfreeze()
    thresholds = gc.get_threshold()
    yield thresholds
    gc.set_threshold(*thresholds)
    gc.unfreeze()


def test_tune_freezes_raises_the_young_threshold_and_restores(clean_gc):
    gc.set_threshold(700, 11, 12)
    before = tune_for_serving()
    assert before == GcSettings((700, 11, 12), 0)
    assert gc.get_threshold() == (YOUNG_THRESHOLD, 11, 12)
    assert gc.get_freeze_count() > 0
    assert gc.get_count()[0] < 100  # collected just before freezing
    restore(before)
    assert gc.get_threshold() == (700, 11, 12)
    assert gc.get_freeze_count() == 0


def test_tune_takes_a_custom_threshold_and_keeps_earlier_freezes(clean_gc):
    gc.freeze()
    frozen = gc.get_freeze_count()
    before = tune_for_serving(5000)
    # frozen objects can still die by reference counting (other tests' threads run on):
    # the count may only have dropped, never to zero
    assert 0 < before.frozen <= frozen
    assert gc.get_threshold()[0] == 5000
    restore(before)  # the permanent generation cannot thaw in part: all stays frozen
    assert gc.get_threshold() == clean_gc
    assert gc.get_freeze_count() >= frozen


@pytest.mark.parametrize("bad", [0, -5, 1.5, "100"])
def test_bad_threshold_names_the_value(bad, clean_gc):
    with pytest.raises(ValueError, match="young_threshold must be a positive integer"):
        tune_for_serving(bad)
    assert gc.get_threshold() == clean_gc
    assert gc.get_freeze_count() == 0
