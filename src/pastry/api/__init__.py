"""The inferlet API, defined once: one typed record per request kind.

Every function an inferlet calls is a record class registered in
:mod:`pastry.api.table` — its fields are the call's parameters, its docstring the call's
documentation — grouped by what it touches: :mod:`~pastry.api.instance` (arguments,
messages, command queues), :mod:`~pastry.api.memory` (KV pages, embeddings, exports),
:mod:`~pastry.api.model` (forward, text, the next token), :mod:`~pastry.api.services`
(grammar constraints, messaging, store, HTTP) and :mod:`~pastry.api.engines` (several
engines). Sampling and logit processing are one record, :class:`Sampling`, shared by every
call that samples.

Every value is an integer (handles are integers local to the calling inferlet), a float,
a bool, a string, bytes, a list, tuple or option of these, or a record: the same surface
is bound into the WebAssembly guest (``wit/pastry.wit``, generated from the table by
:mod:`pastry.api.wit`) and can be bound into any other language. Calls marked *queued*
take a command queue ``q``, run in queue order on the batch scheduler and return an
awaitable; they are submitted when called, so several can be issued before awaiting the
last (that is how embed, forward and sample of one step share an engine batch).

:class:`InferletApi` has one method per request (generated from the table); the host's
:class:`~pastry.control.session.Session` and the guest's binding implement its one
:meth:`~InferletApi.call`. How to add a request kind: ``docs/api.md``.
"""

from __future__ import annotations

from pastry.api.engines import *  # noqa: F403
from pastry.api.errors import ApiError

# The request kinds, in the order of the WIT file (importing registers them).
from pastry.api.instance import *  # noqa: F403
from pastry.api.memory import *  # noqa: F403
from pastry.api.model import *  # noqa: F403
from pastry.api.sampling import MAX_LOGPROBS, Sampling, sampling_of
from pastry.api.services import *  # noqa: F403
from pastry.api.surface import API_FUNCTIONS, InferletApi, answered_by
from pastry.api.table import ALIASES, BY_CLASS, SPECS, VALUES, Alias, Param, Spec, traits

TRAITS: dict[str, tuple[str, ...]] = traits()
"""Trait -> the API functions it groups; a model lists the traits it implements
(``available_traits``)."""

REQUESTS: tuple[type, ...] = tuple(s.cls for s in SPECS.values())

__all__ = [
    "answered_by",
    "ALIASES",
    "API_FUNCTIONS",
    "BY_CLASS",
    "MAX_LOGPROBS",
    "REQUESTS",
    "SPECS",
    "TRAITS",
    "VALUES",
    "Alias",
    "ApiError",
    "InferletApi",
    "Param",
    "Sampling",
    "Spec",
    "sampling_of",
    *(s.cls.__name__ for s in SPECS.values()),
]
