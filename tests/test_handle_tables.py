"""The array-backed handle tables of the resource manager and batch translation.

A shadow dict model (what the tables were before they became arrays) is checked against
the manager after every operation of random sequences; batches of steps with bad handles
fail only those steps, with the same errors as before; tables grow, move and pack.
"""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest

import pastry.control.resources as resources
from pastry.api import ApiError
from pastry.control.resources import (
    ExportError,
    InvalidHandle,
    OutOfResources,
    ResourceError,
    ResourceManager,
)
from pastry.control.scheduler import Command, Stage
from pastry.control.steps import Embed, Step

# The translation paths: a Python loop (few handles), one take per run (few runs), one
# gather over all (many runs). Each test runs with every path forced.
PATHS = {
    "python": {"_SMALL": 10**9},
    "per-run": {"_SMALL": 0, "_FEW_RUNS": 10**9},
    "gather": {"_SMALL": 0, "_FEW_RUNS": 0},
    "default": {},
}


@pytest.fixture(params=list(PATHS))
def path(request, monkeypatch):
    for name, value in PATHS[request.param].items():
        monkeypatch.setattr(resources, name, value)
    monkeypatch.setattr(resources, "_MIN_CAP", 3)  # tables move often
    return request.param


RESERVED = "reserved"


class Model:
    """The tables as dicts: (instance, kind) -> handle -> physical id or RESERVED."""

    def __init__(self) -> None:
        self.tables: dict[tuple[int, str], dict[int, object]] = {}
        self.end: dict[tuple[int, str], int] = {}

    def add(self, inst: int, first: int) -> None:
        for kind in ("kv", "embed"):
            self.tables[(inst, kind)] = {}
            self.end[(inst, kind)] = first

    def give(self, inst: int, kind: str, handles: list[int], ids: list) -> None:
        assert handles == list(range(self.end[(inst, kind)], self.end[(inst, kind)] + len(ids)))
        self.tables[(inst, kind)].update(zip(handles, ids, strict=True))
        self.end[(inst, kind)] += len(ids)

    def bound(self, inst: int, kind: str) -> dict[int, int]:
        return {h: v for h, v in self.tables[(inst, kind)].items() if v != RESERVED}

    def reserved(self, inst: int, kind: str) -> list[int]:
        return [h for h, v in self.tables[(inst, kind)].items() if v == RESERVED]


def check(m: ResourceManager, model: Model, rng: random.Random) -> None:
    """The manager agrees with the model: integrity, every table, and batch translation
    of random runs (good and bad handles) over all instances."""
    m.check_integrity()
    assert {i for i, _ in model.tables} == set(m.instances())
    for inst, kind in model.tables:
        bound = model.bound(inst, kind)
        t = m._handles[kind][inst]
        assert dict(t) == bound and len(t) == m.held(inst, kind) == len(bound)
        assert t.end == model.end[(inst, kind)] and t.reserved == len(model.reserved(inst, kind))
        assert m.translate(inst, kind, list(bound)) == list(bound.values())
        for h in model.reserved(inst, kind):
            with pytest.raises(InvalidHandle, match=f"handle {h} is not filled yet"):
                m.translate(inst, kind, [h])
    # a batch: runs of random tables, each with good handles and maybe one bad one
    handles, keys, counts, want_bad, want = [], [], [], [], []
    for run in range(rng.randint(1, 12) if model.tables else 0):
        inst, kind = rng.choice(list(model.tables))
        bound = model.bound(inst, kind)
        hs = rng.choices(list(bound), k=rng.randint(0, 6)) if bound else []
        if rng.random() < 0.3 or not hs:
            end = model.end[(inst, kind)]
            freed = [h for h in range(m.first_handle, end) if h not in model.tables[(inst, kind)]]
            bad = rng.choice([end, end + 5, -1, m.first_handle - 1, 2**40, *freed[:3]])
            bad = rng.choice([bad, *model.reserved(inst, kind)[:1]])
            hs.insert(rng.randint(0, len(hs)), bad)
            want_bad.append(run)
        handles += hs
        keys += m._handles[kind][inst].key
        counts.append(len(hs))
        want += [bound.get(h, None) for h in hs]
    ints = [rng.randint(0, 99) for _ in range(rng.randint(0, 4))]
    arr, bad = m.translate_runs(handles, keys, counts, ints)
    assert arr.dtype == np.int64 and arr[: len(ints)].tolist() == ints
    assert bad == want_bad
    ids = arr[len(ints) :].tolist()
    at = 0
    for run, n in enumerate(counts):
        if run not in want_bad:
            assert ids[at : at + n] == want[at : at + n]
        at += n


