"""The generation options that completions and chat requests share, checked: sampling,
stops, penalties, logit bias and output constraints (``response_format``, vLLM's
``structured_outputs`` and ``guided_*``), and the :class:`OpenAIError` a bad one is
answered with, naming the parameter. :mod:`pastry.server.openai_params` reads the rest of
each request with them.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pastry.server.openai_tools import closed_schema

MAX_N = 16
MAX_LOGPROBS = 20


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


def check_fields(body: dict, fields: frozenset[str]) -> None:
    for name in body:
        if name not in fields and body[name] is not None:
            raise OpenAIError(f"'{name}' is not supported by this server", name)


def param(body: dict, name: str, kinds, default, valid, what: str):
    """``body[name]`` (``default`` when missing or null), checked to be ``what``."""
    value = body.get(name)
    if value is None:
        return default
    is_bool = isinstance(value, bool)  # JSON true/false are not numbers here
    if is_bool != (kinds is bool) or not isinstance(value, kinds) or not valid(value):
        raise OpenAIError(f"'{name}' must be {what}, got {value!r}", name)
    return value


def generation_options(body: dict, model, max_tokens: int, logprobs: int | None) -> dict:
    """The built-ins' generation options from the request's parameters."""
    vocab = model.info.vocab_size
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise OpenAIError(f"'stop' must be a string or a list of strings, got {stop!r}", "stop")
    number = (int, float)
    n = param(body, "n", int, 1, lambda v: 1 <= v <= MAX_N, f"an integer from 1 to {MAX_N}")
    top_k = param(body, "top_k", int, 0, lambda v: v >= -1, "an integer >= -1 (-1 or 0: off)")
    min_tokens = param(body, "min_tokens", int, 0, lambda v: 0 <= v <= max_tokens, f"an integer from 0 to the maximum tokens ({max_tokens})")  # fmt: skip
    return {
        "model": model.name,
        "max_tokens": max_tokens,
        "temperature": param(
            body, "temperature", number, 1.0, lambda v: 0 <= v <= 2, "a number from 0 to 2"
        ),
        "top_p": param(body, "top_p", number, 1.0, lambda v: 0 < v <= 1, "a number in (0, 1]"),
        "top_k": max(top_k, 0),
        "min_p": param(body, "min_p", number, 0.0, lambda v: 0 <= v <= 1, "a number from 0 to 1"),
        "seed": param(body, "seed", int, None, lambda v: -(2**63) <= v < 2**63, "a 64-bit integer"),
        "stop": stop or [],
        "stop_token_ids": _token_list(body, "stop_token_ids", vocab),
        "ignore_eos": param(body, "ignore_eos", bool, False, lambda v: True, "true or false"),
        "min_tokens": min_tokens,
        "n": n,
        "stream": param(body, "stream", bool, False, lambda v: True, "true or false"),
        "logprobs": logprobs,
        "logit_bias": _logit_bias(body.get("logit_bias"), vocab),
        "frequency_penalty": param(
            body, "frequency_penalty", number, 0.0, lambda v: -2 <= v <= 2, "a number from -2 to 2"
        ),
        "presence_penalty": param(
            body, "presence_penalty", number, 0.0, lambda v: -2 <= v <= 2, "a number from -2 to 2"
        ),
        "repetition_penalty": param(
            body, "repetition_penalty", number, 1.0, lambda v: 0 < v <= 10, "a number in (0, 10]"
        ),
        "grammar": output_constraint(body, model),
    }


def _token_list(body: dict, name: str, vocab: int) -> list[int]:
    value = body.get(name) or []
    if not (isinstance(value, list) and all(type(t) is int and 0 <= t < vocab for t in value)):
        raise OpenAIError(f"'{name}' must be a list of token ids below {vocab}", name)
    return value


def _logit_bias(value: Any, vocab: int) -> dict[str, float]:
    if not value:
        return {}
    if not isinstance(value, dict):
        raise OpenAIError("'logit_bias' must map token ids to numbers", "logit_bias")
    out = {}
    for key, bias in value.items():
        try:
            token = int(key)
        except ValueError:
            token = -1
        if not 0 <= token < vocab:
            raise OpenAIError(
                f"'logit_bias' has key {key!r}, not a token id below {vocab}", "logit_bias"
            )
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not -100 <= bias <= 100:
            raise OpenAIError(
                f"'logit_bias' values must be numbers from -100 to 100, got {bias!r}", "logit_bias"
            )
        out[str(token)] = float(bias)
    return out


def output_constraint(body: dict, model) -> dict | None:
    """The grammar of ``response_format``, vLLM's ``structured_outputs`` or ``guided_*``
    (at most one of them)."""
    found: list[tuple[str, dict]] = []
    fmt = body.get("response_format")
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "json_object":
            found.append(("response_format", {"json_schema": {"type": "object"}}))
        elif kind == "json_schema":
            found.append(("response_format", json_schema_format(fmt.get("json_schema"))))
        elif kind != "text":
            raise OpenAIError(
                '\'response_format\' must be {"type": "text" | "json_object" | '
                f'"json_schema"}}, got {fmt!r:.100}',
                "response_format",
            )
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise OpenAIError("'structured_outputs' must be an object", "structured_outputs")
        for key, value in so.items():
            if value is None or value is False:
                continue
            where = f"structured_outputs.{key}"
            if key not in ("json", "regex", "choice", "grammar", "json_object"):
                raise OpenAIError(f"'{where}' is not supported by this server", where)
            found.append((where, _guided(key, value, where)))
    for key in ("json", "regex", "choice", "grammar"):
        value = body.get(f"guided_{key}")
        if value is not None:
            found.append((f"guided_{key}", _guided(key, value, f"guided_{key}")))
    if len(found) > 1:
        names = ", ".join(f"'{w}'" for w, _ in found)
        raise OpenAIError(f"give one output constraint, not {names}", found[1][0])
    if not found:
        return None
    where, grammar = found[0]
    compile_grammar(where, grammar, model)
    return grammar


def json_schema_format(spec: Any, where: str = "response_format") -> dict:
    """The grammar of a ``json_schema`` format ``{"name", "description", "schema",
    "strict"}``: with ``strict``, every object is closed (no property the schema does not
    name), as OpenAI's structured outputs are."""
    shape = (
        f'\'{where}.json_schema\' must be {{"name", "description", "schema": {{...}}, "strict"}}'
    )
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise OpenAIError(shape, where)
    extra = sorted(k for k in spec if k not in ("name", "description", "schema", "strict"))
    if extra:
        raise OpenAIError(f"{shape}; '{extra[0]}' is not supported", f"{where}.json_schema.{extra[0]}")  # fmt: skip
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise OpenAIError(f"'{where}.json_schema.strict' must be true or false", where)
    schema = spec["schema"]
    return {"json_schema": closed_schema(schema) if strict else schema}


