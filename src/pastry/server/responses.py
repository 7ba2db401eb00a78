"""OpenAI's Responses API: ``POST /v1/responses``, ``GET`` and ``DELETE
/v1/responses/{id}``, ``GET /v1/responses/{id}/input_items``.

A request is translated into the chat request it means (``instructions`` and ``input``
items become messages, ``max_output_tokens``, ``text.format``, function ``tools`` and
``tool_choice`` their chat forms) and checked by :func:`~pastry.server.openai_params.
parse_chat`; it runs as the ``chat`` inferlet like ``/v1/chat/completions``, and its output
is written as Responses items (an assistant ``message``, ``function_call`` items) — whole,
or streamed as the documented events (``response.created``, ``response.in_progress``,
``response.output_item.added``, ``response.content_part.added``,
``response.output_text.delta`` / ``.done``, ``response.function_call_arguments.delta`` /
``.done``, ``response.output_item.done``, then ``response.completed`` or
``response.incomplete``).

**State as KV.** A stored response (``store``, the default) keeps its conversation — the
messages, and the token ids the model saw and wrote — in the server, one store per user,
and its KV as a persistent export of the user's (``responses/<id>``). A follow-up naming
it as ``previous_response_id`` continues the conversation: when its rendered prompt starts
with the stored conversation's text (the same instructions and tools), the chat inferlet
imports the export and computes only the new turn (``usage.input_tokens_details.
cached_tokens`` counts the rest). Exports are a cache under the memory quotas of
``docs/security.md``: dropped least recently used when memory runs short (the follow-up
then computes the history again), and with the stored response when it is deleted or
evicted (at most ``--max-responses-per-user``, oldest first).

Anything the API defines that this server does not do is refused with a 400 naming it
(``docs/endpoints.md`` lists what is supported).

Here: the routes and the answers; the request is checked in
:mod:`pastry.server.responses_params`, the stream's events written by
:mod:`pastry.server.responses_events`, the stored responses kept in
:mod:`pastry.server.responses_store`.
"""

from __future__ import annotations

import asyncio
import json
from functools import partial

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from pastry.control.events import Failed, Finished, Message, Terminated
from pastry.control.programs import session_key
from pastry.server import metrics
from pastry.server.auth import tenant_session, user_of
from pastry.server.openai import adapter_name, admit, model_name, read_body
from pastry.server.openai_answers import (
    SSE_HEADERS,
    ChoiceStream,
    JobRun,
    chat_message,
    instance_error,
)
from pastry.server.openai_params import MAX_LOGPROBS, History, OpenAIError
from pastry.server.relay import Events, send_json
from pastry.server.responses_disk import ResponseFiles
from pastry.server.responses_events import EventWriter, call_item, message_item
from pastry.server.responses_params import FIELDS, Spec, parse_response
from pastry.server.responses_store import ResponseStore, Stored, drop_export
from pastry.server.service import PastryServer

ENDPOINT = "/v1/responses"


# ---------------------------------------------------------------------- answers


def _usage(usage: dict, stored: bool, exported: bool) -> dict:
    cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    return {
        "input_tokens": usage["prompt_tokens"],
        "input_tokens_details": {
            "cached_tokens": cached,
            # prompt tokens newly kept as KV for a follow-up
            "cache_write_tokens": usage["prompt_tokens"] - cached if stored and exported else 0,
        },
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage["total_tokens"],
    }


def _logprobs(lps: dict | None) -> list[dict]:
    """Chat's ``logprobs.content`` entries are the Responses API's logprob objects."""
    return list(lps["content"]) if lps else []


