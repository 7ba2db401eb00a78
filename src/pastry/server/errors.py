"""Request ids and internal errors: what an operator needs to find a failure, and nothing
a client should not see.

- :class:`RequestIds`, the outermost ASGI middleware. Every HTTP request and WebSocket
  connection gets an id: the client's ``X-Request-Id`` when it is a plain token of at most
  64 characters (``[A-Za-z0-9._:-]``, so that ids a proxy assigns carry through), else a
  new ``req-`` + 24 hex digits. Every response carries it in ``X-Request-Id`` (a
  WebSocket handshake too). Every 5xx response is logged under it (status, method, path,
  the error's message, and the details handlers noted, e.g. a failed inferlet's
  traceback), and a JSON error body gets ``"request_id"`` (in ``error`` when it has one).
  An exception that escapes a route is logged with its traceback and answered 500
  ``{"error": {"message": "internal server error (logged as request ...)", "type":
  "server_error", "request_id": ...}}``: tracebacks stay in the log.
- :func:`note_failure`: a handler about to answer 5xx hands the log what the client will
  not see (a traceback; logged at once when the response has started, e.g. a stream);
  :func:`current_request_id` for messages that name the id.
- :func:`failure_reason`: one line for a client out of a traceback's text.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
from contextvars import ContextVar
from dataclasses import dataclass, field

from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger(__name__)

_CLIENT_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")
_MAX_BUFFERED = 64 << 10  # a 5xx body larger than this passes unchanged
_MAX_REASON = 300  # characters of a failure's reason shown to a client


@dataclass
class RequestState:
    """The request being served (a context variable: every task the request starts sees it)."""

    id: str
    details: list[str] = field(default_factory=list)
    started: bool = False  # the response has started: a failure now is logged at once


_current: ContextVar[RequestState | None] = ContextVar("pastry_request", default=None)


def new_request_id() -> str:
    return "req-" + secrets.token_hex(12)


def current_request_id() -> str | None:
    """The id of the request this code runs for, or None outside of one."""
    state = _current.get()
    return state.id if state is not None else None


def note_failure(detail: str) -> None:
    """Record ``detail`` (a traceback, a reason) for the log line of the current request's
    5xx answer. Once the response has started (a stream that answered 200 fails later)
    or outside of a request, it is logged at once, under the request's id."""
    state = _current.get()
    if state is None:
        log.error("internal failure outside of a request:\n%s", detail)
    elif state.started:
        log.error("request %s failed after its response started:\n%s", state.id, detail)
    else:
        state.details.append(detail)


def failure_reason(error: str) -> str:
    """The first line of the exception message in a traceback's ``error`` text (the line
    after the last ``File ...`` frame and its code; the first line when it has no frames),
    without its exception's module path, cut to a few hundred characters: what a client
    may see (a multi-line message, e.g. a grammar's state dump, stays in the log)."""
    lines = error.strip().splitlines()
    frames = [i for i, line in enumerate(lines) if line.startswith('  File "')]
    at = frames[-1] + 1 if frames else 0
    while frames and at < len(lines) and lines[at].startswith("    "):  # its code, carets
        at += 1
    rest = [line for line in lines[at:] if line.strip()]
    reason = rest[0] if rest else "unknown error"
    head, sep, tail = reason.partition(": ")
    if sep and re.fullmatch(r"[\w.]+", head):  # "pastry.api.ApiError: ..." -> "ApiError: ..."
        reason = head.rsplit(".", 1)[-1] + sep + tail
    reason = reason.strip()
    return reason if len(reason) <= _MAX_REASON else reason[: _MAX_REASON - 3] + "..."


