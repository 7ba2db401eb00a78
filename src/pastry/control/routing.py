"""Several engines per model: placement by router programs, and the microserving calls.

A model may be served by several engines (:attr:`Controller.engines`, one
:class:`~pastry.control.model.Model` per engine, by *rank*). Inferlets can name the
engine of a queue (``create_queue(model, engine)``; pages are allocated through a queue, so
on its engine) and move KV between engines with LLM microserving's three calls, with the
paper's semantics (Python slice indices, ``end=-1``):

- ``prep_recv(q, prompt, end)`` on the receiver (``q``'s engine): match ``prompt[:end]`` in
  its prefix cache (``matched_len``: the full pages of the longest cached prefix, in the
  caller's user's tree, shared read-only; never the last prompt token), allocate pages for
  the rest and return ``(kv_addr_info, matched_len)``. No compute. The pages are the
  caller's, recorded in a :class:`RecvBuffer` that ``kv_addr_info`` names.
- ``remote_send(q, prompt, kv_addr_info, recv_rank, begin, end)`` on the sender: compute
  the K/V of ``prompt[:end]`` there and write ``prompt[begin:end]`` straight into the
  receiver's pages, layer by layer as the forward computes them (``SendKv``,
  :mod:`pastry.engine.transfer`); resolves when every write has landed. What ``prep_recv``
  matched is never sent again (``begin`` below ``matched_len`` starts there).
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
from pastry.control.model import Model
from pastry.control.programs import ProcessTable
from pastry.control.scheduler import Op, Stage
from pastry.control.session import Session
from pastry.engine.calls import SendKv, ids

log = logging.getLogger(__name__)

PREFILL_CHUNK = 2048  # tokens per forward of a remote_send's prefill


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


@dataclass(eq=False)
class RecvBuffer:
    """Pages prepared by ``prep_recv`` (what ``kv_addr_info`` names): the caller's handles
    on engine ``rank`` for ``tokens`` (``prompt[:end]``); ``present`` holds the token ranges
    whose K/V are in them."""

    rank: int
    tokens: tuple[int, ...]
    matched: int
    pages: list[int]
    present: list[tuple[int, int]]

    def holds(self, begin: int) -> bool:
        """Whether the K/V of tokens ``[0, begin)`` are all present."""
        covered = 0
        for lo, hi in sorted(self.present):
            if lo > covered:
                break
            covered = max(covered, hi)
        return covered >= begin


def slice_bounds(n: int, begin: int | None, end: int | None) -> tuple[int, int]:
    """``prompt[begin:end]`` as absolute ``(begin, end)`` of a length-``n`` prompt (Python
    slice semantics: negative counts from the end, out of range clamps)."""
    for name, v in (("begin", begin), ("end", end)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
            raise ApiError(f"{name} must be an integer (a Python slice index), got {v!r}")
    b, e, _ = slice(begin, end).indices(n)
    return b, max(b, e)


def _tokens(prompt: Sequence[int]) -> tuple[int, ...]:
    try:
        return tuple(int(t) for t in prompt)
    except (TypeError, ValueError):
        raise ApiError("prompt must be a list of token ids") from None


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
        self._buffers: dict[int, dict[int, RecvBuffer]] = defaultdict(dict)
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
        self._buffers.pop(instance, None)
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
        tokens = _tokens(prompt)
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
            req = RouteRequest(-1, session.queue(q).model.name, _tokens(prompt),
                               session.instance, asyncio.get_running_loop().create_future())  # fmt: skip
            self.hand_over(session, q, req, begin, count=False)
            return list(req.future.result().pages)
        req = self._pending.get(request)
        if req is None or req.router != session.instance:
            self._discard(session, q, _tokens(prompt))  # what was prepared for it
        req = self._taken(session, request)
        if _tokens(prompt) != req.prompt:
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
            self._discard(session, q, tokens)
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
            buf = self._buffer_for(session, target.rank, tokens, begin)
            ps = target.info.page_size
            res = target.resources
            name = f"\0handoff/{req.id}"
            keep = buf.pages[: -(-begin // ps)]
            if req.instance == session.instance:  # the caller keeps its own pages
                pages, buf.pages = keep, buf.pages[len(keep) :]
            else:
                res.export(session.instance, "kv", keep, name, True, pinned=True)
                owner = session.user  # the router's namespace (issue 17: names are per user)
                try:  # a quota of the requester's refuses it here, as ApiError
                    pages = resource_call(res.import_, req.instance, "kv", name, owner)
                finally:
                    res.unexport(None, name, owner)
            self._drop_buffer(session, q, buf)
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

    # ------------------------------------------------------------------ microserving

    def prep_recv(
        self, session: Session, q: int, prompt: Sequence[int], end: int
    ) -> asyncio.Future:
        ref = session.queue(q)
        tokens = _tokens(prompt)
        _, end = slice_bounds(len(tokens), None, end)
        ps = ref.model.info.page_size
        shared = self._match(session, ref.model, tokens, end)
        matched = len(shared) * ps
        try:
            pages = shared + session.alloc_kvpages(q, -(-end // ps) - len(shared))  # masked
        except ApiError:
            ref.model.resources.free(session.instance, "kv", shared)
            raise
        buffers = self._buffers[session.instance]
        handle = max(buffers, default=0) + 1
        buffers[handle] = RecvBuffer(ref.model.rank, tokens[:end], matched, pages, [(0, matched)])
        out = asyncio.get_running_loop().create_future()
        # Resolve once the masks of the fresh pages have run: a write that lands after
        # would otherwise be hidden again.
        _chain(session.synchronize(q), out, (handle, matched))
        return out

    def _match(self, session: Session, model: Model, tokens: tuple, end: int) -> list[int]:
        """New handles of ``session`` for the full pages of the longest prefix of
        ``tokens[:end]`` in ``model``'s prefix cache (the caller's user's tree; shared
        read-only, so ``remote_send`` never writes them). At least the last prompt token is
        left to send (``start_generate`` computes it)."""
        res, cache = model.resources, model.resources.cache
        if cache is None or not end:
            return []
        ps = model.info.page_size
        limit = min(end, len(tokens) - 1)
        m = cache.match(tokens, limit, namespace=res.user_of(session.instance))
        full = m.length // ps
        if not full:
            return []
        handles = resource_call(res.reserve, session.instance, "kv", full)
        res.bind_cached(session.instance, handles, m.pages[:full])
        return handles

    def remote_send(
        self,
        session: Session,
        q: int,
        prompt: Sequence[int],
        kv_addr_info: int,
        recv_rank: int,
        begin: int,
        end: int,
        src_pages: Sequence[int] = (),
        src_len: int = 0,
    ) -> asyncio.Future:
        ref = session.queue(q)
        sender = ref.model
        buf = self._buffers[session.instance].get(kv_addr_info)
        if buf is None:
            raise ApiError(f"kv_addr_info {kv_addr_info!r} is not a prep_recv of this inferlet")
        if recv_rank != buf.rank:
            raise ApiError(f"kv_addr_info {kv_addr_info} is on engine {buf.rank}, not {recv_rank}")
        tokens = _tokens(prompt)
        begin, end = slice_bounds(len(tokens), begin, end)
        if end > len(buf.tokens) or tokens[:end] != buf.tokens[:end]:
            raise ApiError(
                f"prompt[:{end}] is not the prompt prep_recv prepared (its prompt[:{len(buf.tokens)}])"
            )
        # What prep_recv matched in the receiver's cache is there already (and shared: it
        # must not be written), so it is never sent again.
        begin = min(max(begin, buf.matched), end)
        receiver = self.engine(sender.name, recv_rank)
        if receiver is sender:
            raise ApiError(
                f"remote_send from engine {recv_rank} to itself: its K/V are computed there by "
                "start_generate(prompt, begin)"
            )
        out = asyncio.get_running_loop().create_future()
        if begin == end:
            out.set_result(None)
            return out
        peer = self.peer(sender, receiver)
        ps = sender.info.page_size
        # What the sender holds already (Fig. 8): pages of the caller's with the K/V of
        # prompt[:src_len] (the engines keep no context cache yet). Case 1: it holds more
        # than the receiver, and sends that part without compute; case 2: the rest,
        # prompt[held:end], is computed on top, and only prompt[begin:end] is sent.
        src_pages = list(src_pages)
        held = min(int(src_len), end) if src_pages else 0
        if src_pages and not 0 <= src_len <= len(src_pages) * ps:
            raise ApiError(f"src_len {src_len} does not fit {len(src_pages)} pages of {ps}")
        resource_call(sender.resources.translate, session.instance, "kv", src_pages)  # fail now
        work = session.alloc_kvpages(q, -(-end // ps) - held // ps) if held < end else []
        # The page of every page index of prompt[:end] (a partial last held page is
        # copied into work[0], where its page index continues).
        view = src_pages[: held // ps] + work if work else src_pages[: -(-held // ps)]
        guard = f"\0recv/{session.instance}/{kv_addr_info}/{id(out)}"
        # Hold the receiver's pages until the writes have landed, whatever happens to
        # the buffer meanwhile.
        receiver.resources.export(session.instance, "kv", buf.pages, guard, True, pinned=True)
        futs, sends = [], []
        if held % ps and held < end:  # the partial last held page continues in work[0]
            futs.append(session.copy_kvpage(q, src_pages[held // ps], work[0], 0, 0, held % ps))
        if held < end:
            chunk = min(PREFILL_CHUNK, sender.info.max_batch_tokens)
            embeds = session.alloc_embeds(q, min(end - held, chunk))
            for start in range(held, end, chunk):
                stop = min(end, start + chunk)
                m = stop - start
                ctx = view[: -(-start // ps)]
                last = start - (len(ctx) - 1) * ps if ctx else 0
                futs.append(session.embed_txt(q, list(tokens[start:stop]), list(range(start, stop)),
                                              embeds[:m]))  # fmt: skip
                futs.append(session.forward(q, ctx, last, embeds[:m],
                                            view[start // ps : -(-stop // ps)], start % ps, []))  # fmt: skip
                lo = max(begin, start)
                if lo < stop:
                    sends.append(self._send(session, q, receiver, view, buf, lo, stop, peer))
            futs.append(session.dealloc_embeds(q, embeds))
        if begin < held:  # sent from what the sender holds, without compute
            sends.append(self._send(session, q, receiver, view, buf, begin, held, peer))
        if work:
            futs.append(session.dealloc_kvpages(q, work))
        # The receiver's pages are held until every send has ended (landed, failed, or
        # dropped before it ran), even if the caller gives up earlier.
        asyncio.gather(*sends, return_exceptions=True).add_done_callback(
            lambda _: receiver.resources.unexport(None, guard, session.user)
        )

        def done(f: asyncio.Future) -> None:
            if f.cancelled():
                out.cancel()
            elif f.exception() is not None:
                out.set_exception(f.exception())
            else:
                buf.present.append((begin, end))
                out.set_result(None)

        asyncio.gather(*futs, *sends).add_done_callback(done)
        return out

    def _send(self, session, q, receiver, work, buf, lo, hi, peer) -> asyncio.Future:
        ps = receiver.info.page_size
        ref = session.queue(q)
        src, dst = work[lo // ps : -(-hi // ps)], buf.pages[lo // ps : -(-hi // ps)]
        op = Send(session.instance, ref.model, src, receiver, dst, hi - lo, lo % ps, peer)
        return session.submit(ref, Stage.OUTPUT, op)

    def peer(self, sender: Model, receiver: Model) -> str:
        """The address through which ``sender`` writes into ``receiver``'s pool."""
        peers = receiver.info.kv_peers
        if sender.info.host and sender.info.host == receiver.info.host:
            for p in peers:
                if p.startswith("shm:"):
                    return p
        for p in peers:
            if p.startswith("tcp://"):
                return p
        raise ApiError(
            f"engine {receiver.rank} of '{receiver.name}' cannot receive K/V from engine "
            f"{sender.rank}: it has no shared-memory pool on that host and no --kv-recv "
            "endpoint (start it with `pastry engine --kv-recv tcp://HOST:PORT`)"
        )

    def _buffer_for(self, session: Session, rank: int, tokens: tuple, begin: int) -> RecvBuffer:
        for buf in self._buffers[session.instance].values():
            same = len(buf.tokens) >= begin and buf.tokens[:begin] == tokens[:begin]
            if buf.rank == rank and same and buf.holds(begin):
                return buf
        raise ApiError(
            f"the K/V of prompt[:{begin}] is not on engine {rank}: prepare it with prep_recv "
            "there and remote_send from another engine first (or start at begin=0)"
        )

    def _discard(self, session: Session, q: int, tokens: tuple[int, ...]) -> None:
        """Free the buffers this session prepared on ``q``'s engine for ``tokens``."""
        rank = session.queue(q).model.rank
        for buf in list(self._buffers[session.instance].values()):
            if buf.rank == rank and tokens[: len(buf.tokens)] == buf.tokens:
                self._drop_buffer(session, q, buf)

    def _drop_buffer(self, session: Session, q: int, buf: RecvBuffer) -> None:
        buffers = self._buffers[session.instance]
        for h, b in list(buffers.items()):
            if b is buf:
                del buffers[h]
        if buf.pages:
            session.dealloc_kvpages(q, buf.pages).add_done_callback(_consume)