class ResponsesRun(JobRun):
    prefix = "resp_"

    def __init__(self, store: ResponseStore, spec: Spec, user: str, session: str | None) -> None:
        super().__init__(store.server, spec.job, session, ENDPOINT)
        self.spec, self.user = spec, user
        self.id = spec.echo["id"]
        self.store = store
        self.kept = False  # the response (and its KV export) is in the store

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            name = f"responses/{self.id}"
            if self.spec.store and not self.kept:  # ended early: no orphaned export
                drop_export(self.server, self.job.model, self.user, name)

    def body(self, status: str, output: list[dict], usage: dict | None, error=None) -> dict:
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "background": False,
            "error": error,
            "incomplete_details": incomplete,
            **{k: v for k, v in self.spec.echo.items() if k != "id"},
            "output": output,
            "usage": usage,
        }

    async def keep(self, body: dict, result: dict, text: str) -> None:
        """Store the finished response with its conversation (and the KV export); returns
        once it is on the disk (the client hears of it after that)."""
        if not self.spec.store:
            return
        (choice,) = result["choices"]
        tokens = result["prompt"]["tokens"] + choice["tokens"]
        tok = self.writer.tok
        kv = result.get("kv")
        export = kv["name"] if kv and kv["tokens"] == len(tokens) else None
        history = History(tokens, self.job.prompt_text + tok.decode(choice["tokens"]), export)
        # the answer as the model wrote it: what the follow-up's prompt shows it
        answer = {"role": "assistant", "content": text, "raw": True}
        conversation = [*self.spec.conversation, answer]
        stored = Stored(body, self.spec.input_items, conversation, history, self.job.model, self.job.served)  # fmt: skip
        self.kept = True  # in the store from here on, whatever happens to the disk write
        await self.store.put(self.user, self.id, stored)

    def output_items(self, c: dict) -> tuple[list[dict], str]:
        message, finish = chat_message(self.job, c["text"], c["finish_reason"])
        items = []
        if message.get("content"):
            lps = _logprobs(self.writer.logprobs(c["logprobs"]))
            items.append(message_item(message["content"], lps))
        for call in message.get("tool_calls", []):
            items.append(call_item(call["id"], call["function"]["name"], call["function"]["arguments"]))  # fmt: skip
        return items, finish

    async def _reply(self, events: Events, send: Send) -> None:
        while True:
            _, ev = await events.get()
            match ev:
                case Finished(result):
                    result = json.loads(result)
                    break
                case Failed() | Terminated():
                    error = instance_error(ev)
                    metrics.request_done(ENDPOINT, error.status)
                    await send_json(send, error.status, error.body())
                    return
        (c,) = result["choices"]
        items, finish = self.output_items(c)
        status = "incomplete" if finish == "length" else "completed"
        usage = _usage(result["usage"], self.spec.store, "kv" in result)
        body = self.body(status, items, usage)
        await self.keep(body, result, c["text"])
        metrics.request_done(ENDPOINT, 200, result["usage"])
        await send_json(send, 200, body)

    async def _stream(self, events: Events, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        out = EventWriter(send, self.spec.obfuscate)
        await out.emit("response.created", response=self.body("in_progress", [], None))
        await out.emit("response.in_progress", response=self.body("in_progress", [], None))
        stream = ChoiceStream(self.job, self.writer)
        while True:
            _, ev = await events.get()
            match ev:
                case Message(text):
                    m = json.loads(text)
                    for delta, lps in stream.feed(m["delta"], m["logprobs"]):
                        await out.piece(delta, _logprobs(lps))
                case Finished(result):
                    result = json.loads(result)
                    (c,) = result["choices"]
                    pieces = stream.finish(c, c["finish_reason"])
                    for delta, lps, _ in pieces:
                        await out.piece(delta, _logprobs(lps))
                    finish = pieces[-1][2]
                    await out.close_item()
                    status = "incomplete" if finish == "length" else "completed"
                    usage = _usage(result["usage"], self.spec.store, "kv" in result)
                    body = self.body(status, out.items, usage)
                    await self.keep(body, result, c["text"])
                    metrics.request_done(ENDPOINT, 200, result["usage"])
                    await out.emit(f"response.{status}", response=body)
                    break
                case Failed() | Terminated():
                    error = instance_error(ev)
                    metrics.request_done(ENDPOINT, error.status)
                    failed = self.body("failed", out.items, None, {"code": "server_error", "message": str(error)})  # fmt: skip
                    await out.emit("response.failed", response=failed)
                    break
        await send({"type": "http.response.body", "body": b"", "more_body": False})


# ---------------------------------------------------------------------- routes


def routes(server: PastryServer) -> list[Route]:
    """The endpoints (a table: each handler takes the users' store and the request)."""
    root = server.config.responses_dir
    files = None if root is None else ResponseFiles(root)
    store = ResponseStore(server, server.config.quotas.responses_per_user, files)
    table = (
        (ENDPOINT, _create, ["POST"]),
        (ENDPOINT + "/{response_id}", _retrieve, ["GET"]),
        (ENDPOINT + "/{response_id}", _delete, ["DELETE"]),
        (ENDPOINT + "/{response_id}/input_items", _input_items, ["GET"]),
    )
    return [Route(path, partial(fn, store), methods=m) for path, fn, m in table]


async def _create(store: ResponseStore, request: Request):
    server = store.server
    user = user_of(request.scope).name
    try:
        body = await read_body(request)
        m = server.controller.models[model_name(server, body)]
        adapter = adapter_name(server, body)
        await server.image_fetch.inline(body, "responses")  # image URLs it may fetch
        spec = await asyncio.to_thread(
            parse_response, m, body, store, user, adapter, server.config.quotas
        )
        admit(server, request, spec.job, body)
    except OpenAIError as e:
        metrics.request_done(ENDPOINT, e.status)
        return JSONResponse(e.body(), e.status)
    session = session_key(request.headers.get("x-session-id"), body.get("user"))
    return ResponsesRun(store, spec, user, tenant_session(server, request.scope, session))


def _found(store: ResponseStore, request: Request) -> tuple[str, Stored | None]:
    rid = request.path_params["response_id"]
    return rid, store.get(user_of(request.scope).name, rid)


def _bad(message: str, param: str | None, status: int = 400, code: str | None = None):
    e = OpenAIError(message, param, status, code)
    return JSONResponse(e.body(), status)


def _missing(rid: str) -> JSONResponse:
    return _bad(f"No response found with id {rid!r}", "response_id", 404, "not_found")


async def _retrieve(store: ResponseStore, request: Request) -> JSONResponse:
    rid, stored = _found(store, request)
    if stored is None:
        return _missing(rid)
    for key in request.query_params:
        if key not in ("include", "include[]") and not (key == "stream" and request.query_params[key] == "false"):  # fmt: skip
            return _bad(f"query parameter {key!r} is not supported by this server", key)
    return JSONResponse(stored.body)


async def _delete(store: ResponseStore, request: Request) -> JSONResponse:
    rid = request.path_params["response_id"]
    if not await store.delete(user_of(request.scope).name, rid):
        return _missing(rid)
    return JSONResponse({"id": rid, "object": "response", "deleted": True})


async def _input_items(store: ResponseStore, request: Request) -> JSONResponse:
    """A page of a stored response's input items (``limit``, ``order``, ``after``)."""
    rid, stored = _found(store, request)
    if stored is None:
        return _missing(rid)
    q = request.query_params
    try:
        limit = int(q.get("limit", 20))
    except ValueError:
        limit = 0
    order = q.get("order", "desc")
    if not 1 <= limit <= 100 or order not in ("asc", "desc"):
        return _bad("'limit' must be 1 to 100 and 'order' asc or desc", "limit" if not 1 <= limit <= 100 else "order")  # fmt: skip
    items = list(stored.input_items if order == "asc" else reversed(stored.input_items))
    after = q.get("after")
    if after is not None:
        ids = [i["id"] for i in items]
        if after not in ids:
            return _bad(f"'after' {after!r} is not an item of this response", "after")
        items = items[ids.index(after) + 1 :]
    page = items[:limit]
    return JSONResponse({
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(items) > limit,
    })  # fmt: skip


__all__ = ["FIELDS", "MAX_LOGPROBS", "ResponseStore", "parse_response", "routes"]
