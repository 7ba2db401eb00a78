"""The simulator's machine (pastry.sched.hardware), Pastry's KV memory under the real
resource manager and swapper, and the vLLM v0.6.1 baseline (pastry.sched.vllm): exact
small cases in unit-cost steps."""

from __future__ import annotations

import pytest

from pastry.control.policies import Fcfs, Plas
from pastry.control.policies.memory import MemoryAdmission
from pastry.sched.datasets import join_pieces
from pastry.sched.hardware import LLAMA31_8B_KV_BYTES, CostModel, KvMemory
from pastry.sched.programs import CallSpec, ProgramSpec, Stage
from pastry.sched.sim import PastryEngine, SimConfig, Simulator, simulate
from pastry.sched.vllm import Vllm
from pastry.sched.workloads import Scale, make

UNIT = CostModel.unit()


def one_thread(name: str, arrival: float, *calls: tuple[int, int], interrupt: float = 0.0):
    """A single-threaded program: one call (prefill, decode) per stage."""
    return ProgramSpec(name, arrival, tuple(Stage((CallSpec(p, d),), interrupt) for p, d in calls))


def test_the_a100_llama8b_machine():
    assert LLAMA31_8B_KV_BYTES == 2 * 32 * 8 * 128 * 2 == 128 * 1024
    mem = KvMemory.a100_llama8b()
    assert (mem.pages, mem.page_size, mem.host_pages) == (27669, 16, 572204)
    assert mem.page_bytes == 2 * 2**20 and mem.tokens == 27669 * 16
    assert mem.pages_for(16) == 1 and mem.pages_for(17) == 2 and mem.pages_for(0) == 0
    assert mem.swap_s(1000) == pytest.approx(1000 * 2**21 / 25e9)
    cost = CostModel.a100_llama8b()
    assert cost.step(1, 1) == pytest.approx(0.011 + 2e-5 + 6e-5)
    # attention reads the context: a full device adds ~36 ms to a step
    assert cost.step(1, 1, mem.tokens) - cost.step(1, 1) == pytest.approx(0.0363, abs=1e-3)
    with pytest.raises(ValueError, match="pages >= 1"):
        KvMemory(pages=0)


def test_vllm_runs_a_call_as_one_prefill_step_then_decode_steps():
    # two requests admitted together: one prefill step (first tokens), decode steps after
    specs = [one_thread("a", 0.0, (3, 4)), one_thread("b", 0.0, (2, 2))]
    r = simulate(Vllm(), specs, SimConfig(cost=UNIT))
    assert [p.finish for p in r.programs] == [4.0, 2.0]
    assert r.steps == 4 and r.stats["prefill_steps"] == 1 and r.stats["decode_steps"] == 3
    # an arrival during decoding pauses every running request for its prefill
    specs = [one_thread("a", 0.0, (1, 4)), one_thread("b", 0.5, (1, 1))]
    r = simulate(Vllm(), specs, SimConfig(cost=UNIT))
    assert [p.finish for p in r.programs] == [5.0, 2.0]


def test_vllm_prefills_the_whole_context_at_every_call_pastry_only_the_new_tokens():
    # root call (5 in, 3 out), then two calls on forks (2 in, 1 out each), then the root
    spec = ProgramSpec(
        "x",
        0.0,
        (
            Stage((CallSpec(5, 3),)),
            Stage((CallSpec(2, 1), CallSpec(2, 1)), fork=True),
            Stage((CallSpec(4, 2),)),
        ),
    )
    cfg = SimConfig(cost=UNIT, memory=KvMemory(pages=64, page_size=4, host_pages=64))
    vllm = simulate(Vllm(), [spec], cfg)
    pastry = simulate(Fcfs(), [spec], cfg)
    assert vllm.stats["prefill_tokens"] == 5 + 2 * (8 + 2) + (8 + 4)
    assert pastry.stats["prefill_tokens"] == 5 + 2 + 2 + 4
    # the same steps in unit time: 3, then 1 (both forks at once), then 2
    assert vllm.programs[0].finish == pastry.programs[0].finish == 6.0


