"""The OpenAI-compatible HTTP API: ``POST /v1/completions``, ``POST /v1/chat/completions``,
``GET /v1/models`` and ``GET /v1/models/{model}``, plus vLLM's ``POST /tokenize``, ``POST
/detokenize`` and ``GET /tokenizer_info`` (what lm-eval's remote tokenizer reads).

A request is checked by :mod:`pastry.server.openai_params` (errors in OpenAI's shape,
naming the parameter), then runs as instances of the built-in inferlets —
``text-completion``, one instance per prompt, or ``chat`` — through the same scheduler as
every other inferlet. Their results become the JSON of a plain response; with ``"stream":
true`` their messages become server-sent events (``data: {chunk}``, then ``data:
[DONE]``). Log-probabilities come back as token ids and numbers and are written here in
the shape of each endpoint; tool calls are read from the outputs here
(:mod:`pastry.server.openai_tools`). A client that goes away ends its instances.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import uuid
from collections.abc import Awaitable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from pastry.control.events import Failed, Finished, Message, Terminated
from pastry.control.programs import session_key
from pastry.runtime.trusted import Instance
from pastry.server import errors, metrics
from pastry.server.auth import tenant_session, user_of
from pastry.server.openai_params import (
    MAX_N,
    Job,
    OpenAIError,
    check_messages,
    parse_chat,
    parse_completion,
)
from pastry.server.openai_tools import RequiredCalls, ToolCall, new_call_id, parse_required
from pastry.server.relay import Events, relay, send_json
from pastry.server.service import LaunchQuotaError, PastryServer
from pastry.wire.handle import EngineError

__all__ = [
    "MAX_N", "ChoiceStream", "Job", "JobRun", "OpenAIError", "adapter_name", "admit", "chat_message",
    "instance_error", "model_name", "read_body", "routes",
]  # fmt: skip

log = logging.getLogger(__name__)


def _error_response(e: OpenAIError) -> JSONResponse:
    return JSONResponse(e.body(), e.status)


def routes(server: PastryServer) -> list[Route]:
    created = int(time.time())

    lora_paths = {name: str(path) for name, path in server.config.adapters}

    def card(name: str) -> dict:
        base = name if name in server.controller.models else adapters(server)[name]
        info = server.controller.models[base].info
        out = {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "pastry",
            "max_model_len": info.max_position,
        }
        if base != name:  # a LoRA adapter, as vLLM lists them
            out.update(root=lora_paths.get(name), parent=base)
        return out

    async def models(request: Request) -> JSONResponse:
        names = [*server.models, *adapters(server)]
        return JSONResponse({"object": "list", "data": [card(m) for m in names]})

    async def model(request: Request) -> JSONResponse:
        try:
            name = request.path_params["model"]
            model_name(server, {"model": name})
            return JSONResponse(card(name))
        except OpenAIError as e:
            return _error_response(e)

    async def load_lora(request: Request):
        """vLLM's ``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path"}`` (a PEFT
        directory on the server), on every engine of the model (``"model"``, default the
        first); operators only."""
        try:
            body = await lora_request(request, ("lora_name", "lora_path"))
            name, path = body["lora_name"], body["lora_path"]
            if name in server.controller.models or name in adapters(server):
                raise OpenAIError(f"the name '{name}' is already taken by a model or adapter", "lora_name")  # fmt: skip
            base = model_name(server, {"model": body.get("model")}, optional=True)
            try:
                await server.controller.load_adapter(base, name, path)
            except (ValueError, OSError, EngineError) as e:
                raise OpenAIError(f"cannot load '{path}' as a LoRA adapter: {e}", "lora_path") from None  # fmt: skip
        except OpenAIError as e:
            return _error_response(e)
        lora_paths[name] = path
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora(request: Request):
        try:
            body = await lora_request(request, ("lora_name",))
            name = body["lora_name"]
            base = adapters(server).get(name)
            if base is None:
                raise OpenAIError(f"no LoRA adapter named '{name}' is loaded", "lora_name", 404, "model_not_found")  # fmt: skip
            await server.controller.unload_adapter(base, name)
        except OpenAIError as e:
            return _error_response(e)
        lora_paths.pop(name, None)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    async def lora_request(request: Request, needed: tuple[str, ...]) -> dict:
        if not user_of(request.scope).operator:
            raise OpenAIError("loading and unloading adapters is for operators", None, 403, None, "permission_error")  # fmt: skip
        body = await read_body(request)
        for key in body:
            if key not in (*needed, "model", "load_inplace") or (key == "load_inplace" and body[key]):  # fmt: skip
                raise OpenAIError(f"'{key}' is not supported by this server", key)
        for key in needed:
            if not isinstance(body.get(key), str) or not body[key]:
                raise OpenAIError(f"'{key}' is required (a string)", key)
        return body

    def endpoint(parse, name: str):
        async def run(request: Request):
            try:
                body = await read_body(request)
                m = server.controller.models[model_name(server, body)]
                adapter = adapter_name(server, body)
                job = await asyncio.to_thread(parse, m, body, adapter=adapter)  # off the loop
                admit(server, request, job, body)
            except OpenAIError as e:
                metrics.request_done(name, e.status)
                return _error_response(e)
            session = session_key(request.headers.get("x-session-id"), body.get("user"))
            return Run(server, job, tenant_session(server, request.scope, session))

        return run

    async def tokenize(request: Request) -> JSONResponse:
        try:
            body = await read_body(request)
            m = server.controller.models[model_name(server, body, optional=True)]
            tokens = await asyncio.to_thread(_tokenize, m, body)  # issue 17: off the loop
        except OpenAIError as e:
            return _error_response(e)
        out: dict[str, Any] = {
            "count": len(tokens),
            "max_model_len": m.info.max_position,
            "tokens": tokens,
            "token_strs": None,
        }
        if body.get("return_token_strs"):
            out["token_strs"] = [m.tokenizer.id_to_token(t) for t in tokens]
        return JSONResponse(out)

    async def detokenize(request: Request) -> JSONResponse:
        try:
            body = await read_body(request)
            m = server.controller.models[model_name(server, body, optional=True)]
            tokens = body.get("tokens")
            vocab = m.info.vocab_size
            if not (isinstance(tokens, list) and all(type(t) is int for t in tokens)):
                raise OpenAIError("'tokens' must be a list of token ids", "tokens")
            if any(not 0 <= t < vocab for t in tokens):
                raise OpenAIError(f"'tokens' must be token ids below {vocab}", "tokens")
        except OpenAIError as e:
            return _error_response(e)
        return JSONResponse({"prompt": m.tokenizer.decode(tokens)})

    async def tokenizer_info(request: Request) -> JSONResponse:
        m = server.controller.models[server.controller.default_model]
        special = m.tokenizer.special_tokens
        info = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": m.info.max_position,
            "chat_template": m.tokenizer.chat_template,
            **{k: special.get(k) for k in ("bos_token", "eos_token", "pad_token", "unk_token")},
        }
        return JSONResponse(info)

    return [
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model:path}", model, methods=["GET"]),
        Route("/v1/completions", endpoint(parse_completion, "/v1/completions"), methods=["POST"]),
        Route(
            "/v1/chat/completions",
            endpoint(parse_chat, "/v1/chat/completions"),
            methods=["POST"],
        ),
        Route("/v1/load_lora_adapter", load_lora, methods=["POST"]),
        Route("/v1/unload_lora_adapter", unload_lora, methods=["POST"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/tokenizer_info", tokenizer_info, methods=["GET"]),
    ]


def _tokenize(m, body: dict) -> list[int]:
    """vLLM's ``/tokenize``: ``{"prompt", "add_special_tokens"}`` or ``{"messages",
    "add_generation_prompt"}``."""
    special = body.get("add_special_tokens")
    if "messages" in body:
        add = body.get("add_generation_prompt", True)
        if not isinstance(add, bool):
            raise OpenAIError(
                "'add_generation_prompt' must be true or false", "add_generation_prompt"
            )
        try:
            text = m.tokenizer.apply_chat_template(
                check_messages(body["messages"]), add_generation_prompt=add
            )
        except ValueError as e:
            raise OpenAIError(f"'messages' cannot be rendered: {e}", "messages") from None
        return m.tokens.encode_batch([text], bool(special))[0]
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise OpenAIError("'prompt' (a string) or 'messages' is required", "prompt")
    if special is not None and not isinstance(special, bool):
        raise OpenAIError("'add_special_tokens' must be true or false", "add_special_tokens")
    return m.tokens.encode_batch([prompt], special is not False)[0]


# ---------------------------------------------------------------------- tenant limits (issue 17)


def admit(server: PastryServer, request: Request, job: Job, body: dict) -> None:
    """Prompts x choices under the per-request cap; instances under the user's quota."""
    limit = server.config.quotas.request_choices
    per = max(job.n, body.get("best_of") or 1)
    prompts = len(job.args)
    if limit is not None and prompts * per > limit:
        raise OpenAIError(
            f"{prompts} prompts x n={per} is {prompts * per} choices, over this server's "
            f"limit of {limit} per request (--max-request-choices): send fewer prompts per "
            "request",
            "prompt",
        )
    try:
        server.admit(user_of(request.scope), prompts)
    except LaunchQuotaError as e:
        raise OpenAIError(str(e), None, 429, "quota_exceeded", "rate_limit_error") from None


