"""LLM microserving's engine calls as HTTP endpoints, like the paper's REST API.

- ``POST /microserving/prep_recv`` ``{"engine", "prompt", "end"}`` ->
  ``{"kv_addr_info", "matched_len"}``
- ``POST /microserving/remote_send`` ``{"engine", "prompt", "kv_addr_info", "recv_rank",
  "begin", "end"}`` -> ``{"status": "ok"}`` once every K/V write has landed
- ``POST /microserving/start_generate`` ``{"engine", "prompt", "begin", ...}``: the
  ``text-completion`` program (same options: ``max_tokens``, ``temperature``, ``stop``,
  ``seed``, ``stream``...) on that engine, with the K/V of ``prompt[:begin]`` received
  there: its result, or with ``"stream": true`` server-sent events of its text.
- ``GET /microserving/engines``: every model's engines (alive, load, KV peers) and the
  active router; ``POST /microserving/router`` ``{"router": "NAME[:ARG]"}`` swaps it.

``engine`` is a rank (``"model"`` names the model, default the first); ``prompt`` is token
ids or text (tokenized as ``text-completion`` would). The calls run in one server-held
instance (``microserving-http``), so a ``kv_addr_info`` from ``prep_recv`` stays valid for
the ``remote_send`` and ``start_generate`` that follow, as the paper's router uses them.

These calls act on the engines for every tenant (and ``router`` swaps the router that sees
every request): only operators may use them (``docs/security.md``); others get 403.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from pastry.api import ApiError
from pastry.control.events import Failed, Finished, Message, Terminated
from pastry.control.users import User
from pastry.runtime.trusted import Program
from pastry.server import errors
from pastry.server.auth import user_of
from pastry.server.service import PastryServer

log = logging.getLogger(__name__)

_HOLDER = """
import pastry.sdk as px


async def main(args):
    while True:  # holds the microserving endpoints' K/V buffers while the server runs
        await px.receive()
