"""Resource bookkeeping: exact ids, counts and order; errors leave state unchanged."""

from __future__ import annotations

import random

import numpy as np
import pytest

from pastry.control.resources import (
    ExportError,
    InvalidHandle,
    OutOfResources,
    PhysicalPool,
    QuotaExceeded,
    ResourceError,
    ResourceManager,
    TerminateNewest,
)

# ------------------------------------------------------------------------------ helpers


def snapshot(m: ResourceManager) -> tuple:
    """Everything observable about the manager's state."""
    tables = {
        kind: {inst: dict(t) for inst, t in m.handles.tables[kind].items()}
        for kind in ("kv", "embed")
    }
    counts = {
        kind: [m.refcount(kind, pid) for pid in range(m.usage(kind)[2])] for kind in ("kv", "embed")
    }
    return (
        m.instances(),
        tables,
        {k: dict(v) for k, v in m.handles.next.items()},
        counts,
        m.usage("kv"),
        m.usage("embed"),
        m.list_exports(),
        {i: sorted(n) for i, n in m.exports.by_instance.items()},
    )


class Recorder:
    """An ``on_terminate`` callback that ends the instance and records the calls."""

    def __init__(self) -> None:
        self.manager: ResourceManager | None = None
        self.calls: list[tuple[int, str]] = []

    def __call__(self, instance: int, reason: str) -> None:
        self.calls.append((instance, reason))
        assert self.manager is not None
        self.manager.remove_instance(instance)

    @property
    def ended(self) -> list[int]:
        return [i for i, _ in self.calls]


def manager(num_pages: int = 8, num_embeds: int = 4, instances=(1, 2), **kw) -> ResourceManager:
    rec = kw.pop("on_terminate", None)
    m = ResourceManager(num_pages, num_embeds, on_terminate=rec, **kw)
    if isinstance(rec, Recorder):
        rec.manager = m
    for i in instances:
        m.add_instance(i)
    return m


# ------------------------------------------------------------------------------ PhysicalPool


def test_pool_alloc_lowest_first_and_reuse() -> None:
    p = PhysicalPool(6)
    assert p.alloc(3) == [0, 1, 2]
    assert p.alloc(1) == [3]
    assert (p.free, p.used, p.size) == (2, 4, 6)
    assert p.decref([1, 2]) == [1, 2]
    assert p.alloc(2) == [1, 2]
    p.incref([0, 0])
    assert p.refcount(0) == 3
    assert p.decref([0]) == []
    assert p.decref([0, 0]) == [0]
    assert p.alloc(0) == []
    assert p.alloc(3) == [0, 4, 5]
    assert p.free == 0
    p.check_integrity()


def test_pool_errors_change_nothing() -> None:
    p = PhysicalPool(4)
    p.alloc(2)
    with pytest.raises(OutOfResources, match="cannot allocate 3 ids: 2 of 4 free"):
        p.alloc(3)
    assert (p.free, p.used) == (2, 2)
    with pytest.raises(ValueError, match=r"decref below zero for ids \[1\]"):
        p.decref([0, 1, 1])
    assert [p.refcount(i) for i in range(4)] == [1, 1, 0, 0]
    with pytest.raises(ValueError, match=r"not in use: \[2, 9\]"):
        p.incref([0, 2, 9])
    assert [p.refcount(i) for i in range(4)] == [1, 1, 0, 0]
    with pytest.raises(ValueError):
        p.alloc(-1)
    with pytest.raises(ValueError):
        PhysicalPool(-1)
    p.check_integrity()


def test_pool_integrity_detects_corruption() -> None:
    p = PhysicalPool(3)
    p.alloc(1)
    p._refcount[0] = 0  # neither free nor referenced
    with pytest.raises(AssertionError, match=r"free \(2\) \+ used \(0\) != size \(3\)"):
        p.check_integrity()
    p = PhysicalPool(3)
    p._refcount[1] = 1  # both free and referenced
    with pytest.raises(AssertionError, match=r"both free and referenced: \[1\]"):
        p.check_integrity()


# ------------------------------------------------------------------------------ handles


