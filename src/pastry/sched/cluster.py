"""A discrete-event simulator of a cluster: several engines behind a router program, for
the seeds' cluster experiments at their scale (Autellix §6.4's load balancers, LLM
microserving §4's disaggregation patterns; ``docs/scheduling.md``, "The cluster").

What is real:

- **The routers.** The router programs of ``pastry/inferlets/routers`` (round robin, least
  loaded, locality, P/D, balanced P/D, migration) run unchanged: their ``main`` is a task
  on an event loop of the simulator's, bound to :class:`SimRouterApi` (the calls a router
  makes: ``next_request``, ``get_engine_load``, ``prep_recv``, ``remote_send``,
  ``start_generate``), and the loop runs whenever the simulation gives the router
  something to do, at the simulated time.
- **Each engine's control layer.** Every engine is a :class:`~pastry.sched.pastry_engine.
  PastryEngine`: the real batch scheduler and schedule policy (PLAS, ATLAS, ...) forming
  its batches. The engines share one process table, the control layer's (Autellix's
  global table: a program's attained service counts on every engine).

What is modelled:

- **The requests.** Every LLM call of a program is a new context sent with its whole
  input (the program's history and the call's new tokens), as a client of an OpenAI-style
  API sends it, and is routed on its own: the paper's setting. (An inferlet holding its
  context is placed once and never re-routed; that case needs no simulation.)
- **Each engine's prefix cache**: what an engine computed or received stays in its KV
  memory (``ClusterConfig.kv_tokens`` tokens) until evicted, least recently used first;
  a request reuses the longest cached prefix of its input, in whole pages. Prompts are
  real token sequences (each piece of text its own range of ids, a workload's system
  prompt the same for all its programs), so the routers' views (``len(prompt)``, a
  prefix as a key) are the real ones. Running requests are not limited by memory (the
  scheduling-only model of the single-engine simulator, Autellix Fig. 18).
- **Steps** cost what :class:`~pastry.sched.hardware.CostModel` says, each engine on its
  own clock.
- **The network** (:class:`Network`): a K/V transfer moves ``prompt[begin:end]``'s K/V
  from the sending engine to the receiver, over the sender's link (one transfer at a
  time), ``latency_s`` plus bytes over ``bandwidth_b_s``; a transfer of K/V the sender
  computes for it is pipelined layer by layer with that prefill (microserving §3.4:
  layer ``l``'s K/V go while layer ``l + 1`` computes), so it ends one layer's transfer
  after the prefill when the link keeps up, and a whole transfer after its first layer
  when it does not.
"""

from __future__ import annotations

import asyncio
import contextvars
import heapq
import importlib
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from pastry.control.policies import schedule_policy
from pastry.control.programs import ProcessTable
from pastry.sched.cluster_model import (
    MODEL,
    Ctx,
    Network,
    PrefixCache,
    Seg,
    a100_kv_tokens,
    ctx_tokens,
)
from pastry.sched.cluster_router import Request, SimRouterApi
from pastry.sched.hardware import CostModel
from pastry.sched.pastry_engine import PastryEngine
from pastry.sched.programs import ProgramSpec
from pastry.sched.sim_model import ProgramResult, SimConfig, SimProgram, SimResult, SimThread
from pastry.sdk.current import bind

__all__ = [
    "ClusterConfig",
    "ClusterSimulator",
    "Network",
    "PrefixCache",
    "Seg",
    "SimRouterApi",
    "a100_kv_tokens",
    "simulate_cluster",
]


@dataclass(frozen=True)
class ClusterConfig:
    """``engines`` alike engines behind ``router`` (a router program's name with ``:``
    and its arguments, as ``pastry serve --router`` takes it), each scheduling with
    ``schedule`` (a policy name) under the single-engine simulator's batch limits."""

    engines: int = 4
    router: str = "round-robin"
    schedule: str = "plas"
    max_batch: int = 256
    max_batch_tokens: int | None = 8192
    cost: CostModel = field(default_factory=CostModel.a100_llama8b)
    steps_per_schedule: int = 1
    kv_tokens: int = field(default_factory=a100_kv_tokens)  # each engine's KV memory
    page_size: int = 16
    network: Network = field(default_factory=Network)
    measure: tuple[float, float] | None = None  # arrivals measured (None: every program)
    max_time_s: float = math.inf

    def __post_init__(self) -> None:
        if self.engines < 1 or self.kv_tokens < self.page_size:
            raise ValueError(f"a cluster needs >= 1 engine and KV memory: {self}")

    def engine_config(self) -> SimConfig:
        return SimConfig(self.max_batch, self.max_batch_tokens, self.cost, memory=None,
                         steps_per_schedule=self.steps_per_schedule)  # fmt: skip