"""
GENERATE_OPTIONS = ("max_tokens", "temperature", "top_p", "seed", "stop", "n", "stream")


class _Error(Exception):
    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": str(self)}}, self.status)


class Microserving:
    """The server-held instance that the endpoints act through, and its queues."""

    def __init__(self, server: PastryServer) -> None:
        self.server = server
        self._inst = None
        self._queues: dict[tuple[str, int], int] = {}

    @property
    def session(self):
        if self._inst is None or self._inst.done.is_set():
            prog = Program.from_source("microserving-http", _HOLDER)
            self._inst = self.server.runtime.launch(prog, [])
            self.server.owners[self._inst.id] = None
            self._queues.clear()
        return self._inst.session

    def queue(self, model: str, rank: int) -> int:
        q = self._queues.get((model, rank))
        if q is None:
            q = self._queues[(model, rank)] = self.session.create_queue(model, rank)
        return q

    def model(self, body: dict) -> str:
        model = body.get("model") or self.server.models[0]
        if model not in self.server.models:
            raise _Error(f"no model '{model}' (served: {', '.join(self.server.models)})", 404)
        return model

    def prompt(self, body: dict, model: str) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            tok = self.server.controller.models[model].tokenizer
            return tok.encode(prompt, add_special_tokens=bool(prompt))  # a sequence start
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return prompt
        raise _Error("'prompt' must be text or a list of token ids")


def routes(server: PastryServer) -> list[Route]:
    """The microserving endpoints (a table: each handler takes the endpoints' state, the
    JSON body and the calling user)."""
    ms = Microserving(server)
    table = (
        ("/microserving/prep_recv", _prep_recv, "POST"),
        ("/microserving/remote_send", _remote_send, "POST"),
        ("/microserving/start_generate", _start_generate, "POST"),
        ("/microserving/engines", _engines, "GET"),
        ("/microserving/router", _router, "POST"),
    )
    return [Route(path, _endpoint(ms, fn), methods=[m]) for path, fn, m in table]


def _endpoint(ms: Microserving, fn):
    """The request handler of ``fn(ms, body, user)``: operators only, errors as 4xx."""

    async def run(request: Request) -> Response:
        user = user_of(request.scope)
        if not user.operator:  # issue 17: engine-wide calls are the operator's
            return _Error(
                f"user {user.name} is not an operator: the microserving endpoints act on "
                "the engines for everyone (docs/security.md)",
                403,
            ).response()
        try:
            body = await request.json() if request.method == "POST" else {}
            if not isinstance(body, dict):
                raise _Error("the body must be a JSON object")
            return await fn(ms, body, user)
        except _Error as e:
            return e.response()
        except (ApiError, ValueError) as e:
            return _Error(str(e)).response()

    return run


def _arg(body: dict, name: str, default: Any = ...) -> Any:
    value = body.get(name, default)
    if value is ...:
        raise _Error(f"'{name}' is required")
    return value


async def _prep_recv(ms: Microserving, body: dict, user: User) -> Response:
    model = ms.model(body)
    q = ms.queue(model, _arg(body, "engine"))
    kv, matched = await ms.session.prep_recv(q, ms.prompt(body, model), _arg(body, "end"))
    return JSONResponse({"kv_addr_info": kv, "matched_len": matched})


async def _remote_send(ms: Microserving, body: dict, user: User) -> Response:
    model = ms.model(body)
    q = ms.queue(model, _arg(body, "engine"))
    await ms.session.remote_send(
        q, ms.prompt(body, model), _arg(body, "kv_addr_info"), _arg(body, "recv_rank"),
        _arg(body, "begin"), _arg(body, "end"),
    )  # fmt: skip
    return JSONResponse({"status": "ok"})


async def _start_generate(ms: Microserving, body: dict, user: User) -> Response:
    server = ms.server
    model = ms.model(body)
    rank = _arg(body, "engine")
    q = ms.queue(model, rank)
    prompt = ms.prompt(body, model)
    begin = _arg(body, "begin", 0)
    unknown = sorted(set(body) - {"model", "engine", "prompt", "begin", *GENERATE_OPTIONS})
    if unknown:
        raise _Error(f"unknown fields {unknown}; options: {', '.join(GENERATE_OPTIONS)}")
    opts = {k: body[k] for k in GENERATE_OPTIONS if k in body}
    opts |= {"model": model, "prompt": prompt}
    inst = server.launch("text-completion", [json.dumps(opts)], user=user, builtin=True)
    routing = server.controller.routing
    routing.expect(inst.id, lambda req: routing.hand_over(ms.session, q, req, begin))
    if not opts.get("stream"):
        end = await inst.wait()
        if isinstance(end, Finished):
            return Response(end.result or "null", media_type="application/json")
        raise _failure(end)
    return StreamingResponse(_events(inst), media_type="text/event-stream")


async def _events(inst):
    """A streamed generation's server-sent events."""
    async for ev in inst.events():
        if isinstance(ev, Message):
            yield f"data: {ev.text}\n\n"
        elif isinstance(ev, Finished):
            yield "data: [DONE]\n\n"
        elif isinstance(ev, Failed | Terminated):
            err = str(_failure(ev))
            yield f"data: {json.dumps({'error': {'message': err}})}\n\n"


async def _engines(ms: Microserving, body: dict, user: User) -> Response:
    routing = ms.server.controller.routing
    out = {}
    for model, replicas in ms.server.controller.engines.items():
        load = routing.load(model)
        out[model] = [
            {"rank": m.rank, "alive": bool(load[m.rank][0]), "routed": load[m.rank][1],
             "queued_tokens": load[m.rank][2], "kv_peers": list(m.info.kv_peers),
             "device": m.info.device}
            for m in replicas
        ]  # fmt: skip
    return JSONResponse({"engines": out, "router": routing.router_name or None})


async def _router(ms: Microserving, body: dict, user: User) -> Response:
    spec = _arg(body, "router")
    if not isinstance(spec, str) or not spec:
        raise _Error("'router' must be NAME[:ARG], e.g. pd-balance:0.2")
    inst = await ms.server.set_router(spec, user)
    return JSONResponse({"router": spec, "instance": inst.id})


def _failure(end) -> _Error:
    """A failed or ended instance as the client's error: its reason, never a traceback
    (that goes to the log under the request's id, ``server/errors.py``)."""
    error = getattr(end, "error", None)
    if error is None:
        return _Error(f"the request was ended: {getattr(end, 'reason', end)}", 503)
    errors.note_failure(f"a built-in inferlet failed:\n{error}")
    return _Error(f"generation failed: {errors.failure_reason(error)}", 500)
