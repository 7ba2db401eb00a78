"""The ASGI application (Starlette) and ``serve``, which runs it with uvicorn.

Routes: ``GET /health``; the client protocol at ``/ws`` (``server/ws.py``,
``docs/protocol.md``); the OpenAI-compatible API under ``/v1`` (``server/openai.py``);
Prometheus metrics at ``/metrics`` (``server/metrics.py``); the live dashboard at
``/dashboard`` (``server/dashboard.py``).
With tokens configured (``--auth-token``, ``--users``), every HTTP request must carry
``Authorization: Bearer <token>`` and every WebSocket connection must authenticate first;
the token names the user the request is for (``server/auth.py``). Every HTTP request then
passes :class:`~pastry.server.limits.RequestLimits` (body size, JSON depth, Unicode).
Outermost, :class:`~pastry.server.errors.RequestIds` gives every request an id
(``X-Request-Id``) and logs every 5xx answer under it, with the traceback the client does
not get.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from pastry.server import (
    anthropic,
    dashboard,
    metrics,
    microserving,
    openai,
    responses,
    sglang_api,
    supervisor,
    ws,
)
from pastry.server.auth import BearerAuth
from pastry.server.dashboard_state import Recorder
from pastry.server.errors import RequestIds
from pastry.server.limits import RequestLimits
from pastry.server.service import PastryServer, ServerConfig

if TYPE_CHECKING:
    import uvicorn

log = logging.getLogger(__name__)


def create_app(server: PastryServer) -> Starlette:
    async def health(request: Request) -> JSONResponse:
        # "degraded" while an engine is down or restarting (server/supervisor.py); 503
        # when some model has no engine left to serve it
        status, engines = supervisor.health(server)
        serving = {e["model"] for e in engines if e["state"] == supervisor.UP}
        code = 200 if serving >= {e["model"] for e in engines} else 503
        return JSONResponse({"status": status, "models": server.models, "engines": engines}, code)

    recorder = Recorder(server)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        try:
            await server.start()
        except BaseException:
            await server.stop()  # engines already started must not outlive a failed start
            raise
        metrics.install(server)
        recorder.start()
        try:
            yield
        finally:
            await recorder.stop()
            await server.stop()

    routes = [Route("/health", health), *ws.routes(server), *openai.routes(server)]
    routes += responses.routes(server)  # OpenAI's Responses API (/v1/responses)
    routes += anthropic.routes(server)  # Anthropic's Messages API (/v1/messages)
    routes += sglang_api.routes(server)  # SGLang's native API (/generate, ...)
    routes += metrics.routes()
    routes += dashboard.routes(server, recorder)  # the live page, its state and events
    routes += microserving.routes(server)  # microserving's engine calls, the router
    middleware = [  # outermost first: nobody's body is read before they authenticate
        Middleware(RequestIds),  # every answer has an id; every 5xx is logged under it
        Middleware(BearerAuth, server=server),
        Middleware(RequestLimits, quotas=server.config.quotas),
    ]
    return Starlette(routes=routes, lifespan=lifespan, middleware=middleware)


def uvicorn_config(server: PastryServer, log_level: str = "info") -> uvicorn.Config:
    """How uvicorn runs the server's application: its address, connection limit, idle
    keep-alive and largest WebSocket message (``serve`` and the test harness alike)."""
    import uvicorn

    config = server.config
    q = config.quotas
    return uvicorn.Config(
        create_app(server),
        host=config.host,
        port=config.port,
        log_level=log_level,
        limit_concurrency=q.max_connections,
        timeout_keep_alive=config.keep_alive,  # type: ignore[arg-type] (a float works)
        ws_max_size=q.request_bytes or 16 * 2**20,
    )


async def serve(config: ServerConfig, log_level: str = "info") -> None:
    """Run the server until interrupted."""
    import uvicorn

    uv = uvicorn.Server(uvicorn_config(PastryServer(config), log_level))
    log.info("serving on http://%s:%d (WebSocket /ws, OpenAI API /v1)", config.host, config.port)
    await uv.serve()
