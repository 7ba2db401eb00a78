"""Weights on huge pages (engine/hugepages.py): which ranges are collapsed, and that
collapsing keeps the memory's contents."""

from __future__ import annotations

import ctypes
import mmap

import numpy as np
import pytest

from pastry.engine import hugepages
from pastry.engine.hugepages import added, collapse, huge_pages


def test_added_ranges_are_new_regions_and_grown_tails():
    before = {0x1000: 0x3000, 0x10000: 0x20000, 0x30000: 0x38000}
    after = {0x1000: 0x5000, 0x10000: 0x20000, 0x30000: 0x34000, 0x40000: 0x50000}
    assert added(before, after) == [(0x3000, 0x5000), (0x40000, 0x50000)]
    assert added(after, after) == []


def test_collapse_keeps_contents():
    size = 8 << 20
    mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    data = np.frombuffer(mm, dtype=np.int64)
    data[:] = np.arange(len(data))
    addr = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    done = collapse([(addr, addr + size)])
    if done == 0:
        del data
        mm.close()
        pytest.skip("this kernel does not collapse memory into huge pages (Linux >= 6.1 with THP)")
    assert done >= 2 << 20  # at least the whole 2 MiB pages inside the mapping
    assert np.array_equal(data, np.arange(len(data)))
    del data
    mm.close()


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("PASTRY_HUGE_PAGES", "0")
    monkeypatch.setattr(hugepages, "collapse", lambda ranges: pytest.fail("collapsed"))
    with huge_pages():
        pass
