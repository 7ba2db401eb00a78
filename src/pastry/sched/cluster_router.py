"""The inferlet API a router program calls inside the cluster simulator
(:mod:`pastry.sched.cluster`): the real router programs of ``pastry/inferlets/routers``
run against :class:`SimRouterApi` unchanged."""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from pastry.sched.cluster_model import MODEL, Ctx, PrefixCache
from pastry.sched.sim_model import SimProgram


@dataclass(eq=False)
class Request:
    id: int
    program: SimProgram
    ctx: Ctx
    prompt: list[int]
    on_done: Callable[[Ctx], None]  # with the context grown by the output
    decode: int
    placed: bool = False


class SimEngine(Protocol):
    """What the router's API reads of a simulated engine."""

    routed: int  # generations running there
    queued_tokens: int  # input waiting for its first forward
    cache: PrefixCache


class RouterHost(Protocol):
    """The simulator, as the router's API sees it (:class:`~pastry.sched.cluster.
    ClusterSimulator`)."""

    engines: Sequence[SimEngine]
    router_loop: asyncio.AbstractEventLoop
    progress: int  # the router's calls so far (it is idle when they stop)

    def check_model(self, model: str) -> None: ...
    def request(self, rid: int, prompt: Sequence[int]) -> Request: ...
    def request_of(self, prompt: Sequence[int]) -> Request: ...
    def place(self, r: Request, rank: int, begin: int) -> None: ...
    def refuse(self, rid: int, reason: str) -> None: ...
    def send(self, r: Request, rank: int, to: int, begin: int, end: int,
             landed: Callable[[], None]) -> None: ...  # fmt: skip


class SimRouterApi:
    """The inferlet API a router program calls, answered by the cluster simulator (only
    the calls across engines; a queue's handle is its engine's rank)."""

    def __init__(self, sim: RouterHost) -> None:
        self._sim = sim
        self._waiting: deque[Request] = deque()
        self._taker: asyncio.Future | None = None
        self._recv: dict[
            int, tuple[int, Request, int, int]
        ] = {}  # handle -> rank, req, end, matched
        self._handles = itertools.count(1)

    # engines
    def available_engines(self, model: str) -> int:
        self._sim.check_model(model)
        return len(self._sim.engines)

    def create_queue(self, model: str, engine: int = -1, priority: int = 0) -> int:
        self._sim.check_model(model)
        if not 0 <= engine < len(self._sim.engines):
            raise ValueError(f"no engine {engine} (the cluster has {len(self._sim.engines)})")
        return engine

    def get_engine_load(self, model: str) -> list[tuple[int, int, int]]:
        self._sim.check_model(model)
        return [(1, e.routed, e.queued_tokens) for e in self._sim.engines]

    # requests
    def next_request(self) -> asyncio.Future:
        fut = self._sim.router_loop.create_future()
        if self._waiting:
            r = self._waiting.popleft()
            fut.set_result((r.id, MODEL, r.prompt, r.program.instance))
        else:
            self._taker = fut
        return fut

    def offer(self, r: Request) -> None:
        if self._taker is not None and not self._taker.done():
            self._taker.set_result((r.id, MODEL, r.prompt, r.program.instance))
            self._taker = None
        else:
            self._waiting.append(r)

    def start_generate(self, q: int, prompt: Sequence[int], begin: int, request: int = -1) -> list:
        self._sim.progress += 1
        r = self._sim.request(request, prompt)
        self._sim.place(r, q, slice_index(begin, len(r.prompt)))
        return []

    def reject_request(self, request: int, reason: str) -> None:
        self._sim.progress += 1
        self._sim.refuse(request, reason)

    def prep_recv(self, q: int, prompt: Sequence[int], end: int) -> asyncio.Future:
        self._sim.progress += 1
        r = self._sim.request_of(prompt)
        end = slice_index(end, len(r.prompt))
        matched = self._sim.engines[q].cache.match(r.ctx, min(end, len(r.prompt) - 1))
        handle = next(self._handles)
        self._recv[handle] = (q, r, end, matched)
        fut = self._sim.router_loop.create_future()
        fut.set_result((handle, matched))
        return fut

    def remote_send(self, q: int, prompt: Sequence[int], kv_addr_info: int, recv_rank: int,
                    begin: int, end: int, src_pages: Sequence[int] = (), src_len: int = 0,
                    ) -> asyncio.Future:  # fmt: skip
        self._sim.progress += 1
        rank, r, prepared, matched = self._recv.pop(kv_addr_info)
        if rank != recv_rank or rank == q:
            raise ValueError(
                f"kv_addr_info {kv_addr_info} is on engine {rank}, sent {q} -> {recv_rank}"
            )
        end = slice_index(end, len(r.prompt))
        if end > prepared:
            raise ValueError(f"prompt[:{end}] is more than prep_recv prepared ({prepared})")
        begin = min(max(slice_index(begin, len(r.prompt)), matched), end)
        fut = self._sim.router_loop.create_future()
        self._sim.send(r, q, recv_rank, begin, end, lambda: fut.set_result(None))
        return fut


def slice_index(i: int, n: int) -> int:
    """A Python slice bound of a sequence of ``n``."""
    return max(0, min(n, i + n if i < 0 else i))
