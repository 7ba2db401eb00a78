"""The ASGI application (Starlette) and ``serve``, which runs it with uvicorn.

Routes: ``GET /health``; the client protocol at ``/ws`` (``server/ws.py``,
``docs/protocol.md``); the OpenAI-compatible API under ``/v1`` (``server/openai.py``);
Prometheus metrics at ``/metrics`` (``server/metrics.py``).
With an auth token configured, every HTTP request must carry ``Authorization: Bearer
<token>`` and every WebSocket connection must authenticate first.
"""

from __future__ import annotations

import contextlib
import logging

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from pastry.server import metrics, microserving, openai, sglang_api, ws
from pastry.server.service import PastryServer, ServerConfig

log = logging.getLogger(__name__)


class BearerAuth:
    """Rejects HTTP requests without the server's token (WebSockets authenticate in-band)."""

    def __init__(self, app: ASGIApp, server: PastryServer) -> None:
        self.app = app
        self.server = server

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.server.config.auth_token is not None:
            header = dict(scope["headers"]).get(b"authorization", b"").decode()
            token = header[7:] if header.lower().startswith("bearer ") else None
            if not self.server.check_token(token):
                response = JSONResponse(
                    {"error": {"message": "missing or wrong bearer token", "type": "auth_error"}},
                    status_code=401,
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(server: PastryServer) -> Starlette:
    async def health(request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok", "models": server.models})

    @contextlib.asynccontextmanager
    async def lifespan(app):
        try:
            await server.start()
        except BaseException:
            await server.stop()  # engines already started must not outlive a failed start
            raise
        metrics.install(server)
        try:
            yield
        finally:
            await server.stop()

    routes = [Route("/health", health), *ws.routes(server), *openai.routes(server)]
    routes += sglang_api.routes(server)  # SGLang's native API (/generate, ...)
    routes += metrics.routes()
    routes += microserving.routes(server)  # microserving's engine calls, the router
    return Starlette(
        routes=routes, lifespan=lifespan, middleware=[Middleware(BearerAuth, server=server)]
    )


async def serve(config: ServerConfig, log_level: str = "info") -> None:
    """Run the server until interrupted."""
    import uvicorn

    server = PastryServer(config)
    app = create_app(server)
    uv = uvicorn.Server(
        uvicorn.Config(app, host=config.host, port=config.port, log_level=log_level)
    )
    log.info("serving on http://%s:%d (WebSocket /ws, OpenAI API /v1)", config.host, config.port)
    await uv.serve()