class Send(Op):
    """One ``SendKv`` of a ``remote_send``: the sender's pages ``src`` into the receiver's
    ``dst`` (both the instance's handles, translated when batched)."""

    __slots__ = ("dst", "instance", "length", "offset", "peer", "receiver", "sender", "src")

    def __init__(self, instance, sender, src, receiver, dst, length, offset, peer) -> None:
        self.instance, self.sender, self.src, self.receiver, self.dst = (
            instance, sender, src, receiver, dst
        )  # fmt: skip
        self.length, self.offset, self.peer = length, offset, peer

    def prepare(self) -> SendKv:
        inst = self.instance
        return SendKv(
            src_pages=ids(self.sender.resources.translate(inst, "kv", self.src)),
            dst_pages=ids(self.receiver.resources.translate(inst, "kv", self.dst)),
            length=self.length,
            peer=self.peer,
            src_offset=self.offset,
            dst_offset=self.offset,
        )


def _chain(src: asyncio.Future, dst: asyncio.Future, value: object) -> None:
    def done(f: asyncio.Future) -> None:
        if dst.done():
            return
        if f.cancelled():
            dst.cancel()
        elif f.exception() is not None:
            dst.set_exception(f.exception())
        else:
            dst.set_result(value)

    src.add_done_callback(done)


def _consume(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()
