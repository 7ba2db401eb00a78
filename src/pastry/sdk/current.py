"""Which instance's API the running code calls: :func:`api` and :func:`bind`.

Each inferlet instance runs with its own :class:`~pastry.api.InferletApi` (the host's
session for a trusted inferlet, the guest binding in the sandbox), kept in a context
variable so that concurrent instances on one event loop each see their own.
"""

from __future__ import annotations

from contextvars import ContextVar, Token

from pastry.api import InferletApi

_current: ContextVar[InferletApi] = ContextVar("pastry_inferlet")


def api() -> InferletApi:
    """The API of the inferlet instance this code runs in."""
    try:
        return _current.get()
    except LookupError:
        raise RuntimeError(
            "pastry.sdk is used outside an inferlet: its functions work only while an "
            "inferlet instance runs (launched by the server or pastry.runtime)"
        ) from None


def bind(instance_api: InferletApi) -> Token:
    """Make ``instance_api`` the API of the code that runs from here on in this context
    (a runner calls it when it starts an instance's task)."""
    return _current.set(instance_api)