async def read_body(request: Request) -> dict:
    try:
        body = await request.json()
    except ValueError as e:
        raise OpenAIError(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise OpenAIError("the request body must be a JSON object")
    return body


def model_name(server: PastryServer, body: dict, optional: bool = False) -> str:
    """The served model ``body["model"]`` names: a model, or a LoRA adapter of one (then
    its base model; :func:`adapter_name` says which adapter)."""
    name = body.get("model")
    served = ", ".join([*server.models, *adapters(server)])
    if name is None and optional:
        return server.controller.default_model
    if not isinstance(name, str):
        raise OpenAIError(f"'model' is required: one of {served}", "model")
    if name not in server.controller.models:
        base = adapters(server).get(name)
        if base is not None:
            return base
        raise OpenAIError(
            f"The model '{name}' does not exist; this server serves {served}",
            "model",
            404,
            "model_not_found",
        )
    return name


def adapters(server: PastryServer) -> dict[str, str]:
    """Every loaded LoRA adapter's name -> its base model."""
    return {a: name for name, m in server.controller.models.items() for a in m.adapters}


def adapter_name(server: PastryServer, body: dict) -> str | None:
    """The LoRA adapter ``body["model"]`` names (None: a base model)."""
    name = body.get("model")
    if not isinstance(name, str) or name in server.controller.models:
        return None
    return name if name in adapters(server) else None


# ---------------------------------------------------------------------- writing answers


class Writer:
    """Token ids and log-probabilities written in the OpenAI shapes of one request."""

    def __init__(self, tokenizer, job: Job) -> None:
        self.tok = tokenizer
        self.job = job
        self._vocab: list[bytes] | None = None
        self._text: dict[int, str] = {}

    def text(self, token: int) -> str:
        """A token's text as vLLM shows it (the decoding of that token alone)."""
        s = self._text.get(token)
        if s is None:
            raw = bytes(self.raw(token))
            s = self._text[token] = self.tok.decode([token]) if raw else ""
        return s

    def raw(self, token: int) -> list[int]:
        if self._vocab is None:
            self._vocab = self.tok.get_vocabs()
        return list(self._vocab[token]) if token < len(self._vocab) else []

    def completion_logprobs(self, entries: list, offset: int = 0) -> dict:
        """``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``: an entry is
        ``[token, logprob, [[id, logprob], ...]]`` or None (a prompt's first token, which
        needs the token id: given as ``[token, None, None]``)."""
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}  # fmt: skip
        for token, lp, top in entries:
            s = self.text(token)
            out["tokens"].append(s)
            out["text_offset"].append(offset)
            offset += len(s)
            if lp is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["token_logprobs"].append(_finite(lp))
            tops = {self.text(t): _finite(v) for t, v in top}
            tops.setdefault(s, _finite(lp))  # vLLM also lists the chosen token
            out["top_logprobs"].append(tops)
        return out

    def chat_logprobs(self, entries: list) -> dict:
        def one(token: int, lp: float) -> dict:
            return {"token": self.text(token), "logprob": _finite(lp), "bytes": self.raw(token)}

        content = [
            {**one(token, lp), "top_logprobs": [one(t, v) for t, v in top]}
            for token, lp, top in entries
        ]
        return {"content": content, "refusal": None}

    def logprobs(self, entries: list | None, offset: int = 0) -> dict | None:
        if entries is None or self.job.logprobs is None:
            return None
        if self.job.chat:
            return self.chat_logprobs(entries)
        return self.completion_logprobs(entries, offset)


