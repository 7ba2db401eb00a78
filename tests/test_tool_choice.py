"""Forced tool calls (``tool_choice`` ``"required"`` or a named function) on the real
weights (SmolLM2-135M-Instruct), with the request ``openai-agents`` sends: every complete
call comes back even when ``max_tokens`` cuts the output, ``parallel_tool_calls: false``
gives exactly one call, ``strict`` schemas are closed, the array ends when the model
closes it; streamed calls equal plain ones. Skipped without the weights (see the
``smollm2_gguf`` fixture)."""

from __future__ import annotations

import json

import openai
import pytest

from pastry.control.constraints import HostConstraint
from pastry.engine.checkpoint import load_checkpoint
from pastry.server.openai_params import OpenAIError, parse_chat
from pastry.server.openai_tools import closed_schema, named_schema, parse_required
from server_util import integrity, running_server

# What openai-agents 0.24 sends for a @function_tool with ModelSettings(tool_choice="required")
# through OpenAIChatCompletionsModel (captured from the SDK itself)
AGENTS_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "properties": {"city": {"title": "City", "type": "string"}},
            "required": ["city"],
            "title": "get_weather_args",
            "type": "object",
            "additionalProperties": False,
        },
        "strict": True,
    },
}
AGENTS_MESSAGES = [
    {"content": "Be brief.", "role": "system"},
    {"role": "user", "content": "What is the weather in Paris?"},
]
AGENTS_REQUEST = dict(messages=AGENTS_MESSAGES, tool_choice="required", tools=[AGENTS_TOOL])
# a strict tool whose schema leaves its objects open (JSON Schema admits extra properties)
OPEN_TOOL = {
    "type": "function",
    "function": {
        "name": "book",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "when": {"type": "object", "properties": {"day": {"type": "integer"}}},
            },
            "required": ["city", "when"],
        },
        "strict": True,
    },
}


@pytest.fixture(scope="module")
def client(smollm2_gguf, tmp_path_factory):
    with running_server(smollm2_gguf, tmp_path_factory.mktemp("tools")) as (url, server):
        c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        c.model = server.models[0]
        yield c
        assert integrity(server) == (0, 0)


def chat(client, **kw):
    return client.chat.completions.create(model=client.model, **kw).choices[0]


def calls_of(choice) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or []]  # fmt: skip


def token_text(choice) -> list[str]:
    return [t.token for t in choice.logprobs.content]


def complete_items(text: str) -> list[tuple[str, dict]]:
    """The distinct complete call objects of a ``[{...},{...}...`` array, however it ends
    (an oracle independent of the server's parser: the standard JSON decoder item by item)."""
    decoder, items, at = json.JSONDecoder(), [], 1
    while at < len(text) and text[at] == "{":
        try:
            item, at = decoder.raw_decode(text, at)
        except ValueError:
            break
        if (item["name"], item["parameters"]) not in items:
            items.append((item["name"], item["parameters"]))
        if at < len(text) and text[at] == ",":
            at += 1
    return items


def test_the_agents_request_returns_its_calls(client):
    """Greedy and sampled (seeds whose draws once picked a masked token, a 500), without
    max_tokens as the SDK sends it: calls of the one tool with exactly its argument."""
    for kw in ({"temperature": 0}, *({"seed": s, "max_tokens": 100} for s in range(6))):
        c = chat(client, **AGENTS_REQUEST, **kw)
        assert c.message.tool_calls, (kw, c)
        for name, args in calls_of(c):
            assert name == "get_weather" and set(args) == {"city"}, (kw, c)
            assert isinstance(args["city"], str)
        assert c.finish_reason in ("tool_calls", "length") and c.message.content is None
    # greedy decoding writes the same call again and again: the repeat ends the array
    c = chat(client, **AGENTS_REQUEST, temperature=0)
    assert c.finish_reason == "tool_calls" and calls_of(c) == [("get_weather", {"city": "Paris"})]


def test_calls_cut_by_max_tokens_are_returned_when_complete(client):
    full = chat(client, **AGENTS_REQUEST, temperature=0, logprobs=True)
    pieces = token_text(full)
    assert calls_of(full) == complete_items("".join(pieces)) and full.finish_reason == "tool_calls"
    # the token that completes the first call, one before it, and one before the end
    upto = next(i + 1 for i in range(len(pieces)) if complete_items("".join(pieces[: i + 1])))
    for max_tokens in (upto - 1, upto, len(pieces) - 1):
        c = chat(client, **AGENTS_REQUEST, temperature=0, max_tokens=max_tokens)
        prefix = "".join(pieces[:max_tokens])
        assert c.finish_reason == "length", (max_tokens, c)
        assert calls_of(c) == complete_items(prefix), (max_tokens, prefix, c)
        assert c.message.content is None
    assert calls_of(c)  # the last cut output kept its calls


