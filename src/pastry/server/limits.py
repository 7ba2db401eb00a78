"""Request limits: no request body can crash or stall the server.

- :class:`RequestLimits`, ASGI middleware in front of every HTTP route: a body over
  ``Quotas.request_bytes`` is refused with 413 before it is read (``Content-Length``) or as
  soon as it grows past the limit (chunked); a body that is JSON nested deeper than
  ``Quotas.json_depth`` or with a lone surrogate escape (``"\\ud800"``, which no UTF-8 can
  carry) is refused with 400. Endpoints then see only bodies they can handle; whatever else
  is wrong with a body they answer themselves.
- :func:`loads`, the same JSON checks for WebSocket messages.
- :func:`too_many`, the bounds on list fields (:data:`MAX_MESSAGES`, :data:`MAX_TOOLS`):
  checked first, before any work on their items.
- :func:`token_counts`, for endpoints that check prompt lengths: call it off the event loop
  (``asyncio.to_thread``); it tokenizes without holding the global lock.

Errors are OpenAI-shaped: ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pastry.control.quotas import Quotas
from pastry.control.tokenization import Tokenization

MAX_MESSAGES = 2048
"""Messages one chat request may carry (OpenAI's limit): rendering the chat template is
Python work that holds the global lock, ~10 µs a message (100k messages: ~1 s)."""
MAX_TOOLS = 128
"""Tools one request may declare (OpenAI's limit); their schemas are also bounded as
grammars when a forced call compiles them (``control/constraints.py``)."""

_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)  # a JSON string (valid JSON only)
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_BODY_METHODS = {"POST", "PUT", "PATCH", "DELETE"}


class BadRequest(ValueError):
    """A request that breaks a limit; ``status`` is its HTTP status."""

    def __init__(self, message: str, status: int = 400, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.status, self.code = status, code

    def body(self) -> bytes:
        error = {
            "message": str(self),
            "type": "invalid_request_error",
            "param": None,
            "code": self.code,
        }
        return json.dumps({"error": error}).encode()


def loads(text: str | bytes, max_depth: int) -> Any:
    """``json.loads``, refusing (:class:`BadRequest`) nesting deeper than ``max_depth`` and
    strings with lone surrogates. Text that is not JSON raises ``ValueError`` as usual."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise _too_deep(max_depth) from None
    check(value, text if isinstance(text, str) else text.decode("utf-8", "replace"), max_depth)
    return value


def check(value: Any, text: str, max_depth: int) -> None:
    """The checks of :func:`loads` on ``value``, parsed from the JSON ``text``."""
    if text.count("[") + text.count("{") > max_depth and _depth(text) > max_depth:
        raise _too_deep(max_depth)
    if _SURROGATE_ESCAPE.search(text) and _has_lone_surrogate(value):
        raise BadRequest(
            "the request has a string with a lone surrogate (a \\ud800-\\udfff escape "
            "without its pair), which is not valid Unicode text",
            code="invalid_unicode",
        )


def _too_deep(max_depth: int) -> BadRequest:
    return BadRequest(
        f"the request's JSON is nested deeper than {max_depth} levels", code="json_too_deep"
    )


def _depth(text: str) -> int:
    """Deepest bracket nesting of valid JSON ``text`` (brackets inside strings ignored)."""
    outside = _STRING.sub("", text).encode("ascii", "ignore")  # JSON outside strings: ASCII
    b = np.frombuffer(outside, dtype=np.uint8)
    opens = (b == ord("[")) | (b == ord("{"))
    closes = (b == ord("]")) | (b == ord("}"))
    steps = opens.astype(np.int32) - closes.astype(np.int32)
    return int(np.cumsum(steps).max()) if len(steps) else 0


def _has_lone_surrogate(value: Any) -> bool:
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            if not _encodes(v):
                return True
        elif isinstance(v, list):
            stack.extend(x for x in v if isinstance(x, str | list | dict))
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(x for x in v.values() if isinstance(x, str | list | dict))
    return False


def _encodes(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def too_many(value: Any, where: str, limit: int) -> str | None:
    """The 400 message for a list field ``where`` with more than ``limit`` items, or None.
    Worded as OpenAI words it (``array_above_max_length``)."""
    if isinstance(value, list) and len(value) > limit:
        return (
            f"Invalid '{where}': array too long. Expected an array with maximum length "
            f"{limit}, but got an array with length {len(value)} instead."
        )
    return None


def token_counts(
    tokens: Tokenization,
    prompts: list[str | list[int]],
    limit: int | None = None,
    add_special_tokens: bool = False,
) -> list[int]:
    """Token counts of prompts given as text or token ids. Meant for a worker thread: the
    texts are tokenized without the global lock (and remembered for the built-in inferlet
    that tokenizes them again, with the same ``add_special_tokens``,
    ``control/tokenization.py``); a text that cannot have ``limit`` tokens or fewer is not
    tokenized (its count is a lower bound over ``limit``)."""
    texts = [p for p in prompts if isinstance(p, str)]
    counts = iter(tokens.count(texts, limit, add_special_tokens) if texts else [])
    return [len(p) if isinstance(p, list) else next(counts) for p in prompts]


class RequestLimits:
    """ASGI middleware: body size, JSON depth and Unicode checks for every HTTP request.

    The body is read here (at most ``request_bytes``), checked, and handed to the app as
    one message; later ``receive`` calls (e.g. waiting for a disconnect) reach the client.
    """

    def __init__(self, app: ASGIApp, quotas: Quotas) -> None:
        self.app = app
        self.quotas = quotas

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in _BODY_METHODS:
            await self.app(scope, receive, send)
            return
        try:
            body = await self._read(scope, receive)
            if body is None:
                return  # the client went away
            if body:
                self._check_json(body)
        except BadRequest as e:
            await _reject(e, send)
            return
        delivered = False

        async def replay() -> Message:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _read(self, scope: Scope, receive: Receive) -> bytes | None:
        limit = self.quotas.request_bytes
        headers = dict(scope["headers"])
        length = headers.get(b"content-length")
        if limit is not None and length is not None and length.isdigit() and int(length) > limit:
            raise _too_large(int(length), limit)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if limit is not None and size > limit:
                raise _too_large(size, limit, more=True)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    def _check_json(self, body: bytes) -> None:
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError:
            return  # not JSON text: the endpoint answers what it makes of it
        if text.count("[") + text.count("{") <= self.quotas.json_depth and not (
            _SURROGATE_ESCAPE.search(text)
        ):
            return  # shallow, no surrogate escapes: nothing to check (no parse needed)
        try:
            loads(text, self.quotas.json_depth)
        except BadRequest:
            raise
        except ValueError:
            return  # not JSON: the endpoint answers


def _too_large(size: int, limit: int, more: bool = False) -> BadRequest:
    size_is = "is longer than" if more else f"is {size} bytes, over"
    return BadRequest(
        f"the request body {size_is} this server's limit of {limit} bytes (--max-request-bytes)",
        status=413,
        code="request_too_large",
    )


async def _reject(error: BadRequest, send: Send) -> None:
    data = error.body()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": data})
