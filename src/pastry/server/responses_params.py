"""Checking a Responses request (:mod:`pastry.server.responses`): the body in, a
:class:`Spec` out — the chat request it means, checked by
:func:`~pastry.server.openai_params.parse_chat`, and the fields the response repeats — or
an :class:`~pastry.server.openai_params.OpenAIError` naming the Responses field.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from pastry.control.quotas import Quotas
from pastry.server.chat_images import input_image
from pastry.server.openai_params import Job, OpenAIError, parse_chat
from pastry.server.responses_store import ResponseStore, Stored

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
    model,
    body: dict,
    store: ResponseStore,
    user: str,
    adapter: str | None = None,
    quotas: Quotas | None = None,
) -> Spec:
    """``model``: the served model, ``adapter``: its LoRA adapter the request names (if
    any), ``quotas``: the image quotas (None: ``input_image`` parts are refused); errors
    are :class:`OpenAIError` naming the field.

    A conversation with images is not exported for its follow-up (an export is imported
    by token ids, which name no image): the prefix cache supplies its K/V instead, the
    images matched by their digests."""
    for name in body:
        if name not in FIELDS and body[name] is not None:
            raise _error(f"'{name}' is not supported by this server", name)
    previous = _previous(body.get("previous_response_id"), store, user, model.name)
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise _error("'instructions' must be a string", "instructions")
    items = _input_items(body.get("input"), model, quotas)
    conversation = (previous.conversation if previous else []) + _messages(items)
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + conversation  # fmt: skip
    if not messages:
        raise _error("'input' is empty: give a message to answer", "input")
    tools = _tools(body.get("tools"))
    chat = _chat_request(body, model.name, messages, tools)
    stored, metadata, obfuscate = _response_options(body)
    rid = "resp_" + uuid.uuid4().hex
    served = adapter or model.name
    # KV computed with another adapter (or without one) is not this request's
    history = previous.history if previous and previous.served == served else None
    options = {"kv_export": f"responses/{rid}"} if stored else None
    if any(isinstance(m.get("content"), list) for m in conversation):  # images
        history = options = None
    try:
        job = parse_chat(model, {k: v for k, v in chat.items() if v is not None}, history=history, options=options, adapter=adapter, quotas=quotas)  # fmt: skip
    except OpenAIError as e:
        raise _renamed(e) from None
    if job.n != 1:  # never: Responses has no n
        raise _error("one output per response", None)
    echo = _echo(body, rid, served, bool(tools), metadata, stored)
    return Spec(job, echo, stored, items, conversation, obfuscate)


def _previous(prev_id: Any, store: ResponseStore, user: str, model: str) -> Stored | None:
    """The stored response ``previous_response_id`` names (None: none named)."""
    if prev_id is None:
        return None
    previous = store.get(user, prev_id) if isinstance(prev_id, str) else None
    if previous is None:
        raise _error(
            f"Previous response with id {prev_id!r} not found (responses are kept only "
            "with store: true, per user, until deleted or evicted)",
            "previous_response_id",
            404,
            "previous_response_not_found",
        )
    if previous.model != model:
        raise _error(
            f"the previous response was made by model {previous.model!r}, not {model!r}",
            "previous_response_id",
        )
    return previous


def _chat_request(body: dict, model: str, messages: list[dict], tools: list[dict]) -> dict:
    """The chat request the Responses request means (None: a field left out)."""
    chat: dict[str, Any] = {
        "model": model,
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
    return chat


def _response_options(body: dict) -> tuple[bool, dict, bool]:
    """What the request asks of the response itself: ``store``, ``metadata`` and
    ``stream_options.include_obfuscation`` (``truncation`` and ``service_tier`` checked)."""
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
    return stored, metadata, obfuscate


def _echo(body: dict, rid: str, served: str, tools: bool, metadata: dict, stored: bool) -> dict:
    """The request's fields as the response object repeats them."""
    echo = {
        "id": rid,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "max_tool_calls": None,
        "metadata": metadata,
        "model": served,
        "parallel_tool_calls": body.get("parallel_tool_calls", True) is not False,
        "previous_response_id": body.get("previous_response_id"),
        "reasoning": {"effort": None, "summary": None},
        "service_tier": "default",
        "store": stored,
        "temperature": body.get("temperature", 1.0),
        "text": {"format": (body.get("text") or {}).get("format") or {"type": "text"}},
        "tool_choice": body.get("tool_choice") or ("auto" if tools else "none"),
        "tools": body.get("tools") or [],
        "top_logprobs": body.get("top_logprobs"),
        "top_p": body.get("top_p", 1.0),
        "truncation": "disabled",
        "user": body.get("user"),
    }
    for key in ("temperature", "top_p"):
        if echo[key] is None:
            echo[key] = 1.0
    return echo


