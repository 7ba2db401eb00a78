"""What an inferlet instance tells its client: typed events on its session's outbox.

An instance produces any number of :class:`Message` events (``send``), then exactly one
:class:`End` event: :class:`Finished` (``main`` returned), :class:`Failed` (it raised, or
the sandbox ended it over a limit) or :class:`Terminated` (ended from outside: its client,
the resource policy, shutdown). Consumers match on the type; ``kind`` is the event's name
on the wire (the WebSocket protocol, ``docs/protocol.md``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, TypeAlias


@dataclass(frozen=True, slots=True)
class Message:
    """A message the inferlet sent to its client."""

    text: str
    kind: ClassVar[str] = "message"


@dataclass(frozen=True, slots=True)
class Finished:
    """``main`` returned: its result as text (``None``: it returned nothing)."""

    result: str | None
    kind: ClassVar[str] = "result"


@dataclass(frozen=True, slots=True)
class Failed:
    """The inferlet raised (``error`` is the traceback) or broke a sandbox limit (the limit)."""

    error: str
    kind: ClassVar[str] = "error"


@dataclass(frozen=True, slots=True)
class Terminated:
    """The instance was ended from outside; ``reason`` says by whom and why."""

    reason: str
    kind: ClassVar[str] = "terminated"


End: TypeAlias = Finished | Failed | Terminated
Event: TypeAlias = Message | Finished | Failed | Terminated


def event_data(event: Event) -> str | None:
    """The event's one field (text, result, error or reason), as the wire carries it."""
    match event:
        case Message(text):
            return text
        case Finished(result):
            return result
        case Failed(error):
            return error
        case Terminated(reason):
            return reason
    raise TypeError(f"not an instance event: {event!r}")
