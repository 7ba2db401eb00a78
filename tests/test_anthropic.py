"""Anthropic's Messages API (``server/anthropic.py``) through the official ``anthropic`` SDK
against a live server: text, stop sequences, streaming events, tool use and tool results,
structured output, cache-read tokens, ``x-api-key``, count_tokens, and errors in
Anthropic's shape naming the field. Tool use runs on the real weights (SmolLM2-135M-
Instruct, skipped without them), the rest on a tiny random checkpoint."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from pastry.control.users import Account, User
from server_util import integrity, running_server

anthropic = pytest.importorskip("anthropic", reason="the anthropic SDK is a test dependency")

WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
IMAGE = [{"role": "user", "content": [{"type": "image", "source": {}}]}]
GREEDY = {"extra_body": {"temperature": 0}}  # SDK 2.x has no temperature argument


@pytest.fixture(scope="module")
def real(smollm2_gguf, tmp_path_factory):
    with running_server(smollm2_gguf, tmp_path_factory.mktemp("anthropic-real")) as (url, server):  # fmt: skip
        c = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)
        c.model = server.models[0]
        yield c
        assert integrity(server) == (0, 0)


@pytest.fixture(scope="module")
def tiny(make_tiny, tmp_path_factory):
    users = (Account(User("alice"), "tok-alice"),)
    path = tmp_path_factory.mktemp("anthropic-tiny")
    with running_server(make_tiny("llama"), path, users=users) as (url, server):
        c = anthropic.Anthropic(base_url=url, api_key="tok-alice", max_retries=0)  # x-api-key
        c.model, c.url = server.models[0], url
        yield c
        assert integrity(server) == (0, 0)


def test_text_stop_sequences_and_cache_reads(real):
    kw = dict(model=real.model, max_tokens=30, system="Answer in one sentence.", messages=[{"role": "user", "content": "What is the capital of France?"}], **GREEDY)  # fmt: skip
    r = real.messages.create(**kw)
    assert r.type == "message" and r.role == "assistant" and r.id.startswith("msg_")
    assert [b.type for b in r.content] == ["text"] and r.content[0].text == "The capital of France is Paris."  # fmt: skip
    assert r.stop_reason == "end_turn" and r.stop_sequence is None
    total = r.usage.input_tokens + r.usage.cache_read_input_tokens
    # the same prompt again: read from the automatic prefix cache
    again = real.messages.create(**kw)
    assert again.usage.cache_read_input_tokens > 0
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == total
    cut = real.messages.create(**{**kw, "stop_sequences": ["Italy", "Paris"]})
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == "Paris"
    assert cut.content[0].text == "The capital of France is "
    short = real.messages.create(**{**kw, "max_tokens": 3})
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3


def test_streamed_events_equal_the_plain_message(real):
    kw = dict(model=real.model, max_tokens=30, system="Answer in one sentence.", messages=[{"role": "user", "content": "What is the capital of France?"}], **GREEDY)  # fmt: skip
    plain = real.messages.create(**kw)
    events = list(real.messages.create(**kw, stream=True))
    kinds = [e.type for e in events]
    n = kinds.count("content_block_delta")
    assert kinds == ["message_start", "content_block_start", *["content_block_delta"] * n, "content_block_stop", "message_delta", "message_stop"]  # fmt: skip
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == plain.content[0].text  # fmt: skip
    assert events[-2].delta.stop_reason == "end_turn"
    assert events[-2].usage.output_tokens == plain.usage.output_tokens
    with real.messages.stream(**kw) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == plain.content[0].text and final.stop_reason == "end_turn"


def test_tool_use_and_tool_results(real):
    for choice in ({"type": "any"}, {"type": "tool", "name": "get_weather"}):
        r = real.messages.create(model=real.model, max_tokens=100, messages=ASK, tools=[WEATHER], tool_choice=choice, **GREEDY)  # fmt: skip
        [block] = r.content
        assert block.type == "tool_use" and block.name == "get_weather" and r.stop_reason == "tool_use"  # fmt: skip
        assert block.input == {"city": "Paris"} and block.id.startswith("toolu_")
        with real.messages.stream(model=real.model, max_tokens=100, messages=ASK, tools=[WEATHER], tool_choice=choice, **GREEDY) as s:  # fmt: skip
            final = s.get_final_message()
        assert [(b.name, b.input) for b in final.content] == [(block.name, block.input)]
    # the result goes back as a tool_result block; the answer is text
    history = [*ASK, {"role": "assistant", "content": [block.model_dump(exclude_none=True)]}, {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id, "content": "sunny, 24 C"}]}]  # fmt: skip
    r = real.messages.create(model=real.model, max_tokens=20, messages=history, tools=[WEATHER], **GREEDY)  # fmt: skip
    assert r.content[0].type == "text" and r.usage.cache_read_input_tokens > 0
    # one call at most without parallel tool use
    r = real.messages.create(model=real.model, max_tokens=100, messages=ASK, tools=[WEATHER], tool_choice={"type": "any", "disable_parallel_tool_use": True}, **GREEDY)  # fmt: skip
    assert len(r.content) == 1 and r.stop_reason == "tool_use"


def test_structured_output_and_count_tokens(tiny):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    r = tiny.messages.create(model=tiny.model, max_tokens=40, messages=[{"role": "user", "content": "A number?"}], output_config={"format": {"type": "json_schema", "schema": schema}})  # fmt: skip
    if r.stop_reason == "end_turn":
        value = json.loads(r.content[0].text)
        assert set(value) == {"n"} and isinstance(value["n"], int)
    n = tiny.messages.count_tokens(model=tiny.model, messages=[{"role": "user", "content": "Hi"}])
    m = tiny.messages.count_tokens(model=tiny.model, messages=[{"role": "user", "content": "Hi there, how are you?"}])  # fmt: skip
    assert 0 < n.input_tokens < m.input_tokens


def test_auth_by_x_api_key_and_errors_in_anthropics_shape(tiny):
    def post(headers: dict, body: dict) -> tuple[int, dict]:
        req = urllib.request.Request(tiny.url + "/v1/messages", json.dumps(body).encode(), {"content-type": "application/json", **headers})  # fmt: skip
        try:
            with urllib.request.urlopen(req) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    body = {"model": tiny.model, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
    assert post({"x-api-key": "tok-alice"}, body)[0] == 200
    assert post({"authorization": "Bearer tok-alice"}, body)[0] == 200
    status, got = post({"x-api-key": "wrong"}, body)
    assert status == 401 and got["type"] == "error" and got["error"]["type"] == "authentication_error"  # fmt: skip
    status, got = post({"x-api-key": "tok-alice"}, {**body, "model": "nope"})
    assert status == 404 and got["error"]["type"] == "not_found_error"


@pytest.mark.parametrize(
    "kw, named",
    [
        (dict(thinking={"type": "enabled", "budget_tokens": 1024}), "'thinking'"),
        (dict(max_tokens=0), "'max_tokens'"),
        (dict(extra_body={"temperature": 1.5}), "'temperature'"),
        (dict(tools=[{"type": "web_search_20250305", "name": "web_search"}]), "'tools[0]'"),
        (dict(tool_choice={"type": "any"}), "'tool_choice'"),  # without tools
        (dict(messages=IMAGE), "'messages[0].content[0]'"),
        (dict(messages=[{"role": "system", "content": "x"}]), "'messages[0].role'"),
        (dict(stop_sequences=[""]), "'stop_sequences'"),
        (dict(output_config={"effort": "high"}), "'output_config.effort'"),
        (dict(extra_body={"top_logprobs": 2}), "'top_logprobs'"),
    ],
)
def test_refused_fields_are_named(tiny, kw, named):
    body = {"model": tiny.model, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}], **kw}  # fmt: skip
    with pytest.raises(anthropic.BadRequestError) as e:
        tiny.messages.create(**body)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"  # fmt: skip
    assert named in e.value.body["error"]["message"], e.value.body
