"""The Python SDK for inferlets.

An inferlet is a Python module with an entry point::

    async def main(args: list[str]) -> str | None

``args`` are the launch arguments; the return value (if not None) is sent to the client as
the instance's result; an exception ends the instance and its traceback goes to the client.
Inside, every function of the inferlet API (:mod:`pastry.api`) is available here as a
module-level function bound to the running instance, e.g. ``pastry.sdk.send("hi")`` (the
calls that sample take a :class:`Sampling` record, or its fields as keywords:
``sample(q, e, temperature=0.7)``), and the support library (:class:`Context`, samplers, stop conditions) is built on them::

    from pastry.sdk import Context

    async def main(args):
        ctx = Context()
        ctx.fill("Hello,")
        return await ctx.generate_until(max_tokens=10)
"""

from __future__ import annotations

from typing import Any

from pastry.api import API_FUNCTIONS, ApiError, InferletApi, Sampling
from pastry.sdk.current import api, bind


def _bind(name: str):
    def call(*args: Any, **kwargs: Any) -> Any:
        return getattr(api(), name)(*args, **kwargs)

    call.__name__ = call.__qualname__ = name
    call.__doc__ = getattr(InferletApi, name).__doc__
    return call


for _name in API_FUNCTIONS:
    globals()[_name] = _bind(_name)

from pastry.sdk.context import Context  # noqa: E402
from pastry.sdk.sampling import Greedy, MinP, Sampler, TopK, TopP  # noqa: E402
from pastry.sdk.stop import EosTokens, MaxTokens, StopCondition, StopStrings  # noqa: E402

__all__ = [
    "API_FUNCTIONS",
    "ApiError",
    "Sampling",
    "Context",
    "EosTokens",
    "Greedy",
    "MaxTokens",
    "MinP",
    "Sampler",
    "StopCondition",
    "StopStrings",
    "TopK",
    "TopP",
    "api",
    "bind",
    *API_FUNCTIONS,
]
