"""The cluster simulator (pastry.sched.cluster): the real router programs and schedulers
over simulated engines, prefix caches and links."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pastry.control.policies import schedule_policy
from pastry.sched import workloads
from pastry.sched.cluster import ClusterConfig, Network, PrefixCache, Seg, simulate_cluster
from pastry.sched.programs import CallSpec, ProgramSpec, Stage
from pastry.sched.sim import CostModel, SimConfig, simulate

ROUTERS = ("round-robin", "least-loaded", "locality", "pd", "pd-balance:0.2", "migrate")


def _no_prefix(specs: list[ProgramSpec]) -> list[ProgramSpec]:
    return [replace(s, shared_prefix=0) for s in specs]


@pytest.mark.parametrize(
    "workload,policy",
    [("sharegpt", "fcfs"), ("sharegpt", "plas"), ("sharegpt", "atlas"), ("lats", "fcfs")],
)
def test_one_engine_is_the_single_engine_simulator(workload, policy):
    """One engine whose cache holds everything, page size 1: each call's history is
    cached, so it computes what the single-engine simulator's held context computes (one
    token more, the last output, which the step cost here does not see): the same
    batches, the same finish times. (LATS under PLAS/ATLAS differs: a cluster call is a
    context of its own, a thread per call, not a fork held for the stage.)"""
    specs = _no_prefix(workloads.make(workload, 25, 0.5, seed=2))
    cost = CostModel(0.01, 0.001, 0.0, 0.0)
    one = simulate(schedule_policy(policy), specs,
                   SimConfig(max_batch=16, max_batch_tokens=None, cost=cost))  # fmt: skip
    cluster = simulate_cluster(specs, ClusterConfig(
        engines=1, schedule=policy, max_batch=16, max_batch_tokens=None, cost=cost,
        page_size=1, kv_tokens=10**9))  # fmt: skip
    assert cluster.completed and one.completed
    assert cluster.steps == one.steps
    assert [p.finish for p in cluster.programs] == [p.finish for p in one.programs]


def _one_request(prompt: int, out: int) -> list[ProgramSpec]:
    return [ProgramSpec("x", 0.0, (Stage((CallSpec(prompt, out),)),))]


COST = CostModel(0.01, 0.0, 1e-5, 0.0)
NET = Network(bandwidth_b_s=1e9, latency_s=0.001, layers=4, kv_bytes_per_token=1000)


def _expected_pd(sent: int, decode_prefill: int, out: int) -> tuple[float, float]:
    """First token and finish of one request under P/D: the prefill engine computes
    ``sent`` tokens, sent layer by layer as they are computed; the decode engine prefills
    ``decode_prefill`` and then decodes one token per step."""
    compute = COST.step(1, sent)
    wire = sent * NET.kv_bytes_per_token / NET.bandwidth_b_s
    landed = max(compute / NET.layers + wire, compute + wire / NET.layers) + NET.latency_s
    first = landed + COST.step(1, decode_prefill)
    return first, first + (out - 1) * COST.step(1, 1)


@pytest.mark.parametrize("router,sent", [("pd", 2999), ("pd-balance:0.2", 2400)])
def test_pd_times_one_request_from_its_prefill_transfer_and_decode(router, sent):
    cfg = ClusterConfig(engines=2, router=router, cost=COST, network=NET, page_size=1)
    r = simulate_cluster(_one_request(3000, 10), cfg)
    first, finish = _expected_pd(sent, 3000 - sent, 10)
    (p,) = r.programs
    assert p.first_token == pytest.approx(first, rel=1e-12)
    assert p.finish == pytest.approx(finish, rel=1e-12)
    assert r.stats["transfers"] == 1 and r.stats["sent_tokens"] == sent
    assert r.stats["generations"] == [0, 1]  # engine 0 only prefills
    dp = simulate_cluster(_one_request(3000, 10), replace(cfg, router="round-robin")).programs[0]
    assert dp.first_token == pytest.approx(COST.step(1, 3000))
    assert dp.finish == pytest.approx(COST.step(1, 3000) + 9 * COST.step(1, 1))


def test_a_link_carries_one_transfer_at_a_time():
    # the link's time, not the compute, bounds a transfer behind another on the same link
    assert NET.pipelined_end(0.0, 0.0, 1000, link_free=0.5) == pytest.approx(0.5 + 1e-3 + 1e-3)
    # bandwidth-bound: the first layer's compute, then the whole transfer
    assert NET.pipelined_end(0.0, 0.0004, 1000, 0.0) == pytest.approx(0.0001 + 0.001 + 0.001)
    # compute-bound: the prefill, then one layer's transfer
    assert NET.pipelined_end(0.0, 0.4, 1000, 0.0) == pytest.approx(0.4 + 0.00025 + 0.001)
    two = [ProgramSpec("x", 0.0, (Stage((CallSpec(2000, 1),)),)) for _ in range(2)]
    slow = replace(NET, bandwidth_b_s=1e8)  # 20 ms per request on the wire
    r = simulate_cluster(two, ClusterConfig(engines=2, router="pd", cost=COST, network=slow,
                                            page_size=1, max_batch_tokens=None))  # fmt: skip
    firsts = sorted(p.first_token for p in r.programs)
    assert firsts[1] - firsts[0] == pytest.approx(1999 * 1000 / 1e8, rel=1e-6)


def test_locality_pins_a_programs_long_calls_to_one_engine():
    """With threshold 0 every call of a program goes to its engine, where its history is
    cached: each later call computes only its new input and the last output token."""
    specs = _no_prefix(workloads.make("sharegpt", 40, 2.0, seed=3))
    cfg = ClusterConfig(engines=4, router="locality:0", page_size=1, kv_tokens=10**9)
    r = simulate_cluster(specs, cfg)
    expected = sum(
        st.calls[0].prefill + (1 if i else 0) for s in specs for i, st in enumerate(s.stages)
    )
    assert r.completed and r.stats["computed_tokens"] == expected
    rr = simulate_cluster(specs, replace(cfg, router="round-robin"))
    assert rr.stats["computed_tokens"] > expected
    assert r.summary()["avg_latency"] < rr.summary()["avg_latency"]


@pytest.mark.parametrize("router", ROUTERS)
def test_every_router_serves_every_program(router):
    specs = workloads.make("sharegpt", 60, 6.0, seed=4)
    r = simulate_cluster(specs, ClusterConfig(engines=4, router=router, steps_per_schedule=4))
    assert r.completed and not any(p.failed for p in r.programs)
    s = r.stats
    assert s["calls"] == sum(p.num_calls for p in specs)
    if router.startswith("pd"):
        assert s["transfers"] == s["calls"] and s["generations"][0] == 0
    elif router == "migrate":
        assert s["transfers"] > 0
    else:
        assert s["transfers"] == 0


def test_xpyd_prefills_on_the_first_p_engines():
    specs = [ProgramSpec("x", i * 0.01, (Stage((CallSpec(1000, 20),)),)) for i in range(40)]
    r = simulate_cluster(specs, ClusterConfig(engines=5, router="pd:2"))
    gens = r.stats["generations"]
    assert gens[:2] == [0, 0] and sum(gens) == 40 and min(gens[2:]) > 0
    with pytest.raises(RuntimeError, match="pd:0"):
        simulate_cluster(specs, ClusterConfig(engines=5, router="pd:0"))


def test_prefix_cache_matches_whole_pages_and_evicts_least_recently_used():
    now = [0.0]
    cache = PrefixCache(capacity=64, page_size=16, clock=lambda: now[0])
    a, b, c = Seg(1, 40), Seg(100, 30), Seg(200, 30)
    cache.insert((a,), 40)
    assert cache.match((a, b), 70) == 32  # 40 cached: two whole pages
    assert cache.match((a,), 20) == 16  # at most the limit, in pages
    now[0] = 1.0
    cache.insert((b,), 30)  # 70 > 64: the least recently used (a) goes
    assert cache.tokens == 30 and cache.match((a,), 40) == 0 and cache.match((b,), 30) == 16
    now[0] = 2.0
    cache.insert((c,), 20)  # a partial piece counts what it holds
    assert cache.tokens == 50 and cache.match((c,), 30) == 16
    cache.insert((c,), 30)  # grows to 60
    assert cache.tokens == 60