@pytest.mark.parametrize("seed", range(4))
def test_tables_follow_a_dict_model_through_random_operations(path, seed: int) -> None:
    rng = random.Random(seed)
    m = ResourceManager(num_pages=40, num_embeds=16, num_host_pages=12, first_handle=seed * 7)
    model = Model()
    ended: set[int] = set()

    def on_terminate(inst: int, reason: str) -> None:
        ended.add(inst)
        m.remove_instance(inst)

    m.on_terminate = on_terminate
    next_inst = 0
    for _ in range(600):
        insts = m.instances()
        if not insts or rng.random() < 0.04:
            m.add_instance(next_inst, user=rng.choice(["a", "b"]))
            model.add(next_inst, m.first_handle)
            next_inst += 1
            continue
        inst, kind = rng.choice(insts), rng.choice(["kv", "embed"])
        bound, reserved = model.bound(inst, kind), model.reserved(inst, kind)
        op = rng.choice(
            ["alloc"] * 4 + ["free"] * 3 + ["reserve", "bind", "unbind", "unreserve", "export"]
            + ["import", "swap", "remove", "bad"]
        )  # fmt: skip
        try:
            if op == "alloc":
                hs = m.alloc(inst, kind, rng.randint(0, 5))
                model.give(inst, kind, hs, m.translate(inst, kind, hs))
            elif op == "free":
                chosen = rng.sample([*bound, *reserved], rng.randint(0, len(bound) + len(reserved)))
                m.free(inst, kind, chosen)
                for h in chosen:
                    del model.tables[(inst, kind)][h]
            elif op == "reserve":
                hs = m.reserve(inst, kind, rng.randint(0, 4))
                model.give(inst, kind, hs, [RESERVED] * len(hs))
            elif op == "bind" and reserved:
                chosen = rng.sample(reserved, rng.randint(1, len(reserved)))
                ids = m.bind_fresh(inst, kind, chosen)
                model.tables[(inst, kind)].update(zip(chosen, ids, strict=True))
            elif op == "unbind" and bound and kind == "embed":
                chosen = rng.sample(list(bound), rng.randint(1, len(bound)))
                m.unbind(inst, kind, chosen)
                model.tables[(inst, kind)].update(dict.fromkeys(chosen, RESERVED))
            elif op == "unreserve":
                chosen = rng.sample([*reserved, *bound], min(2, len(reserved) + len(bound)))
                m.unreserve(inst, kind, chosen)
                for h in chosen:
                    if h in reserved:
                        del model.tables[(inst, kind)][h]
            elif op == "export" and bound:
                chosen = rng.sample(list(bound), rng.randint(1, len(bound)))
                if all(bound[h] >= 0 for h in chosen):
                    m.export(inst, kind, chosen, f"x{rng.randint(0, 3)}", rng.random() < 0.5)
            elif op == "import":
                names = [n for n, k, _ in m.list_exports(m.user_of(inst)) if k == kind]
                if names:
                    hs = m.import_(inst, kind, rng.choice(names))
                    model.give(inst, kind, hs, m.translate(inst, kind, hs))
            elif op == "swap":
                before = dict(model.bound(inst, "kv"))
                if rng.random() < 0.5:
                    m.swap_out(inst, rng.randint(1, 4))
                else:
                    m.swap_in(inst)
                m.take_moves()
                after = dict(m._handles["kv"][inst])
                assert after.keys() == before.keys()  # same handles, maybe other pages
                assert m.handles_on_host(inst) == sum(1 for p in after.values() if p < 0)
                model.tables[(inst, "kv")].update(after)
            elif op == "remove":
                m.remove_instance(inst)
                ended.add(inst)
            elif op == "bad":
                bad = [*bound, model.end[(inst, kind)]]
                with pytest.raises(InvalidHandle, match="not owned by this inferlet"):
                    m.translate(inst, kind, bad)
                with pytest.raises(InvalidHandle):
                    m.free(inst, kind, bad)
        except (OutOfResources, ExportError):
            pass
        for i in ended:
            for kind in ("kv", "embed"):
                model.tables.pop((i, kind), None)
        ended.clear()
        check(m, model, rng)
    assert m._slots.tables and len(m._slots.tables) == 2 * len(m.instances())


