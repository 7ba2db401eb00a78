"""Anthropic's Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

A request is translated into the chat request it means — ``system``, ``messages`` with
``text``, ``tool_use`` and ``tool_result`` blocks, ``max_tokens``, ``temperature``,
``top_p``, ``top_k``, ``stop_sequences``, ``tools`` (``input_schema``) and ``tool_choice``
(``auto`` / ``any`` / ``tool`` / ``none``, ``disable_parallel_tool_use``) — checked by
:func:`~pastry.server.openai_params.parse_chat`, and runs as the ``chat`` inferlet like
``/v1/chat/completions``. The answer is a ``message`` with ``text`` and ``tool_use``
blocks and Anthropic's ``stop_reason`` (``end_turn``, ``max_tokens``, ``stop_sequence``
with the ``stop_sequence`` that matched, ``tool_use``), or, with ``stream``, the events
``message_start``, ``content_block_start``, ``content_block_delta`` (``text_delta``,
``input_json_delta``), ``content_block_stop``, ``message_delta``, ``message_stop``.
``usage.cache_read_input_tokens`` are the prompt tokens the automatic prefix cache supplied
(``input_tokens`` are the others, as Anthropic counts them); the prefix cache caches every
prompt, so ``cache_control`` marks are accepted and need nothing more. Errors have
Anthropic's shape, ``{"type": "error", "error": {"type", "message"}}``, and name the field;
``x-api-key`` is accepted as the bearer token (``server/auth.py``).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.types import Send

from pastry.control.events import Failed, Finished, Message, Terminated
from pastry.control.programs import session_key
from pastry.control.quotas import Quotas
from pastry.server import metrics
from pastry.server.auth import tenant_session
from pastry.server.chat_images import added_positions, anthropic_image
from pastry.server.openai import adapter_name, admit, model_name, read_body
from pastry.server.openai_answers import ChoiceStream, JobRun, chat_message, instance_error
from pastry.server.openai_params import Job, OpenAIError, parse_chat
from pastry.server.relay import Events, send_json
from pastry.server.service import PastryServer

ENDPOINT = "/v1/messages"
FIELDS = frozenset({
    "model", "messages", "system", "max_tokens", "temperature", "top_p", "top_k",
    "stop_sequences", "stream", "tools", "tool_choice", "metadata", "service_tier",
    "output_config", "cache_control",
})  # fmt: skip
_KINDS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
# where parse_chat's errors name a chat field, the Messages field it came from
_CHAT_NAMES = {"stop": "stop_sequences", "response_format": "output_config.format"}


def error_body(e: OpenAIError) -> dict:
    """An error in Anthropic's shape (the field it names is in the message)."""
    return {"type": "error", "error": {"type": _KINDS.get(e.status, "api_error"), "message": str(e)}}  # fmt: skip


def _error(message: str, param: str | None = None, status: int = 400) -> OpenAIError:
    return OpenAIError(message, param, status)


def _only(obj: dict, keys: set[str], where: str) -> None:
    extra = sorted(k for k in obj if k not in keys and obj[k] is not None)
    if extra:
        raise _error(f"'{where}.{extra[0]}' is not supported by this server", f"{where}.{extra[0]}")  # fmt: skip


def _cache_control(block: dict, where: str) -> None:
    """``cache_control`` marks are honoured by the automatic prefix cache (it caches every
    prompt); anything but an ephemeral mark is refused."""
    mark = block.get("cache_control")
    if mark is not None and not (isinstance(mark, dict) and mark.get("type") == "ephemeral" and set(mark) <= {"type", "ttl"}):  # fmt: skip
        raise _error(f"'{where}.cache_control' must be {{\"type\": \"ephemeral\"}}", f"{where}.cache_control")  # fmt: skip


