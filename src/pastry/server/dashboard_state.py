"""What the dashboard shows, recorded: :class:`Recorder` (``server/dashboard.py`` serves it).

Programs as programs — who runs what, at which scheduling level, with how much attained
service and how many pages — the KV pool by owner, the prefix cache and each engine's pace.
A recorder per server:

- observes every engine's batches (the scheduler's observers, as ``/metrics`` does): the
  tokens each instance and each engine sampled, queues per batch, step time, each
  instance's time to its first token (from its start) and each later token's latency
  (from when it was asked for, or the queue's previous token if that came later: a
  program's own pauses between tokens are not the server's latency);
- samples every engine once a second into a ring of the last ten minutes
  (:meth:`Recorder.sample`): tokens/s, batch size, step time, time to first token and
  inter-token latency (median and p99 over the last minute), KV pages by owner, swapped
  pages, the prefix cache's hit rate, cached pages and evictions;
- answers :meth:`Recorder.snapshot` for one user: that user's programs only (an operator:
  everyone's), with the engines' series, which every user may see (as ``/metrics``).

Everything here is read on the server's event loop; nothing changes what it reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pastry.control.commands import Stage
from pastry.control.users import User

if TYPE_CHECKING:
    from pastry.control.controller import Controller
    from pastry.control.model import Model
    from pastry.runtime.trusted import Instance
    from pastry.server.running import RunningServer

HISTORY_POINTS = 600  # one a second: ten minutes
LATENCY_WINDOW_S = 60.0  # TTFT and ITL percentiles over the last minute
MAX_BATCHES = 4096  # batches whose latencies are kept per engine (the newest)


def engine_name(m: Model) -> str:
    return getattr(m.engine, "name", f"{m.name}/{m.rank}")


@dataclass
class EngineLog:
    """One engine's counters (cumulative, written by its observer) and its series."""

    model: str
    rank: int
    tokens: int = 0
    batches: int = 0
    queues: int = 0  # queues served, summed over batches
    step_s: float = 0.0
    # (when, latencies in seconds) per batch: time to first token, inter-token latency
    ttft: deque[tuple[float, list[float]]] = field(
        default_factory=lambda: deque(maxlen=MAX_BATCHES)
    )
    itl: deque[tuple[float, list[float]]] = field(default_factory=lambda: deque(maxlen=MAX_BATCHES))
    points: deque[dict] = field(default_factory=lambda: deque(maxlen=HISTORY_POINTS))
    seen: tuple = (0, 0, 0, 0.0, 0, 0, 0)  # the counters at the last sample