def _finite(x: float) -> float:
    return -9999.0 if x == -math.inf or math.isnan(x) else x


def _prompt_entries(prompt: dict) -> list:
    lps = prompt.get("logprobs")
    if lps is None:
        return [[t, None, None] for t in prompt["tokens"]]
    return [[t, None, None] if e is None else e for t, e in zip(prompt["tokens"], lps, strict=True)]


class JobRun:
    """The answer to one request, as an ASGI response: launches the job's instances, relays
    their events to ``_reply`` (a JSON body) or ``_stream`` (server-sent events), and ends
    them if the client goes away. The endpoints' answers (chat and completions here, the
    Responses and Messages APIs in their modules) are subclasses."""

    prefix = "req-"

    def __init__(
        self, server: PastryServer, job: Job, session: str | None = None, endpoint: str = ""
    ) -> None:
        self.server = server
        self.job = job
        self.id = self.prefix + uuid.uuid4().hex
        self.program = session or f"request:{self.id}"  # its entry in the process table
        self.created = int(time.time())
        self.writer = Writer(server.controller.models[job.model].tokenizer, job)
        self.endpoint = endpoint or job.endpoint  # for the metrics
        self.clock = metrics.RequestClock(self.endpoint)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        user = user_of(scope)

        def launch(arg: str) -> Instance:
            program = self.job.program
            instance = self.server.launch(program, [arg], owner=self, user=user, builtin=True)
            self.server.controller.programs.join(instance.id, self.program)
            self.clock.watch(instance.id)
            return instance

        def answer(events: Events) -> Awaitable[None]:
            return self._stream(events, send) if self.job.stream else self._reply(events, send)

        try:
            await relay(self.server, self, self.job.args, launch, answer, receive)
        finally:
            self.clock.close()

    async def _reply(self, events: Events, send: Send) -> None:
        raise NotImplementedError

    async def _stream(self, events: Events, send: Send) -> None:
        raise NotImplementedError