def test_alloc_translate_free_exact() -> None:
    m = manager()
    assert m.alloc(1, "kv", 3) == [0, 1, 2]
    assert m.alloc(2, "kv", 2) == [0, 1]
    assert m.alloc(1, "embed", 2) == [0, 1]
    assert m.translate(1, "kv", [0, 1, 2]) == [0, 1, 2]
    assert m.translate(2, "kv", [1, 0]) == [4, 3]
    assert m.translate(1, "embed", [1]) == [1]
    assert m.usage("kv") == (3, 5, 8)
    assert m.usage("embed") == (2, 2, 4)
    assert (m.held(1, "kv"), m.held(2, "kv"), m.held(1, "embed"), m.held(2, "embed")) == (
        3,
        2,
        2,
        0,
    )
    m.free(1, "kv", [1])
    assert m.usage("kv") == (4, 4, 8)
    # handles are never reused; the lowest physical id is
    assert m.alloc(1, "kv", 2) == [3, 4]
    assert m.translate(1, "kv", [0, 2, 3, 4]) == [0, 2, 1, 5]
    assert m.alloc(1, "kv", 0) == []
    m.check_integrity()


def test_translate_array() -> None:
    m = manager()
    m.alloc(1, "kv", 2)
    h = m.alloc(2, "kv", 3)
    out = m.translate_array(2, "kv", np.array([[2, 0], [1, 1]], dtype=np.int32))
    assert out.dtype == np.int64 and out.shape == (2, 2)
    assert out.tolist() == [[4, 2], [3, 3]]
    assert m.translate_array(2, "kv", np.array(h, dtype=np.int64)).tolist() == [2, 3, 4]
    assert m.translate_array(2, "kv", np.zeros(0, dtype=np.int64)).tolist() == []
    with pytest.raises(InvalidHandle, match="kv page handle 7 is not owned by this inferlet"):
        m.translate_array(2, "kv", np.array([0, 7]))


@pytest.mark.parametrize(
    ("op", "handles", "message"),
    [
        ("free", [0, 0], "kv page handle 0 is listed twice"),
        ("free", [1], "kv page handle 1 was freed"),
        ("free", [0, 1, 5], "kv page handle 1 was freed; kv page handle 5 is not owned"),
        ("free", [3], "kv page handle 3 is not owned by this inferlet"),
        ("free", [-1], "kv page handle -1 is not owned by this inferlet"),
        ("free", ["x"], "kv page handle 'x' is not an integer handle"),
        ("translate", [0, 1], "kv page handle 1 was freed"),
        ("translate", [9, 0, 8], "kv page handle 9 is not owned.*; kv page handle 8 is not"),
        ("export", [2, 1], "kv page handle 1 was freed"),
    ],
)
def test_invalid_handles_change_nothing(op: str, handles: list, message: str) -> None:
    m = manager()
    m.alloc(1, "kv", 3)  # handles 0, 1, 2 -> pages 0, 1, 2
    m.alloc(2, "kv", 5)  # inferlet 2 holds handles 0..4, so handle 3 is foreign to 1
    m.free(1, "kv", [1])
    before = snapshot(m)
    with pytest.raises(InvalidHandle, match=message) as e:
        if op == "free":
            m.free(1, "kv", handles)
        elif op == "translate":
            m.translate(1, "kv", handles)
        else:
            m.export(1, "kv", handles, "name")
    assert str(e.value).startswith("inferlet 1: ")
    assert snapshot(m) == before
    m.check_integrity()


def test_double_free_across_calls() -> None:
    m = manager()
    h = m.alloc(1, "kv", 2)
    m.free(1, "kv", h)
    before = snapshot(m)
    with pytest.raises(InvalidHandle, match="kv page handle 0 was freed; kv page handle 1 was"):
        m.free(1, "kv", h)
    assert snapshot(m) == before