def _renamed(e: OpenAIError) -> OpenAIError:
    """A chat-request error in the Responses request's terms."""
    message, param = str(e), e.param
    message = message.replace("the messages", "the input")
    for chat, ours in _CHAT_NAMES.items():
        message = message.replace(f"'{chat}'", f"'{ours}'")
        if param is not None and (param == chat or param.startswith(chat + "[")):
            param = ours + param[len(chat) :]
    return OpenAIError(message, param, e.status, e.code, e.kind)


def _input_items(value: Any, model, quotas: Quotas | None) -> list[dict]:
    """``input`` as a list of items (a string is one user message), each checked."""
    if isinstance(value, str):
        return [_message_item({"role": "user", "content": value}, "input", model, quotas)]
    if not isinstance(value, list):
        raise _error("'input' must be a string or a list of input items", "input")
    out = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise _error(f"'{where}' must be an object", where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            out.append(_message_item(item, where, model, quotas))
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


def _message_item(item: dict, where: str, model, quotas: Quotas | None) -> dict:
    _only(item, {"type", "role", "content", "id", "status", "phase"}, where)
    role = item.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise _error(f"'{where}.role' must be user, system, developer or assistant", f"{where}.role")  # fmt: skip
    content = item.get("content")
    if role == "user" and quotas is not None and isinstance(content, list):
        parts = _image_content(content, f"{where}.content", model, quotas)
        if all(p["type"] == "input_text" for p in parts):  # text only: one part
            parts = [{"type": "input_text", "text": "".join(p["text"] for p in parts)}]
    else:
        kinds = ("output_text", "refusal") if role == "assistant" else ("input_text",)
        parts = [{"type": kinds[0], "text": _text_of(content, f"{where}.content", kinds)}]
    return {"type": "message", "role": role, "content": parts, "id": item.get("id") or "msg_" + uuid.uuid4().hex, "status": "completed"}  # fmt: skip


def _image_content(content: list, where: str, model, quotas: Quotas) -> list[dict]:
    """A user message's ``input_text`` and ``input_image`` parts, checked, in order."""
    parts = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_image":
            parts.append(input_image(part, at, model, quotas))
        elif kind == "input_text":
            _only(part, {"type", "text"}, at)
            if not isinstance(part.get("text"), str):
                raise _error(f"'{at}.text' must be a string", f"{at}.text")
            parts.append({"type": "input_text", "text": part["text"]})
        else:
            raise _error(f"'{at}' has type {kind!r}: this server takes input_text and input_image parts", f"{at}.type")  # fmt: skip
    return parts


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
            out.append({"role": item["role"], "content": _chat_content(item["content"])})
        elif item["type"] == "function_call":
            call = {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}}  # fmt: skip
            if out and out[-1]["role"] == "assistant" and "raw" not in out[-1]:
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})  # fmt: skip
    return out


def _chat_content(parts: list[dict]) -> str | list[dict]:
    """A message item's content as a chat message's: its text, or (with images) parts."""
    if len(parts) == 1 and "text" in parts[0]:
        return parts[0]["text"]
    return [{"type": "text", "text": p["text"]} if "text" in p else {"type": "image_url", "image_url": {"url": p["image_url"]}} for p in parts]  # fmt: skip


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
