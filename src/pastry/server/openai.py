"""The OpenAI-compatible HTTP API: ``POST /v1/completions``, ``POST /v1/chat/completions``,
``GET /v1/models`` and ``GET /v1/models/{model}``.

A request is checked here (errors in OpenAI's shape, naming the parameter), then runs as
instances of the built-in inferlets — ``text-completion``, one instance per prompt, or
``chat`` — through the same scheduler as every other inferlet. Their results become the
JSON of a plain response; with ``"stream": true`` their messages become server-sent events
(``data: {chunk}``, then ``data: [DONE]``). A client that goes away ends its instances.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

import jinja2
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from pastry.control.events import Event, Failed, Finished, Message, Terminated
from pastry.control.programs import session_key
from pastry.runtime.trusted import Instance
from pastry.server.service import PastryServer

log = logging.getLogger(__name__)

MAX_N = 16
# Parameters that are not implemented, with the values that leave them off (others: 400).
UNSUPPORTED = {
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "tools": (None, []),
    "functions": (None, []),
    "response_format": (None, {"type": "text"}),
}


class OpenAIError(Exception):
    """A failed request, answered as ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        code: str | None = None,
        kind: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.param, self.status, self.code, self.kind = param, status, code, kind

    def body(self) -> dict:
        error = {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}
        return {"error": error}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), self.status)


@dataclass(frozen=True)
class Job:
    """A checked request: one instance of the built-in per argument, and how to answer."""

    chat: bool
    model: str
    args: tuple[str, ...]  # the JSON argument of each instance (one per prompt)
    n: int  # choices per instance
    stream: bool
    include_usage: bool

    @property
    def program(self) -> str:
        return "chat" if self.chat else "text-completion"


def routes(server: PastryServer) -> list[Route]:
    created = int(time.time())

    def card(name: str) -> dict:
        info = server.controller.models[name].info
        return {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "pastry",
            "max_model_len": info.max_position,
        }

    async def models(request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [card(m) for m in server.models]})

    async def model(request: Request) -> JSONResponse:
        try:
            return JSONResponse(card(_model(server, {"model": request.path_params["model"]})))
        except OpenAIError as e:
            return e.response()

    def endpoint(parse):
        async def run(request: Request):
            try:
                body = await _body(request)
                session = session_key(request.headers.get("x-session-id"), body.get("user"))
                return Run(server, parse(server, body), session)
            except OpenAIError as e:
                return e.response()

        return run

    return [
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model:path}", model, methods=["GET"]),
        Route("/v1/completions", endpoint(parse_completion), methods=["POST"]),
        Route("/v1/chat/completions", endpoint(parse_chat), methods=["POST"]),
    ]


# ---------------------------------------------------------------------- checking requests


def parse_completion(server: PastryServer, body: dict) -> Job:
    model = _model(server, body)
    m = server.controller.models[model]
    prompts = _prompts(body.get("prompt"), m.info.vocab_size)
    lengths = [len(p) if isinstance(p, list) else len(m.tokenizer.encode(p)) for p in prompts]
    max_tokens = _get(body, "max_tokens", int, 16, lambda v: v >= 1, "an integer >= 1")
    for length in lengths:
        _check_length(length, max_tokens, m.info.max_position, "prompt", "max_tokens")
    opts = _options(body, model, max_tokens)
    args = tuple(json.dumps({"prompt": p, **opts}) for p in prompts)
    return Job(False, model, args, opts["n"], opts["stream"], _include_usage(body))


