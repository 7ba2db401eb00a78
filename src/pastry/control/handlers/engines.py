"""Handlers of the requests across several engines: the control layer's routing
(:mod:`pastry.control.routing`) answers them."""

from __future__ import annotations

import asyncio

from pastry import api
from pastry.control.handlers.caller import Caller
from pastry.control.handlers.registry import handles


@handles(api.AvailableEngines)
def available_engines(s: Caller, r: api.AvailableEngines) -> int:
    return len(s.controller.routing.engines(r.model))


@handles(api.GetQueueEngine)
def get_queue_engine(s: Caller, r: api.GetQueueEngine) -> int:
    return s.queue(r.q).model.rank


@handles(api.GetEngineLoad)
def get_engine_load(s: Caller, r: api.GetEngineLoad) -> list[tuple[int, int, int]]:
    return s.controller.routing.load(r.model)


@handles(api.Route)
def route(s: Caller, r: api.Route) -> asyncio.Future:
    return s.controller.routing.route(s, r.q, r.prompt, r.whole)


@handles(api.PrepRecv)
def prep_recv(s: Caller, r: api.PrepRecv) -> asyncio.Future:
    return s.controller.routing.transfers.prep_recv(s, r.q, r.prompt, r.end)


@handles(api.RemoteSend)
def remote_send(s: Caller, r: api.RemoteSend) -> asyncio.Future:
    return s.controller.routing.transfers.remote_send(
        s, r.q, r.prompt, r.kv_addr_info, r.recv_rank, r.begin, r.end, r.src_pages or (),
        r.src_len,
    )  # fmt: skip


@handles(api.StartGenerate)
def start_generate(s: Caller, r: api.StartGenerate) -> list[int]:
    return s.controller.routing.start_generate(s, r.q, r.prompt, r.begin, r.request)


@handles(api.NextRequest)
def next_request(s: Caller, r: api.NextRequest) -> asyncio.Future:
    return s.controller.routing.next_request(s)


@handles(api.RejectRequest)
def reject_request(s: Caller, r: api.RejectRequest) -> None:
    s.controller.routing.reject_request(s, r.request, r.reason)