def _guided(kind: str, value: Any, where: str) -> dict:
    if kind == "json_object":
        return {"json_schema": {"type": "object"}}
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise OpenAIError(f"'{where}' is not valid JSON", where) from None
        if not isinstance(value, dict):
            raise OpenAIError(f"'{where}' must be a JSON schema object", where)
        return {"json_schema": value}
    if kind == "choice":
        if not (isinstance(value, list) and value and all(isinstance(c, str) for c in value)):
            raise OpenAIError(f"'{where}' must be a non-empty list of strings", where)
        return {"regex": "(" + "|".join(re.escape(c) for c in value) + ")"}
    if not isinstance(value, str):
        raise OpenAIError(f"'{where}' must be a string", where)
    return {"regex": value} if kind == "regex" else {"lark": value}


def compile_grammar(where: str, grammar: dict, model) -> None:
    """Compile the grammar here, in the request's worker thread, so that a bad one is a
    400, not a failed instance, and the instance gets a ready matcher instead of compiling
    on the event loop (``control/constraints.py``)."""
    from pastry.api import ApiError
    from pastry.control.constraints import prepare

    info = model.info
    try:
        prepare(model.tokenizer, info.vocab_size, tuple(info.eos_token_ids), grammar)
    except ValueError as e:
        raise OpenAIError(f"'{where}' is not a valid output constraint: {e}", where) from None
    except (ApiError, ImportError) as e:  # this model or server cannot take grammars
        raise OpenAIError(f"'{where}': this server cannot constrain output: {e}", where) from None


def include_usage(body: dict) -> bool:
    opts = body.get("stream_options") or {}
    if (
        not isinstance(opts, dict)
        or set(opts) - {"include_usage"}
        or not isinstance(opts.get("include_usage", False), bool)
    ):
        raise OpenAIError("'stream_options' must be {\"include_usage\": bool}", "stream_options")
    return opts.get("include_usage", False)
