"""The OpenAI-compatible HTTP API: ``POST /v1/completions``, ``POST /v1/chat/completions``,
``GET /v1/models`` and ``GET /v1/models/{model}``, plus vLLM's ``POST /tokenize``, ``POST
/detokenize`` and ``GET /tokenizer_info`` (what lm-eval's remote tokenizer reads).

A request is checked by :mod:`pastry.server.openai_params` (errors in OpenAI's shape,
naming the parameter), then runs as instances of the built-in inferlets —
``text-completion``, one instance per prompt, or ``chat`` — through the same scheduler as
every other inferlet. Their results become the JSON of a plain response; with ``"stream":
true`` their messages become server-sent events (``data: {chunk}``, then ``data:
[DONE]``), written by :mod:`pastry.server.openai_answers`. A client that goes away ends
its instances.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route

from pastry.control.programs import session_key
from pastry.server import metrics
from pastry.server.auth import tenant_session, user_of
from pastry.server.openai_answers import ChoiceStream, JobRun, Run, chat_message, instance_error
from pastry.server.openai_params import (
    MAX_N,
    Job,
    OpenAIError,
    check_messages,
    parse_chat,
    parse_completion,
)
from pastry.server.service import LaunchQuotaError, PastryServer
from pastry.wire.handle import EngineError

__all__ = [
    "MAX_N", "ChoiceStream", "Job", "JobRun", "OpenAIError", "adapter_name", "admit", "chat_message",
    "instance_error", "model_name", "read_body", "routes",
]  # fmt: skip


def routes(server: PastryServer) -> list[Route]:
    """The endpoints (a table: each handler takes the :class:`Api` and the request)."""
    api = Api(server, lora_paths={name: str(path) for name, path in server.config.adapters})
    chat = partial(parse_chat, quotas=server.config.quotas)  # image_url parts taken
    table = (
        ("/v1/models", _models, ["GET"]),
        ("/v1/models/{model:path}", _model, ["GET"]),
        ("/v1/completions", partial(_generate, parse_completion, "/v1/completions"), ["POST"]),
        ("/v1/chat/completions", partial(_generate, chat, "/v1/chat/completions"), ["POST"]),
        ("/v1/load_lora_adapter", _load_lora, ["POST"]),
        ("/v1/unload_lora_adapter", _unload_lora, ["POST"]),
        ("/tokenize", _tokenize_endpoint, ["POST"]),
        ("/detokenize", _detokenize, ["POST"]),
        ("/tokenizer_info", _tokenizer_info, ["GET"]),
    )
    return [Route(path, partial(fn, api), methods=m) for path, fn, m in table]


@dataclass
class Api:
    """What the endpoints share: the server, when it started (the models' ``created``) and
    each LoRA adapter's path (``root`` in the model list, as vLLM shows it)."""

    server: PastryServer
    created: int = field(default_factory=lambda: int(time.time()))
    lora_paths: dict[str, str] = field(default_factory=dict)

    def card(self, name: str) -> dict:
        """The ``/v1/models`` entry of a model or adapter."""
        base = name if name in self.server.controller.models else adapters(self.server)[name]
        info = self.server.controller.models[base].info
        out = {
            "id": name,
            "object": "model",
            "created": self.created,
            "owned_by": "pastry",
            "max_model_len": info.max_position,
        }
        if base != name:  # a LoRA adapter, as vLLM lists them
            out.update(root=self.lora_paths.get(name), parent=base)
        return out


def _error_response(e: OpenAIError) -> JSONResponse:
    return JSONResponse(e.body(), e.status)


async def _models(api: Api, request: Request) -> JSONResponse:
    names = [*api.server.models, *adapters(api.server)]
    return JSONResponse({"object": "list", "data": [api.card(m) for m in names]})


async def _model(api: Api, request: Request) -> JSONResponse:
    try:
        name = request.path_params["model"]
        model_name(api.server, {"model": name})
        return JSONResponse(api.card(name))
    except OpenAIError as e:
        return _error_response(e)


async def _generate(parse, endpoint: str, api: Api, request: Request):
    """``/v1/completions`` or ``/v1/chat/completions`` (``parse`` checks the body): a
    :class:`~pastry.server.openai_answers.Run` of the job, or the error."""
    server = api.server
    try:
        body = await read_body(request)
        m = server.controller.models[model_name(server, body)]
        adapter = adapter_name(server, body)
        if endpoint == "/v1/chat/completions":
            await server.image_fetch.inline(body, "chat")  # image URLs it may fetch
        job = await asyncio.to_thread(parse, m, body, adapter=adapter)  # off the loop
        admit(server, request, job, body)
    except OpenAIError as e:
        metrics.request_done(endpoint, e.status)
        return _error_response(e)
    session = session_key(request.headers.get("x-session-id"), body.get("user"))
    return Run(server, job, tenant_session(server, request.scope, session))


async def _load_lora(api: Api, request: Request):
    """vLLM's ``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path"}`` (a PEFT
    directory on the server), on every engine of the model (``"model"``, default the
    first); operators only."""
    server = api.server
    try:
        body = await _lora_request(request, ("lora_name", "lora_path"))
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
    api.lora_paths[name] = path
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


async def _unload_lora(api: Api, request: Request):
    try:
        body = await _lora_request(request, ("lora_name",))
        name = body["lora_name"]
        base = adapters(api.server).get(name)
        if base is None:
            raise OpenAIError(f"no LoRA adapter named '{name}' is loaded", "lora_name", 404, "model_not_found")  # fmt: skip
        await api.server.controller.unload_adapter(base, name)
    except OpenAIError as e:
        return _error_response(e)
    api.lora_paths.pop(name, None)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


async def _lora_request(request: Request, needed: tuple[str, ...]) -> dict:
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


async def _tokenize_endpoint(api: Api, request: Request) -> JSONResponse:
    try:
        body = await read_body(request)
        m = api.server.controller.models[model_name(api.server, body, optional=True)]
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


async def _detokenize(api: Api, request: Request) -> JSONResponse:
    try:
        body = await read_body(request)
        m = api.server.controller.models[model_name(api.server, body, optional=True)]
        tokens = body.get("tokens")
        vocab = m.info.vocab_size
        if not (isinstance(tokens, list) and all(type(t) is int for t in tokens)):
            raise OpenAIError("'tokens' must be a list of token ids", "tokens")
        if any(not 0 <= t < vocab for t in tokens):
            raise OpenAIError(f"'tokens' must be token ids below {vocab}", "tokens")
    except OpenAIError as e:
        return _error_response(e)
    return JSONResponse({"prompt": m.tokenizer.decode(tokens)})


async def _tokenizer_info(api: Api, request: Request) -> JSONResponse:
    m = api.server.controller.models[api.server.controller.default_model]
    special = m.tokenizer.special_tokens
    info = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": m.info.max_position,
        "chat_template": m.tokenizer.chat_template,
        **{k: special.get(k) for k in ("bos_token", "eos_token", "pad_token", "unk_token")},
    }
    return JSONResponse(info)


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