def test_a_long_lived_table_slides_its_window_and_memory_stays_bounded(path) -> None:
    m = ResourceManager(num_pages=64, num_embeds=1)
    for inst in range(3):
        m.add_instance(inst)
    live: dict[int, list[int]] = {inst: [] for inst in range(3)}
    for i in range(3000):
        inst = i % 3
        live[inst] += m.alloc(inst, "kv", 1)
        if len(live[inst]) > 10:  # a sliding window of 10 pages per instance
            m.free(inst, "kv", [live[inst].pop(0)])
        if i % 250 == 0:
            m.check_integrity()
    m.check_integrity()
    for inst in range(3):
        t = m._handles["kv"][inst]
        assert t.end == 1000 and t.lo > 900  # the freed handles were left behind
        assert m.translate(inst, "kv", live[inst]) == [t[h] for h in live[inst]]
        with pytest.raises(InvalidHandle, match="kv page handle 0 was freed"):
            m.translate(inst, "kv", [0])
    assert len(m._slots.array) < 400  # not 3000 handles' worth


def test_dropped_tables_read_nothing_and_their_slots_are_reused(path) -> None:
    m = ResourceManager(num_pages=200, num_embeds=4)
    for round_ in range(20):
        for inst in range(4):
            m.add_instance(round_ * 4 + inst)
            m.alloc(round_ * 4 + inst, "kv", 9)
        key = m._handles["kv"][round_ * 4].key
        for inst in range(4):
            m.remove_instance(round_ * 4 + inst)
        assert m.translate_runs([0, 1, 2], list(key), [3], [])[1] == [
            0
        ]  # (the stale table's slots hold _NONE now)
        m.check_integrity()
    assert len(m._slots.array) < 400


# ------------------------------------------------------------------ batches of steps


def _manager() -> tuple[ResourceManager, dict[int, list[int]], dict[int, list[int]]]:
    m = ResourceManager(num_pages=300, num_embeds=40)
    kv, emb = {}, {}
    for inst in range(6):
        m.add_instance(inst)
    for inst in range(6):
        kv[inst] = m.alloc(inst, "kv", 3 + 9 * inst)
        emb[inst] = m.alloc(inst, "embed", 3)
    return m, kv, emb


def _step(loop, m: ResourceManager, inst: int, kv: list, emb: list) -> Command:
    s = Step(
        m, inst, [5], [7], [emb[0], emb[1]], kv, len(kv) - 1, 3, 2, (0.0, 0, 1.0, 0.0, None), {}
    )
    return Command(
        Stage.EMBED, tokens=1, last_stage=Stage.OUTPUT, batched=s, future=loop.create_future()
    )


def _bad_cases(m: ResourceManager, kv, emb) -> dict[str, tuple[int, list, list, str]]:
    """name -> (instance, kv handles, embed handles, the error translate gives)."""
    m.free(0, "kv", [kv[0][0]])
    (res0,) = m.reserve(1, "kv", 1)
    (eres,) = m.reserve(2, "embed", 1)
    m.free(3, "embed", [emb[3][2]])
    return {
        "freed": (0, kv[0], emb[0], f"kv page handle {kv[0][0]} was freed"),
        "reserved": (1, [*kv[1], res0], emb[1], f"kv page handle {res0} is not filled yet"),
        "foreign": (2, [*kv[2][:2], 40], emb[2][:2], "kv page handle 40 is not owned"),
        "embed reserved": (2, kv[2][:2], [emb[2][0], eres], f"embed handle {eres} is not filled"),
        "negative": (3, [-1, *kv[3][:2]], emb[3][:2], "kv page handle -1 is not owned"),
        "embed freed": (
            3,
            kv[3][:2],
            [emb[3][2], emb[3][0]],
            f"embed handle {emb[3][2]} was freed",
        ),
        "huge": (4, [2**70, *kv[4]], emb[4], f"kv page handle {2**70} is not owned"),
        "float": (5, [1.0, *kv[5]], emb[5], "kv page handle 1.0 is not an integer handle"),
    }


