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
"""

from __future__ import annotations

import asyncio
import json
import secrets
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from pastry.control.events import Failed, Finished, Message, Terminated
from pastry.control.programs import session_key
from pastry.control.resources import ExportError
from pastry.server import metrics
from pastry.server.auth import tenant_session, user_of
from pastry.server.openai import (
    ChoiceStream,
    JobRun,
    adapter_name,
    admit,
    chat_message,
    instance_error,
    model_name,
    read_body,
)
from pastry.server.openai_params import MAX_LOGPROBS, History, Job, OpenAIError, parse_chat
from pastry.server.relay import Events, send_json
from pastry.server.service import PastryServer

ENDPOINT = "/v1/responses"
FIELDS = frozenset({
    "model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "tools",
    "tool_choice", "parallel_tool_calls", "text", "stream", "stream_options", "store",
    "previous_response_id", "metadata", "user", "top_logprobs", "include", "truncation",
    "service_tier",
})  # fmt: skip
LOGPROBS = "message.output_text.logprobs"  # the one ``include`` this server can add
# where parse_chat's errors name a chat field, the Responses field it came from
_CHAT_NAMES = {
    "max_tokens": "max_output_tokens",
    "messages": "input",
    "response_format": "text.format",
    "logprobs": "top_logprobs",
}


def _error(message: str, param: str | None, status: int = 400, code: str | None = None):
    return OpenAIError(message, param, status, code)


# ---------------------------------------------------------------------- the store


@dataclass
class Stored:
    """A stored response: its body, its input items, the conversation up to and with its
    answer (chat messages, without the instructions, which a follow-up does not inherit),
    and the tokens and KV export of that conversation."""

    body: dict
    input_items: list[dict]
    conversation: list[dict]
    history: History | None
    model: str
    served: str = ""  # the model name it was asked for (a LoRA adapter's, or the model's)


@dataclass
class ResponseStore:
    """Each user's stored responses, least recently stored first; over ``limit`` per user
    the oldest goes (with its KV export)."""

    server: PastryServer
    limit: int | None
    users: dict[str, OrderedDict[str, Stored]] = field(default_factory=dict)

    def get(self, user: str, rid: str) -> Stored | None:
        return self.users.get(user, {}).get(rid)

    def put(self, user: str, rid: str, stored: Stored) -> None:
        mine = self.users.setdefault(user, OrderedDict())
        mine[rid] = stored
        while self.limit is not None and len(mine) > self.limit:
            _, dropped = mine.popitem(last=False)
            self._forget(user, dropped)

    def delete(self, user: str, rid: str) -> bool:
        stored = self.users.get(user, {}).pop(rid, None)
        if stored is None:
            return False
        self._forget(user, stored)
        return True

    def _forget(self, user: str, stored: Stored) -> None:
        if stored.history is not None and stored.history.export is not None:
            drop_export(self.server, stored.model, user, stored.history.export)


def drop_export(server: PastryServer, model: str, user: str, name: str) -> None:
    """Unexport ``user``'s persistent export ``name`` if it is still there."""
    m = server.controller.models.get(model)
    if m is None:
        return
    try:
        m.resources.unexport(None, name, user)
    except ExportError:  # already dropped (memory was short) or never made
        return
    m.scheduler.wake()  # waiting prefills may use its pages


# ---------------------------------------------------------------------- requests


@dataclass(frozen=True)
class Spec:
    """A checked Responses request: what to run, and what to echo in the response."""

    job: Job
    echo: dict  # the request's fields as the response object repeats them
    store: bool
    input_items: list[dict]
    conversation: list[dict]  # the messages before the answer (without the instructions)
    obfuscate: bool


