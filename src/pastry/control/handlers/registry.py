"""The request handlers, by request kind: :data:`HANDLERS` and :func:`handles`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pastry.api import BY_CLASS

HANDLERS: dict[type, Callable[[Any, Any], Any]] = {}


def handles(kind: type):
    """Register the decorated function ``fn(caller, request)`` as the handler of request
    kind ``kind`` (a record class of :mod:`pastry.api`)."""
    if kind not in BY_CLASS:
        raise TypeError(f"{kind!r} is not a request kind of pastry.api")

    def register(fn):
        if kind in HANDLERS:
            raise ValueError(f"{kind.__name__} has two handlers")
        HANDLERS[kind] = fn
        return fn

    return register
