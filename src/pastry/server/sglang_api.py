"""SGLang's native HTTP API: ``POST /generate``, ``GET /get_model_info``,
``GET /get_server_info``, ``POST /flush_cache`` — the endpoints SGLang's
``RuntimeEndpoint`` (and so SGLang's frontend language) talks to.

A ``/generate`` request is checked here (a 400 ``{"error": {"message"}}`` naming the
field, for anything malformed or not implemented — never silently ignored), then each
prompt runs as one instance of the built-in ``sglang-generate`` inferlet
(``inferlets/sglang_generate.py``) through the same scheduler as every other inferlet.
A batch (``text`` or ``input_ids`` as a list) answers a list, one object per prompt and
generation (prompt ``i``'s ``j``-th of ``n`` at ``i * n + j``); with ``"stream": true``
the answer is server-sent events ``data: {...}`` carrying the text so far, then
``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Awaitable
from functools import partial
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

import pastry
from pastry.control.events import Failed, Finished, Message, Terminated
from pastry.control.programs import session_key
from pastry.runtime.trusted import Instance
from pastry.server import errors
from pastry.server.auth import tenant_session, user_of
from pastry.server.openai_options import OpenAIError
from pastry.server.relay import Events, relay, send_json
from pastry.server.service import LaunchQuotaError, PastryServer
from pastry.server.sglang_params import ApiError, Job, check_texts, parse

PROGRAM = "sglang-generate"


def routes(server: PastryServer) -> list[Route]:
    """SGLang's native endpoints (a table: each handler takes the server and the request)."""
    table = (
        ("/generate", _generate, ["POST", "PUT"]),
        ("/get_model_info", _get_model_info, ["GET"]),
        ("/get_server_info", _get_server_info, ["GET"]),
        ("/flush_cache", _flush_cache, ["POST", "GET"]),
    )
    return [Route(path, partial(fn, server), methods=m) for path, fn, m in table]


async def _get_model_info(server: PastryServer, request: Request) -> JSONResponse:
    info = server.controller.models[server.models[0]].info
    return JSONResponse(
        {
            "model_path": info.model_name,
            "tokenizer_path": info.model_name,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "has_image_understanding": info.image_layout is not None,
            "has_audio_understanding": False,
            "model_type": info.arch,
            "architectures": None,
        }
    )


async def _get_server_info(server: PastryServer, request: Request) -> JSONResponse:
    info = server.controller.models[server.models[0]].info
    cfg = server.config
    return JSONResponse(
        {
            "version": f"pastry {pastry.__version__}",
            "model_path": info.model_name,
            "served_model_name": info.model_name,
            "served_models": server.models,
            "context_length": info.max_position,
            "page_size": info.page_size,
            "max_total_num_tokens": info.num_pages * info.page_size,
            "max_batch_tokens": info.max_batch_tokens,
            "dtype": info.dtype,
            "device": info.device,
            "host": cfg.host,
            "port": cfg.port,
            "schedule_policy": cfg.schedule,
            "batching_policy": cfg.policy,
            "admission_policy": cfg.admission,
            "internal_states": [],
        }
    )


async def _flush_cache(server: PastryServer, request: Request) -> PlainTextResponse:
    """Evict every engine's prefix cache but the pages inferlets hold (those stay: a
    running program keeps its KV); says how many KV pages were freed, per engine."""
    engines = server.controller.all_engines()
    if all(m.resources.cache is None for m in engines):
        return PlainTextResponse(
            "Cache flushed: nothing to flush (this server runs without a prefix cache, "
            "--no-prefix-cache).\n"
        )
    parts = [f"{m.name} engine {m.rank}: {m.resources.flush_cache()}" for m in engines]
    return PlainTextResponse(f"Cache flushed. KV pages freed: {'; '.join(parts)}.\n")


async def _generate(server: PastryServer, request: Request):
    try:
        body = await request.json()
    except ValueError as e:
        return ApiError(f"the request body is not valid JSON: {e}").response()
    try:
        try:
            await server.image_fetch.inline(body, "generate")  # image URLs it may fetch
        except OpenAIError as e:
            raise ApiError(str(e)) from None
        job = await asyncio.to_thread(parse, server, body)  # compiles grammars: off the loop
        await asyncio.to_thread(check_texts, server, body)  # issue 17: off the loop
        _admit(server, request, job)
    except ApiError as e:
        return e.response()
    user = body.get("user") if isinstance(body, dict) else None
    session = session_key(request.headers.get("x-session-id"), user)
    return Generate(server, job, tenant_session(server, request.scope, session))


