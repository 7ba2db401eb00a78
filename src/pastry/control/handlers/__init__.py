"""The host side of every request: one handler per request kind of :mod:`pastry.api`.

A handler ``fn(caller, request)`` checks the request once (an :class:`ApiError` naming the
bad value and the fix), acts on the :class:`~pastry.control.handlers.caller.Caller` (the
instance) and returns the answer, or for a queued request queues an op
(:mod:`pastry.control.ops`) and returns its future. Grouped like the API:
:mod:`~.instance`, :mod:`~.memory`, :mod:`~.model`, :mod:`~.text`, :mod:`~.grammar`,
:mod:`~.services`, :mod:`~.engines`. ``tests/test_api_table.py`` checks that every request
kind has exactly one handler.
"""

from __future__ import annotations

from pastry.control.handlers import (  # noqa: F401  (importing registers the handlers)
    engines,
    grammar,
    instance,
    memory,
    model,
    services,
    text,
)
from pastry.control.handlers.caller import Caller, QueueRef, resource_call
from pastry.control.handlers.registry import HANDLERS, handles

__all__ = ["HANDLERS", "Caller", "QueueRef", "handles", "resource_call"]