# ---------------------------------------------------------------------- engines, jobs


@dataclass(eq=False)
class _Job:
    """A forward run on an engine for a request: its generation, or a one-step prefill
    whose K/V a ``remote_send`` sends."""

    engine: _Engine
    thread: SimThread
    kv0: int  # tokens of ctx with K/V there before it
    tokens: int  # computed by its first forward
    on_first: Callable[[float, float], None]  # (its first forward's start, duration)
    on_done: Callable[[], None]


class _Engine:
    def __init__(self, sim: ClusterSimulator, rank: int, table: ProcessTable) -> None:
        cfg = sim.config
        self.rank = rank
        self.core = PastryEngine(_View(sim), schedule_policy(cfg.schedule), table, f"e{rank}")
        self.cache = PrefixCache(cfg.kv_tokens, cfg.page_size, lambda: sim.now)
        self.jobs: dict[SimThread, _Job] = {}
        self.waiting: dict[SimThread, _Job] = {}  # first forward not run yet
        self.routed = 0  # generations running (the routers' load)
        self.generations = 0  # placed here so far
        self.queued_tokens = 0
        self.busy = self.kicked = False
        self.busy_s = 0.0
        self.link_free = 0.0  # when its outgoing link is free


class _View:
    """What a PastryEngine reads of its simulator: the config and the clock."""

    def __init__(self, sim: ClusterSimulator) -> None:
        self._sim = sim
        self.config = sim.config.engine_config()

    @property
    def now(self) -> float:
        return self._sim.now


# ---------------------------------------------------------------------- the simulator


