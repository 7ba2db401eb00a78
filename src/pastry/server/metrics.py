"""Prometheus metrics at ``GET /metrics`` (``prometheus_client``'s text format).

- ``pastry_requests_total{endpoint, status}``, ``pastry_prompt_tokens_total{endpoint}``,
  ``pastry_generation_tokens_total{endpoint}``: the OpenAI endpoints' requests and tokens;
- ``pastry_inferlets_running`` (live instances) and ``pastry_inferlets_waiting`` (of them,
  those with commands queued for the engine, not yet in a batch), per model;
- ``pastry_batch_size`` (queues served by one engine batch) and
  ``pastry_engine_step_seconds`` (one batch, dispatch to results) histograms, per model;
- ``pastry_kv_pages_used`` / ``pastry_kv_pages_free``, per model;
- ``pastry_time_to_first_token_seconds{endpoint}`` and
  ``pastry_inter_token_latency_seconds{endpoint}``: from a request's arrival to its first
  sampled token, and between consecutive sampled tokens of one sequence (one queue);
- ``pastry_engine_restarts_total{engine}`` (engine processes lost and restarted,
  ``server/supervisor.py``) and ``pastry_engine_up{engine}`` (1 while it serves);
- what the dashboard shows (``docs/dashboard.md``): ``pastry_programs{state, level}``,
  ``pastry_kv_pages{engine, owner}``, ``pastry_prefix_cache_pages{engine}``,
  ``pastry_prefix_cache_prompt_tokens_total{engine}``,
  ``pastry_prefix_cache_hit_tokens_total{engine}`` and
  ``pastry_prefix_cache_evictions_total{engine}``.

Batch and token timings come from the batch scheduler's observers
(:attr:`~pastry.control.scheduler.BatchScheduler.observers`), installed by :func:`install`
when the server starts; the gauges are read when scraped.
"""

from __future__ import annotations

import collections
import time
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from pastry.control.commands import Stage
from pastry.server.dashboard_state import engine_name, program_facts

if TYPE_CHECKING:
    from pastry.server.running import RunningServer

REGISTRY = CollectorRegistry()
_LATENCY = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

REQUESTS = Counter(
    "pastry_requests", "OpenAI API requests", ["endpoint", "status"], registry=REGISTRY
)
PROMPT_TOKENS = Counter(
    "pastry_prompt_tokens", "Prompt tokens of answered requests", ["endpoint"], registry=REGISTRY
)
GENERATION_TOKENS = Counter(
    "pastry_generation_tokens", "Generated tokens of answered requests", ["endpoint"],
    registry=REGISTRY,
)  # fmt: skip
BATCH_SIZE = Histogram(
    "pastry_batch_size", "Queues served by one engine batch", ["model"],
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512), registry=REGISTRY,
)  # fmt: skip
STEP_SECONDS = Histogram(
    "pastry_engine_step_seconds", "Engine batch time, dispatch to results", ["model"],
    buckets=_LATENCY, registry=REGISTRY,
)  # fmt: skip
TTFT = Histogram(
    "pastry_time_to_first_token_seconds", "Request arrival to its first sampled token",
    ["endpoint"], buckets=_LATENCY, registry=REGISTRY,
)  # fmt: skip
ITL = Histogram(
    "pastry_inter_token_latency_seconds", "Between consecutive sampled tokens of a sequence",
    ["endpoint"], buckets=_LATENCY, registry=REGISTRY,
)  # fmt: skip

ENGINE_RESTARTS = Counter(
    "pastry_engine_restarts", "Engine processes lost (exited, killed, hung) and restarted",
    ["engine"], registry=REGISTRY,
)  # fmt: skip


def engine_restarted(engine: str) -> None:
    ENGINE_RESTARTS.labels(engine).inc()


# instance id -> the clock of the request it serves
_clocks: weakref.WeakValueDictionary[int, RequestClock] = weakref.WeakValueDictionary()


