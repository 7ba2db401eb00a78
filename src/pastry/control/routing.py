"""Several engines per model: placement by router programs, and the microserving calls.

A model may be served by several engines (:attr:`Controller.engines`, one
:class:`~pastry.control.model.Model` per engine, by *rank*). Inferlets can name the
engine of a queue (``create_queue(model, engine)``; pages are allocated through a queue, so
on its engine) and move KV between engines with LLM microserving's three calls, with the
paper's semantics (Python slice indices, ``end=-1``):

- ``prep_recv`` and ``remote_send`` (:mod:`pastry.control.kv_transfer`): prepare pages on
  the receiver, and fill them with the K/V the sender computes.
- ``start_generate(q, prompt, begin, request)``: hand a *routed request* to ``q``'s engine,
  where the K/V of ``prompt[:begin]`` now is: the requesting program's context continues
  there, prefilling ``prompt[begin:]`` and generating.

**Routing.** A context that is not placed yet (``pastry.sdk.Context`` before its first
forward, on a model with several engines) asks to be placed with ``route(q, prompt)``. The
request goes to the *active router*, an inferlet (``inferlets/routers/``) that takes
requests with ``next_request()`` and answers each with ``start_generate`` (or
``reject_request``), after moving whatever KV it wants with the calls above. The router
is chosen at start (``pastry serve --router``) and can be swapped at any time
(:meth:`Routing.set_router`); requests it took but did not answer when it ended, and every
request while no router is active, are placed here on the least-loaded engine. Since
every program's contexts are placed this way, the OpenAI and native endpoints go through
the active router too.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pastry.api import ApiError
from pastry.control.handlers.caller import resource_call
from pastry.control.kv_transfer import Transfers, slice_bounds, tokens_of
from pastry.control.model import Model
from pastry.control.programs import ProcessTable
from pastry.control.session import Session

log = logging.getLogger(__name__)


@dataclass(eq=False)
class RouteRequest:
    """A context waiting to be placed: its model and prompt, the instance asking and the
    program it belongs to (its process-table entry: an OpenAI session's requests are one
    program, control/programs.py)."""

    id: int
    model: str
    prompt: tuple[int, ...]
    instance: int  # the requesting instance
    future: asyncio.Future
    arrived: float = field(default_factory=time.perf_counter)
    router: int | None = None  # the router instance that took it
    program: int = -1  # the process-table program id (-1: none)
    whole: bool = False  # the requester computes the whole prompt (begin is always 0)


@dataclass(frozen=True)
class Placement:
    """Where a routed context runs: engine ``rank``, with the K/V of ``prompt[:begin]`` in
    ``pages`` (the requester's handles on that engine)."""

    rank: int
    begin: int = 0
    pages: tuple[int, ...] = ()


class Routing:
    """The control layer's multi-engine service (see the module docstring)."""

    def __init__(
        self, engines: dict[str, list[Model]], programs: ProcessTable | None = None
    ) -> None:
        self.models = engines  # every engine of each model, by rank (the controller's)
        self.programs = programs
        self.router: int | None = None  # the active router's instance id
        self.router_name = ""
        self._waiting: asyncio.Queue[RouteRequest] | None = None
        self._pending: dict[int, RouteRequest] = {}
        self._ids = itertools.count(1)
        self.transfers = Transfers(self.engine)  # prep_recv / remote_send
        self._placed: dict[tuple[int, int], tuple[str, int]] = {}  # (instance, q) -> engine
        self._expected: dict[int, Callable[[RouteRequest], None]] = {}
        self.inflight: dict[tuple[str, int], int] = defaultdict(int)
        self.routed = 0  # requests placed by a router
        self.fallback = 0  # requests placed here, without a router

    # ------------------------------------------------------------------ engines

    def engines(self, model: str) -> list[Model]:
        replicas = self.models.get(model)
        if replicas is None:
            raise ApiError(f"no model named '{model}' (available: {', '.join(self.models)})")
        return replicas

    def engine(self, model: str, rank: int) -> Model:
        replicas = self.engines(model)
        if not isinstance(rank, int) or not 0 <= rank < len(replicas):
            raise ApiError(
                f"engine {rank!r} does not exist: '{model}' has {len(replicas)} engine(s), "
                f"ranks 0..{len(replicas) - 1}"
            )
        return replicas[rank]

    def load(self, model: str) -> list[tuple[int, int, int]]:
        """Per engine: (alive 1/0, routed contexts running there, forward tokens queued)."""
        out = []
        for m in self.engines(model):
            queued = sum(c.tokens for q in m.scheduler.queues for c in q.pending)
            out.append((int(m.engine.alive), self.inflight[(model, m.rank)], queued))
        return out

    def least_loaded(self, model: str) -> int:
        loads = self.load(model)
        alive = [r for r, (ok, _, _) in enumerate(loads) if ok] or list(range(len(loads)))
        return min(alive, key=lambda r: (loads[r][1], loads[r][2], r))

    # ------------------------------------------------------------------ the router

    def set_router(self, instance: int | None, name: str = "") -> None:
        """Make ``instance`` the active router (None: none). Requests the previous router
        took but did not answer are placed here; waiting ones go to the new router."""
        old = self.router
        self.router, self.router_name = instance, name if instance is not None else ""
        if old is not None and old != instance:
            self._orphan(old)
        if instance is None:
            self._drain()
        log.info("active router: %s", f"{name} (instance {instance})" if instance else "none")

    def end_instance(self, instance: int) -> None:
        """An instance ended: forget its buffers and placements; orphan its requests."""
        self.transfers.end_instance(instance)
        self._expected.pop(instance, None)
        for key in [k for k in self._placed if k[0] == instance]:
            self.inflight[self._placed.pop(key)] -= 1
        for req in list(self._pending.values()):
            if req.instance == instance:
                self._pending.pop(req.id, None)
                if not req.future.done():
                    req.future.cancel()
        if instance == self.router:
            self.set_router(None)

    def queue_closed(self, instance: int, q: int) -> None:
        key = self._placed.pop((instance, q), None)
        if key is not None:
            self.inflight[key] -= 1

    def _orphan(self, router: int) -> None:
        for req in list(self._pending.values()):
            if req.router == router and not req.future.done():
                log.warning("router %d ended before placing request %d", router, req.id)
                self._place_here(req)

    def _drain(self) -> None:
        while self._waiting is not None and not self._waiting.empty():
            req = self._waiting.get_nowait()
            if not req.future.done():
                self._place_here(req)

    def _place_here(self, req: RouteRequest) -> None:
        self._pending.pop(req.id, None)
        self.fallback += 1
        req.future.set_result(Placement(self.least_loaded(req.model)))

    # ------------------------------------------------------------------ requester side

    def route(
        self, session: Session, q: int, prompt: Sequence[int], whole: bool = False
    ) -> asyncio.Future:
        """Place queue ``q`` (a context about to prefill ``prompt``); resolves to
        ``(begin, pages)`` once ``q`` runs on its engine, whose pages hold the K/V of
        ``prompt[:begin]`` (``whole``: begin is 0, the caller computes the prompt)."""
        ref = session.queue(q)
        tokens = tokens_of(prompt)
        loop = asyncio.get_running_loop()
        out = loop.create_future()
        if ref.placed or len(self.engines(ref.model.name)) == 1:
            out.set_result((0, []))
            return out
        if ref.queue.pending:
            raise ApiError(f"route queue {q} before issuing calls on it")
        ref.placed = True  # one placement per queue
        req = RouteRequest(next(self._ids), ref.model.name, tokens, session.instance,
                           loop.create_future(), program=self._program(session.instance),
                           whole=bool(whole))  # fmt: skip
        place = self._expected.pop(session.instance, None)
        if place is not None:
            self._pending[req.id] = req
            try:
                place(req)
            except ApiError as e:
                self._pending.pop(req.id, None)
                req.future.set_exception(e)
        elif self.router is None:
            self._place_here(req)
        else:
            self._pending[req.id] = req
            self._queue().put_nowait(req)

        def placed(f: asyncio.Future) -> None:
            if out.done():
                return
            if f.cancelled():
                out.set_exception(ApiError("the request was not placed (it ended)"))
            elif f.exception() is not None:
                out.set_exception(f.exception())
            else:
                try:
                    out.set_result(self._move(session, q, f.result()))
                except ApiError as e:
                    out.set_exception(e)

        req.future.add_done_callback(placed)
        return out

    def _program(self, instance: int) -> int:
        table = self.programs
        p = table.program_of(instance) if table is not None else None
        return p.pid if p is not None else instance

    def _move(self, session: Session, q: int, where: Placement) -> tuple[int, list[int]]:
        ref = session.queue(q)
        target = self.engine(ref.model.name, where.rank)
        if target is not ref.model:
            old = ref.queue
            ref.model.scheduler.close_queue(old, "the queue moved to another engine")
            ref.model, ref.queue = target, target.scheduler.create_queue(session.instance)
            ref.queue.priority = old.priority
        self._placed[(session.instance, q)] = (target.name, target.rank)
        self.inflight[(target.name, target.rank)] += 1
        return where.begin, list(where.pages)

    def _queue(self) -> asyncio.Queue[RouteRequest]:
        if self._waiting is None:
            self._waiting = asyncio.Queue()
        return self._waiting

    # ------------------------------------------------------------------ router side

    def next_request(self, session: Session) -> asyncio.Future:
        """The next request to place: ``(request, model, prompt, program)``."""
        self._check_router(session)

        async def take() -> tuple[int, str, list[int], int]:
            while True:
                req = await self._queue().get()
                if req.future.done() or req.id not in self._pending:
                    continue
                if self.router != session.instance:  # swapped while waiting: give it back
                    self._queue().put_nowait(req)
                    raise ApiError("this router was replaced")
                req.router = session.instance
                return req.id, req.model, list(req.prompt), req.program

        return asyncio.ensure_future(take())

    def reject_request(self, session: Session, request: int, reason: str) -> None:
        req = self._taken(session, request)
        self._pending.pop(request, None)
        req.future.set_exception(ApiError(f"the router refused the request: {reason}"))

    def start_generate(
        self, session: Session, q: int, prompt: Sequence[int], begin: int, request: int
    ) -> list[int]:
        """Hand ``request`` to ``q``'s engine, where the K/V of ``prompt[:begin]`` is; with
        ``request=-1`` the caller itself starts there: returns the pages holding it."""
        if request == -1:
            req = RouteRequest(-1, session.queue(q).model.name, tokens_of(prompt),
                               session.instance, asyncio.get_running_loop().create_future())  # fmt: skip
            self.hand_over(session, q, req, begin, count=False)
            return list(req.future.result().pages)
        req = self._pending.get(request)
        if req is None or req.router != session.instance:
            tokens = tokens_of(prompt)  # free what was prepared for it
            self.transfers.discard(session, q, tokens, slice_bounds(len(tokens), begin, None)[0])
        req = self._taken(session, request)
        if tokens_of(prompt) != req.prompt:
            raise ApiError(f"prompt differs from request {request}'s prompt")
        self.hand_over(session, q, req, begin)
        return []

    def hand_over(
        self, session: Session, q: int, req: RouteRequest, begin: int, count: bool = True
    ) -> None:
        """Place ``req`` on ``q``'s engine with the K/V of ``prompt[:begin]`` that
        ``session`` received there (its prep_recv buffers), moving those pages to the
        requester."""
        tokens = req.prompt
        begin, _ = slice_bounds(len(tokens), begin, None)
        if req.whole and begin:  # it wants the prompt's outputs: what was sent is dropped
            self.transfers.discard(session, q, tokens, begin)
            begin = 0
        if tokens and begin >= len(tokens):
            raise ApiError(
                f"begin {begin} leaves nothing to prefill: start_generate needs at least the "
                "last prompt token, whose output starts generation"
            )
        ref = session.queue(q)
        target = ref.model
        if target.name != req.model:
            raise ApiError(
                f"queue {q} is on model '{target.name}', the request is for '{req.model}'"
            )
        pages: list[int] = []
        if begin:
            buf = self.transfers.buffer_for(session, target.rank, tokens, begin)
            ps = target.info.page_size
            res = target.resources
            keep = buf.pages[: -(-begin // ps)]
            if req.instance == session.instance:  # the caller keeps its own pages
                pages, buf.pages = keep, buf.pages[len(keep) :]
            else:  # the router's pages become the requester's
                hold = res.hold(session.instance, "kv", keep)
                try:  # a quota of the requester's refuses it here, as ApiError
                    pages = resource_call(res.claim, req.instance, "kv", hold, session.user)
                finally:
                    res.release(hold, session.user)
            self.transfers.drop_buffer(session, q, buf)
        self._pending.pop(req.id, None)
        self.routed += count
        req.future.set_result(Placement(target.rank, begin, tuple(pages)))

    def expect(self, program: int, place: Callable[[RouteRequest], None]) -> None:
        """The next request of instance ``program`` is placed by ``place`` (which must
        answer it with :meth:`hand_over`), not by the router: the microserving HTTP
        ``start_generate`` launches a program whose context is already placed."""
        self._expected[program] = place

    def _taken(self, session: Session, request: int) -> RouteRequest:
        self._check_router(session)
        req = self._pending.get(request)
        if req is None or req.router != session.instance:
            raise ApiError(
                f"request {request!r} is not waiting for this router (answered already, its "
                "program ended, or it was never taken with next_request)"
            )
        return req

    def _check_router(self, session: Session) -> None:
        if session.instance != self.router:
            raise ApiError(
                "only the active router takes requests (pastry serve --router, or the "
                "microserving /router endpoint, makes a program the router)"
            )