def _text(content: Any, where: str) -> str:
    """A string, or ``text`` blocks joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _error(f"'{where}' must be a string or a list of text blocks", where)
    return "".join(_text_block(b, f"{where}[{j}]") for j, b in enumerate(content))


def _text_block(b: Any, w: str) -> str:
    if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
        kind = b.get("type") if isinstance(b, dict) else None
        raise _error(f"'{w}' must be a text block (this server takes text only), got type {kind!r}", f"{w}.type")  # fmt: skip
    _only(b, {"type", "text", "cache_control"}, w)
    _cache_control(b, w)
    return b["text"]


def chat_messages(system: Any, messages: Any, model=None, quotas: Quotas | None = None) -> list[dict]:  # fmt: skip
    """Anthropic's ``system`` and ``messages`` as chat messages: ``tool_use`` blocks become
    the assistant's tool calls, ``tool_result`` blocks tool messages, base64 ``image``
    blocks of a user turn (with ``quotas``) ``image_url`` parts of its content."""
    out: list[dict] = []
    if system is not None:
        out.append({"role": "system", "content": _text(system, "system")})
    if not isinstance(messages, list) or not messages:
        raise _error('\'messages\' must be a non-empty list of {"role", "content"}', "messages")
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise _error(f"'{where}.role' must be 'user' or 'assistant'", f"{where}.role")
        _only(m, {"role", "content"}, where)
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": m["role"], "content": content})
            continue
        if not isinstance(content, list):
            raise _error(f"'{where}.content' must be a string or a list of blocks", f"{where}.content")  # fmt: skip
        text, calls, results, images = [], [], [], []
        for j, b in enumerate(content):
            w = f"{where}.content[{j}]"
            kind = b.get("type") if isinstance(b, dict) else None
            if kind == "text":
                text.append(_text_block(b, w))
                images.append({"type": "text", "text": text[-1]})
            elif kind == "image" and m["role"] == "user" and quotas is not None:
                _cache_control(b, w)
                _only(b, {"type", "source", "cache_control"}, w)
                images.append(anthropic_image(b, w, model, quotas))
            elif kind == "tool_use" and m["role"] == "assistant":
                _only(b, {"type", "id", "name", "input", "cache_control"}, w)
                if not (isinstance(b.get("id"), str) and isinstance(b.get("name"), str) and isinstance(b.get("input"), dict)):  # fmt: skip
                    raise _error(f"'{w}' must be {{\"type\": \"tool_use\", \"id\", \"name\", \"input\": {{...}}}}", w)  # fmt: skip
                calls.append({"id": b["id"], "type": "function", "function": {"name": b["name"], "arguments": json.dumps(b["input"])}})  # fmt: skip
            elif kind == "tool_result" and m["role"] == "user":
                _only(b, {"type", "tool_use_id", "content", "is_error", "cache_control"}, w)
                if not isinstance(b.get("tool_use_id"), str):
                    raise _error(f"'{w}.tool_use_id' must be a string", f"{w}.tool_use_id")
                result = _text(b.get("content") or "", f"{w}.content")
                if b.get("is_error"):
                    result = f"Error: {result}"
                results.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": result})  # fmt: skip
            else:
                raise _error(
                    f"'{w}' has type {kind!r}: this server takes text blocks, tool_use "
                    "(assistant) and tool_result and image (user) blocks",
                    f"{w}.type",
                )
        out += results  # a user turn's tool results come first, then its text
        if calls:
            out.append({"role": "assistant", "content": "".join(text) or None, "tool_calls": calls})  # fmt: skip
        elif len(images) > len(text):  # the turn's text and images, in order
            out.append({"role": "user", "content": images})
        elif text or not results:
            out.append({"role": m["role"], "content": "".join(text)})
    return out


def _tools(value: Any) -> list[dict] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise _error("'tools' must be a list of {\"name\", \"description\", \"input_schema\"}", "tools")  # fmt: skip
    out = []
    for i, t in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type", "custom") not in ("custom", None):
            kind = t.get("type") if isinstance(t, dict) else None
            raise _error(f"'{where}' has type {kind!r}: this server runs custom (client) tools only", f"{where}.type")  # fmt: skip
        _only(t, {"type", "name", "description", "input_schema", "cache_control", "strict"}, where)
        _cache_control(t, where)
        schema = t.get("input_schema")
        if not isinstance(schema, dict):
            raise _error(f"'{where}.input_schema' must be a JSON schema object", f"{where}.input_schema")  # fmt: skip
        fn = {"name": t.get("name"), "parameters": schema}
        for key in ("description", "strict"):
            if t.get(key) is not None:
                fn[key] = t[key]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(value: Any) -> tuple[Any, bool | None]:
    """(chat's tool_choice, parallel_tool_calls)."""
    if value is None:
        return None, None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in ("auto", "any", "tool", "none"):
        raise _error("'tool_choice' must be {\"type\": \"auto\" | \"any\" | \"tool\" | \"none\"}", "tool_choice")  # fmt: skip
    _only(value, {"type", "name", "disable_parallel_tool_use"}, "tool_choice")
    single = value.get("disable_parallel_tool_use")
    if single is not None and not isinstance(single, bool):
        raise _error("'tool_choice.disable_parallel_tool_use' must be true or false", "tool_choice.disable_parallel_tool_use")  # fmt: skip
    parallel = None if single is None else not single
    if kind == "tool":
        if not isinstance(value.get("name"), str):
            raise _error("'tool_choice.name' must name a tool", "tool_choice.name")
        return {"type": "function", "function": {"name": value["name"]}}, parallel
    return {"auto": "auto", "any": "required", "none": "none"}[kind], parallel


def _output_format(config: Any) -> dict | None:
    """``output_config.format`` (structured outputs: the text is JSON of the schema, every
    object closed) as chat's ``response_format``."""
    if config is None:
        return None
    if not isinstance(config, dict):
        raise _error("'output_config' must be {\"format\": {...}}", "output_config")
    _only(config, {"format"}, "output_config")
    fmt = config.get("format")
    if fmt is None:
        return None
    if not (isinstance(fmt, dict) and fmt.get("type") == "json_schema" and isinstance(fmt.get("schema"), dict)):  # fmt: skip
        raise _error("'output_config.format' must be {\"type\": \"json_schema\", \"schema\": {...}}", "output_config.format")  # fmt: skip
    _only(fmt, {"type", "schema"}, "output_config.format")
    spec = {"name": "output", "schema": fmt["schema"], "strict": True}
    return {"type": "json_schema", "json_schema": spec}


def parse_messages(
    model, body: dict, adapter: str | None = None, quotas: Quotas | None = None
) -> Job:
    for name in body:
        if name not in FIELDS and body[name] is not None:
            raise _error(f"'{name}' is not supported by this server", name)
    max_tokens = body.get("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise _error(f"'max_tokens' is required: an integer >= 1, got {max_tokens!r}", "max_tokens")  # fmt: skip
    temperature = body.get("temperature")
    if temperature is not None and (isinstance(temperature, bool) or not isinstance(temperature, int | float) or not 0 <= temperature <= 1):  # fmt: skip
        raise _error(f"'temperature' must be a number from 0 to 1, got {temperature!r}", "temperature")  # fmt: skip
    stops = body.get("stop_sequences")
    if stops is not None and not (isinstance(stops, list) and all(isinstance(s, str) and s for s in stops)):  # fmt: skip
        raise _error("'stop_sequences' must be a list of non-empty strings", "stop_sequences")
    metadata = body.get("metadata") or {}
    if not isinstance(metadata, dict) or set(metadata) - {"user_id"}:
        raise _error("'metadata' must be {\"user_id\": ...}", "metadata")
    if body.get("service_tier") not in (None, "auto", "standard_only"):
        raise _error("'service_tier' must be 'auto' or 'standard_only'", "service_tier")
    _cache_control(body, "request")
    choice, parallel = _tool_choice(body.get("tool_choice"))
    tools = _tools(body.get("tools"))
    if choice not in (None, "none") and not tools:
        raise _error("'tool_choice' needs 'tools'", "tool_choice")
    chat = {
        "model": model.name,
        "messages": chat_messages(body.get("system"), body.get("messages"), model, quotas),
        "max_tokens": max_tokens,
        "temperature": temperature,
        "top_p": body.get("top_p"),
        "top_k": body.get("top_k"),
        "stop": stops or None,
        "stream": body.get("stream"),
        "user": metadata.get("user_id"),
        "tools": tools,
        "tool_choice": choice,
        "parallel_tool_calls": parallel,
        "response_format": _output_format(body.get("output_config")),
    }
    try:
        return parse_chat(model, {k: v for k, v in chat.items() if v is not None}, adapter=adapter, quotas=quotas)  # fmt: skip
    except OpenAIError as e:
        message, param = str(e), e.param
        for ours, theirs in _CHAT_NAMES.items():
            message = message.replace(f"'{ours}'", f"'{theirs}'")
            if param == ours:
                param = theirs
        raise OpenAIError(message, param, e.status, e.code, e.kind) from None


# ---------------------------------------------------------------------- answers


def _tool_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def _usage(usage: dict) -> dict:
    cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    return {
        "input_tokens": usage["prompt_tokens"] - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": usage["completion_tokens"],
    }


class MessagesRun(JobRun):
    prefix = "msg_"

    def __init__(self, server: PastryServer, job: Job, stops: list[str], session: str | None) -> None:  # fmt: skip
        super().__init__(server, job, session, ENDPOINT)
        self.stops = stops

    def stop(self, c: dict, finish: str) -> tuple[str, str | None]:
        """Anthropic's stop reason and the stop sequence that matched."""
        if finish == "tool_calls" or (finish == "stop" and self.job.tools and self.job.tools.mode == "named"):  # fmt: skip
            return "tool_use", None
        if finish == "length":
            return "max_tokens", None
        if self.stops:
            tokens = c["tokens"]
            eos = set(self.server.controller.models[self.job.model].info.eos_token_ids)
            full = self.writer.tok.decode(tokens[:-1] if tokens and tokens[-1] in eos else tokens)  # fmt: skip
            rest = full[len(c["text"]) :]
            for s in self.stops:
                if rest.startswith(s):
                    return "stop_sequence", s
        return "end_turn", None

    def blocks(self, c: dict) -> tuple[list[dict], str]:
        message, finish = chat_message(self.job, c["text"], c["finish_reason"])
        out = []
        if message.get("content"):
            out.append({"type": "text", "text": message["content"]})
        for call in message.get("tool_calls", []):
            try:
                args = json.loads(call["function"]["arguments"])
            except ValueError:  # a named call cut by max_tokens: not a complete call
                continue
            out.append({"type": "tool_use", "id": _tool_id(call["id"]), "name": call["function"]["name"], "input": args})  # fmt: skip
        return out, finish

    def body(self, content: list[dict], reason: str | None, sequence: str | None, usage: dict) -> dict:  # fmt: skip
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.job.served,
            "content": content,
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": usage,
        }

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
                    await send_json(send, error.status, error_body(error))
                    return
        (c,) = result["choices"]
        content, finish = self.blocks(c)
        reason, sequence = self.stop(c, finish)
        metrics.request_done(ENDPOINT, 200, result["usage"])
        await send_json(send, 200, self.body(content, reason, sequence, _usage(result["usage"])))

    async def _stream(self, events: Events, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]})  # fmt: skip

        async def emit(kind: str, **data) -> None:
            chunk = f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n".encode()
            await send({"type": "http.response.body", "body": chunk, "more_body": True})

        blocks = _Blocks(emit)
        started = False
        stream = ChoiceStream(self.job, self.writer)
        while True:
            _, ev = await events.get()
            match ev:
                case Message(text):
                    m = json.loads(text)
                    if not started:
                        await emit("message_start", message=self.body([], None, None, _usage({"prompt_tokens": 0, "completion_tokens": 0})))  # fmt: skip
                        started = True
                    for delta, _ in stream.feed(m["delta"], None):
                        await blocks.piece(delta)
                case Finished(result):
                    result = json.loads(result)
                    (c,) = result["choices"]
                    usage = _usage(result["usage"])
                    if not started:
                        await emit("message_start", message=self.body([], None, None, {**usage, "output_tokens": 0}))  # fmt: skip
                    pieces = stream.finish(c, c["finish_reason"])
                    for delta, _, _ in pieces:
                        await blocks.piece(delta)
                    await blocks.close()
                    finish = chat_message(self.job, c["text"], c["finish_reason"])[1]
                    reason, sequence = self.stop(c, finish)
                    await emit("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence}, usage=usage)  # fmt: skip
                    await emit("message_stop")
                    metrics.request_done(ENDPOINT, 200, result["usage"])
                    break
                case Failed() | Terminated():
                    error = instance_error(ev)
                    metrics.request_done(ENDPOINT, error.status)
                    await emit("error", error=error_body(error)["error"])
                    break
        await send({"type": "http.response.body", "body": b"", "more_body": False})


class _Blocks:
    """Content blocks of a streamed message, opened, grown and closed in order."""

    def __init__(self, emit) -> None:
        self.emit = emit
        self.index = -1
        self.open: str | None = None  # "text" or "tool_use"

    async def piece(self, delta: Any) -> None:
        if isinstance(delta, str):
            if not delta:
                return
            if self.open != "text":
                await self.start({"type": "text", "text": ""}, "text")
            await self.emit("content_block_delta", index=self.index, delta={"type": "text_delta", "text": delta})  # fmt: skip
            return
        for call in (delta or {}).get("tool_calls", []):
            fn = call.get("function") or {}
            if call.get("id"):
                block = {"type": "tool_use", "id": _tool_id(call["id"]), "name": fn.get("name", ""), "input": {}}  # fmt: skip
                await self.start(block, "tool_use")
            if fn.get("arguments"):
                await self.emit("content_block_delta", index=self.index, delta={"type": "input_json_delta", "partial_json": fn["arguments"]})  # fmt: skip

    async def start(self, block: dict, kind: str) -> None:
        await self.close()
        self.index += 1
        self.open = kind
        await self.emit("content_block_start", index=self.index, content_block=block)

    async def close(self) -> None:
        if self.open is not None:
            await self.emit("content_block_stop", index=self.index)
            self.open = None


# ---------------------------------------------------------------------- routes


def routes(server: PastryServer) -> list[Route]:
    async def create(request: Request):
        try:
            body = await read_body(request)
            m = server.controller.models[model_name(server, body)]
            await server.image_fetch.inline(body, "messages")  # image URLs it may fetch
            job = await asyncio.to_thread(parse_messages, m, body, adapter_name(server, body), server.config.quotas)  # fmt: skip
            admit(server, request, job, body)
        except OpenAIError as e:
            metrics.request_done(ENDPOINT, e.status)
            return JSONResponse(error_body(e), e.status)
        user = (body.get("metadata") or {}).get("user_id")
        session = session_key(request.headers.get("x-session-id"), user)
        stops = body.get("stop_sequences") or []
        return MessagesRun(server, job, stops, tenant_session(server, request.scope, session))

    async def count_tokens(request: Request) -> JSONResponse:
        try:
            body = await read_body(request)
            m = server.controller.models[model_name(server, body)]
            counted = {k: body[k] for k in ("model", "messages", "system", "tools", "tool_choice") if k in body}  # fmt: skip
            await server.image_fetch.inline(counted, "messages")
            job = await asyncio.to_thread(parse_messages, m, {**counted, "max_tokens": 1}, None, server.config.quotas)  # fmt: skip
        except OpenAIError as e:
            return JSONResponse(error_body(e), e.status)
        arg = json.loads(job.args[0])  # each image's one placeholder: its embeddings' worth
        images = added_positions(m, arg.get("images", []))
        return JSONResponse({"input_tokens": len(arg["prompt"]) + images})

    return [
        Route(ENDPOINT, create, methods=["POST"]),
        Route(ENDPOINT + "/count_tokens", count_tokens, methods=["POST"]),
    ]