def parse_response(
    model, body: dict, store: ResponseStore, user: str, adapter: str | None = None
) -> Spec:
    """``model``: the served model, ``adapter``: its LoRA adapter the request names (if
    any); errors are :class:`OpenAIError` naming the field."""
    for name in body:
        if name not in FIELDS and body[name] is not None:
            raise _error(f"'{name}' is not supported by this server", name)
    previous = None
    prev_id = body.get("previous_response_id")
    if prev_id is not None:
        previous = store.get(user, prev_id) if isinstance(prev_id, str) else None
        if previous is None:
            raise _error(
                f"Previous response with id {prev_id!r} not found (responses are kept only "
                "with store: true, per user, until deleted or evicted)",
                "previous_response_id",
                404,
                "previous_response_not_found",
            )
        if previous.model != model.name:
            raise _error(
                f"the previous response was made by model {previous.model!r}, not {model.name!r}",
                "previous_response_id",
            )
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise _error("'instructions' must be a string", "instructions")
    items = _input_items(body.get("input"))
    new = _messages(items)
    conversation = (previous.conversation if previous else []) + new
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + conversation  # fmt: skip
    if not messages:
        raise _error("'input' is empty: give a message to answer", "input")
    tools = _tools(body.get("tools"))
    chat: dict[str, Any] = {
        "model": model.name,
        "messages": messages,
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "stream": body.get("stream"),
        "user": body.get("user"),
        "tools": tools or None,
        "tool_choice": _tool_choice(body.get("tool_choice")),
        "parallel_tool_calls": body.get("parallel_tool_calls"),
        "response_format": _text_format(body.get("text")),
    }
    top = body.get("top_logprobs")
    include = _include(body.get("include"))
    if top is not None or LOGPROBS in include:
        chat["logprobs"], chat["top_logprobs"] = True, top
    max_out = body.get("max_output_tokens")
    if max_out is not None:
        if isinstance(max_out, bool) or not isinstance(max_out, int) or max_out < 1:
            raise _error(f"'max_output_tokens' must be an integer >= 1, got {max_out!r}", "max_output_tokens")  # fmt: skip
        chat["max_tokens"] = max_out
    truncation = body.get("truncation")
    if truncation not in (None, "disabled"):
        raise _error(
            f"'truncation' {truncation!r} is not supported: only 'disabled' (a conversation "
            "longer than the context is an error)",
            "truncation",
        )
    if body.get("service_tier") not in (None, "auto", "default"):
        raise _error("'service_tier' must be 'auto' or 'default' on this server", "service_tier")
    stored = body.get("store", True)
    if stored is None:
        stored = True
    if not isinstance(stored, bool):
        raise _error("'store' must be true or false", "store")
    metadata = _metadata(body.get("metadata"))
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict) or set(stream_options) - {"include_obfuscation"}:
        raise _error("'stream_options' must be {\"include_obfuscation\": bool}", "stream_options")
    obfuscate = stream_options.get("include_obfuscation", True)
    if not isinstance(obfuscate, bool):
        raise _error("'stream_options.include_obfuscation' must be true or false", "stream_options")  # fmt: skip
    rid = "resp_" + uuid.uuid4().hex
    served = adapter or model.name
    # KV computed with another adapter (or without one) is not this request's
    history = previous.history if previous and previous.served == served else None
    options = {"kv_export": f"responses/{rid}"} if stored else None
    try:
        job = parse_chat(model, {k: v for k, v in chat.items() if v is not None}, history=history, options=options, adapter=adapter)  # fmt: skip
    except OpenAIError as e:
        raise _renamed(e) from None
    if job.n != 1:  # never: Responses has no n
        raise _error("one output per response", None)
    echo = {
        "id": rid,
        "instructions": instructions,
        "max_output_tokens": max_out,
        "max_tool_calls": None,
        "metadata": metadata,
        "model": served,
        "parallel_tool_calls": body.get("parallel_tool_calls", True) is not False,
        "previous_response_id": prev_id,
        "reasoning": {"effort": None, "summary": None},
        "service_tier": "default",
        "store": stored,
        "temperature": body.get("temperature", 1.0),
        "text": {"format": (body.get("text") or {}).get("format") or {"type": "text"}},
        "tool_choice": body.get("tool_choice") or ("auto" if tools else "none"),
        "tools": body.get("tools") or [],
        "top_logprobs": top,
        "top_p": body.get("top_p", 1.0),
        "truncation": "disabled",
        "user": body.get("user"),
    }
    for key in ("temperature", "top_p"):
        if echo[key] is None:
            echo[key] = 1.0
    return Spec(job, echo, stored, items, conversation, obfuscate)


def _renamed(e: OpenAIError) -> OpenAIError:
    """A chat-request error in the Responses request's terms."""
    message, param = str(e), e.param
    message = message.replace("the messages", "the input")
    for chat, ours in _CHAT_NAMES.items():
        message = message.replace(f"'{chat}'", f"'{ours}'")
        if param is not None and (param == chat or param.startswith(chat + "[")):
            param = ours + param[len(chat) :]
    return OpenAIError(message, param, e.status, e.code, e.kind)