class Run(JobRun):
    """Chat and completions."""

    def __init__(self, server: PastryServer, job: Job, session: str | None = None) -> None:
        self.prefix = "chatcmpl-" if job.chat else "cmpl-"
        super().__init__(server, job, session)

    # ------------------------------------------------------------------ plain answers

    async def _reply(self, events: Events, send: Send) -> None:
        results: dict[int, dict] = {}
        while len(results) < len(self.job.args):
            k, ev = await events.get()
            match ev:
                case Finished(result):
                    results[k] = json.loads(result)
                case Failed() | Terminated():
                    error = instance_error(ev)
                    metrics.request_done(self.job.endpoint, error.status)
                    await send_json(send, error.status, error.body())
                    return
        n = self.job.n
        choices = [
            self._choice(k * n + c["index"], c, results[k]["prompt"])
            for k in sorted(results)
            for c in results[k]["choices"]
        ]
        usage = _total(r["usage"] for r in results.values())
        body = {
            "id": self.id,
            "object": "chat.completion" if self.job.chat else "text_completion",
            "created": self.created,
            "model": self.job.served,
            "system_fingerprint": None,
            "choices": choices,
            "usage": usage,
        }
        metrics.request_done(self.job.endpoint, 200, usage)
        await send_json(send, 200, body)

    def _choice(self, index: int, c: dict, prompt: dict) -> dict:
        w, finish = self.writer, c["finish_reason"]
        if self.job.chat:
            message, finish = self._message(c["text"], finish)
            body = {"message": message, "logprobs": w.logprobs(c["logprobs"])}
        elif self.job.echo:
            prompt_text = w.tok.decode(prompt["tokens"])
            entries = None
            if c["logprobs"] is not None:
                entries = _prompt_entries(prompt) + c["logprobs"]
            body = {"text": prompt_text + c["text"], "logprobs": w.logprobs(entries)}
        else:
            body = {"text": c["text"], "logprobs": w.logprobs(c["logprobs"])}
        return {"index": index, **body, "finish_reason": finish}

    def _message(self, text: str, finish: str) -> tuple[dict, str]:
        return chat_message(self.job, text, finish)

    # ------------------------------------------------------------------ streams

    async def _stream(self, events: Events, send: Send) -> None:
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
        states: dict[int, ChoiceStream] = {}

        def state(i: int) -> ChoiceStream:
            if i not in states:
                states[i] = ChoiceStream(self.job, self.writer)
            return states[i]

        if self.job.chat:  # one prompt
            for i in range(n):
                await emit(self._chunk(i, {"role": "assistant", "content": ""}))
        usages, left, failed = [], len(self.job.args), False
        while left:
            k, ev = await events.get()
            match ev:
                case Message(text):
                    m = json.loads(text)
                    if "prompt" in m:  # the echo of a completion, first
                        prompt = m["prompt"]
                        entries = _prompt_entries(prompt) if prompt["logprobs"] else None
                        for i in range(n):
                            st = state(k * n + i)
                            lps = self.writer.logprobs(entries, st.offset)
                            st.offset += len(self.writer.tok.decode(prompt["tokens"]))
                            await emit(self._chunk(k * n + i, self.writer.tok.decode(prompt["tokens"]), logprobs=lps))  # fmt: skip
                        continue
                    i = k * n + m["index"]
                    for delta, lps in state(i).feed(m["delta"], m["logprobs"]):
                        await emit(self._chunk(i, delta, logprobs=lps))
                case Finished(result):
                    done = json.loads(result)
                    usages.append(done["usage"])
                    for c in done["choices"]:
                        i = k * n + c["index"]
                        for delta, lps, end in state(i).finish(c, c["finish_reason"]):
                            await emit(self._chunk(i, delta, end, lps))
                    left -= 1
                case Failed() | Terminated():
                    error = instance_error(ev)
                    metrics.request_done(self.job.endpoint, error.status)
                    await emit(error.body())
                    failed = True
                    break
        if not failed:
            usage = _total(usages)
            metrics.request_done(self.job.endpoint, 200, usage)
            if self.job.include_usage:
                await emit({**self._chunk(0, None), "choices": [], "usage": usage})
        await emit("[DONE]")
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    def _chunk(
        self,
        index: int,
        delta: str | dict | None,
        finish: str | None = None,
        logprobs: dict | None = None,
    ) -> dict:
        """One choice's piece of a stream: text (or, in chat, a delta object), or its finish."""
        if self.job.chat:
            piece = {"delta": {"content": delta} if isinstance(delta, str) else delta or {}}
        else:
            piece = {"text": delta or ""}
        choice = {"index": index, **piece, "logprobs": logprobs, "finish_reason": finish}
        chunk = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.job.chat else "text_completion",
            "created": self.created,
            "model": self.job.served,
            "system_fingerprint": None,
            "choices": [choice],
        }
        if self.job.include_usage:
            chunk["usage"] = None
        return chunk


