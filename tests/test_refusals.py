"""Cheap refusals stay cheap (issue 31, point 2): a request's message list, tool list and
grammar are bounded, and a request over a bound is refused with a 400 naming it before
any work is done on it (the chat template is not rendered, the grammar not compiled).
The body-size 413 and the prompt-length 400 are tested in ``test_security.py``
(``test_request_body_size_limit``, ``test_prompts_are_tokenized_off_the_event_loop``)."""

from __future__ import annotations

import httpx
import pytest

from pastry.control import constraints
from pastry.server.limits import MAX_MESSAGES, MAX_TOOLS
from server_util import call, running_server


@pytest.fixture(scope="module")
def served(make_tiny, tmp_path_factory):
    with running_server(make_tiny("llama"), tmp_path_factory.mktemp("refusals")) as s:
        yield s


def post(url: str, path: str, body: dict) -> tuple[int, dict]:
    r = httpx.post(url + path, json=body, timeout=60)
    return r.status_code, r.json()


def tool(i: int) -> dict:
    params = {"type": "object", "properties": {"x": {"type": "string"}}}
    return {"type": "function", "function": {"name": f"f{i}", "parameters": params}}


def test_message_and_tool_lists_are_bounded_before_any_work(served, monkeypatch):
    url, server = served
    model = server.models[0]
    tokenizer = call(server, lambda: server.controller.models[model].tokenizer)
    rendered: list[int] = []
    render = tokenizer.apply_chat_template

    def spy(messages, *a, **kw):
        rendered.append(len(messages))
        return render(messages, *a, **kw)

    monkeypatch.setattr(tokenizer, "apply_chat_template", spy)
    msg = {"role": "user", "content": "hi"}
    base = {"model": model, "max_tokens": 2}
    status, body = post(url, "/v1/chat/completions", {**base, "messages": [msg] * (MAX_MESSAGES + 1)})  # fmt: skip
    assert status == 400, body
    assert body["error"]["param"] == "messages"
    assert body["error"]["code"] == "array_above_max_length"
    assert (
        f"maximum length {MAX_MESSAGES}, but got an array with length {MAX_MESSAGES + 1}"
        in (body["error"]["message"])
    )
    tools = [tool(i) for i in range(MAX_TOOLS + 1)]
    status, body = post(url, "/v1/chat/completions", {**base, "messages": [msg], "tools": tools})
    assert status == 400 and body["error"]["param"] == "tools", body
    assert body["error"]["code"] == "array_above_max_length"
    status, body = post(url, "/tokenize", {"model": model, "messages": [msg] * (MAX_MESSAGES + 1)})
    assert status == 400 and body["error"]["code"] == "array_above_max_length", body
    assert rendered == []  # none of them was rendered
    # at the limits they pass, to be rendered (and then be longer than the tiny model's
    # context, which is checked on the rendered prompt)
    status, body = post(url, "/v1/chat/completions", {**base, "messages": [msg] * MAX_MESSAGES})
    assert status == 400 and "maximum context length" in body["error"]["message"], body
    tools = [tool(i) for i in range(MAX_TOOLS)]  # rendered into the prompt too
    status, body = post(url, "/v1/chat/completions", {**base, "messages": [msg], "tools": tools})
    assert status == 400 and "maximum context length" in body["error"]["message"], body
    assert len(rendered) == 2 and rendered[0] == MAX_MESSAGES  # (tools may add a message)


def test_a_grammar_over_the_size_limits_is_a_400_naming_it(served):
    url, server = served
    model = server.models[0]
    base = {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}
    huge = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(20000)}}
    fmt = {"type": "json_schema", "json_schema": {"name": "o", "schema": huge}}
    status, body = post(url, "/v1/chat/completions", {**base, "response_format": fmt})
    assert status == 400, body
    assert body["error"]["param"] == "response_format"
    assert "too large" in body["error"]["message"]
    text = {"text": "x", "sampling_params": {"max_new_tokens": 2, "regex": "a" * (1 << 20)}}
    status, body = post(url, "/generate", text)
    assert status == 400 and "sampling_params.regex" in body["error"]["message"], body
    assert f"limit is {constraints.MAX_GRAMMAR_BYTES}" in body["error"]["message"]