class Recorder:
    """The dashboard's memory of a running server (see the module docstring)."""

    def __init__(self, server: RunningServer, clock: Callable[[], float] = time.time) -> None:
        self.server = server
        self.clock = clock
        self.engines: dict[str, EngineLog] = {}
        self.tokens: dict[int, int] = {}  # instance -> tokens sampled
        self.first: dict[int, float] = {}  # instance -> when its first token came
        self._last: dict[int, tuple[float, int]] = {}  # id(queue) -> (its last token, instance)
        self._task: asyncio.Task | None = None
        self._sampled = asyncio.Event()

    # ------------------------------------------------------------------ recording

    def install(self) -> None:
        """Observe every engine's batches (once the server has started)."""
        for m in self.server.controller.all_engines():
            log = self.engines.setdefault(engine_name(m), EngineLog(m.name, m.rank))
            m.scheduler.observers.append(self._observer(log))

    def _observer(self, log: EngineLog):
        tokens, first, last = self.tokens, self.first, self._last
        instances = self.server.runtime.instances

        def observe(batch, elapsed: float) -> None:
            now, tick = self.clock(), time.perf_counter()
            queues = set()
            gaps: list[float] = []
            n = 0
            for c in batch:
                q = c.queue
                if q is None:
                    continue
                key = id(q)
                queues.add(key)
                if c.end_stage != Stage.OUTPUT:
                    continue
                n += 1
                iid = q.instance
                tokens[iid] = tokens.get(iid, 0) + 1
                prev = last.get(key)
                last[key] = (tick, iid)
                if prev is not None:  # from when it was asked for: not the program's pauses
                    gaps.append(tick - max(prev[0], c.created))
                elif iid not in first and (inst := instances.get(iid)) is not None:
                    first[iid] = now
                    log.ttft.append((now, [now - inst.started]))
            if gaps:
                log.itl.append((now, gaps))
            log.tokens += n
            log.batches += 1
            log.queues += len(queues)
            log.step_s += elapsed

        return observe

    def start(self) -> None:
        """Install the observers and sample once a second until :meth:`stop`."""
        self.install()

        async def run() -> None:
            while True:
                await asyncio.sleep(1.0)
                self.sample()

        self._task = asyncio.get_running_loop().create_task(run(), name="dashboard-sampler")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def next_sample(self) -> None:
        """Return once the next sample is taken."""
        await self._sampled.wait()

    def sample(self) -> None:
        """Add one point to every engine's series and forget instances that ended."""
        now = self.clock()
        for m in self.server.controller.all_engines():
            log = self.engines.get(engine_name(m))
            if log is not None:
                log.points.append(self._point(m, log, now))
        live = self.server.runtime.instances
        for table in (self.tokens, self.first):
            for iid in [i for i in table if i not in live]:
                del table[iid]
        tick = time.perf_counter()
        for key in [k for k, (t, i) in self._last.items() if i not in live or tick - t > 60]:
            del self._last[key]
        sampled, self._sampled = self._sampled, asyncio.Event()
        sampled.set()  # the events streams send this point

    def _point(self, m: Model, log: EngineLog, now: float) -> dict:
        stats = m.prefiller.stats if m.prefiller is not None else None
        asked, cached = (stats.tokens, stats.cached_tokens) if stats else (0, 0)
        res = m.resources
        evicted = res.cache_events["evicted"]
        counters = (log.tokens, log.batches, log.queues, log.step_s, asked, cached, evicted)
        d = [a - b for a, b in zip(counters, log.seen, strict=True)]
        dt = max(now - log.points[-1]["t"], 1e-3) if log.points else 1.0
        log.seen = counters
        host_free, host_used, host_total = res.host_usage()
        return {
            "t": round(now, 3),
            "tokens_s": round(d[0] / dt, 2),
            "batch": round(d[2] / d[1], 2) if d[1] else 0.0,
            "step_ms": round(1000 * d[3] / d[1], 3) if d[1] else None,
            **_percentiles("ttft", log.ttft, now),
            **_percentiles("itl", log.itl, now),
            "kv": res.kv_owners(),
            "host": {"swapped": host_used, "free": host_free, "total": host_total},
            "cache_hit": round(d[5] / d[4], 4) if d[4] else None,
            "prompt_tokens": d[4],  # prefilled this second, of which cached_tokens cached
            "cached_tokens": d[5],
            "cached_pages": res.cached_pages(),
            "evictions": d[6],
            "waiting": len({q.instance for q in m.scheduler.queues if q.pending}),
        }

    # ------------------------------------------------------------------ reading

    def visible(self, inst: Instance, user: User) -> bool:
        """Whether ``user`` sees (and may terminate) ``inst``: its own, or any for an
        operator."""
        return user.operator or inst.user == user.name

    def snapshot(self, user: User, health: list[dict], history: bool = False) -> dict:
        """What ``user`` sees now: its programs, the engines (their state from ``health``,
        ``supervisor.health``'s rows; their whole series when ``history``, else the latest
        point) and the router."""
        server = self.server
        states = {(h["model"], h["rank"]): h for h in health}
        engines = []
        for name, log in self.engines.items():
            h = states.get((log.model, log.rank), {})
            points = list(log.points) if history else list(log.points)[-1:]
            engines.append({
                "name": name, "model": log.model, "rank": log.rank,
                "state": h.get("state", "up"), "restarts": h.get("restarts", 0),
                "points": points,
            })  # fmt: skip
        programs = [
            self._row(inst) for inst in server.runtime.instances.values()
            if self.visible(inst, user)
        ]  # fmt: skip
        routing = server.controller.routing
        return {
            "now": round(self.clock(), 3),
            "user": user.name,
            "operator": user.operator,
            "models": list(server.controller.models),
            "router": {
                "name": routing.router_name or "round-robin",
                "routed": routing.routed,
                "fallback": routing.fallback,
            },
            "engines": engines,
            "programs": programs,
        }

    def _row(self, inst: Instance) -> dict:
        return {
            "id": inst.id,
            "name": inst.program.name,
            "user": inst.user,
            "runtime": "sandboxed" if inst.program.sandboxed else "trusted",
            "age_s": round(self.clock() - inst.started, 1),
            "tokens": self.tokens.get(inst.id, 0),
            **program_facts(self.server.controller, inst.id),
        }


def program_facts(controller: Controller, iid: int) -> dict:
    """Where instance ``iid`` stands: its scheduling level (None: no call placed), the
    attained service (engine seconds of its calls, the open ones included), the KV pages
    it is charged on every engine, how many of them are swapped to host memory, and its
    state: ``swapped`` (some pages on the host), ``waiting`` (commands queued for the
    engine, not yet in a batch) or ``running``."""
    p = controller.programs.program_of(iid)
    threads = p.threads if p is not None else []
    pages = swapped = 0
    for m in controller.all_engines():
        res = m.resources
        if res.registered(iid):
            pages += res.charged(iid, "kv")
            swapped += res.pages_on_host(iid)
    if swapped:
        state = "swapped"
    elif any(t.pending for t in threads):
        state = "waiting"
    else:
        state = "running"
    service = (p.service if p else 0.0) + sum(t.call.model_time for t in threads if t.call)
    return {
        "level": p.queue if p is not None else None,
        "service_s": round(service, 4),
        "pages": pages,
        "swapped_pages": swapped,
        "state": state,
    }


def _percentiles(name: str, samples: deque[tuple[float, list[float]]], now: float) -> dict:
    """``{name}_p50_ms`` and ``{name}_p99_ms`` of the samples of the last minute (None
    without any)."""
    recent = sorted(v for t, values in samples if now - t <= LATENCY_WINDOW_S for v in values)
    if not recent:
        return {f"{name}_p50_ms": None, f"{name}_p99_ms": None}
    pick = lambda q: round(1000 * recent[min(len(recent) - 1, int(q * len(recent)))], 3)  # noqa: E731
    return {f"{name}_p50_ms": pick(0.5), f"{name}_p99_ms": pick(0.99)}