def test_vllm_preempts_the_latest_request_and_recomputes_it():
    # 3 blocks of 2 tokens, no watermark; both prompts (2 tokens) fit, the decodes do not
    specs = [one_thread("a", 0.0, (2, 4)), one_thread("b", 0.0, (2, 4))]
    cfg = SimConfig(cost=UNIT, memory=KvMemory(pages=3, page_size=2))
    r = simulate(Vllm(watermark=0.0), specs, cfg)
    # step 1 prefills both; step 2: a takes the last block, b is preempted (3 tokens to
    # recompute); a decodes to the end (step 4), frees 3 blocks; b prefills its 3 tokens
    # again (step 5) and decodes two more (steps 6, 7)
    assert [p.finish for p in r.programs] == [4.0, 7.0]
    assert r.stats["preemptions"] == 1 and r.stats["recomputed_tokens"] == 3
    assert r.stats["prefill_tokens"] == 2 + 2 + 3
    assert (r.stats["prefill_steps"], r.stats["decode_steps"]) == (2, 5)


def test_vllm_fails_a_prompt_larger_than_the_device_and_rejects_a_bad_watermark():
    r = simulate(
        Vllm(), [one_thread("a", 0.0, (9, 1))], SimConfig(memory=KvMemory(pages=2, page_size=4))
    )
    assert r.programs[0].finish is None and "exceeds the device" in r.programs[0].failed
    with pytest.raises(ValueError, match="watermark"):
        Vllm(watermark=1.0)


def test_pastry_swaps_an_idle_program_out_and_back_in_exactly():
    # 4 device pages of 2 tokens, swapping a page costs 1 step. a (4 tokens, 2 pages) goes
    # into a tool call; b (6 tokens, then 1 more) needs 4 pages: a's pages go to the host
    # one per step; a's next call brings both back. (Without admission by memory, which
    # would keep b waiting while a is in memory, until nothing else can run: see below.)
    a = one_thread("a", 0.0, (4, 1), (1, 1), interrupt=10.0)
    b = one_thread("b", 1.0, (6, 2))
    mem = KvMemory(pages=4, page_size=2, host_pages=16, page_bytes=1, swap_bytes_per_s=1.0)
    cfg = SimConfig(cost=UNIT, memory=mem, share_prefix=False, admission=None)
    sim = Simulator(Plas(), cfg)
    r = sim.run([a, b])
    assert [p.finish for p in r.programs] == [14.0, 5.0]
    s = r.stats
    assert (s["pages_out"], s["pages_in"], s["swap_outs"], s["forced"]) == (2, 2, 2, 0)
    assert s["swap_s"] == 4.0
    engine = sim.engine
    assert isinstance(engine, PastryEngine) and engine.resources is not None
    engine.resources.check_integrity()
    assert engine.resources.usage("kv")[1] == 0  # every page came back to the pool
    sim.table.check_integrity()


def test_pastry_shares_a_workload_s_system_prompt_between_programs():
    first = ProgramSpec("w", 0.0, (Stage((CallSpec(3, 2),)),), shared_prefix=8)
    second = ProgramSpec("w", 5.0, (Stage((CallSpec(3, 2),)),), shared_prefix=8)
    mem = KvMemory(pages=32, page_size=4, host_pages=32)
    shared = simulate(Fcfs(), [first, second], SimConfig(cost=UNIT, memory=mem))
    alone = simulate(Fcfs(), [first, second], SimConfig(cost=UNIT, memory=mem, share_prefix=False))
    assert shared.stats["prefill_tokens"] == (8 + 3) + 3
    assert alone.stats["prefill_tokens"] == 2 * (8 + 3)
    assert [p.finish for p in shared.programs] == [2.0, 7.0]


def test_memory_pressure_keeps_every_program_and_the_books_exact():
    # a small device under the mixed workload (128 pages of 4 tokens; a thread holds up to
    # 150 tokens, the shared system prompts stay resident): programs are swapped out and
    # back, by force when nothing else can run, and none is lost
    scale = Scale(tokens=8, max_calls=12, max_context=150)
    progs = make("mixed", 16, rate=0.5, seed=5, scale=scale)
    mem = KvMemory(pages=128, page_size=4, host_pages=4096)
    for policy, steps in ((Fcfs(), 1), (Plas(), 1), (Plas(), 8)):
        cfg = SimConfig(max_batch=8, cost=UNIT, memory=mem, steps_per_schedule=steps)
        sim = Simulator(policy, cfg)
        r = sim.run(progs)
        assert r.completed, [p.failed for p in r.programs if p.failed]
        assert r.stats["pages_out"] == r.stats["pages_in"] > 0 and r.stats["forced"] > 0
        assert sum(p.tokens for p in r.programs) == sum(p.decode_tokens for p in progs)
        engine = sim.engine
        assert isinstance(engine, PastryEngine) and engine.resources is not None
        engine.resources.check_integrity()
        sim.table.check_integrity()
    v = simulate(Vllm(), progs, SimConfig(max_batch=8, cost=UNIT, memory=mem))
    assert v.completed and v.stats["preemptions"] > 0