def parse_chat(server: PastryServer, body: dict) -> Job:
    model = _model(server, body)
    m = server.controller.models[model]
    messages = _messages(body.get("messages"))
    try:
        text = m.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except (ValueError, jinja2.TemplateError) as e:
        raise OpenAIError(
            f"'messages' cannot be rendered with the chat template: {e}", "messages"
        ) from None
    length = len(m.tokenizer.encode(text))
    name = (
        "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    )
    room = m.info.max_position - length
    max_tokens = _get(body, name, int, room, lambda v: v >= 1, "an integer >= 1")
    _check_length(length, max_tokens, m.info.max_position, "messages", name)
    opts = _options(body, model, max_tokens)
    args = (json.dumps({"messages": messages, **opts}),)
    return Job(True, model, args, opts["n"], opts["stream"], _include_usage(body))


async def _body(request: Request) -> dict:
    try:
        body = await request.json()
    except ValueError as e:
        raise OpenAIError(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise OpenAIError("the request body must be a JSON object")
    return body


def _model(server: PastryServer, body: dict) -> str:
    name = body.get("model")
    served = ", ".join(server.models)
    if not isinstance(name, str):
        raise OpenAIError(f"'model' is required: one of {served}", "model")
    if name not in server.controller.models:
        raise OpenAIError(
            f"The model '{name}' does not exist; this server serves {served}",
            "model",
            404,
            "model_not_found",
        )
    return name


def _get(body: dict, name: str, kinds, default, valid, what: str):
    """``body[name]`` (``default`` when missing or null), checked to be ``what``."""
    value = body.get(name)
    if value is None:
        return default
    is_bool = isinstance(value, bool)  # JSON true/false are not numbers here
    if is_bool != (kinds is bool) or not isinstance(value, kinds) or not valid(value):
        raise OpenAIError(f"'{name}' must be {what}, got {value!r}", name)
    return value


def _options(body: dict, model: str, max_tokens: int) -> dict:
    """The built-ins' generation options from the request's parameters."""
    for name, off in UNSUPPORTED.items():
        if body.get(name) not in off:
            raise OpenAIError(f"'{name}' is not supported by this server", name)
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise OpenAIError(f"'stop' must be a string or a list of strings, got {stop!r}", "stop")
    number = (int, float)
    return {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": _get(
            body, "temperature", number, 1.0, lambda v: 0 <= v <= 2, "a number from 0 to 2"
        ),
        "top_p": _get(body, "top_p", number, 1.0, lambda v: 0 < v <= 1, "a number in (0, 1]"),
        "seed": _get(body, "seed", int, None, lambda v: -(2**63) <= v < 2**63, "a 64-bit integer"),
        "stop": stop or [],
        "n": _get(body, "n", int, 1, lambda v: 1 <= v <= MAX_N, f"an integer from 1 to {MAX_N}"),
        "stream": _get(body, "stream", bool, False, lambda v: True, "true or false"),
    }


def _include_usage(body: dict) -> bool:
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict) or not isinstance(opts.get("include_usage", False), bool):
        raise OpenAIError("'stream_options' must be {\"include_usage\": bool}", "stream_options")
    return opts.get("include_usage", False)


def _prompts(prompt: Any, vocab_size: int) -> list[str | list[int]]:
    """The prompts of a completion: a string, strings, token ids, or lists of token ids."""

    def is_tokens(p: Any) -> bool:
        return isinstance(p, list) and bool(p) and all(type(t) is int for t in p)

    if isinstance(prompt, str):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = prompt
    elif is_tokens(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(is_tokens(p) for p in prompt):
        prompts = prompt
    else:
        raise OpenAIError(
            "'prompt' must be a string, a list of strings, a list of token ids or a list of "
            f"lists of token ids, got {prompt!r:.100}",
            "prompt",
        )
    for p in prompts:
        bad = [t for t in p if not 0 <= t < vocab_size] if isinstance(p, list) else []
        if bad:
            raise OpenAIError(
                f"'prompt' has token id {bad[0]}, outside the vocabulary (0 to {vocab_size - 1})",
                "prompt",
            )
    return prompts


def _messages(messages: Any) -> list[dict]:
    """``[{"role", "content"}]`` with string contents (text content parts are joined)."""
    if not isinstance(messages, list) or not messages:
        raise OpenAIError(
            '\'messages\' must be a non-empty list of {"role", "content"} objects', "messages"
        )
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise OpenAIError(f"'{where}' must be an object with a string 'role'", where)
        content = m.get("content")
        if isinstance(content, list) and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            for p in content
        ):
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise OpenAIError(
                f"'{where}.content' must be a string or a list of text parts, got {content!r:.100}",
                f"{where}.content",
            )
        out.append({"role": m["role"], "content": content})
    return out


def _check_length(length: int, max_tokens: int, max_position: int, what: str, name: str) -> None:
    if length == 0:
        raise OpenAIError(f"'{what}' is empty: give at least one token to continue from", what)
    if length + max(max_tokens, 1) > max_position:
        raise OpenAIError(
            f"this model's maximum context length is {max_position} tokens, but the {what} has "
            f"{length} and '{name}' asks for {max_tokens} more: shorten the {what} or lower "
            f"'{name}'",
            name,
        )


# ---------------------------------------------------------------------- running and answering