def test_wrong_kind() -> None:
    m = manager()
    m.alloc(1, "kv", 2)
    before = snapshot(m)
    with pytest.raises(InvalidHandle, match=r"embed handle 1 is not owned .*kv page handles"):
        m.free(1, "embed", [1])
    with pytest.raises(InvalidHandle, match="embed handle 0 is not owned"):
        m.translate(1, "embed", [0])
    assert snapshot(m) == before
    with pytest.raises(ValueError, match="unknown resource kind 'gpu'"):
        m.alloc(1, "gpu", 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown resource kind 'gpu'"):
        m.translate(1, "gpu", [0])  # type: ignore[arg-type]
    assert snapshot(m) == before


def test_unknown_instance() -> None:
    m = manager()
    for call in (
        lambda: m.alloc(9, "kv", 1),
        lambda: m.free(9, "kv", [0]),
        lambda: m.translate(9, "kv", [0]),
        lambda: m.translate_array(9, "kv", np.array([0])),
        lambda: m.held(9, "kv"),
        lambda: m.import_(9, "kv", "x"),
        lambda: m.unexport(9, "x"),
    ):
        with pytest.raises(ResourceError, match="inferlet 9 is not registered") as e:
            call()
        assert type(e.value) is ResourceError
    with pytest.raises(ValueError, match="already registered"):
        m.add_instance(1)


def test_remove_instance_releases_everything_and_is_idempotent() -> None:
    m = manager()
    m.alloc(1, "kv", 3)
    m.alloc(1, "embed", 2)
    m.export(1, "kv", [0, 1], "tmp")
    m.export(1, "kv", [2], "keep", persistent=True)
    m.alloc(2, "kv", 1)
    m.remove_instance(1)
    assert m.instances() == [2]
    assert m.list_exports() == [("keep", "kv", 1)]
    assert m.usage("kv") == (6, 2, 8)  # page 2 (persistent) and inferlet 2's page 3
    assert m.usage("embed") == (4, 0, 4)
    assert [m.refcount("kv", p) for p in range(4)] == [0, 0, 1, 1]
    m.check_integrity()
    before = snapshot(m)
    m.remove_instance(1)
    m.remove_instance(42)
    assert snapshot(m) == before
    # a re-added id starts over with an empty handle space
    m.add_instance(1)
    assert m.held(1, "kv") == 0
    assert m.alloc(1, "kv", 1) == [0]
    assert m.translate(1, "kv", [0]) == [0]
    assert m.instances() == [2, 1]


# ------------------------------------------------------------------------------ export/import


def test_export_import_shares_by_refcount() -> None:
    m = manager(instances=(1, 2, 3))
    h = m.alloc(1, "kv", 3)  # pages 0, 1, 2
    m.export(1, "kv", [h[2], h[0]], "prefix")
    assert m.list_exports() == [("prefix", "kv", 2)]
    assert [m.refcount("kv", p) for p in range(3)] == [2, 1, 2]
    m.alloc(2, "kv", 1)  # handle 0 -> page 3
    assert m.import_(2, "kv", "prefix") == [1, 2]
    assert m.translate(2, "kv", [1, 2]) == [2, 0]
    assert m.import_(3, "kv", "prefix") == [0, 1]
    assert [m.refcount("kv", p) for p in range(4)] == [4, 1, 4, 1]
    assert m.usage("kv") == (4, 4, 8)
    # the exporter frees its handles: the shared pages stay, page 1 goes
    m.free(1, "kv", h)
    assert m.usage("kv") == (5, 3, 8)
    assert [m.refcount("kv", p) for p in range(4)] == [3, 0, 3, 1]
    assert m.translate(3, "kv", [0, 1]) == [2, 0]
    m.free(2, "kv", [1, 2])
    m.free(3, "kv", [0])
    assert [m.refcount("kv", p) for p in range(4)] == [2, 0, 1, 1]
    m.unexport(1, "prefix")
    assert m.list_exports() == []
    assert [m.refcount("kv", p) for p in range(4)] == [1, 0, 0, 1]
    m.free(3, "kv", [1])
    assert m.usage("kv") == (7, 1, 8)
    m.check_integrity()


def test_non_persistent_export_ends_with_exporter_imports_survive() -> None:
    m = manager()
    h = m.alloc(1, "embed", 2)
    m.export(1, "embed", h, "e")
    assert m.import_(2, "embed", "e") == [0, 1]
    m.remove_instance(1)
    assert m.list_exports() == []
    with pytest.raises(ExportError, match="no export named 'e'"):
        m.import_(2, "embed", "e")
    assert m.translate(2, "embed", [0, 1]) == [0, 1]  # the importer keeps them
    assert m.usage("embed") == (2, 2, 4)
    m.remove_instance(2)
    assert m.usage("embed") == (4, 0, 4)
    m.check_integrity()


def test_persistent_export_outlives_exporter() -> None:
    m = manager(instances=(1,))
    h = m.alloc(1, "kv", 2)
    m.export(1, "kv", h, "sys", persistent=True)
    m.remove_instance(1)
    assert m.list_exports() == [("sys", "kv", 2)]
    assert m.usage("kv") == (6, 2, 8)
    m.add_instance(5)
    assert m.import_(5, "kv", "sys") == [0, 1]
    assert m.translate(5, "kv", [0, 1]) == [0, 1]
    m.unexport(5, "sys")  # anyone may drop a persistent export
    assert m.translate(5, "kv", [0, 1]) == [0, 1]  # the importer keeps the pages alive
    assert m.usage("kv") == (6, 2, 8)
    m.free(5, "kv", [0, 1])
    assert m.usage("kv") == (8, 0, 8)
    m.check_integrity()


def test_export_errors_change_nothing() -> None:
    m = manager()
    m.alloc(1, "kv", 2)
    m.alloc(2, "embed", 1)
    m.export(1, "kv", [0], "a")
    m.export(2, "embed", [0], "b", persistent=True)
    before = snapshot(m)
    with pytest.raises(ExportError, match="'a' is already taken"):
        m.export(2, "embed", [0], "a")
    with pytest.raises(ExportError, match="non-empty string"):
        m.export(1, "kv", [1], "")
    with pytest.raises(ExportError, match="no export named 'zz'"):
        m.import_(2, "kv", "zz")
    with pytest.raises(ExportError, match="'a' holds KV pages, not embeds"):
        m.import_(2, "embed", "a")
    with pytest.raises(ExportError, match="belongs to inferlet 1"):
        m.unexport(2, "a")
    with pytest.raises(ExportError, match="no export named 'zz'"):
        m.unexport(1, "zz")
    assert snapshot(m) == before
    m.unexport(None, "a")  # the server may drop anything
    assert m.list_exports() == [("b", "embed", 1)]
    m.check_integrity()


# ------------------------------------------------------------------------------ FCFS


def test_fcfs_terminates_newest_first() -> None:
    rec = Recorder()
    m = manager(num_pages=12, instances=(1, 2, 3, 4), on_terminate=rec)
    m.alloc(1, "kv", 3)  # pages 0-2
    m.alloc(2, "kv", 3)  # 3-5
    m.alloc(3, "kv", 2)  # 6-7
    m.alloc(4, "kv", 2)  # 8-9; 2 free
    assert m.alloc(1, "kv", 5) == [3, 4, 5, 6, 7]  # needs 4 (3) and 3 (2)
    reason = (
        "terminated to free KV pages for inferlet 1 (FCFS policy: the newest inferlets end "
        "first): 5 KV pages needed, 2 free"
    )
    assert rec.calls == [(4, reason), (3, reason)]
    assert m.instances() == [1, 2]
    assert m.translate(1, "kv", [3, 4, 5, 6, 7]) == [6, 7, 8, 9, 10]
    assert m.usage("kv") == (1, 11, 12)
    m.check_integrity()


def test_fcfs_requester_newest_gets_out_of_resources() -> None:
    rec = Recorder()
    m = manager(num_pages=4, instances=(1, 2), on_terminate=rec)
    m.alloc(1, "kv", 2)
    m.alloc(2, "kv", 1)
    before = snapshot(m)
    with pytest.raises(OutOfResources) as e:
        m.alloc(2, "kv", 3)
    assert str(e.value) == (
        "cannot allocate 3 KV pages for inferlet 2: 1 of 4 free, inferlet 2 holds 1 (the FCFS "
        "policy: the newest inferlets end first chose inferlet 2 itself to give way). Free KV "
        "pages it no longer needs, or give the server more (num_pages)"
    )
    assert rec.calls == []
    assert snapshot(m) == before


def test_fcfs_middle_requester_short_terminates_nobody() -> None:
    rec = Recorder()
    m = manager(num_pages=6, instances=(1, 2, 3), on_terminate=rec)
    m.alloc(1, "kv", 3)
    m.alloc(2, "kv", 1)
    m.alloc(3, "kv", 1)
    before = snapshot(m)
    # 1 free + 1 from inferlet 3 < 4: inferlet 2 itself would be next, so nobody ends
    with pytest.raises(OutOfResources, match="chose inferlet 2 itself"):
        m.alloc(2, "kv", 4)
    assert TerminateNewest().choose_victims(m, "kv", 4, 2) == [3, 2]
    assert rec.calls == []
    assert snapshot(m) == before


def test_fcfs_counts_only_pages_that_would_be_freed() -> None:
    rec = Recorder()
    m = manager(num_pages=6, instances=(1, 2, 3, 4), on_terminate=rec)
    m.alloc(1, "kv", 2)  # pages 0-1
    m.export(1, "kv", [0, 1], "p")
    m.alloc(2, "kv", 2)  # pages 2-3
    m.import_(3, "kv", "p")  # 3 holds only pages shared with 1
    m.alloc(4, "kv", 1)  # page 4
    m.import_(4, "kv", "p")
    # 1 free; inferlet 4 frees page 4, inferlet 3 frees nothing, inferlet 2 frees 2 and 3
    policy = TerminateNewest()
    assert m.reclaimable("kv", [4]) == 1
    assert m.reclaimable("kv", [3, 4]) == 1
    assert m.reclaimable("kv", [1, 3, 4]) == 3  # pages 0, 1 (1's export ends too), 4
    assert policy.choose_victims(m, "kv", 2, 1) == [4]
    assert policy.choose_victims(m, "kv", 4, 1) == [4, 2]  # 3 frees nothing: it stays
    assert m.alloc(1, "kv", 4) == [2, 3, 4, 5]
    assert rec.ended == [4, 2]
    assert m.instances() == [1, 3]
    assert m.translate(1, "kv", [2, 3, 4, 5]) == [2, 3, 4, 5]
    m.check_integrity()


def test_shared_pages_count_once_all_sharers_are_chosen() -> None:
    m = manager(num_pages=3, instances=(1, 2, 3), on_terminate=Recorder())
    m.alloc(1, "kv", 1)
    m.alloc(2, "kv", 2)
    m.export(2, "kv", [0, 1], "x", persistent=True)
    m.import_(3, "kv", "x")
    m.unexport(2, "x")
    # pages 1-2 are shared by 2 and 3: neither alone frees anything, both together free two
    assert m.reclaimable("kv", [3]) == 0
    assert m.reclaimable("kv", [2]) == 0
    assert m.reclaimable("kv", [2, 3]) == 2
    assert TerminateNewest().choose_victims(m, "kv", 2, 1) == [3, 2]


def test_callback_that_does_not_remove_still_reclaims() -> None:
    calls = []
    m = manager(num_pages=2, on_terminate=lambda i, r: calls.append(i))
    m.alloc(1, "kv", 1)
    m.alloc(2, "kv", 1)
    assert m.alloc(1, "kv", 1) == [1]
    assert calls == [2]
    assert m.instances() == [1]
    m.check_integrity()


def test_callback_that_raises_still_reclaims() -> None:
    def boom(instance: int, reason: str) -> None:
        raise RuntimeError("cancel failed")

    m = manager(num_pages=2, on_terminate=boom)
    m.alloc(1, "kv", 1)
    m.alloc(2, "kv", 1)
    with pytest.raises(RuntimeError, match="cancel failed"):
        m.alloc(1, "kv", 1)
    assert m.instances() == [1]
    assert m.usage("kv") == (1, 1, 2)
    m.check_integrity()


def test_no_callback_no_termination() -> None:
    m = manager(num_pages=2)
    m.alloc(1, "kv", 1)
    m.alloc(2, "kv", 1)
    before = snapshot(m)
    with pytest.raises(OutOfResources, match="no terminate callback"):
        m.alloc(1, "kv", 1)
    assert snapshot(m) == before


class Fixed:
    def __init__(self, victims: list[int]) -> None:
        self.victims = victims

    def choose_victims(self, manager, kind, needed, requester) -> list[int]:
        return self.victims


def test_custom_policy_refuses_or_frees_too_little() -> None:
    rec = Recorder()
    m = manager(num_pages=4, instances=(1, 2, 3), policy=Fixed([]), on_terminate=rec)
    m.alloc(1, "kv", 1)
    m.alloc(2, "kv", 1)
    m.alloc(3, "kv", 2)
    with pytest.raises(OutOfResources, match="the Fixed chose no inferlet to end"):
        m.alloc(1, "kv", 1)
    m.policy = Fixed([2, 2, 99])  # duplicates and unknown ids are skipped
    with pytest.raises(OutOfResources, match=r"1 of 4 free.*still short after terminating .*\[2\]"):
        m.alloc(1, "kv", 2)
    assert rec.ended == [2]
    assert rec.calls[0][1].startswith("terminated to free KV pages for inferlet 1 (Fixed)")
    assert m.instances() == [1, 3]
    m.check_integrity()


def test_embed_contention() -> None:
    rec = Recorder()
    m = manager(num_embeds=4, instances=(1, 2), on_terminate=rec)
    m.alloc(1, "embed", 2)
    m.alloc(2, "embed", 2)
    m.alloc(2, "kv", 3)
    assert m.alloc(1, "embed", 1) == [2]
    assert rec.calls == [
        (
            2,
            "terminated to free embeds for inferlet 1 (FCFS policy: the newest inferlets end "
            "first): 1 embeds needed, 0 free",
        )
    ]
    assert m.usage("kv") == (8, 0, 8)
    m.check_integrity()


# ------------------------------------------------------------------------------ limits


def test_limit_caps_alloc_with_an_exact_error_and_changes_nothing() -> None:
    rec = Recorder()
    m = manager(num_pages=8, instances=(1, 2), on_terminate=rec)
    m.set_limit(2, "kv", 3, "SandboxLimits.max_kv_pages")
    assert m.limit(2, "kv") == 3 and m.limit(2, "embed") is None and m.limit(1, "kv") is None
    assert m.alloc(2, "kv", 2) == [0, 1]
    m.alloc(1, "kv", 5)  # the pool is full now: the limit is checked before any eviction
    before = snapshot(m)
    with pytest.raises(QuotaExceeded) as e:
        m.alloc(2, "kv", 2)
    assert str(e.value) == (
        "KV page quota exceeded: inferlet 2 holds 2, asked for 2 more, quota 3 (set by "
        "SandboxLimits.max_kv_pages). Free KV pages it no longer needs, or raise "
        "SandboxLimits.max_kv_pages"
    )
    assert isinstance(e.value, OutOfResources)
    assert snapshot(m) == before and rec.calls == []
    m.free(1, "kv", [2])
    assert m.alloc(2, "kv", 1) == [2]  # up to the limit is fine
    m.check_integrity()


def test_limit_caps_import_and_embeds() -> None:
    m = manager(num_pages=8, num_embeds=4, instances=(1, 2))
    m.export(1, "kv", m.alloc(1, "kv", 3), "ctx")
    m.set_limit(2, "kv", 2)
    before = snapshot(m)
    with pytest.raises(QuotaExceeded, match=r"^KV page quota exceeded: inferlet 2 holds 0, "
                       r"asked for 3 more, quota 2 \(set by set_limit\)"):  # fmt: skip
        m.import_(2, "kv", "ctx")
    assert snapshot(m) == before
    m.set_limit(2, "embed", 0, "the test")
    with pytest.raises(QuotaExceeded, match="embedding quota exceeded: inferlet 2 holds 0, "):
        m.alloc(2, "embed", 1)
    assert m.alloc(2, "embed", 0) == []
    m.set_limit(2, "kv", None)  # lifted
    assert m.import_(2, "kv", "ctx") == [0, 1, 2] and m.held(2, "kv") == 3
    m.check_integrity()


def test_limit_ends_with_its_instance_and_rejects_bad_values() -> None:
    m = manager(instances=(1,))
    m.set_limit(1, "kv", 1)
    m.remove_instance(1)
    m.check_integrity()
    m.add_instance(1)
    assert m.limit(1, "kv") is None and len(m.alloc(1, "kv", 4)) == 4
    with pytest.raises(ValueError, match="a limit must be a non-negative integer or None, got -1"):
        m.set_limit(1, "kv", -1)
    with pytest.raises(ValueError, match="unknown resource kind 'gpu'"):
        m.set_limit(1, "gpu", 1)
    with pytest.raises(ResourceError, match="inferlet 9 is not registered"):
        m.set_limit(9, "kv", 1)


# ------------------------------------------------------------------------------ randomized


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_ops_keep_integrity(seed: int) -> None:
    """A few thousand random operations, valid and not, against a shadow model."""
    rng = random.Random(seed)
    rec = Recorder()
    m = manager(num_pages=24, num_embeds=12, instances=(), on_terminate=rec)
    # shadow: (instance, kind) -> {handle: physical id}; exports: name -> (kind, ids, owner, p)
    live: dict[tuple[int, str], dict[int, int]] = {}
    next_id = 0
    errors = 0
    for step in range(3000):
        insts = m.instances()
        op = rng.choice(
            ["add", "remove", "alloc", "alloc", "free", "free", "bad", "export", "import", "unex"]
        )
        kind = rng.choice(["kv", "embed"])
        inst = rng.choice(insts) if insts else None
        before = snapshot(m)
        try:
            if op == "add" or inst is None:
                m.add_instance(next_id)
                live[(next_id, "kv")], live[(next_id, "embed")] = {}, {}
                next_id += 1
            elif op == "remove":
                m.remove_instance(inst)
            elif op == "alloc":
                n = rng.randint(0, 6)
                handles = m.alloc(inst, kind, n)
                assert len(handles) == n
                live[(inst, kind)].update(
                    zip(handles, m.translate(inst, kind, handles), strict=True)
                )
            elif op == "free":
                held = list(live[(inst, kind)])
                chosen = rng.sample(held, rng.randint(0, len(held)))
                m.free(inst, kind, chosen)
                for h in chosen:
                    del live[(inst, kind)][h]
            elif op == "bad":  # a freed, foreign or repeated handle among good ones
                held = list(live[(inst, kind)])
                bad = rng.choice([-1, m.handles.next[kind][inst], 10_000])
                if held and rng.random() < 0.5:
                    bad = held[0]
                    held = [*held, bad]
                else:
                    held.append(bad)
                with pytest.raises(InvalidHandle):
                    m.free(inst, kind, held)
                with pytest.raises(InvalidHandle):
                    m.translate(inst, kind, [*held[:-1], m.handles.next[kind][inst] + 1])
                assert snapshot(m) == before
            elif op == "export":
                held = list(live[(inst, kind)])
                chosen = rng.sample(held, rng.randint(0, len(held)))
                m.export(inst, kind, chosen, f"e{rng.randint(0, 5)}", rng.random() < 0.3)
            elif op == "import":
                names = [n for n, k, _ in m.list_exports() if k == kind] or ["none"]
                handles = m.import_(inst, kind, rng.choice(names))
                live[(inst, kind)].update(
                    zip(handles, m.translate(inst, kind, handles), strict=True)
                )
            else:
                names = [n for n, _, _ in m.list_exports()] or ["none"]
                m.unexport(rng.choice([inst, None]), rng.choice(names))
        except (OutOfResources, ExportError):
            errors += 1
            assert snapshot(m) == before, f"step {step}: failed {op} changed state"
        # ended instances (removed or terminated) drop out of the shadow
        for key in [k for k in live if k[0] not in m.users]:
            del live[key]
        m.check_integrity()
        for (i, k), table in live.items():
            assert m.held(i, k) == len(table)
            assert m.translate(i, k, list(table)) == list(table.values())
    assert rec.calls, "the run should have exercised eviction"
    assert errors > 0


def test_unused_persistent_exports_are_dropped_after_the_exports_changed() -> None:
    # The manager keeps the exports' reference counts between shortages while the set of
    # exports is the same: a drop followed by a new export must not reuse the old counts
    rm = ResourceManager(4, 0)
    for inst in (1, 2):
        rm.add_instance(inst)
    a = rm.alloc(1, "kv", 2)  # pages 0, 1
    rm.export(1, "kv", a, "a", persistent=True)
    rm.free(1, "kv", a)  # held by the export alone
    imported = rm.import_(2, "kv", "a")
    c = rm.alloc(2, "kv", 2)  # pages 2, 3: the device is full
    with pytest.raises(OutOfResources):  # "a" is in use: nothing to drop
        rm.alloc(2, "kv", 1)
    rm.free(2, "kv", imported)
    assert rm.translate(2, "kv", rm.alloc(2, "kv", 1)) == [0]  # "a" dropped for it
    assert [name for name, *_ in rm.list_exports()] == []
    rm.export(2, "kv", c, "b", persistent=True)  # one persistent export again (pages 2, 3)
    rm.free(2, "kv", c)
    got = rm.alloc(2, "kv", 3)  # 1 free page: "b" gives the other two
    assert sorted(rm.translate(2, "kv", got)) == [1, 2, 3]
    assert rm.list_exports() == []
    rm.check_integrity()