def _input_items(value: Any) -> list[dict]:
    """``input`` as a list of items (a string is one user message), each checked."""
    if isinstance(value, str):
        return [_message_item({"role": "user", "content": value}, "input")]
    if not isinstance(value, list):
        raise _error("'input' must be a string or a list of input items", "input")
    out = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise _error(f"'{where}' must be an object", where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            out.append(_message_item(item, where))
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    raise _error(f"'{where}.{key}' must be a string", f"{where}.{key}")
            _only(item, {"type", "id", "call_id", "name", "arguments", "status"}, where)
            out.append({"type": "function_call", **{k: item[k] for k in ("call_id", "name", "arguments")}, "id": item.get("id") or "fc_" + uuid.uuid4().hex, "status": "completed"})  # fmt: skip
        elif kind == "function_call_output":
            _only(item, {"type", "id", "call_id", "output", "status"}, where)
            if not isinstance(item.get("call_id"), str):
                raise _error(f"'{where}.call_id' must be a string", f"{where}.call_id")
            output = _text_of(item.get("output"), f"{where}.output", ("input_text",))
            out.append({"type": "function_call_output", "call_id": item["call_id"], "output": output, "id": item.get("id") or "fco_" + uuid.uuid4().hex, "status": "completed"})  # fmt: skip
        else:
            raise _error(
                f"'{where}' has type {kind!r}: this server takes message, function_call and "
                "function_call_output items",
                f"{where}.type",
            )
    return out


def _message_item(item: dict, where: str) -> dict:
    _only(item, {"type", "role", "content", "id", "status", "phase"}, where)
    role = item.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise _error(f"'{where}.role' must be user, system, developer or assistant", f"{where}.role")  # fmt: skip
    kinds = ("output_text", "refusal") if role == "assistant" else ("input_text",)
    text = _text_of(item.get("content"), f"{where}.content", kinds)
    return {"type": "message", "role": role, "content": [{"type": kinds[0], "text": text}], "id": item.get("id") or "msg_" + uuid.uuid4().hex, "status": "completed"}  # fmt: skip


def _text_of(content: Any, where: str, kinds: tuple[str, ...]) -> str:
    """A string, or text parts of ``kinds`` joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _error(f"'{where}' must be a string or a list of {kinds[0]} parts", where)
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in kinds:
            raise _error(
                f"'{where}[{j}]' has type {kind!r}: this server takes text only ({', '.join(kinds)})",
                f"{where}[{j}].type",
            )
        text = part.get("text", part.get("refusal"))
        if not isinstance(text, str):
            raise _error(f"'{where}[{j}].text' must be a string", f"{where}[{j}].text")
        parts.append(text)
    return "".join(parts)


def _only(item: dict, keys: set[str], where: str) -> None:
    extra = sorted(k for k in item if k not in keys and item[k] is not None)
    if extra:
        raise _error(f"'{where}.{extra[0]}' is not supported by this server", f"{where}.{extra[0]}")  # fmt: skip


def _messages(items: list[dict]) -> list[dict]:
    """Chat messages of input items: consecutive function calls join the assistant message
    before them."""
    out: list[dict] = []
    for item in items:
        if item["type"] == "message":
            out.append({"role": item["role"], "content": item["content"][0]["text"]})
        elif item["type"] == "function_call":
            call = {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}}  # fmt: skip
            if out and out[-1]["role"] == "assistant" and "raw" not in out[-1]:
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})  # fmt: skip
    return out


def _tools(value: Any) -> list[dict]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise _error("'tools' must be a list of function tools", "tools")
    out = []
    for i, t in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else None
            raise _error(
                f"'{where}' has type {kind!r}: this server runs function tools only",
                f"{where}.type",
            )
        _only(t, {"type", "name", "description", "parameters", "strict"}, where)
        fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if t.get(k) is not None}  # fmt: skip
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(value: Any) -> Any:
    if value is None or value in ("none", "auto", "required"):
        return value
    if isinstance(value, dict) and value.get("type") == "function" and set(value) <= {"type", "name"}:  # fmt: skip
        return {"type": "function", "function": {"name": value.get("name")}}
    raise _error(
        '\'tool_choice\' must be "none", "auto", "required" or {"type": "function", "name": ...}'
        f", got {value!r:.100}",
        "tool_choice",
    )


def _text_format(text: Any) -> dict | None:
    if text is None:
        return None
    if not isinstance(text, dict):
        raise _error("'text' must be an object: {\"format\": {...}}", "text")
    _only(text, {"format"}, "text")
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_schema":
        spec = {k: v for k, v in fmt.items() if k != "type"}
        return {"type": "json_schema", "json_schema": spec}
    if kind in ("text", "json_object") and set(fmt) == {"type"}:
        return {"type": kind}
    raise _error(
        '\'text.format\' must be {"type": "text"}, {"type": "json_object"} or {"type": '
        f'"json_schema", "name", "schema", "strict"}}, got {fmt!r:.100}',
        "text.format",
    )


def _include(value: Any) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _error("'include' must be a list of strings", "include")
    for i, v in enumerate(value):
        if v != LOGPROBS:
            raise _error(f"'include' value {v!r} is not supported: only {LOGPROBS!r}", f"include[{i}]")  # fmt: skip
    return value


def _short(s: Any, n: int) -> bool:
    return isinstance(s, str) and len(s) <= n


def _metadata(value: Any) -> dict:
    if value is None:
        return {}
    if (
        not isinstance(value, dict)
        or len(value) > 16
        or not all(_short(k, 64) and _short(v, 512) for k, v in value.items())
    ):
        raise _error(
            "'metadata' must be at most 16 string keys (64 characters) to string values (512)",
            "metadata",
        )
    return value


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

    def keep(self, body: dict, result: dict, text: str) -> None:
        """Store the finished response with its conversation (and the KV export)."""
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
        self.store.put(self.user, self.id, Stored(body, self.spec.input_items, conversation, history, self.job.model, self.job.served))  # fmt: skip
        self.kept = True

    def output_items(self, c: dict) -> tuple[list[dict], str]:
        message, finish = chat_message(self.job, c["text"], c["finish_reason"])
        items = []
        if message.get("content"):
            lps = _logprobs(self.writer.logprobs(c["logprobs"]))
            items.append(_message(message["content"], lps))
        for call in message.get("tool_calls", []):
            items.append(_call_item(call["id"], call["function"]["name"], call["function"]["arguments"]))  # fmt: skip
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
        self.keep(body, result, c["text"])
        metrics.request_done(ENDPOINT, 200, result["usage"])
        await send_json(send, 200, body)

    async def _stream(self, events: Events, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]})  # fmt: skip
        out = _EventWriter(send, self.spec.obfuscate)
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
                    self.keep(body, result, c["text"])
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


def _message(text: str, logprobs: list[dict], status: str = "completed", mid: str | None = None) -> dict:  # fmt: skip
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}
    return {"type": "message", "id": mid or "msg_" + uuid.uuid4().hex, "status": status, "role": "assistant", "content": [part]}  # fmt: skip


def _call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {"type": "function_call", "id": "fc_" + uuid.uuid4().hex, "call_id": call_id, "name": name, "arguments": arguments, "status": status}  # fmt: skip


class _EventWriter:
    """The events of one streamed response: items opened, grown and closed in order."""

    def __init__(self, send: Send, obfuscate: bool) -> None:
        self.send, self.obfuscate = send, obfuscate
        self.seq = 0
        self.items: list[dict] = []  # finished items
        self.open: dict | None = None  # the item being written
        self.text = ""
        self.logprobs: list[dict] = []

    async def emit(self, kind: str, **fields) -> None:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        if self.obfuscate and kind.endswith(".delta"):
            data["obfuscation"] = secrets.token_urlsafe(12)[: 4 + self.seq % 8]
        chunk = f"event: {kind}\ndata: {json.dumps(data)}\n\n".encode()
        await self.send({"type": "http.response.body", "body": chunk, "more_body": True})

    @property
    def index(self) -> int:
        return len(self.items)

    async def piece(self, delta: Any, logprobs: list[dict]) -> None:
        """A delta of the chat stream: text (a str) or tool calls ({"tool_calls": [...]})."""
        if isinstance(delta, str):
            if not delta and not logprobs:
                return
            if self.open is None or self.open["type"] != "message":
                await self.close_item()
                self.open = _message("", [], "in_progress")
                self.open["content"] = []
                await self.emit("response.output_item.added", output_index=self.index, item=self.open)  # fmt: skip
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                await self.emit("response.content_part.added", item_id=self.open["id"], output_index=self.index, content_index=0, part=part)  # fmt: skip
            self.text += delta
            self.logprobs += logprobs
            await self.emit("response.output_text.delta", item_id=self.open["id"], output_index=self.index, content_index=0, delta=delta, logprobs=logprobs)  # fmt: skip
            return
        for call in (delta or {}).get("tool_calls", []):
            fn = call.get("function") or {}
            if call.get("id"):  # a new call
                await self.close_item()
                self.open = _call_item(call["id"], fn.get("name", ""), "", "in_progress")
                await self.emit("response.output_item.added", output_index=self.index, item=dict(self.open))  # fmt: skip
            if fn.get("arguments"):
                self.open["arguments"] += fn["arguments"]
                await self.emit("response.function_call_arguments.delta", item_id=self.open["id"], output_index=self.index, delta=fn["arguments"])  # fmt: skip

    async def close_item(self) -> None:
        item, self.open = self.open, None
        if item is None:
            return
        at = self.index
        if item["type"] == "message":
            part = {"type": "output_text", "text": self.text, "annotations": [], "logprobs": self.logprobs}  # fmt: skip
            await self.emit("response.output_text.done", item_id=item["id"], output_index=at, content_index=0, text=self.text, logprobs=self.logprobs)  # fmt: skip
            await self.emit("response.content_part.done", item_id=item["id"], output_index=at, content_index=0, part=part)  # fmt: skip
            item = {**item, "status": "completed", "content": [part]}
            self.text, self.logprobs = "", []
        else:
            await self.emit("response.function_call_arguments.done", item_id=item["id"], output_index=at, name=item["name"], arguments=item["arguments"])  # fmt: skip
            item = {**item, "status": "completed"}
        self.items.append(item)
        await self.emit("response.output_item.done", output_index=at, item=item)


# ---------------------------------------------------------------------- routes


def routes(server: PastryServer) -> list[Route]:
    store = ResponseStore(server, server.config.quotas.responses_per_user)

    async def create(request: Request):
        user = user_of(request.scope).name
        try:
            body = await read_body(request)
            m = server.controller.models[model_name(server, body)]
            adapter = adapter_name(server, body)
            spec = await asyncio.to_thread(parse_response, m, body, store, user, adapter)
            admit(server, request, spec.job, body)
        except OpenAIError as e:
            metrics.request_done(ENDPOINT, e.status)
            return JSONResponse(e.body(), e.status)
        session = session_key(request.headers.get("x-session-id"), body.get("user"))
        return ResponsesRun(store, spec, user, tenant_session(server, request.scope, session))

    def found(request: Request) -> tuple[str, Stored | None]:
        rid = request.path_params["response_id"]
        return rid, store.get(user_of(request.scope).name, rid)

    def missing(rid: str) -> JSONResponse:
        e = _error(f"No response found with id {rid!r}", "response_id", 404, "not_found")
        return JSONResponse(e.body(), 404)

    async def retrieve(request: Request) -> JSONResponse:
        rid, stored = found(request)
        if stored is None:
            return missing(rid)
        for key in request.query_params:
            if key not in ("include", "include[]") and not (key == "stream" and request.query_params[key] == "false"):  # fmt: skip
                e = _error(f"query parameter {key!r} is not supported by this server", key)
                return JSONResponse(e.body(), 400)
        return JSONResponse(stored.body)

    async def delete(request: Request) -> JSONResponse:
        rid = request.path_params["response_id"]
        if not store.delete(user_of(request.scope).name, rid):
            return missing(rid)
        return JSONResponse({"id": rid, "object": "response", "deleted": True})

    async def input_items(request: Request) -> JSONResponse:
        rid, stored = found(request)
        if stored is None:
            return missing(rid)
        q = request.query_params
        try:
            limit = int(q.get("limit", 20))
        except ValueError:
            limit = 0
        order = q.get("order", "desc")
        if not 1 <= limit <= 100 or order not in ("asc", "desc"):
            e = _error("'limit' must be 1 to 100 and 'order' asc or desc", "limit" if not 1 <= limit <= 100 else "order")  # fmt: skip
            return JSONResponse(e.body(), 400)
        items = list(stored.input_items if order == "asc" else reversed(stored.input_items))
        after = q.get("after")
        if after is not None:
            ids = [i["id"] for i in items]
            if after not in ids:
                e = _error(f"'after' {after!r} is not an item of this response", "after")
                return JSONResponse(e.body(), 400)
            items = items[ids.index(after) + 1 :]
        page = items[:limit]
        return JSONResponse({
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > limit,
        })  # fmt: skip

    return [
        Route(ENDPOINT, create, methods=["POST"]),
        Route(ENDPOINT + "/{response_id}", retrieve, methods=["GET"]),
        Route(ENDPOINT + "/{response_id}", delete, methods=["DELETE"]),
        Route(ENDPOINT + "/{response_id}/input_items", input_items, methods=["GET"]),
    ]


__all__ = ["MAX_LOGPROBS", "ResponseStore", "parse_response", "routes"]
