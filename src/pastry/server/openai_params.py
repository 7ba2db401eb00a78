"""Checking OpenAI requests: a request body in, a :class:`Job` out (or an
:class:`OpenAIError` naming the bad parameter).

Every parameter of the body is either implemented or rejected with a 400 that names it,
never ignored: :data:`COMPLETION_FIELDS` and :data:`CHAT_FIELDS` are what is accepted
(OpenAI's parameters plus vLLM's extensions, with vLLM's meaning); ``null`` is the same as
leaving a parameter out. The generation options become the JSON argument of the built-in
inferlets (``text-completion``, ``chat``), which run them; the options completions and chat
share are checked in :mod:`pastry.server.openai_options`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import jinja2

from pastry.control.quotas import Quotas
from pastry.server.chat_images import added_positions, content_parts
from pastry.server.limits import MAX_MESSAGES, MAX_TOOLS, too_many
from pastry.server.openai_options import (
    MAX_LOGPROBS,
    MAX_N,
    OpenAIError,
    check_fields,
    compile_grammar,
    generation_options,
    include_usage,
    param,
)
from pastry.server.openai_tools import (
    HermesFormat,
    ToolCallFormat,
    inline_tools,
    named_schema,
    required_schema,
    template_messages,
)

_COMMON = {
    "model", "n", "stream", "stream_options", "temperature", "top_p", "seed", "stop",
    "logit_bias", "frequency_penalty", "presence_penalty", "user", "max_tokens",
    "response_format",
    # vLLM's extensions
    "top_k", "min_p", "repetition_penalty", "stop_token_ids", "ignore_eos", "min_tokens",
    "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
}  # fmt: skip
COMPLETION_FIELDS = frozenset(_COMMON | {"prompt", "logprobs", "echo", "best_of", "suffix"})
CHAT_FIELDS = frozenset(
    _COMMON
    | {
        "messages",
        "logprobs",
        "top_logprobs",
        "max_completion_tokens",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
    }
)
TOOL_FORMAT: ToolCallFormat = HermesFormat()


@dataclass(frozen=True)
class Tools:
    """How the endpoint reads tool calls from the outputs of a chat request."""

    mode: str  # "auto" (parse the model's format), "required" (a JSON array), "named"
    name: str | None = None  # the function, when named
    parallel: bool = True  # False: at most one call
    fmt: ToolCallFormat = field(default=TOOL_FORMAT)


@dataclass(frozen=True)
class Job:
    """A checked request: one instance of the built-in per argument, and how to answer."""

    chat: bool
    model: str
    args: tuple[str, ...]  # the JSON argument of each instance (one per prompt)
    n: int  # choices per instance
    stream: bool
    include_usage: bool
    logprobs: int | None = None  # top log-probabilities per token; None: no logprobs
    echo: bool = False
    tools: Tools | None = None
    prompt_text: str | None = None  # a chat's rendered prompt
    adapter: str | None = None  # the LoRA adapter the request named as its model

    @property
    def served(self) -> str:
        """The model name answers carry: the one the request gave."""
        return self.adapter or self.model

    @property
    def program(self) -> str:
        return "chat" if self.chat else "text-completion"

    @property
    def endpoint(self) -> str:
        return "/v1/chat/completions" if self.chat else "/v1/completions"


def parse_completion(model, body: dict, adapter: str | None = None) -> Job:
    """``model``: the served model (``controller.models[name]``); ``adapter``: one of its
    LoRA adapters, applied to every forward."""
    check_fields(body, COMPLETION_FIELDS)
    prompts = _prompts(body.get("prompt"), model)
    echo = param(body, "echo", bool, False, lambda v: True, "true or false")
    least = 0 if echo else 1
    max_tokens = param(body, "max_tokens", int, 16, lambda v: v >= least, f"an integer >= {least}")
    for p in prompts:
        _check_length(len(p), max_tokens, model.info.max_position, "prompt", "max_tokens")
    if body.get("suffix") not in (None, ""):
        raise OpenAIError(
            "'suffix' is not supported by this server (no fill-in-the-middle)", "suffix"
        )
    logprobs = param(body, "logprobs", int, None, lambda v: 0 <= v <= MAX_LOGPROBS, f"an integer from 0 to {MAX_LOGPROBS}")  # fmt: skip
    opts = generation_options(body, model, max_tokens, logprobs)
    opts["echo"] = echo
    best_of = param(body, "best_of", int, None, lambda v: opts["n"] <= v <= MAX_N, f"an integer from n ({opts['n']}) to {MAX_N}")  # fmt: skip
    if best_of is not None and best_of > opts["n"] and opts["stream"]:
        raise OpenAIError("'best_of' greater than 'n' cannot be streamed", "best_of")
    opts["best_of"] = best_of
    opts["adapter"] = adapter
    args = tuple(json.dumps({"prompt": p, **opts}) for p in prompts)
    return Job(
        False, model.name, args, opts["n"], opts["stream"], include_usage(body), logprobs, echo,
        adapter=adapter,
    )  # fmt: skip


@dataclass(frozen=True)
class History:
    """A conversation the server computed before (a stored response): its token ids, the
    text they spell, and the persistent KV export that holds them (None: not kept)."""

    tokens: list[int]
    text: str
    export: str | None = None


def parse_chat(
    model,
    body: dict,
    fields: frozenset[str] | None = None,
    history: History | None = None,
    options: dict | None = None,
    adapter: str | None = None,
    quotas: Quotas | None = None,
) -> Job:
    """``fields``: what the body may hold (default :data:`CHAT_FIELDS`). ``history``: when
    the rendered prompt starts with its text, the prompt is its tokens plus the rest
    tokenized, and its KV export is imported instead of computed again. ``options``: more
    options of the ``chat`` inferlet (e.g. ``kv_export``). ``quotas``: the image quotas,
    given where ``image_url`` parts are taken (None: they are refused)."""
    check_fields(body, CHAT_FIELDS if fields is None else fields)
    images: list[str] = []
    messages = check_messages(body.get("messages"), model, quotas, images)
    tools, choice, tool_list = _tools(body)
    text = _render(model, messages, tool_list, choice)
    prompt, kv_import = _chat_prompt(model, text, history)
    length = len(prompt)
    if images:
        length += _image_placeholders(model, prompt, images)
        if kv_import is not None:  # a stored conversation's KV has no image in it
            raise OpenAIError("images cannot continue a stored conversation", "messages")
    name = (
        "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    )
    room = model.info.max_position - length
    max_tokens = param(body, name, int, room, lambda v: v >= 1, "an integer >= 1")
    _check_length(length, max_tokens, model.info.max_position, "messages", name)
    want = param(body, "logprobs", bool, False, lambda v: True, "true or false")
    top = param(body, "top_logprobs", int, None, lambda v: 0 <= v <= MAX_LOGPROBS, f"an integer from 0 to {MAX_LOGPROBS}")  # fmt: skip
    if top is not None and not want:
        raise OpenAIError("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    logprobs = (top or 0) if want else None
    opts = generation_options(body, model, max_tokens, logprobs)
    if tools is not None and tools.mode != "auto":
        _force_tool_calls(opts, tools, tool_list, model)
    opts.update(kv_import=kv_import, adapter=adapter, **(options or {}))
    if images:
        opts["images"] = images
    args = (json.dumps({"prompt": prompt, **opts}),)
    return Job(
        True, model.name, args, opts["n"], opts["stream"], include_usage(body), logprobs,
        tools=tools, prompt_text=text, adapter=adapter,
    )  # fmt: skip


def _image_placeholders(model, prompt: list[int], images: list[str]) -> int:
    """The tokens ``images`` add to ``prompt`` (each of the chat template's image
    placeholders becomes the image's embeddings: ``added_positions``); a 400 unless the
    template wrote one placeholder per image."""
    info = model.info
    found = prompt.count(info.image_token_id)
    if found != len(images):
        raise OpenAIError(
            f"'messages' has {len(images)} image parts, but the rendered chat template holds "
            f"{found} image placeholders (token {info.image_token_id}); the model's chat "
            "template must write one per image part",
            "messages",
        )
    return added_positions(model, images)


def _render(model, messages: list[dict], tool_list: list[dict], choice: str | None) -> str:
    """The chat's prompt text: the messages (and tools) through the model's chat template;
    tools go into the system message when the template has no place for them."""
    render = template_messages(messages)
    template = model.tokenizer.chat_template or ""
    if tool_list and choice is not None and "tools" not in template:
        render = inline_tools(render, tool_list, TOOL_FORMAT)
    try:
        return model.tokenizer.apply_chat_template(
            render, add_generation_prompt=True, tools=tool_list or None
        )
    except (ValueError, TypeError, jinja2.TemplateError) as e:
        raise OpenAIError(
            f"'messages' cannot be rendered with the chat template: {e}", "messages"
        ) from None


def _chat_prompt(model, text: str, history: History | None) -> tuple[list[int], dict | None]:
    """The prompt's token ids, and the KV export to import (None: compute it all): when
    ``text`` continues ``history``'s, only the rest is tokenized."""
    if history is not None and text.startswith(history.text) and len(text) > len(history.text):
        (rest,) = _encode(model, [text[len(history.text) :]], "messages")
        kv_import = None
        if history.export is not None:
            kv_import = {"name": history.export, "tokens": len(history.tokens)}
        return history.tokens + rest, kv_import
    (prompt,) = _encode(model, [text], "messages")  # issue 17: off the event loop
    return prompt, None


def _force_tool_calls(opts: dict, tools: Tools, tool_list: list[dict], model) -> None:
    """A named or required tool choice as the grammar of the output (in ``opts``)."""
    if opts["grammar"] is not None:
        raise OpenAIError(
            "a forced tool call cannot be combined with 'response_format' or structured outputs",
            "tool_choice",
        )
    if tools.mode == "named":
        [tool] = [t for t in tool_list if t["function"]["name"] == tools.name]
        opts["grammar"] = {"json_schema": named_schema(tool)}
    else:
        opts["grammar"] = {"json_schema": required_schema(tool_list, tools.parallel)}
        opts["stop_repeated_item"] = tools.parallel  # a repeated call ends the array
    compile_grammar("tools", opts["grammar"], model)


FUNCTION_FIELDS = frozenset({"name", "description", "parameters", "strict"})


def check_tools(tools: Any, where: str = "tools") -> list[dict]:
    """Chat's function tools, checked: ``[{"type": "function", "function": {"name",
    "description", "parameters", "strict"}}]`` (any other field is refused, naming it)."""
    shape = (
        f'\'{where}\' must be a list of {{"type": "function", "function": {{"name", '
        '"description", "parameters", "strict"}}'
    )
    if not isinstance(tools, list):
        raise OpenAIError(shape, where)
    if (over := too_many(tools, where, MAX_TOOLS)) is not None:
        raise OpenAIError(over, where, code="array_above_max_length")
    for i, t in enumerate(tools):
        if not (
            isinstance(t, dict)
            and t.get("type") == "function"
            and isinstance(t.get("function"), dict)
        ):
            raise OpenAIError(f"{shape}; {where}[{i}] is not", f"{where}[{i}]")
        fn = t["function"]
        extra = [f"{where}[{i}].{k}" for k in sorted(set(t) - {"type", "function"})]
        extra += [f"{where}[{i}].function.{k}" for k in sorted(fn) if k not in FUNCTION_FIELDS]
        if extra:
            raise OpenAIError(f"'{extra[0]}' is not supported by this server", extra[0])
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise OpenAIError(f"'{where}[{i}].function.name' must be a non-empty string", f"{where}[{i}].function.name")  # fmt: skip
        if not isinstance(fn.get("parameters") or {}, dict):
            raise OpenAIError(f"'{where}[{i}].function.parameters' must be a JSON schema object", f"{where}[{i}].function.parameters")  # fmt: skip
        if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
            raise OpenAIError(f"'{where}[{i}].function.strict' must be true or false", f"{where}[{i}].function.strict")  # fmt: skip
    return tools


def _tools(body: dict) -> tuple[Tools | None, str | None, list[dict]]:
    tools = check_tools(body.get("tools") or [])
    choice = body.get("tool_choice")
    if choice is None:
        choice = "auto" if tools else "none"
    names = [t["function"]["name"] for t in tools]
    if choice == "none":
        return None, None, tools
    if not tools:
        raise OpenAIError("'tool_choice' needs 'tools'", "tool_choice")
    parallel = param(body, "parallel_tool_calls", bool, True, lambda v: True, "true or false")
    if choice in ("auto", "required"):
        return Tools(choice, parallel=parallel), choice, tools
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = (choice.get("function") or {}).get("name")
        if name not in names:
            raise OpenAIError(
                f"'tool_choice' names function {name!r}, not one of the tools ({names})",
                "tool_choice",
            )
        return Tools("named", name), "named", tools
    raise OpenAIError(
        '\'tool_choice\' must be "none", "auto", "required" or {"type": "function", '
        f'"function": {{"name": ...}}}}, got {choice!r:.100}',
        "tool_choice",
    )


def _prompts(prompt: Any, model) -> list[list[int]]:
    """The prompts of a completion as token ids: a string, strings, token ids, or lists of
    token ids."""
    vocab = model.info.vocab_size

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
    out = []
    # issue 17: called off the event loop; texts too long to fit are not even tokenized
    # text starts a sequence: with a BOS if the model has one (an empty text stays empty)
    texts = iter(_encode(model, [p for p in prompts if isinstance(p, str)], "prompt", True))
    for p in prompts:
        if isinstance(p, str):
            p = next(texts)
        bad = [t for t in p if not 0 <= t < vocab]
        if bad:
            raise OpenAIError(
                f"'prompt' has token id {bad[0]}, outside the vocabulary (0 to {vocab - 1})",
                "prompt",
            )
        out.append(p)
    return out


_ROLES = ("system", "developer", "user", "assistant", "tool")


def check_messages(
    messages: Any, model=None, quotas: Quotas | None = None, images: list[str] | None = None
) -> list[dict]:
    """Messages with string contents (text parts joined); assistant ``tool_calls`` and
    ``tool_call_id`` kept for the template; ``developer`` is ``system``. With ``quotas``,
    ``image_url`` parts are taken for ``model`` (:mod:`pastry.server.chat_images`): such
    a message's content stays a list of parts, each image's base64 goes to ``images``."""
    if not isinstance(messages, list) or not messages:
        raise OpenAIError(
            '\'messages\' must be a non-empty list of {"role", "content"} objects', "messages"
        )
    if (over := too_many(messages, "messages", MAX_MESSAGES)) is not None:
        raise OpenAIError(over, "messages", code="array_above_max_length")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in _ROLES:
            raise OpenAIError(f"'{where}' must be an object with a 'role' in {_ROLES}", where)
        content = m.get("content")
        if isinstance(content, list):
            at = [] if images is None else images
            content = content_parts(content, f"{where}.content", model, quotas, at)
        calls = m.get("tool_calls")
        if content is None and m["role"] == "assistant" and calls:
            content = ""
        if not isinstance(content, str | list):
            raise OpenAIError(
                f"'{where}.content' must be a string or a list of parts, got {content!r:.100}",
                f"{where}.content",
            )
        msg: dict[str, Any] = {"role": "system" if m["role"] == "developer" else m["role"]}
        msg["content"] = content
        if calls:
            if not isinstance(calls, list) or not all(
                isinstance(c, dict) and isinstance(c.get("function"), dict) for c in calls
            ):
                raise OpenAIError(f"'{where}.tool_calls' must be a list of calls", where)
            msg["tool_calls"] = calls
        for key in ("tool_call_id", "name"):
            if isinstance(m.get(key), str):
                msg[key] = m[key]
        out.append(msg)
    return out


def _encode(model, texts: list[str], what: str, start: bool = False) -> list[list[int]]:
    """Token ids of ``texts``, tokenized without the global lock (``control/tokenization.py``;
    parsing runs in a worker thread); a text that cannot fit the context by its length alone
    is refused without being tokenized. ``start``: each non-empty text starts a sequence
    (the tokenizer's special tokens, e.g. a BOS, are added)."""
    limit = model.info.max_position
    for text in texts:
        least = model.tokens.fewest_tokens(text)
        if least > limit:
            raise OpenAIError(
                f"this model's maximum context length is {limit} tokens, but the {what} has "
                f"at least {least}: shorten the {what}",
                what,
            )
    if not start:
        return model.tokens.encode_batch(texts) if texts else []
    full = [i for i, t in enumerate(texts) if t]
    out: list[list[int]] = [[] for _ in texts]
    for i, ids in zip(full, model.tokens.encode_batch([texts[i] for i in full], True), strict=True):
        out[i] = ids
    return out


def _check_length(length: int, max_tokens: int, max_position: int, what: str, name: str) -> None:
    if length == 0:
        raise OpenAIError(f"'{what}' is empty: give at least one token to continue from", what)
    if length >= max_position:  # the prompt alone leaves no room
        raise OpenAIError(
            f"this model's maximum context length is {max_position} tokens, but the {what} has "
            f"{length}: shorten the {what}",
            what,
        )
    if length + max(max_tokens, 1) > max_position:
        raise OpenAIError(
            f"this model's maximum context length is {max_position} tokens, but the {what} has "
            f"{length} and '{name}' asks for {max_tokens} more: shorten the {what} or lower "
            f"'{name}'",
            name,
        )


__all__ = [
    "CHAT_FIELDS", "COMPLETION_FIELDS", "MAX_LOGPROBS", "MAX_N", "History", "Job", "OpenAIError",
    "Tools", "check_messages", "check_tools", "parse_chat", "parse_completion",
]  # fmt: skip
