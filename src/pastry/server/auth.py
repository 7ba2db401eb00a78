"""Who an HTTP request is for: :class:`BearerAuth` and :func:`user_of`.

The bearer token of each request names its user (:class:`~pastry.control.users.Directory`);
a request without a valid one is answered 401 before anything else reads it. WebSocket
connections authenticate in-band (``server/ws.py``).
"""

from __future__ import annotations

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from pastry.control.users import LOCAL_USER, User
from pastry.server.service import PastryServer

USER_KEY = "pastry.user"  # the scope key BearerAuth sets


def is_public(path: str) -> bool:
    """The dashboard's page and its files (``server/dashboard.py``): they hold no data,
    so a browser loads them without a token; the routes with data need one."""
    return path == "/dashboard" or path.startswith("/dashboard/static/")


def user_of(scope: Scope) -> User:
    """The user an HTTP request is for (set by :class:`BearerAuth`)."""
    return scope.get(USER_KEY, LOCAL_USER)


class BearerAuth:
    """Names the user of each HTTP request by its bearer token, or rejects it with 401
    (WebSockets authenticate in-band). A token that is not ASCII is simply wrong."""

    def __init__(self, app: ASGIApp, server: PastryServer) -> None:
        self.app = app
        self.server = server

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not is_public(scope["path"]):
            # HTTP header bytes are Latin-1; tokens are printable ASCII (checked at start)
            headers = dict(scope["headers"])
            header = headers.get(b"authorization", b"").decode("latin-1")
            token = header[7:].strip() if header.lower().startswith("bearer ") else None
            if token is None and b"x-api-key" in headers:  # what Anthropic's clients send
                token = headers[b"x-api-key"].decode("latin-1").strip()
            user = self.server.authenticate(token)
            if user is None:
                message = "missing or wrong bearer token (Authorization: Bearer, or x-api-key)"
                body = {"error": {"message": message, "type": "auth_error"}}
                if scope["path"].startswith("/v1/messages"):  # Anthropic's error shape
                    body = {"type": "error", "error": {"type": "authentication_error", "message": message}}  # fmt: skip
                response = JSONResponse(body, status_code=401)
                await response(scope, receive, send)
                return
            scope[USER_KEY] = user
        await self.app(scope, receive, send)


def tenant_session(server: PastryServer, scope: Scope, key: str | None) -> str | None:
    """An API request's session key (``control/programs.py``), kept apart per user when the
    server has several: one tenant cannot join another's program by naming its session."""
    if key is None or server.directory.single_user:
        return key
    return f"{user_of(scope).name}/{key}"