def _admit(server: PastryServer, request: Request, job: Job) -> None:
    """Prompts x n under the per-request cap; instances under the user's quota."""
    limit = server.config.quotas.request_choices
    if limit is not None and sum(job.n) > limit:
        raise ApiError(
            f"{len(job.n)} prompts with {sum(job.n)} generations in all, over this server's "
            f"limit of {limit} per request (--max-request-choices): send fewer per request"
        )
    try:
        server.admit(user_of(request.scope), len(job.args))
    except LaunchQuotaError as e:
        raise ApiError(str(e), 429) from None


# ---------------------------------------------------------------------- running and answering


class Generate:
    """The answer to one ``/generate``, as an ASGI response: launches one instance per
    prompt, relays their results (or text, when streaming), ends them if the client goes."""

    def __init__(self, server: PastryServer, job: Job, session: str | None = None) -> None:
        self.server = server
        self.job = job
        self.start = time.time()
        self.program = session or f"request:{uuid.uuid4().hex}"  # its process-table entry

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        user = user_of(scope)

        def launch(arg: str) -> Instance:
            inst = self.server.launch(PROGRAM, [arg], owner=self, user=user, builtin=True)
            self.server.controller.programs.join(inst.id, self.program)
            return inst

        def answer(events: Events) -> Awaitable[None]:
            return self._stream(events, send) if self.job.stream else self._reply(events, send)

        await relay(self.server, self, self.job.args, launch, answer, receive)

    def _items(self, k: int, result: str) -> list[dict]:
        items = json.loads(result)
        for item in items:
            item["meta_info"]["id"] = self.job.rids[k]
            item["meta_info"]["e2e_latency"] = time.time() - self.start
        return items

    async def _reply(self, events: Events, send: Send) -> None:
        results: dict[int, list[dict]] = {}
        while len(results) < len(self.job.args):
            k, ev = await events.get()
            if isinstance(ev, Finished):
                results[k] = self._items(k, ev.result)
            elif isinstance(ev, Failed | Terminated):
                status, message = _failure(ev)
                await send_json(send, status, {"error": {"message": message}})
                return
        flat = [item for k in sorted(results) for item in results[k]]
        body = flat if self.job.batch or len(flat) > 1 else flat[0]
        await send_json(send, 200, body)

    async def _stream(self, events: Events, send: Send) -> None:
        headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})

        async def emit(data: Any) -> None:
            text = data if isinstance(data, str) else json.dumps(data)
            await send(
                {
                    "type": "http.response.body",
                    "body": f"data: {text}\n\n".encode(),
                    "more_body": True,
                }
            )

        offsets = [0]
        for n in self.job.n[:-1]:
            offsets.append(offsets[-1] + n)
        texts: dict[int, str] = {}
        left = len(self.job.args)
        while left:
            k, ev = await events.get()
            if isinstance(ev, Message):
                m = json.loads(ev.text)
                index = offsets[k] + m["index"]
                texts[index] = texts.get(index, "") + m["delta"]
                meta = {"id": self.job.rids[k], "finish_reason": None}
                await emit({"text": texts[index], "meta_info": meta, "index": index})
            elif isinstance(ev, Finished):
                for j, item in enumerate(self._items(k, ev.result)):
                    await emit({**item, "index": offsets[k] + j})
                left -= 1
            elif isinstance(ev, Failed | Terminated):
                await emit({"error": {"message": _failure(ev)[1]}})
                break
        await emit("[DONE]")
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def _failure(ev: Failed | Terminated) -> tuple[int, str]:
    if isinstance(ev, Terminated):
        return 503, f"the request was ended: {ev.reason}"
    errors.note_failure(f"a built-in inferlet failed:\n{ev.error}")  # the log, not the client
    message = f"generation failed: {errors.failure_reason(ev.error)}"
    rid = errors.current_request_id()
    return 500, message if rid is None else f"{message} (logged as request {rid})"
