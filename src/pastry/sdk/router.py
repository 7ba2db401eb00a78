"""The support library of router programs (``pastry/inferlets/routers/``).

A router is an inferlet that the server makes the *active router* (``pastry serve --router``).
Every context about to prefill on a model with several engines becomes a routed request;
the router takes it (``next_request``), may move K/V between engines with microserving's
calls, and hands it to an engine (``start_generate``), where the requesting program goes
on. A router is a loop over :func:`serve` with a handler per request::

    from pastry.sdk.router import engines, serve

    async def main(args):
        async def handle(req):
            e = engines(req.model)
            req.start_generate(e.queue(e.least_loaded()))

        await serve(handle)
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from pastry.api import ApiError
from pastry.sdk.current import api


def _api():
    return api()


@dataclass(frozen=True)
class Request:
    """A context waiting to be placed: ``prompt`` on ``model``, for ``program`` (the
    requesting instance's process-table program: an OpenAI session's requests share one)."""

    id: int
    model: str
    prompt: list[int]
    program: int

    def start_generate(self, q: int, begin: int = 0) -> None:
        """Hand the request to ``q``'s engine, which has the K/V of ``prompt[:begin]``."""
        _api().start_generate(q, self.prompt, begin, self.id)

    def reject(self, reason: str) -> None:
        _api().reject_request(self.id, reason)


class Engines:
    """The engines of one model, each with a queue of this router's (microserving's calls
    run on an engine through a queue on it)."""

    def __init__(self, model: str) -> None:
        a = _api()
        self.model = model
        self.count = a.available_engines(model)
        self._queues = [a.create_queue(model, rank) for rank in range(self.count)]
        # Contexts this router is moving to each engine (prep_recv done, start_generate not
        # yet): the engine counts a context from start_generate, so without these every
        # request during a transfer would pick the same engine.
        self.incoming = [0] * self.count

    def queue(self, rank: int) -> int:
        return self._queues[rank]

    def load(self) -> list[tuple[int, int, int]]:
        """Per engine: (alive, routed contexts running, forward tokens queued)."""
        return _api().get_engine_load(self.model)

    def alive(self, among: list[int] | None = None) -> list[int]:
        """Ranks of the live engines (of ``among``), all of them if none is known live."""
        ranks = list(range(self.count)) if among is None else among
        load = self.load()
        return [r for r in ranks if load[r][0]] or ranks

    def least_loaded(self, among: list[int] | None = None) -> int:
        """The live engine (of ``among``) with the fewest routed contexts (counting those
        this router is moving there), then the fewest queued tokens."""
        load = self.load()
        return min(self.alive(among), key=lambda r: (load[r][1] + self.incoming[r], load[r][2], r))


# Per running router (keyed by its API session): a module is shared by every instance.
_engines: weakref.WeakKeyDictionary[object, dict[str, Engines]] = weakref.WeakKeyDictionary()


def engines(model: str) -> Engines:
    """This router's :class:`Engines` of ``model`` (made once)."""
    mine = _engines.setdefault(_api(), {})
    e = mine.get(model)
    if e is None:
        e = mine[model] = Engines(model)
    return e


def prefill_count(arg: str) -> int:
    """The number of prefill engines a P/D router was given (``pd:P``)."""
    try:
        count = int(arg)
    except ValueError:
        count = 0
    if count < 1:
        raise ValueError(f"the number of prefill engines must be an integer >= 1, got {arg!r}")
    return count


def roles(e: Engines, prefill: int) -> tuple[int, int]:
    """(prefill, decode) engines for a request under xPyD with the first ``prefill``
    engines prefilling: the live prefill engine with the fewest tokens queued and the
    least-loaded live decode engine. Where either kind has no live engine (or there are
    not more engines than ``prefill``), the other kind's engine does both."""
    live = e.alive()
    pre = [r for r in live if r < prefill]
    dec = [r for r in live if r >= prefill]
    if not pre or not dec:
        one = e.least_loaded(live)
        return one, one
    load = e.load()
    return min(pre, key=lambda r: (load[r][2], r)), e.least_loaded(dec)


async def disaggregate(req: Request, prefill: int, decode: int, split: int = -1) -> None:
    """Prefill/decode disaggregation (microserving Fig. 3, 4 and 6): the K/V of
    ``prompt[:split]`` is computed on engine ``prefill`` and written into engine
    ``decode``, which prefills ``prompt[split:]`` and generates. ``split=-1``: all but the
    last token (plain P/D); an earlier split balances prefill work onto the decode engine.
    Whatever ``decode`` already holds in its context cache (``matched_len``) is not sent."""
    e = engines(req.model)
    d = e.queue(decode)
    if prefill == decode:
        req.start_generate(d)
        return
    e.incoming[decode] += 1
    try:
        kv, matched = await _api().prep_recv(d, req.prompt, split)
        await _api().remote_send(e.queue(prefill), req.prompt, kv, decode, matched, split)
    finally:
        e.incoming[decode] -= 1
    req.start_generate(d, split)


async def serve(handle: Callable[[Request], Awaitable[None]]) -> None:
    """Take requests forever, each handled in its own task; a handler that raises rejects
    its request with the error (the requesting program sees it)."""
    a = _api()
    tasks: set[asyncio.Task] = set()
    while True:
        rid, model, prompt, program = await a.next_request()
        task = asyncio.ensure_future(_handle(handle, Request(rid, model, list(prompt), program)))
        tasks.add(task)
        task.add_done_callback(tasks.discard)


async def _handle(handle: Callable[[Request], Awaitable[None]], req: Request) -> None:
    try:
        await handle(req)
    except Exception as e:  # the router's bug or an engine failure: fail this request only
        with contextlib.suppress(ApiError):  # already answered, or its program ended
            req.reject(f"{type(e).__name__}: {e}")
