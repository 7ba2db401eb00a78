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
from dataclasses import dataclass
from functools import partial
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

import pastry
from pastry.control.events import Failed, Finished, Message, Terminated
from pastry.control.programs import session_key
from pastry.lang.expr import SamplingParams
from pastry.lang.generation import MAX_LOGPROBS, check
from pastry.runtime.trusted import Instance
from pastry.server import errors
from pastry.server.auth import tenant_session, user_of
from pastry.server.chat_images import image_text
from pastry.server.limits import token_counts
from pastry.server.openai_options import OpenAIError
from pastry.server.relay import Events, relay, send_json
from pastry.server.service import LaunchQuotaError, PastryServer

PROGRAM = "sglang-generate"
# Request fields: SGLang's GenerateReqInput. Those not listed are refused by name.
FIELDS = {
    "text", "input_ids", "sampling_params", "return_logprob", "logprob_start_len",
    "top_logprobs_num", "return_text_in_logprobs", "stream", "rid", "model", "lora_path",
    "image_data",
}  # fmt: skip
# SGLang fields this server does not implement, with the values that leave them off.
OFF = {
    "video_data": (None, [], ""), "audio_data": (None, [], ""),
    "custom_logit_processor": (None, ""),
    "return_hidden_states": (None, False), "input_embeds": (None,), "session_params": (None,),
    "token_ids_logprob": (None,), "bootstrap_host": (None,), "data_parallel_rank": (None,),
    "log_metrics": (None, True, False), "modalities": (None, []),
}  # fmt: skip
# sampling_params this server takes as they are (SGLang's names).
SAMPLING = {
    "max_new_tokens", "min_new_tokens", "n", "stop", "stop_token_ids", "temperature",
    "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
    "repetition_penalty", "ignore_eos", "regex", "json_schema", "sampling_seed", "logit_bias",
}  # fmt: skip
# sampling_params accepted only at the value that leaves them off (others: 400).
SAMPLING_OFF = {
    "skip_special_tokens": (None, True), "spaces_between_special_tokens": (None, True),
    "no_stop_trim": (None, False), "ebnf": (None,), "structural_tag": (None,),
    "custom_params": (None,), "stop_regex": (None, [], ""),
    "dtype": (None,),
}  # fmt: skip
MAX_N = 16


class ApiError(Exception):
    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": str(self)}}, self.status)


@dataclass(frozen=True)
class Job:
    """A checked request: one ``sglang-generate`` argument per prompt."""

    args: tuple[str, ...]
    n: tuple[int, ...]  # generations per prompt
    batch: bool
    stream: bool
    rids: tuple[str, ...]


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
            "has_image_understanding": False,
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
        job = await asyncio.to_thread(parse, server, body)  # compiles grammars: off the loop
        await asyncio.to_thread(_check_texts, server, body)  # issue 17: off the loop
        _admit(server, request, job)
    except ApiError as e:
        return e.response()
    user = body.get("user") if isinstance(body, dict) else None
    session = session_key(request.headers.get("x-session-id"), user)
    return Generate(server, job, tenant_session(server, request.scope, session))


# ---------------------------------------------------------------------- checking requests


def parse(server: PastryServer, body: Any) -> Job:
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    for name in body:
        if name in OFF:
            if body[name] not in OFF[name]:
                raise ApiError(f"'{name}' is not supported by this server")
        elif name not in FIELDS:
            raise ApiError(f"unknown field '{name}'; the fields are {sorted(FIELDS | set(OFF))}")
    model = body.get("model") or server.models[0]
    if not isinstance(model, str) or model not in server.controller.models:
        raise ApiError(f"no model {model!r}; this server serves {', '.join(server.models)}")
    vocab = server.controller.models[model].info.vocab_size
    batch, prompts = _prompts(body, vocab)
    k = len(prompts)
    sampling = _per_prompt(body.get("sampling_params"), k, "sampling_params", {})
    per = {
        name: _per_prompt(body.get(name), k, name, None)
        for name in (
            "return_logprob",
            "logprob_start_len",
            "top_logprobs_num",
            "return_text_in_logprobs",
        )
    }
    rid = body.get("rid")
    rids = _per_prompt(rid, k, "rid", None) if rid is not None else [None] * k
    # SGLang's lora_path: the name of a loaded LoRA adapter (one, or one per prompt)
    loras = _per_prompt(body.get("lora_path") or None, k, "lora_path", None)
    loaded = server.controller.models[model].adapters
    for lora in loras:
        if lora is not None and lora not in loaded:
            names = ", ".join(loaded) or "none"
            raise ApiError(f"'lora_path' names no loaded adapter: {lora!r} (loaded: {names})")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(f"'stream' must be true or false, got {stream!r}")
    images = _images(server, body, model, batch, k)
    args, ns = [], []
    for i, prompt in enumerate(prompts):
        sp = _sampling(sampling[i], vocab, server.controller.models[model])
        req = {**prompt, "sampling_params": sp, "model": model, "stream": stream}
        if images[i]:
            if per["return_logprob"][i]:
                raise ApiError("'return_logprob' with 'image_data' is not supported yet")
            _check_image_prompt(server.controller.models[model], prompt, len(images[i]))
            req["images"] = images[i]
        if loras[i] is not None:
            req["lora_path"] = loras[i]
        for name, values in per.items():
            if values[i] is not None:
                req[name] = values[i]
        _check_logprob_args(req)
        ns.append(sp.get("n", 1))
        args.append(json.dumps(req))
    rids_out = tuple(r if r is not None else uuid.uuid4().hex for r in rids)
    return Job(tuple(args), tuple(ns), batch, stream, rids_out)