def test_one_call_without_parallel_calls_and_the_array_closes(client):
    for kw in ({"temperature": 0}, {"seed": 3}, {"seed": 11}):
        c = chat(client, **AGENTS_REQUEST, parallel_tool_calls=False, logprobs=True, **kw)
        [(name, args)] = calls_of(c)
        assert name == "get_weather" and set(args) == {"city"}
        assert c.finish_reason == "tool_calls"
        assert "".join(token_text(c)).endswith("}]")  # nothing after the closed array


def test_strict_schemas_are_closed(client):
    for kw in ({"temperature": 0}, {"seed": 1}, {"seed": 2}):
        c = chat(client, messages=AGENTS_MESSAGES, tools=[OPEN_TOOL], tool_choice="required", max_tokens=80, **kw)  # fmt: skip
        for name, args in calls_of(c):
            assert name == "book" and set(args) == {"city", "when"}
            assert set(args["when"]) <= {"day"}
        named = {"type": "function", "function": {"name": "book"}}
        c = chat(client, messages=AGENTS_MESSAGES, tools=[OPEN_TOOL], tool_choice=named, max_tokens=80, **kw)  # fmt: skip
        if c.finish_reason == "stop":
            [(name, args)] = calls_of(c)
            assert set(args) == {"city", "when"} and set(args["when"]) <= {"day"}


def test_forced_call_grammars_refuse_extra_properties(smollm2_gguf):
    ckpt = load_checkpoint(smollm2_gguf)
    tok, eos = ckpt.tokenizer, ckpt.config.eos_token_ids

    def accepts(schema: dict, text: str) -> bool:
        c = HostConstraint(tok, ckpt.config.vocab_size, eos, json.dumps({"json_schema": schema}))
        try:
            c.consume(tok.encode(text))
        except Exception:
            return False
        return c.state()[0]

    loose = {**OPEN_TOOL, "function": {**OPEN_TOOL["function"], "strict": False}}
    good, extra = '{"city":"Oslo","when":{"day":3}}', '{"city":"Oslo","when":{"day":3,"h":1}}'
    raw = OPEN_TOOL["function"]["parameters"]  # JSON Schema itself admits extra properties
    assert accepts(raw, good) and accepts(raw, extra)
    for tool in (OPEN_TOOL, loose):  # a forced call's grammar does not, strict or not
        assert accepts(named_schema(tool), good) and not accepts(named_schema(tool), extra)
        assert not accepts(named_schema(tool), '{"city":"Oslo","when":{"day":3},"x":0}')
    # what the schema already says stays as it is
    kept = {"type": "object", "additionalProperties": {"type": "integer"}}
    assert closed_schema(kept) == kept


def test_streamed_forced_calls_equal_plain_ones(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    for kw in (
        {**AGENTS_REQUEST, "temperature": 0},
        {**AGENTS_REQUEST, "temperature": 0, "max_tokens": 12},
        {**AGENTS_REQUEST, "seed": 5, "max_tokens": 60},
        {**AGENTS_REQUEST, "tool_choice": named, "temperature": 0},
    ):
        plain = chat(client, **kw)
        calls, finish = {}, None
        for chunk in client.chat.completions.create(model=client.model, stream=True, **kw):
            for ch in chunk.choices:
                for d in ch.delta.tool_calls or []:
                    call = calls.setdefault(d.index, {"id": d.id, "name": "", "arguments": ""})
                    call["name"] += d.function.name or ""
                    call["arguments"] += d.function.arguments or ""
                finish = ch.finish_reason or finish
        got = [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in sorted(calls)]
        assert got == calls_of(plain) and finish == plain.finish_reason, kw
        assert all(c["id"] for c in calls.values())


def test_required_parser_keeps_complete_calls_only():
    text = '[{"name":"f","parameters":{"s":"a}],{\\"b"}},{"name":"g","parameters":{"x":[1,{'
    [call] = parse_required(text)
    assert call.name == "f" and json.loads(call.arguments) == {"s": 'a}],{"b'}
    assert parse_required("[") == [] and len(parse_required(text[:-16] + "}]")) == 1


def test_bad_tools_are_refused_naming_the_field(smollm2_gguf):
    class Model:  # what parse_chat reads before it renders anything
        pass

    bad = [
        (
            {"tools": [{**AGENTS_TOOL, "function": {**AGENTS_TOOL["function"], "strict": "yes"}}]},
            "tools[0].function.strict",
        ),
        (
            {"tools": [{**AGENTS_TOOL, "function": {**AGENTS_TOOL["function"], "examples": []}}]},
            "tools[0].function.examples",
        ),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0].function.name"),
    ]
    for body, param in bad:
        with pytest.raises(OpenAIError) as e:
            parse_chat(Model(), {"model": "m", "messages": AGENTS_MESSAGES, **body})
        assert e.value.param == param and e.value.status == 400