class ClusterSimulator:
    """Runs programs on a cluster (see the module docstring)."""

    def __init__(self, config: ClusterConfig | None = None) -> None:
        self.config = cfg = config or ClusterConfig()
        self.now = 0.0
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self.table = ProcessTable(clock=lambda: self.now, session_ttl_s=0)
        self.engines = [_Engine(self, r, self.table) for r in range(cfg.engines)]
        self._next_id = 1  # token ids
        self._rids = itertools.count(1)
        self._prefixes: dict[tuple[str, int], Seg] = {}
        self._requests: dict[int, Request] = {}
        self._by_prompt: dict[tuple[int, int], Request] = {}
        self._programs: list[SimProgram] = []
        self._roots: dict[SimProgram, Ctx] = {}
        self._first: dict[SimProgram, float] = {}
        self._measuring = 0
        self.progress = 0  # the router's calls (it is idle when they stop)
        self._progress_pending = False  # the router has something to take
        self._stats = dict(calls=0, prompt_tokens=0, computed_tokens=0, sent_tokens=0,
                           transfers=0, transfer_s=0.0)  # fmt: skip
        # The router program, on a loop of its own run at the simulated time
        self.router_loop = asyncio.new_event_loop()
        self.api = SimRouterApi(self)
        name, _, args = cfg.router.partition(":")
        module = importlib.import_module(f"pastry.inferlets.routers.{name.replace('-', '_')}")
        ctx = contextvars.copy_context()
        ctx.run(bind, self.api)
        self._router = self.router_loop.create_task(
            module.main([a for a in args.split(",") if a]), context=ctx
        )
        self._settle()

    # ------------------------------------------------------------------ running

    def run(self, programs: Sequence[ProgramSpec]) -> SimResult:
        window = self.config.measure
        for i, spec in enumerate(sorted(programs, key=lambda s: s.arrival)):
            p = SimProgram(spec, i)
            p.measured = window is None or window[0] <= spec.arrival < window[1]
            self._measuring += p.measured
            self._programs.append(p)
            self._at(spec.arrival, lambda p=p: self._start(p))
        steps = 0
        try:
            while self._events and self._measuring:
                t, _, action = heapq.heappop(self._events)
                self.now = t
                if t > self.config.max_time_s:
                    break
                steps += action() or 0
                if self._progress_pending:
                    self._settle()
        finally:
            self._close_router()
        stats = self._summary()
        for e in self.engines:
            e.core.finish()
        results = tuple(self._result(p) for p in self._programs)
        return SimResult(f"{self.config.router} x{len(self.engines)}", results, steps,
                         self.now, stats)  # fmt: skip

    def _close_router(self) -> None:
        """End the router program and the handlers it still runs (requests in flight)."""
        loop = self.router_loop
        if loop.is_closed():
            return
        tasks = asyncio.all_tasks(loop)
        for t in tasks:
            t.cancel()

        async def ended() -> None:
            await asyncio.gather(*tasks, return_exceptions=True)

        loop.run_until_complete(ended())
        loop.close()

    def _at(self, t: float, action: Callable[[], int | None]) -> None:
        heapq.heappush(self._events, (t, next(self._seq), action))

    def _settle(self) -> None:
        """Run the router until it waits for the simulation (a request, a transfer)."""
        self._progress_pending = False

        async def idle() -> None:
            quiet = 0
            while quiet < 3:
                before = self.progress
                await asyncio.sleep(0)
                quiet = quiet + 1 if self.progress == before else 0

        self.router_loop.run_until_complete(idle())
        if self._router.done():
            exc = None if self._router.cancelled() else self._router.exception()
            self._close_router()
            raise RuntimeError(f"the router program {self.config.router!r} ended: {exc!r}")

    def _wake_router(self) -> None:
        self.progress += 1
        self._progress_pending = True

    def check_model(self, model: str) -> None:
        if model != MODEL:
            raise ValueError(f"no model {model!r} (the cluster serves {MODEL!r})")

    # ------------------------------------------------------------------ programs

    def _start(self, p: SimProgram) -> None:
        spec = p.spec
        self.table.start(p.instance)
        root: Ctx = ()
        if spec.shared_prefix:
            key = (spec.workload, spec.shared_prefix)
            seg = self._prefixes.get(key)
            if seg is None:
                seg = self._prefixes[key] = self._seg(spec.shared_prefix)
            root = (seg,)
        self._roots[p] = root
        self._next_stage(p)

    def _seg(self, n: int) -> Seg:
        seg = Seg(self._next_id, n)
        self._next_id += n
        return seg

    def _next_stage(self, p: SimProgram) -> None:
        if p.failed is not None:
            return
        p.stage += 1
        stage = p.spec.stages[p.stage]
        base = self._roots[p]
        p.running = len(stage.calls)
        for i, call in enumerate(stage.calls):
            ctx = base + ((self._seg(call.prefill),) if call.prefill else ())
            if not ctx:
                ctx = (self._seg(1),)
            on_root = i == 0 and not stage.fork

            def done(grown: Ctx, on_root: bool = on_root) -> None:
                if on_root:
                    self._roots[p] = grown
                self._call_done(p)

            self._submit(p, ctx, call.decode, done)

    def _call_done(self, p: SimProgram) -> None:
        if p.failed is not None:
            return
        p.running -= 1
        if p.running:
            return
        if p.stage + 1 < len(p.spec.stages):
            self._at(self.now + p.spec.stages[p.stage].interrupt_s, lambda: self._next_stage(p))
            return
        p.finish = self.now
        self._end(p)

    def _end(self, p: SimProgram) -> None:
        self._measuring -= p.measured
        self.table.end(p.instance)
        self._roots.pop(p, None)

    def _fail(self, p: SimProgram, why: str) -> None:
        if p.failed is None and p.finish is None:
            p.failed = why
            self._end(p)

    def refuse(self, rid: int, reason: str) -> None:
        """The router refused request ``rid``: its program fails."""
        self._fail(self._requests.pop(rid).program, f"the router refused the request: {reason}")

    def _result(self, p: SimProgram) -> ProgramResult:
        s = p.spec
        return ProgramResult(s.workload, s.arrival, p.finish, s.decode_tokens, s.num_calls,
                             p.wait_s, p.failed, p.measured, self._first.get(p))  # fmt: skip

    # ------------------------------------------------------------------ requests

    def _submit(self, p: SimProgram, ctx: Ctx, decode: int, done: Callable[[Ctx], None]) -> None:
        r = Request(next(self._rids), p, ctx, ctx_tokens(ctx), done, decode)
        self._requests[r.id] = r
        self._by_prompt[(len(r.prompt), r.prompt[-1])] = r
        self._stats["calls"] += 1
        self._stats["prompt_tokens"] += len(r.prompt)
        self.api.offer(r)
        self._wake_router()

    def request(self, rid: int, prompt: Sequence[int]) -> Request:
        r = self._requests.get(rid)
        if r is None or r.placed:
            raise ValueError(f"request {rid} is not waiting to be placed")
        if len(prompt) != len(r.prompt) or (prompt and prompt[-1] != r.prompt[-1]):
            raise ValueError(f"prompt differs from request {rid}'s prompt")
        return r

    def request_of(self, prompt: Sequence[int]) -> Request:
        r = self._by_prompt.get((len(prompt), prompt[-1])) if prompt else None
        if r is None:
            raise ValueError("the prompt is no request's")
        return r

    def place(self, r: Request, rank: int, begin: int) -> None:
        """``start_generate``: ``r`` runs on ``rank``, where the K/V of ``prompt[:begin]``
        were received (and whatever its cache holds of the prompt)."""
        r.placed = True
        e = self.engines[rank]
        n = len(r.prompt)
        kv = max(min(begin, n - 1), e.cache.match(r.ctx, n - 1))
        out = self._seg(r.decode)

        def first(start: float, dt: float) -> None:
            p = r.program
            if p.stage == 0 and p not in self._first:
                self._first[p] = start + dt

        def done() -> None:
            e.routed -= 1
            grown = (*r.ctx, out)
            e.cache.insert(grown, n + r.decode - 1)  # the last token has no K/V yet
            self._requests.pop(r.id, None)
            self._by_prompt.pop((n, r.prompt[-1]), None)
            r.on_done(grown)

        e.routed += 1
        e.generations += 1
        self._run(e, r.program, kv, n - kv, r.decode, first, done)

    def send(self, r: Request, rank: int, to: int, begin: int, end: int,
              landed: Callable[[], None]) -> None:  # fmt: skip
        """``remote_send``: the K/V of ``prompt[begin:end]`` from ``rank`` to ``to``,
        computing there what it does not hold of ``prompt[:end]``."""
        e = self.engines[rank]
        held = e.cache.match(r.ctx, end) if end else 0
        net = self.config.network
        sent = end - begin
        self._stats["transfers"] += 1
        self._stats["sent_tokens"] += sent

        def go(start: float, compute_s: float) -> None:
            t = net.pipelined_end(start, compute_s, sent, max(start, e.link_free))
            e.link_free = t - net.latency_s  # one transfer at a time on the sender's link
            self._stats["transfer_s"] += t - start

            def arrive() -> None:
                landed()
                self._wake_router()

            self._at(t, arrive)

        if held >= end:
            go(self.now, 0.0)
            return
        tokens = end - held

        def first(start: float, dt: float) -> None:
            e.cache.insert(r.ctx, end)  # the sender keeps what it computed
            go(start, dt)

        self._run(e, r.program, held, tokens, 1, first, lambda: None)

    # ------------------------------------------------------------------ engine steps

    def _run(self, e: _Engine, p: SimProgram, kv: int, tokens: int, decode: int, first,
             done) -> None:  # fmt: skip
        th = SimThread(p, root=False)
        e.core.open_thread(th, None)
        th.kv, th.left = kv, decode
        job = _Job(e, th, kv, max(1, tokens), first, done)
        e.jobs[th] = e.waiting[th] = job
        e.queued_tokens += job.tokens
        self._stats["computed_tokens"] += tokens
        e.core.start_call(th, job.tokens, decode)
        self._kick(e)

    def _kick(self, e: _Engine) -> None:
        if not e.busy and not e.kicked and e.core.has_work():
            e.kicked = True
            self._at(self.now, lambda: self._step(e))

    def _step(self, e: _Engine) -> int:
        e.kicked = False
        start = self.now
        dt, done, failed = e.core.step()
        if failed:
            raise RuntimeError(f"engine {e.rank} failed programs without a memory model: {failed}")
        if dt <= 0:
            return 0
        firsts = [j for th, j in e.waiting.items() if th.kv != j.kv0]
        for j in firsts:
            del e.waiting[j.thread]
            e.queued_tokens -= j.tokens
        e.busy = True
        e.busy_s += dt
        self._at(start + dt, lambda: self._stepped(e, start, dt, firsts, done))
        return 1

    def _stepped(self, e: _Engine, start: float, dt: float, firsts: list[_Job],
                 done: list[SimThread]) -> None:  # fmt: skip
        e.busy = False
        for j in firsts:
            j.on_first(start, dt)
        for th in done:
            job = e.jobs.pop(th)
            e.core.close_thread(th)
            th.program.wait_s += th.waited
            job.on_done()
        self._kick(e)

    # ------------------------------------------------------------------ results

    def _summary(self) -> dict:
        s = dict(self._stats)
        busy = [e.busy_s for e in self.engines]
        span = max(self.now, 1e-12)
        s["hit_rate"] = round(1 - s["computed_tokens"] / max(1, s["prompt_tokens"]), 4)
        s["utilization"] = round(sum(busy) / (span * len(busy)), 4)
        s["busiest_over_mean"] = round(max(busy) / max(1e-12, sum(busy) / len(busy)), 3)
        s["transfer_s"] = round(s["transfer_s"], 3)
        s["generations"] = [e.generations for e in self.engines]
        return s


def simulate_cluster(programs: Sequence[ProgramSpec], config: ClusterConfig | None = None,
                     **changes) -> SimResult:  # fmt: skip
    """Run ``programs`` on a fresh cluster (``config`` with ``changes``)."""
    cfg = replace(config or ClusterConfig(), **changes)
    return ClusterSimulator(cfg).run(programs)