def test_admission_by_memory_stops_plas_swapping_more_than_fcfs():
    # BFCL-like at memory saturation: ReAct programs (a shared tool-documentation prompt,
    # short calls, tool latencies) arriving while older ones are mid-work, on a device that
    # holds the system prompt and a few programs. PLAS serves new programs first; without
    # admission by memory they push out programs waiting mid-work, which then push back
    def react(t: float, calls: int) -> ProgramSpec:
        return ProgramSpec("bfcl", t, tuple(Stage((CallSpec(2, 2),), 1.0) for _ in range(calls)), 8)

    progs = [react(2.0 * i, 2 + 7 * i % 5) for i in range(8)]
    mem = KvMemory(pages=24, page_size=2, host_pages=256, page_bytes=1, swap_bytes_per_s=4.0)
    runs = {}
    for admission in (None, MemoryAdmission()):
        for policy in (Fcfs, Plas):
            cfg = SimConfig(cost=UNIT, memory=mem, max_batch=4, admission=admission)
            sim = Simulator(policy(), cfg)
            r = sim.run(progs)
            assert r.completed and r.stats["forced"] == 0
            engine = sim.engine
            assert isinstance(engine, PastryEngine) and engine.resources is not None
            engine.resources.check_integrity()
            s = r.summary()
            runs[admission is not None, policy.name] = (s["avg_latency"], s["pages_out"])
    (fcfs_lat, fcfs_out), (plas_lat, plas_out) = runs[False, "fcfs"], runs[False, "plas"]
    assert plas_out > fcfs_out and plas_lat > fcfs_lat  # the thrashing admission prevents
    (fcfs_lat, fcfs_out), (plas_lat_adm, plas_out_adm) = runs[True, "fcfs"], runs[True, "plas"]
    assert plas_out_adm <= fcfs_out and plas_lat_adm <= fcfs_lat
    assert plas_out_adm < plas_out and plas_lat_adm < plas_lat


def test_split_sharegpt_pieces_are_joined_in_order():
    def rec(rid: str, n: int) -> dict:
        return {"id": rid, "conversations": [{"from": "human", "value": "x " * n},
                                             {"from": "gpt", "value": "y " * n}]}  # fmt: skip

    convs = join_pieces([rec("a_1", 8), rec("b_0", 12), rec("a_0", 4), rec("c", 16)])
    assert convs == [[(2, 2), (4, 4)], [(6, 6)], [(8, 8)]]  # a_0 before a_1; a, b, c


def test_the_replay_inferlet_runs_a_spec_with_root_and_fork_stages(make_tiny):
    """The same ProgramSpec on the real engine: a root stage with a parallel call (one
    fork), then a stage of calls on forks only; every page is given back."""
    import asyncio
    import json
    from importlib import resources

    from inferlet_util import load_engine, result, run_all

    spec = ProgramSpec(
        "lats",
        0.0,
        (
            Stage((CallSpec(3, 2), CallSpec(2, 1))),
            Stage((CallSpec(2, 2), CallSpec(1, 3), CallSpec(2, 1)), 0.01, fork=True),
            Stage((CallSpec(1, 2),)),
        ),
        shared_prefix=5,
    )
    engine = load_engine(make_tiny("llama"))
    source = resources.files("pastry.sched").joinpath("replay.py").read_text()
    args = [spec.to_json(), "7", str(engine.info.vocab_size)]
    events, controller = asyncio.run(run_all(engine, [(source, args)]))
    assert json.loads(result(events[0])) == {"tokens": spec.decode_tokens} == {"tokens": 11}
    m = next(iter(controller.models.values()))
    m.resources.check_integrity()
    assert m.resources.referenced("kv") == 0  # (the prefix cache may keep some)
