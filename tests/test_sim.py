"""The scheduling simulator (pastry.sched.sim) with the real policy objects; workloads."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pastry.control.policies import Atlas, Fcfs, Levels, Mlfq, Plas
from pastry.sched.datasets import complete_records
from pastry.sched.programs import CallSpec, ProgramSpec, Stage
from pastry.sched.sim import CostModel, SimConfig, Simulator, simulate
from pastry.sched.srpt import Srpt
from pastry.sched.systems import system_named
from pastry.sched.workloads import Knobs, Scale, make

# Autellix Fig. 2: batch size 2, time in decode steps, all programs at t=0, each call's
# successor arrives the moment it ends.
TOY = {"A": (4, 3, 1, 1), "B": (3, 3, 4), "C": (1, 2), "D": (4,)}
UNIT = SimConfig(max_batch=2, max_batch_tokens=None, cost=CostModel.unit())


def toy() -> list[ProgramSpec]:
    return [
        ProgramSpec(name, 0.0, tuple(Stage((CallSpec(0, d),)) for d in steps))
        for name, steps in TOY.items()
    ]


def test_figure_2_fcfs_waits_18_and_plas_beats_mlfq():
    fcfs = simulate(Fcfs(), toy(), UNIT)
    assert fcfs.total_wait == 18.0 and fcfs.steps == 14 and fcfs.completed
    levels = Levels((2.0, 4.0))
    mlfq = simulate(Mlfq(levels), toy(), UNIT)
    plas = simulate(Plas(levels), toy(), UNIT)
    srpt = simulate(lambda sim: Srpt(sim.remaining_steps), toy(), UNIT)
    assert (mlfq.total_wait, plas.total_wait, srpt.total_wait) == (15.0, 13.0, 7.0)
    assert srpt.total_wait < plas.total_wait < mlfq.total_wait < fcfs.total_wait
    # every policy ran every step of every call (a step holds one or two of them)
    for r in (mlfq, plas, srpt):
        assert [p.tokens for p in r.programs] == [sum(s) for s in TOY.values()]
        assert 13 <= r.steps <= 26 and r.completed


def test_systems_by_name_run_the_toy_example():
    """The benchmarks' names for systems: FCFS and SRPT give the toy's known waits, every
    other name a system that runs every program to the end."""
    assert simulate(system_named("fcfs"), toy(), UNIT).total_wait == 18.0
    assert simulate(system_named("srpt"), toy(), UNIT).total_wait == 7.0
    for name in ("mlfq", "plas", "atlas", "vllm"):
        r = simulate(system_named(name), toy(), UNIT)
        assert r.completed and [p.tokens for p in r.programs] == [sum(s) for s in TOY.values()]


def test_the_simulator_keeps_the_process_table_consistent():
    sim = Simulator(Atlas(), SimConfig(max_batch=4, cost=CostModel.unit()))
    progs = make("mixed", 12, rate=0.05, seed=3, scale=Scale(tokens=16, max_calls=12))
    result = sim.run(progs)
    assert result.completed and len(result.programs) == 12
    sim.table.check_integrity()
    assert sim.table.programs() == []  # every program ended
    assert all(p.finish >= p.arrival and p.latency > 0 for p in result.programs)
    tokens = sum(p.tokens for p in result.programs)
    assert tokens == sum(p.decode_tokens for p in progs)


def test_a_time_limit_leaves_programs_unfinished():
    progs = make("sharegpt", 20, rate=100.0, seed=1, scale=Scale(tokens=4))
    cfg = SimConfig(max_batch=2, cost=CostModel.unit(), max_time_s=50.0)
    result = simulate(Fcfs(), progs, cfg)
    assert not result.completed and result.summary()["completed"] < 20


def test_parallel_stages_wait_for_all_their_threads():
    spec = ProgramSpec(
        "lats", 0.0, (Stage((CallSpec(0, 3), CallSpec(0, 1)), 5.0), Stage((CallSpec(0, 1),)))
    )
    r = simulate(Fcfs(), [spec], SimConfig(max_batch=8, cost=CostModel.unit()))
    assert r.programs[0].finish == 3 + 5 + 1  # the slow thread, the interrupt, the last call


def test_multi_step_passes_run_each_call_up_to_n_steps_and_cost_every_step():
    # A: one call of 10 steps from t=0; B: one call of 3 steps arriving at t=1. With a pass
    # of 4 steps, B waits for A's first pass to end (t=4), then runs in A's second pass.
    a = ProgramSpec("a", 0.0, (Stage((CallSpec(0, 10),)),))
    b = ProgramSpec("b", 1.0, (Stage((CallSpec(0, 3),)),))
    unit = SimConfig(max_batch=8, cost=CostModel.unit())
    every = simulate(Fcfs(), [a, b], unit)
    assert [p.finish for p in every.programs] == [10.0, 4.0] and every.steps == 10
    multi = simulate(Fcfs(), [a, b], SimConfig(max_batch=8, cost=CostModel.unit(),
                                               steps_per_schedule=4))  # fmt: skip
    assert [p.finish for p in multi.programs] == [10.0, 8.0]  # B's result at its pass's end
    assert multi.steps == 3  # passes
    # each step of a pass is costed with the calls still in it (per sequence here)
    per_seq = CostModel(0.0, 1.0, 0.0, 0.0)
    r = simulate(Fcfs(), [a, b], SimConfig(max_batch=8, cost=per_seq, steps_per_schedule=4))
    assert [p.finish for p in r.programs] == [4 + 3 * 2 + 1 + 2, 4 + 3 * 2 + 1]
    with pytest.raises(ValueError, match="steps_per_schedule"):
        SimConfig(steps_per_schedule=0)


def test_a_measured_window_stops_the_run_when_its_programs_are_done():
    progs = [ProgramSpec(str(i), float(i), (Stage((CallSpec(0, 5),)),)) for i in range(10)]
    cfg = SimConfig(max_batch=1, cost=CostModel.unit(), measure=(2.0, 4.0))
    r = simulate(Fcfs(), progs, cfg)
    assert [p.arrival for p in r.measured] == [2.0, 3.0] and r.completed
    assert r.end_time == 20.0  # FCFS one at a time: program 3 ends at 20, the rest never run
    assert [p.finish is None for p in r.programs] == [False] * 4 + [True] * 6
    assert r.summary()["programs"] == 2


def test_synthetic_workloads_have_the_paper_s_shapes():
    for name, calls, out in (("sharegpt", 6.66, 277), ("bfcl", 10.75, 34), ("lats", 160, 73)):
        progs = make(name, 300, rate=2.0, seed=0)
        mean_calls = np.mean([p.num_calls for p in progs])
        mean_out = sum(p.decode_tokens for p in progs) / sum(p.num_calls for p in progs)
        assert mean_calls == pytest.approx(calls, rel=0.25), name
        assert mean_out == pytest.approx(out, rel=0.35), name
    gaps = np.diff([p.arrival for p in make("mixed", 2000, rate=4.0, seed=0)])
    assert np.mean(gaps) == pytest.approx(0.25, rel=0.1)
    assert {p.workload for p in make("mixed", 60, rate=1.0)} == {"sharegpt", "bfcl", "lats"}


def test_scaling_keeps_ratios_and_caps_programs():
    scale = Scale(tokens=16, time=0.1, max_calls=10, max_context=300)
    for p in make("mixed", 50, rate=1.0, seed=2, scale=scale, knobs=Knobs(think_s=1.0)):
        assert p.num_calls <= 10 or len(p.stages) == 1
        assert all(s.interrupt_s <= 10.0 for s in p.stages)
    with pytest.raises(ValueError, match="unknown workload 'chat'"):
        make("chat", 1, 1.0)


def test_program_specs_round_trip_through_json():
    spec = make("lats", 1, rate=1.0, seed=4)[0]
    back = ProgramSpec.from_json(spec.to_json(), spec.arrival)
    assert back == spec


def test_a_cut_off_json_array_is_read_up_to_its_last_complete_record():
    records = [{"id": i, "conversations": [{"from": "human", "value": "x" * i}]} for i in range(3)]
    text = json.dumps(records, indent=2)
    cut = text[: text.index('"id": 2') + 5]
    assert [r["id"] for r in complete_records(cut)] == [0, 1]
    assert [r["id"] for r in complete_records(text)] == [0, 1, 2]
    assert list(complete_records("[")) == []