def _images(server: PastryServer, body: dict, model: str, batch: bool, k: int) -> list[list[str]]:
    """Each prompt's images (checked base64) from ``image_data``: SGLang's one image or
    list of images for one prompt, or per prompt of a batch an image, a list or null. The
    prompt writes the model's image token (``<image>`` for LLaVA) where each one goes."""
    given = body.get("image_data")
    if given in (None, [], ""):
        return [[] for _ in range(k)]
    if batch:
        if not isinstance(given, list) or len(given) != k:
            raise ApiError(f"'image_data' of a batch needs one entry per prompt ({k})")
        rows = [[] if g is None else g if isinstance(g, list) else [g] for g in given]
    else:
        rows = [given if isinstance(given, list) else [given]]
    m, q = server.controller.models[model], server.config.quotas
    try:
        return [
            [image_text(v, _where(batch, i, j), m, q) for j, v in enumerate(row)]
            for i, row in enumerate(rows)
        ]
    except OpenAIError as e:
        raise ApiError(str(e)) from None


def _check_image_prompt(m, prompt: dict, images: int) -> None:
    """One image token in ``prompt`` per image, and room for the images' embeddings."""
    info = m.info
    ids = prompt.get("input_ids") or m.tokens.encode_batch([prompt["text"]], True)[0]
    found = ids.count(info.image_token_id)
    if found != images:
        raise ApiError(
            f"the prompt has {found} image tokens (id {info.image_token_id}) for {images} "
            "images of 'image_data': write the model's image token where each image goes"
        )
    n = len(ids) + images * (info.image_tokens - 1)
    if n > info.max_position:
        raise ApiError(
            f"the prompt with its images is {n} tokens, over this model's context of "
            f"{info.max_position} tokens"
        )


def _where(batch: bool, i: int, j: int) -> str:
    return f"image_data[{i}][{j}]" if batch else f"image_data[{j}]"


def _prompts(body: dict, vocab: int) -> tuple[bool, list[dict]]:
    """Whether the request is a batch, and its prompts (``text`` or ``input_ids``)."""
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise ApiError("give exactly one of 'text' and 'input_ids'")
    if text is not None:
        batch = isinstance(text, list)
        prompts: list[dict] = [{"text": t} for t in (text if batch else [text])]
        if not all(isinstance(p["text"], str) for p in prompts) or not prompts:
            raise ApiError("'text' must be a string or a non-empty list of strings")
    else:
        batch = isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
        rows = ids if batch else [ids]
        if not rows or not all(
            isinstance(r, list) and r and all(type(t) is int and 0 <= t < vocab for t in r)
            for r in rows
        ):
            raise ApiError(
                f"'input_ids' must be a non-empty list of token ids (0 to {vocab - 1}) or a "
                "list of such lists"
            )
        prompts = [{"input_ids": r} for r in rows]
    return batch, prompts


def _per_prompt(value: Any, k: int, name: str, default: Any) -> list[Any]:
    if isinstance(value, list) and name != "sampling_params" and name != "rid":
        if len(value) != k:
            raise ApiError(f"'{name}' has {len(value)} values for {k} prompts")
        return value
    if name in ("sampling_params", "rid") and isinstance(value, list):
        if len(value) != k:
            raise ApiError(f"'{name}' has {len(value)} values for {k} prompts")
        return value
    return [default if value is None else value] * k