class Run:
    """The answer to one request, as an ASGI response: launches the job's instances, relays
    their events as JSON or server-sent events, and ends them if the client goes away."""

    def __init__(self, server: PastryServer, job: Job, session: str | None = None) -> None:
        self.server = server
        self.job = job
        self.id = ("chatcmpl-" if job.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.program = session or f"request:{self.id}"  # its entry in the process table

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        events: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()
        tasks: list[asyncio.Task] = []
        try:
            for k, arg in enumerate(self.job.args):
                instance = self.server.launch(self.job.program, [arg], owner=self)
                self.server.controller.programs.join(instance.id, self.program)
                tasks.append(asyncio.create_task(_pump(k, instance, events)))
            reply = self._stream(events, send) if self.job.stream else self._reply(events, send)
            answer = asyncio.create_task(reply)
            gone = asyncio.create_task(_disconnected(receive))
            tasks += [answer, gone]
            await asyncio.wait([answer, gone], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            self.server.disown(self)  # ends the instances still running
        if answer.done() and not answer.cancelled():
            answer.result()  # raises what the answer raised

    async def _reply(self, events: asyncio.Queue, send: Send) -> None:
        results: dict[int, dict] = {}
        while len(results) < len(self.job.args):
            k, ev = await events.get()
            match ev:
                case Finished(result):
                    results[k] = json.loads(result)
                case Failed() | Terminated():
                    error = _instance_error(ev)
                    await _send_json(send, error.status, error.body())
                    return
        n = self.job.n
        choices = [
            self._choice(k * n + c["index"], c)
            for k in sorted(results)
            for c in results[k]["choices"]
        ]
        body = {
            "id": self.id,
            "object": "chat.completion" if self.job.chat else "text_completion",
            "created": self.created,
            "model": self.job.model,
            "system_fingerprint": None,
            "choices": choices,
            "usage": _total(r["usage"] for r in results.values()),
        }
        await _send_json(send, 200, body)

    def _choice(self, index: int, c: dict) -> dict:
        if self.job.chat:
            body = {"message": {"role": "assistant", "content": c["text"], "refusal": None}}
        else:
            body = {"text": c["text"]}
        return {"index": index, **body, "logprobs": None, "finish_reason": c["finish_reason"]}

    async def _stream(self, events: asyncio.Queue, send: Send) -> None:
        headers = [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
        ]
        await send({"type": "http.response.start", "status": 200, "headers": headers})

        async def emit(data: dict | str) -> None:
            text = data if isinstance(data, str) else json.dumps(data)
            body = f"data: {text}\n\n".encode()
            await send({"type": "http.response.body", "body": body, "more_body": True})

        n = self.job.n
        if self.job.chat:  # one prompt
            for i in range(n):
                await emit(self._chunk(i, {"role": "assistant", "content": ""}))
        usages, left = [], len(self.job.args)
        while left:
            k, ev = await events.get()
            match ev:
                case Message(text):
                    m = json.loads(text)
                    await emit(self._chunk(k * n + m["index"], m["delta"]))
                case Finished(result):
                    done = json.loads(result)
                    usages.append(done["usage"])
                    for c in done["choices"]:
                        await emit(self._chunk(k * n + c["index"], None, c["finish_reason"]))
                    left -= 1
                case Failed() | Terminated():
                    await emit(_instance_error(ev).body())
                    break
        if not left and self.job.include_usage:
            await emit({**self._chunk(0, None), "choices": [], "usage": _total(usages)})
        await emit("[DONE]")
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    def _chunk(self, index: int, delta: str | dict | None, finish: str | None = None) -> dict:
        """One choice's piece of a stream: text (or, in chat, the role), or its finish."""
        if self.job.chat:
            piece = {"delta": {"content": delta} if isinstance(delta, str) else delta or {}}
        else:
            piece = {"text": delta or ""}
        choice = {"index": index, **piece, "logprobs": None, "finish_reason": finish}
        chunk = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.job.chat else "text_completion",
            "created": self.created,
            "model": self.job.model,
            "system_fingerprint": None,
            "choices": [choice],
        }
        if self.job.include_usage:
            chunk["usage"] = None
        return chunk


async def _pump(k: int, instance: Instance, events: asyncio.Queue) -> None:
    async for ev in instance.events():
        events.put_nowait((k, ev))


async def _disconnected(receive: Receive) -> None:
    """Returns when the client has gone (or, after the response, when the request is over)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _send_json(send: Send, status: int, body: dict) -> None:
    data = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


def _instance_error(ev: Failed | Terminated) -> OpenAIError:
    if isinstance(ev, Terminated):
        return OpenAIError(f"the request was ended: {ev.reason}", None, 503, None, "server_error")
    log.warning("a built-in inferlet failed:\n%s", ev.error)
    last = ev.error.strip().splitlines()[-1:] or ["unknown error"]
    return OpenAIError(f"generation failed: {last[0]}", None, 500, None, "server_error")


def _total(usages) -> dict:
    total = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    for u in usages:
        for key in total:
            total[key] += u[key]
    return total
