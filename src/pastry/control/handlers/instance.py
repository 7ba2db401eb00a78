"""Handlers of the instance's own requests: arguments, its client's messages, queues."""

from __future__ import annotations

import asyncio

from pastry import api
from pastry.api import ApiError
from pastry.control.commands import Stage
from pastry.control.events import Message
from pastry.control.handlers.caller import Caller, QueueRef
from pastry.control.handlers.registry import handles
from pastry.control.ops import SYNC

API_VERSION = "0.1.0"


@handles(api.GetArguments)
def get_arguments(s: Caller, r: api.GetArguments) -> list[str]:
    return list(s.args)


@handles(api.GetInstanceId)
def get_instance_id(s: Caller, r: api.GetInstanceId) -> int:
    return s.instance


@handles(api.GetVersion)
def get_version(s: Caller, r: api.GetVersion) -> str:
    return API_VERSION


@handles(api.Send)
def send(s: Caller, r: api.Send) -> None:
    if not isinstance(r.message, str):
        raise ApiError(f"send takes a string, got {type(r.message).__name__}")
    limit = s.controller.quotas.backlog_bytes
    if limit is not None and s.outbox.queued_bytes > limit:
        reason = (
            f"its client has not read {s.outbox.queued_bytes} bytes of its messages, "
            f"over the backlog quota of {limit} bytes (--max-backlog-bytes): a client must "
            "keep reading what its instances send"
        )
        s.controller.on_terminate(s.instance, reason)
        raise ApiError(f"this inferlet was ended: {reason}")
    s.outbox.put_nowait(Message(r.message))


@handles(api.Receive)
def receive(s: Caller, r: api.Receive):
    return s.inbox.get()


@handles(api.AvailableModels)
def available_models(s: Caller, r: api.AvailableModels) -> list[str]:
    return list(s.controller.models)


@handles(api.AvailableTraits)
def available_traits(s: Caller, r: api.AvailableTraits) -> list[str]:
    return s.model(r.model).traits


@handles(api.CreateQueue)
def create_queue(s: Caller, r: api.CreateQueue) -> int:
    m = s.model(r.model)
    if r.engine != -1:
        m = s.controller.routing.engine(r.model, r.engine)
    qid = s.new_handle()
    queue = m.scheduler.create_queue(s.instance)
    s.queues[qid] = QueueRef(m, queue, r.engine != -1)
    return qid


@handles(api.Synchronize)
def synchronize(s: Caller, r: api.Synchronize) -> asyncio.Future:
    return s.submit(s.queue(r.q), Stage.CONTROL, SYNC)


@handles(api.SetQueuePriority)
def set_queue_priority(s: Caller, r: api.SetQueuePriority) -> None:
    ref = s.queue(r.q)
    if not isinstance(r.priority, int) or isinstance(r.priority, bool):
        raise ApiError(f"priority must be an integer, got {r.priority!r}")
    ref.model.scheduler.set_priority(ref.queue, r.priority)


@handles(api.CloseQueue)
def close_queue(s: Caller, r: api.CloseQueue) -> None:
    ref = s.queue(r.q)
    ref.model.scheduler.close_queue(ref.queue, f"queue {r.q} was closed")
    del s.queues[r.q]
    s.controller.routing.queue_closed(s.instance, r.q)