def _sampling(given: Any, vocab: int, model) -> dict[str, Any]:
    if not isinstance(given, dict):
        raise ApiError(f"'sampling_params' must be an object, got {given!r:.100}")
    out: dict[str, Any] = {}
    for name, value in given.items():
        if name in SAMPLING_OFF:
            if value not in SAMPLING_OFF[name]:
                raise ApiError(f"'sampling_params.{name}' is not supported by this server")
        elif name not in SAMPLING:
            raise ApiError(
                f"unknown sampling parameter '{name}'; this server takes {sorted(SAMPLING)}"
            )
        elif value is not None:
            out[name] = value
    if isinstance(out.get("stop"), str):
        out["stop"] = [out["stop"]]
    if "json_schema" in out and not isinstance(out["json_schema"], str):
        out["json_schema"] = json.dumps(out["json_schema"])
    for name in ("stop_token_ids", "logit_bias"):
        if name not in out:
            continue
        tokens = list(out[name]) if isinstance(out[name], dict) else out[name]
        if not isinstance(tokens, list) or not all(_token(t, vocab) for t in tokens):
            raise ApiError(
                f"'sampling_params.{name}' must {'map' if name == 'logit_bias' else 'list'} "
                f"token ids (0 to {vocab - 1}), got {out[name]!r:.100}"
            )
    try:
        p = SamplingParams().override({("seed" if k == "sampling_seed" else k): v
                                       for k, v in out.items()})  # fmt: skip
        check(p)
    except (TypeError, ValueError) as e:
        raise ApiError(f"sampling_params: {e}") from None
    if p.n > MAX_N:
        raise ApiError(f"'sampling_params.n' must be at most {MAX_N}, got {p.n}")
    if p.regex is not None:
        _check_grammar({"regex": p.regex}, model)
    if p.json_schema is not None:
        _check_grammar({"json_schema": p.json_schema}, model)
    return out


def _token(t: Any, vocab: int) -> bool:
    """A token id, or its decimal text (JSON object keys, as in ``logit_bias``)."""
    if isinstance(t, str) and t.isdigit():
        t = int(t)
    return type(t) is int and 0 <= t < vocab


def _check_grammar(spec: dict, model) -> None:
    """Compile the grammar (in the request's worker thread) for the instance to copy
    (``control/constraints.py``): a bad one is a 400, and none compiles on the loop."""
    from pastry.control.constraints import prepare

    info = model.info
    try:
        prepare(model.tokenizer, info.vocab_size, tuple(info.eos_token_ids), spec)
    except ValueError as e:
        raise ApiError(f"sampling_params.{next(iter(spec))}: {e}") from None
    except ImportError as e:
        raise ApiError(
            f"sampling_params.{next(iter(spec))}: cannot constrain output: {e}"
        ) from None


def _check_logprob_args(req: dict) -> None:
    for name, kind in (("return_logprob", bool), ("return_text_in_logprobs", bool),
                       ("logprob_start_len", int), ("top_logprobs_num", int)):  # fmt: skip
        v = req.get(name)
        if v is not None and (not isinstance(v, kind) or (kind is int and isinstance(v, bool))):
            raise ApiError(f"'{name}' must be {'true or false' if kind is bool else 'an integer'}")
    if not 0 <= (req.get("top_logprobs_num") or 0) <= MAX_LOGPROBS:
        raise ApiError(f"'top_logprobs_num' must be from 0 to {MAX_LOGPROBS}")
    start = req.get("logprob_start_len")
    if start is not None and start < -1:
        raise ApiError("'logprob_start_len' must be -1 (the last prompt token) or >= 0")


# ---------------------------------------------------------------------- tenant limits (issue 17)


def _check_texts(server: PastryServer, body: dict) -> None:
    """Refuse texts longer than the context; tokenize the others here, in a worker thread
    without the global lock, so that the built-in finds their tokens ready instead of
    tokenizing on the event loop (``control/tokenization.py``)."""
    text = body.get("text")
    if text is None:
        return
    m = server.controller.models[body.get("model") or server.models[0]]
    texts = text if isinstance(text, list) else [text]
    # as the built-in tokenizes them: each text starts a sequence (a BOS if the model has one)
    for n in token_counts(m.tokens, texts, m.info.max_position, add_special_tokens=True):
        if n > m.info.max_position:
            raise ApiError(
                f"'text' has {n} tokens or more, over this model's context of "
                f"{m.info.max_position} tokens: shorten it"
            )


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
