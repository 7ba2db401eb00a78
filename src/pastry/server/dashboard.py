"""``GET /dashboard``: the server as a page, live (``docs/dashboard.md``).

- ``GET /dashboard`` and ``/dashboard/static/*``: the page and its script and style,
  shipped in the package (``server/static/``; no build step, no CDN: the server may run
  offline). They hold no data, so they need no token; the page asks for one when the
  server has tokens (or takes it from the address's ``#token=`` fragment, which browsers
  never send).
- ``GET /dashboard/state``: one snapshot as JSON (``?history=1``: with every engine's
  last ten minutes), what ``pastry top`` reads.
- ``GET /dashboard/events``: the same as server-sent events, one per sample (1 s), the
  first with the history.
- ``POST /dashboard/terminate`` ``{"instance": ID}``: end a program, if the caller may.

Tenancy: a user sees its own programs only; an operator (the local user on a server
without tokens, or a user marked operator in ``--users``) sees everyone's. Engine series
and the router are the server's, shown to every user (as ``/metrics`` is).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from importlib import resources

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from pastry.server import supervisor
from pastry.server.auth import user_of
from pastry.server.dashboard_state import Recorder
from pastry.server.service import PastryServer

STATIC = {  # file -> media type
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
}
MAX_ROWS = 256  # programs listed per snapshot (the most served first); counts cover all


def _static(name: str) -> bytes:
    return resources.files("pastry.server").joinpath("static", name).read_bytes()


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error"}}, status)


def routes(server: PastryServer, recorder: Recorder) -> list[Route]:
    async def page(request: Request) -> Response:
        return Response(_static("dashboard.html"), media_type="text/html; charset=utf-8",
                        headers={"Cache-Control": "no-cache"})  # fmt: skip

    async def static(request: Request) -> Response:
        name = request.path_params["name"]
        if name not in STATIC:
            return _error(404, f"no dashboard file {name!r}")
        return Response(_static(name), media_type=STATIC[name],
                        headers={"Cache-Control": "no-cache"})  # fmt: skip

    def view(request: Request, history: bool) -> dict:
        _, health = supervisor.health(server)
        snap = recorder.snapshot(user_of(request.scope), health, history=history)
        return trimmed(snap)

    async def state(request: Request) -> JSONResponse:
        history = request.query_params.get("history", "0")
        if history not in ("0", "1"):
            return _error(400, f"history must be 0 or 1, got {history!r}")
        return JSONResponse(view(request, history == "1"))

    async def events(request: Request) -> StreamingResponse:
        async def stream() -> AsyncIterator[str]:
            yield f"data: {json.dumps(view(request, True))}\n\n"
            while True:
                await recorder.next_sample()
                yield f"data: {json.dumps(view(request, False))}\n\n"

        headers = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}
        return StreamingResponse(stream(), media_type="text/event-stream", headers=headers)

    async def terminate(request: Request) -> JSONResponse:
        try:
            body = await request.json()
        except ValueError:
            return _error(400, 'the body must be JSON: {"instance": ID}')
        iid = body.get("instance") if isinstance(body, dict) else None
        if isinstance(iid, bool) or not isinstance(iid, int):
            return _error(400, "field 'instance' must be an instance id (an integer)")
        user = user_of(request.scope)
        inst = server.runtime.instances.get(iid)
        if inst is None or not recorder.visible(inst, user):
            return _error(404, f"no running instance {iid} of yours")
        if iid == server.controller.routing.router:
            return _error(409, f"instance {iid} is the active router: start another "
                          "router instead (pastry serve --router)")  # fmt: skip
        server.runtime.terminate(iid, f"terminated from the dashboard by {user.name}")
        return JSONResponse({"terminated": iid})

    return [
        Route("/dashboard", page, methods=["GET"]),
        Route("/dashboard/static/{name}", static, methods=["GET"]),
        Route("/dashboard/state", state, methods=["GET"]),
        Route("/dashboard/events", events, methods=["GET"]),
        Route("/dashboard/terminate", terminate, methods=["POST"]),
    ]


def trimmed(snap: dict) -> dict:
    """``snap`` with its programs counted by state and listed up to :data:`MAX_ROWS`, the
    most served first."""
    rows = sorted(snap["programs"], key=lambda r: -r["service_s"])
    counts = {"total": len(rows), "running": 0, "waiting": 0, "swapped": 0}
    for r in rows:
        counts[r["state"]] += 1
    return snap | {"programs": rows[:MAX_ROWS], "counts": counts}
