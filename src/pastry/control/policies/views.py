"""What policies read of the scheduler: the small interfaces they are written against.

Policies never import the scheduler (:mod:`pastry.control.scheduler` imports them): they
read queues and commands through these protocols, which the scheduler's ``Queue`` and
``Command`` (and a waiting prefill's ``Admission``, :mod:`pastry.control.prefill`)
satisfy. A test or the simulator may pass anything with these fields.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from pastry.control.programs import Thread


class AdmissionView(Protocol):
    """A prefill waiting to be admitted (read only)."""

    tokens: Sequence[int]
    kv_len: int
    arrived: float
    seen: int | None  # the batch count when an admission policy first saw it (settable)
    starved: bool  # waited too long: admitted first (settable)

    def cached(self) -> int: ...


class CommandView(Protocol):
    """A queued command (read only)."""

    created: float  # arrival, on the process table's clock
    stage: int
    tokens: int  # forward input tokens
    admission: AdmissionView | None
    queue: Any  # its QueueView


class QueueView(Protocol):
    """A command queue of one instance (read only)."""

    instance: int
    priority: int  # set by the inferlet (higher first)
    pending: Sequence[CommandView]  # head first
    thread: Thread | None  # its entry in the process table