def chat_message(job: Job, text: str, finish: str) -> tuple[dict, str]:
    """The assistant message of a chat choice, with its tool calls read from the text, and
    its finish reason ("tool_calls" when it ended on calls)."""
    message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
    tools = job.tools
    calls: list[ToolCall] = []
    if tools is None:
        return message, finish
    if tools.mode == "auto":
        content, calls = tools.fmt.parse(text)
        calls = calls if tools.parallel else calls[:1]  # parallel_tool_calls false: one
    elif tools.mode == "named":
        content, calls = None, [ToolCall(tools.name, text, new_call_id())]
    else:  # the complete calls, also of an output cut short by max_tokens
        content, calls = None, parse_required(text)
        message["content"] = None
    if calls:
        message["content"] = content
        message["tool_calls"] = [c.to_openai() for c in calls]
        if tools.mode != "named" and finish == "stop":
            finish = "tool_calls"
    return message, finish


class ChoiceStream:
    """The stream of one choice: text deltas (or tool call deltas) and their logprobs."""

    def __init__(self, job: Job, writer: Writer) -> None:
        self.job, self.writer = job, writer
        self.sent_logprobs = 0  # log-probability entries streamed
        self.offset = 0  # characters streamed (completions' text_offset)
        self.text = ""
        self.calls = 0
        tools = job.tools
        self.tool_stream = tools.fmt.stream() if tools and tools.mode == "auto" else None
        self.required = RequiredCalls() if tools and tools.mode == "required" else None

    def _lps(self, entries: list | None) -> dict | None:
        if not entries:
            return None
        self.sent_logprobs += len(entries)
        lps = self.writer.logprobs(entries, self.offset)
        return lps

    def feed(self, delta: str, entries: list | None) -> list[tuple[Any, dict | None]]:
        """Chunks for a text delta of the inferlet."""
        lps = self._lps(entries)
        self.text += delta
        tools = self.job.tools
        if tools is None:
            self.offset += len(delta)
            return [(delta, lps)]
        if self.required is not None:  # each call once it is complete
            out = [({}, lps)] if lps else []
            for call in self.required.feed(delta):
                out.append(({"tool_calls": [call.to_openai(self.calls)]}, None))
                self.calls += 1
            return out
        if tools.mode == "named":
            first = self.calls == 0
            self.calls = 1
            fn: dict[str, Any] = {"arguments": delta}
            call: dict[str, Any] = {"index": 0, "function": fn}
            if first:
                call.update(id=new_call_id(), type="function")
                fn["name"] = tools.name
            return [({"tool_calls": [call]}, lps)]
        shown, calls = self.tool_stream.feed(delta)
        out: list[tuple[Any, dict | None]] = []
        if shown or lps:
            out.append((shown, lps))
        for c in calls if tools.parallel or not self.calls else []:
            out.append(({"tool_calls": [c.to_openai(self.calls)]}, None))
            self.calls += 1
            if not tools.parallel:
                break
        return out

    def finish(self, c: dict, finish: str) -> list[tuple[Any, dict | None, str | None]]:
        """The last chunks: what is left of the text and the logprobs, then the finish."""
        rest = c["logprobs"][self.sent_logprobs :] if c["logprobs"] is not None else None
        lps = self._lps(rest)
        out: list[tuple[Any, dict | None, str | None]] = []
        tools = self.job.tools
        if self.required is not None:  # the text's calls not yet sent (a stop string cut)
            for call in parse_required(c["text"])[self.calls :]:
                out.append(({"tool_calls": [call.to_openai(self.calls)]}, None, None))
                self.calls += 1
        elif tools is not None and tools.mode == "named" and self.calls == 0:
            call = ToolCall(tools.name, c["text"], new_call_id())
            out.append(({"tool_calls": [call.to_openai(0)]}, None, None))
            self.calls = 1
        elif self.tool_stream is not None:
            rest_text = self.tool_stream.close()
            if rest_text:
                out.append((rest_text, None, None))
        if self.calls and tools is not None and tools.mode != "named" and finish == "stop":
            finish = "tool_calls"
        empty: Any = {} if self.job.chat else ""
        out.append((empty, lps, finish))
        return out


def instance_error(ev: Failed | Terminated) -> OpenAIError:
    if isinstance(ev, Terminated):
        return OpenAIError(f"the request was ended: {ev.reason}", None, 503, None, "server_error")
    errors.note_failure(f"a built-in inferlet failed:\n{ev.error}")  # the log, not the client
    message = f"generation failed: {errors.failure_reason(ev.error)}"
    rid = errors.current_request_id()
    if rid is not None:
        message += f" (logged as request {rid})"
    return OpenAIError(message, None, 500, None, "server_error")


def _total(usages) -> dict:
    total = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    cached = 0  # prompt tokens that came from the prefix cache
    for u in usages:
        for key in total:
            total[key] += u[key]
        cached += u.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    return {**total, "prompt_tokens_details": {"cached_tokens": cached}}