class RequestIds:
    """ASGI middleware: request ids, 5xx logging, no traceback to a client (see the module
    docstring). Put it outermost, so that every answer (401, 413, ...) has an id."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        rid = _client_id(scope) or new_request_id()
        state = RequestState(rid)
        token = _current.set(state)
        scope.setdefault("state", {})["request_id"] = rid
        reply = _IdSender(scope, state, send)
        try:
            await self.app(scope, receive, reply)
        except Exception:
            log.exception(
                "request %s: %s %s failed with an exception", rid, _method(scope), _path(scope)
            )
            if scope["type"] == "http" and not state.started:
                await reply.internal_error()
        finally:
            _current.reset(token)


class _IdSender:
    """The ``send`` of one request: adds ``X-Request-Id`` to the answer's headers, logs a
    5xx, and holds a 5xx JSON answer until its body is complete, to add the id to it."""

    def __init__(self, scope: Scope, state: RequestState, send: Send) -> None:
        self.scope, self.state, self.send = scope, state, send
        self.header = (b"x-request-id", state.id.encode())
        self.held: Message | None = None  # a 5xx JSON start, until its body is complete
        self.body = b""

    async def __call__(self, message: Message) -> None:
        kind = message["type"]
        if kind == "websocket.accept":
            message = {**message, "headers": [*message.get("headers", []), self.header]}
        elif kind == "http.response.start":
            self.state.started = True
            message = {**message, "headers": [*message.get("headers", []), self.header]}
            status = message["status"]
            if status >= 500:
                if _is_json(message):
                    self.held = message
                    return
                _log_failure(self.scope, self.state, status, "")
        elif kind == "http.response.body" and self.held is not None:
            self.body += message.get("body", b"")
            if message.get("more_body", False) and len(self.body) <= _MAX_BUFFERED:
                return
            message = await self._release(message)
        await self.send(message)

    async def _release(self, last: Message) -> Message:
        """Log the held 5xx and send its start; returns ``last`` carrying the whole body,
        the id added (a body too large to rewrite goes as it came)."""
        start, self.held = self.held, None
        status = start["status"]
        new_body, text = _with_request_id(self.body, self.state.id)
        if last.get("more_body", False):  # too large to rewrite: as it came
            new_body = self.body
        _log_failure(self.scope, self.state, status, text)
        headers = [(k, v) for k, v in start["headers"] if k.lower() != b"content-length"]
        if not last.get("more_body", False):
            headers.append((b"content-length", str(len(new_body)).encode()))
        await self.send({**start, "headers": headers})
        return {**last, "body": new_body}

    async def internal_error(self) -> None:
        """The 500 of an exception that escaped the app before it answered."""
        rid = self.state.id
        error = {
            "message": f"internal server error (logged as request {rid})",
            "type": "server_error",
            "param": None,
            "code": None,
            "request_id": rid,
        }
        data = json.dumps({"error": error}).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(data)).encode()),
            self.header,
        ]
        await self.send({"type": "http.response.start", "status": 500, "headers": headers})
        await self.send({"type": "http.response.body", "body": data})


def _log_failure(scope: Scope, state: RequestState, status: int, message: str) -> None:
    details = "".join(f"\n{d.rstrip()}" for d in state.details)
    level = logging.WARNING if status == 503 else logging.ERROR
    log.log(
        level, "request %s: %d on %s %s: %s%s",
        state.id, status, _method(scope), _path(scope), message or "(no message)", details,
    )  # fmt: skip


def _client_id(scope: Scope) -> str | None:
    for name, value in scope.get("headers", ()):
        if name == b"x-request-id":
            text = value.decode("latin-1")
            return text if _CLIENT_ID.fullmatch(text) else None
    return None


def _is_json(start: Message) -> bool:
    for name, value in start.get("headers", ()):
        if name.lower() == b"content-type":
            return value.split(b";")[0].strip().lower() == b"application/json"
    return False


def _with_request_id(body: bytes, rid: str) -> tuple[bytes, str]:
    """The JSON error ``body`` with ``request_id`` added, and its message (for the log)."""
    try:
        value = json.loads(body)
    except ValueError:
        return body, body[:_MAX_REASON].decode("utf-8", "replace")
    if not isinstance(value, dict):
        return body, str(value)[:_MAX_REASON]
    error = value.get("error")
    if isinstance(error, dict):
        error["request_id"] = rid
        message = str(error.get("message", ""))
    else:
        value["request_id"] = rid
        message = str(error if error is not None else value.get("message", ""))
    return json.dumps(value).encode(), message


def _method(scope: Scope) -> str:
    return scope.get("method", "WEBSOCKET")


def _path(scope: Scope) -> str:
    return scope.get("path", "")
