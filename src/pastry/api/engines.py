"""Requests across several engines of one model (microserving; ``docs/multi-engine.md``).

A model may be served by several engines (ranks 0..n-1). A queue runs on one engine
(``create_queue(model, engine)``; -1: placed by the router at the first ``route``); pages
and embeddings allocated through it live there. Slice indices are Python's: -1 = all but
the last token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated

from pastry.api.table import request
from pastry.api.types import I64, U64, Count, Handle, Token

M = "multi_engine"
G = "several engines"


@request(G, trait=M, now=Count)
class AvailableEngines:
    """How many engines serve ``model``."""

    model: str


@request(G, trait=M, now=Count)
class GetQueueEngine:
    """The rank of the engine queue ``q`` runs on."""

    q: Handle


@request(G, trait=M, now=list[tuple[Count, Count, Annotated[int, U64]]])
class GetEngineLoad:
    """Per engine of ``model``: (alive 1/0, routed contexts running there, forward tokens
    queued)."""

    model: str


@request(G, trait=M, queued=("placed",))
class Route:
    """Queued: place the context of queue ``q`` (no call issued on it yet), which is about
    to prefill ``prompt``, through the active router. Resolves to ``(begin, pages)`` once
    ``q`` runs on the chosen engine: ``pages`` (handles there, now this inferlet's) hold
    the K/V of ``prompt[:begin]``. ``whole``: the caller computes the whole prompt itself
    (it wants its outputs, e.g. prompt log-probabilities), so ``begin`` is 0 whatever the
    router moved. A queue created on a named engine, or on a model with one engine,
    resolves to ``(0, [])`` at once."""

    q: Handle
    prompt: Sequence[Token]
    whole: bool = False


@request(G, trait=M, queued=("received",))
class PrepRecv:
    """Queued, on the receiving engine: match ``prompt[:end]`` (Python slice index, ``-1``:
    all but the last token) in its context cache, allocate pages for the rest, and
    resolve to ``(kv_addr_info, matched_len)``. No compute."""

    q: Handle
    prompt: Sequence[Token]
    end: I64


@request(G, trait=M, queued=("none",))
class RemoteSend:
    """Queued, on the sending engine: write the K/V of ``prompt[begin:end]`` into the pages
    ``kv_addr_info`` names on engine ``recv_rank``, one-sided. What the sender holds is
    sent as it is (``src_pages``: this inferlet's pages there with the K/V of
    ``prompt[:src_len]``); the rest of ``prompt[:end]`` is computed there and sent layer by
    layer as the forward computes it. Resolves when every write has landed."""

    q: Handle
    prompt: Sequence[Token]
    kv_addr_info: Count
    recv_rank: Count
    begin: I64
    end: I64
    src_pages: Sequence[Handle] = ()
    src_len: Count = 0


@request(G, trait=M, now=list[Handle])
class StartGenerate:
    """Start generating on ``q``'s engine, where the K/V of ``prompt[:begin]`` is
    (received with prep_recv/remote_send; ``begin=0``: nothing needed), leaving at least
    the last token to prefill. A router hands ``request`` (from ``next_request``) over: its
    program prefills ``prompt[begin:]`` there and generates (returns ``[]``); with
    ``request=-1`` the caller starts there itself: returns the pages holding the K/V, now
    plain pages of its own."""

    q: Handle
    prompt: Sequence[Token]
    begin: I64
    request: I64 = -1


@request(G, trait=M, queued=("request",))
class NextRequest:
    """Router only: the next context to place: ``(request, model, prompt, program)``,
    ``program`` being the process-table program of the requesting instance (the requests
    of one OpenAI session share one)."""


@request(G, trait=M)
class RejectRequest:
    """Router only: fail ``request`` with ``reason``."""

    request: Count
    reason: str
