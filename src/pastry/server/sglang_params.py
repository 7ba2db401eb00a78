"""Checking SGLang's ``POST /generate`` (``server/sglang_api.py``): the request's fields
(SGLang's ``GenerateReqInput``; those not implemented refused by name, never ignored), its
prompts, sampling parameters, grammars and images, made into one ``sglang-generate``
argument per prompt.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from starlette.responses import JSONResponse

from pastry.lang.expr import SamplingParams
from pastry.lang.generation import MAX_LOGPROBS, check
from pastry.server.chat_images import added_positions, image_text
from pastry.server.limits import token_counts
from pastry.server.openai_options import OpenAIError
from pastry.server.service import PastryServer

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
            _check_image_prompt(server.controller.models[model], prompt, images[i])
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


def _check_image_prompt(m, prompt: dict, images: list[str]) -> None:
    """One image token in ``prompt`` per image, and room for the images' embeddings."""
    info = m.info
    ids = prompt.get("input_ids") or m.tokens.encode_batch([prompt["text"]], True)[0]
    found = ids.count(info.image_token_id)
    if found != len(images):
        raise ApiError(
            f"the prompt has {found} image tokens (id {info.image_token_id}) for {len(images)} "
            "images of 'image_data': write the model's image token where each image goes"
        )
    n = len(ids) + added_positions(m, images)
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


def check_texts(server: PastryServer, body: dict) -> None:
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
