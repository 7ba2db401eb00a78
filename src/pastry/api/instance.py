"""Requests of the instance itself: arguments, its client's messages, command queues."""

from __future__ import annotations

from pastry.api.table import request
from pastry.api.types import I32, I64, Handle


@request("runtime", now=list[str], fallible=False)
class GetArguments:
    """Arguments the client passed at launch."""


@request("runtime", now=I64, fallible=False)
class GetInstanceId:
    """This instance's id (what its client and the server's process table call it)."""


@request("runtime", now=str, fallible=False)
class GetVersion:
    """Version of this API."""


@request("runtime")
class Send:
    """Send a message to the client that launched the inferlet."""

    message: str


@request("runtime", queued=("text",), fallible=False)
class Receive:
    """The next message from the client."""


@request("runtime", now=list[str], fallible=False)
class AvailableModels:
    """Names of the models this server serves."""


@request("runtime", now=list[str])
class AvailableTraits:
    """The traits (groups of API functions, ``pastry.api.TRAITS``) ``model`` implements."""

    model: str


@request("runtime", now=Handle)
class CreateQueue:
    """A new command queue on ``model``; calls on different queues are independent.
    ``engine``: the rank of the engine it runs on (-1: the first, or where ``route``
    places it)."""

    model: str
    engine: I32 = -1


@request("runtime", queued=("none",))
class Synchronize:
    """Queued: resolves when every call queued on ``q`` before it has completed."""

    q: Handle


@request("runtime")
class SetQueuePriority:
    """Higher-priority queues are batched first (default 0), under every schedule policy:
    FCFS orders by priority, then arrival; the program-aware policies (MLFQ, PLAS, ATLAS)
    order by priority within a level (``docs/scheduling.md``)."""

    q: Handle
    priority: I32


@request("runtime")
class CloseQueue:
    """Drop a queue (its pending calls fail); resources stay with the inferlet."""

    q: Handle