class RequestClock:
    """Token timings of one request's instances (:meth:`watch` each one)."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.start = time.perf_counter()
        self.first: float | None = None
        self.last: dict[int, float] = {}  # queue id -> time of its last token
        self.instances: list[int] = []

    def watch(self, instance: int) -> None:
        _clocks[instance] = self
        self.instances.append(instance)

    def token(self, qid: int, now: float) -> None:
        if self.first is None:
            self.first = now
            TTFT.labels(self.endpoint).observe(now - self.start)
        prev = self.last.get(qid)
        if prev is not None:
            ITL.labels(self.endpoint).observe(now - prev)
        self.last[qid] = now

    def close(self) -> None:
        for iid in self.instances:
            if _clocks.get(iid) is self:
                del _clocks[iid]


def request_done(endpoint: str, status: int, usage: dict | None = None) -> None:
    REQUESTS.labels(endpoint, str(status)).inc()
    if usage:
        PROMPT_TOKENS.labels(endpoint).inc(usage["prompt_tokens"])
        GENERATION_TOKENS.labels(endpoint).inc(usage["completion_tokens"])


def _observer(model: str):
    sizes, steps = BATCH_SIZE.labels(model), STEP_SECONDS.labels(model)

    def observe(batch, elapsed: float) -> None:
        now = time.perf_counter()
        sizes.observe(len({id(c.queue) for c in batch}))
        steps.observe(elapsed)
        if not _clocks:
            return
        for c in batch:
            if c.end_stage == Stage.OUTPUT and c.queue is not None:
                clock = _clocks.get(c.queue.instance)
                if clock is not None:
                    clock.token(c.queue.qid, now)

    return observe


class _Gauges:
    """Read at scrape time from the server installed last."""

    def __init__(self) -> None:
        self.server: weakref.ReferenceType[RunningServer] | None = None

    def collect(self) -> Iterator[GaugeMetricFamily]:
        server = self.server() if self.server is not None else None
        if server is None or server.controller is None:
            return
        running = GaugeMetricFamily("pastry_inferlets_running", "Live inferlet instances", labels=["model"])  # fmt: skip
        waiting = GaugeMetricFamily(
            "pastry_inferlets_waiting", "Instances with commands waiting for the engine",
            labels=["model"],
        )  # fmt: skip
        used = GaugeMetricFamily("pastry_kv_pages_used", "KV cache pages in use", labels=["model"])
        free = GaugeMetricFamily("pastry_kv_pages_free", "Free KV cache pages", labels=["model"])
        live = len(server.runtime.instances) if server.runtime is not None else 0
        for name, m in server.controller.models.items():
            running.add_metric([name], live)
            waiting.add_metric([name], len({q.instance for q in m.scheduler.queues if q.pending}))
            f, u, _ = m.resources.usage("kv")
            used.add_metric([name], u)
            free.add_metric([name], f)
        up = GaugeMetricFamily(
            "pastry_engine_up", "1 while an engine serves, 0 while it is down or restarting",
            labels=["engine"],
        )  # fmt: skip
        for m in server.controller.all_engines():
            up.add_metric([engine_name(m)], int(m.engine.alive))
        yield from (running, waiting, used, free, up)
        yield from _program_series(server)


def _program_series(server: RunningServer) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    """What the dashboard shows, as series: programs by state and level, KV pages by
    owner, the prefix cache's tokens, pages and evictions (``docs/dashboard.md``)."""
    controller = server.controller
    programs = GaugeMetricFamily(
        "pastry_programs", "Running inferlet instances by state (running, waiting, swapped) "
        "and scheduling level ('none': no call placed)", labels=["state", "level"],
    )  # fmt: skip
    counts: collections.Counter[tuple[str, str]] = collections.Counter()
    for iid in list(server.runtime.instances) if server.runtime is not None else []:
        facts = program_facts(controller, iid)
        level = facts["level"]
        counts[facts["state"], "none" if level is None else str(level)] += 1
    for (state, level), n in sorted(counts.items()):
        programs.add_metric([state, level], n)
    pages = GaugeMetricFamily(
        "pastry_kv_pages", "KV pages by owner: programs (handles and exports), cache (only "
        "the prefix cache keeps them), free; swapped: host pages in use", labels=["engine", "owner"],
    )  # fmt: skip
    cached = GaugeMetricFamily("pastry_prefix_cache_pages", "Pages in the prefix cache's tree", labels=["engine"])  # fmt: skip
    prompt = CounterMetricFamily("pastry_prefix_cache_prompt_tokens", "Prompt tokens prefilled through the prefix cache", labels=["engine"])  # fmt: skip
    hits = CounterMetricFamily("pastry_prefix_cache_hit_tokens", "Of them, taken from the cache", labels=["engine"])  # fmt: skip
    evicted = CounterMetricFamily("pastry_prefix_cache_evictions", "Pages evicted from the prefix cache", labels=["engine"])  # fmt: skip
    for m in controller.all_engines():
        name, res = engine_name(m), m.resources
        for owner, n in res.kv_owners().items():
            if owner != "total":
                pages.add_metric([name, owner], n)
        pages.add_metric([name, "swapped"], res.host_usage()[1])
        cached.add_metric([name], res.cached_pages())
        stats = m.prefiller.stats if m.prefiller is not None else None
        prompt.add_metric([name], stats.tokens if stats else 0)
        hits.add_metric([name], stats.cached_tokens if stats else 0)
        evicted.add_metric([name], res.cache_events["evicted"])
    yield from (programs, pages, cached, prompt, hits, evicted)


_GAUGES = _Gauges()
REGISTRY.register(_GAUGES)


def install(server: RunningServer) -> None:
    """Observe ``server``'s schedulers and read its gauges (call once it has started)."""
    _GAUGES.server = weakref.ref(server)
    for name, m in server.controller.models.items():
        m.scheduler.observers.append(_observer(name))


def routes() -> list[Route]:
    async def scrape(request: Request) -> Response:
        return Response(generate_latest(REGISTRY), media_type="text/plain; version=0.0.4")

    return [Route("/metrics", scrape, methods=["GET"])]