def test_a_batch_of_steps_translates_at_once_and_bad_handles_fail_only_their_steps(path) -> None:
    loop = asyncio.new_event_loop()
    m, kv, emb = _manager()
    cases = _bad_cases(m, kv, emb)
    cmds, expect = [], []
    for n, (i, k, e, msg) in enumerate(cases.values()):  # good steps between the bad ones
        good = n % 6
        cmds.append(_step(loop, m, good, kv[good][1:], emb[good][:2]))
        cmds.append(_step(loop, m, i, k, e))
        expect += [None, msg]
    failed = Step.prepare_batch(cmds)
    assert failed == [c for c, msg in zip(cmds, expect, strict=True) if msg is not None]
    for c, msg in zip(cmds, expect, strict=True):
        s = c.batched
        if msg is None:
            embed, forward, sample = c.call
            phys_kv = m.translate(s.instance, "kv", s.kv)
            phys_e = m.translate(s.instance, "embed", s.embeds)
            assert forward.ctx_pages.tolist() == phys_kv[:-1]
            assert forward.out_pages.tolist() == phys_kv[-1:]
            assert embed.out_embeds.tolist() == forward.in_embeds.tolist() == phys_e[:1]
            assert forward.out_embeds.tolist() == phys_e[1:] and sample.embed == phys_e[1]
            assert embed.tokens.tolist() == [5] and embed.positions.tolist() == [7]
            assert forward.ctx_last_len == 3 and forward.out_offset == 2
        else:
            assert c.call is None and not c.future.done()
            with pytest.raises(ApiError, match=msg.replace("(", r"\(").replace(".", r"\.")):
                s.prepare()  # what the scheduler then does: the error its caller sees
    # an ended instance's step and another manager's are left to prepare alone
    other, _, _ = _manager()
    m.remove_instance(5)
    alone = [_step(loop, m, 5, kv[5], emb[5][:2]), _step(loop, other, 1, kv[1], emb[1][:2])]
    assert Step.prepare_batch([*alone, cmds[0]]) == alone
    with pytest.raises(ApiError, match="inferlet 5 is not registered"):
        alone[0].batched.prepare()
    assert alone[1].batched.prepare()[1].ctx_pages.tolist() == other.translate(1, "kv", kv[1][:-1])
    loop.close()


def test_a_batch_of_embeds_translates_at_once_and_bad_handles_fail_only_their_embeds(path):
    loop = asyncio.new_event_loop()
    m, _, emb = _manager()
    m.free(2, "embed", [emb[2][1]])
    embeds = {inst: emb[inst][:2] for inst in range(6)}
    embeds[4] = [emb[4][0], 99]
    cmds = [
        Command(Stage.EMBED, tokens=2, batched=Embed(m, i, [3, 4], [0, 1], embeds[i]),
                future=loop.create_future())
        for i in range(6)
    ]  # fmt: skip
    assert Embed.prepare_batch(cmds) == [cmds[2], cmds[4]]
    for i, c in enumerate(cmds):
        if i in (2, 4):
            assert c.call is None
            with pytest.raises(ApiError, match="was freed" if i == 2 else "99 is not owned"):
                c.batched.prepare()
        else:
            assert c.call.out_embeds.tolist() == m.translate(i, "embed", embeds[i])
            assert c.call.tokens.tolist() == [3, 4] and c.call.positions.tolist() == [0, 1]
    loop.close()


def test_swapped_pages_translate_to_host_ids_in_a_batch(path) -> None:
    m = ResourceManager(num_pages=20, num_embeds=4, num_host_pages=20)
    m.add_instance(1)
    m.add_instance(2)
    pages = m.alloc(1, "kv", 12)
    other = m.alloc(2, "kv", 3)
    assert m.swap_out(1, 5) == 5
    m.take_moves()
    ids = m.translate(1, "kv", pages)
    assert sum(1 for p in ids if p < 0) == 5 and m.handles_on_host(1) == 5
    keys = [*m._handles["kv"][1].key, *m._handles["kv"][2].key]
    arr, bad = m.translate_runs([*pages, *other], keys, [12, 3], [])
    assert bad == [] and arr.tolist() == ids + m.translate(2, "kv", other)
    m.swap_in(1)
    assert min(m.translate(1, "kv", pages)) >= 0
    m.check_integrity()


def test_translate_runs_names_no_run_of_an_empty_batch_and_keeps_ints() -> None:
    m = ResourceManager(num_pages=2, num_embeds=2)
    m.add_instance(1)
    arr, bad = m.translate_runs([], [], [], [4, 5])
    assert arr.tolist() == [4, 5] and bad == []
    with pytest.raises(ResourceError, match="inferlet 2 is not registered"):
        m.translate(2, "kv", [0])
