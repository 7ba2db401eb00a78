"""OpenAI's Responses API (``server/responses.py``) through the official ``openai`` SDK
against a live server: text, streaming events, function tools, structured output, stored
responses with their conversation's KV as a per-user export (reused by
``previous_response_id``, counted in ``cached_tokens``, dropped with the response), GET /
DELETE / input_items, per-user stores, and the fields refused with a 400 naming them.

The KV and tool tests run on the real weights (SmolLM2-135M-Instruct, skipped without
them), the rest on a tiny random checkpoint."""

from __future__ import annotations

import json

import openai
import pytest

from pastry.control.quotas import Quotas
from pastry.control.users import Account, User
from server_util import call, integrity, running_server

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"title": "City", "type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}
ALICE, BOB = Account(User("alice"), "tok-alice"), Account(User("bob"), "tok-bob")


def exports(server) -> list[str]:
    def names():
        return sorted(
            name
            for m in server.controller.models.values()
            for name, _, _ in m.resources.list_exports()
        )

    return call(server, names)


@pytest.fixture(scope="module")
def real(smollm2_gguf, tmp_path_factory):
    """The real model without the automatic prefix cache: every cached token is the
    stored conversation's export."""
    path = tmp_path_factory.mktemp("responses-real")
    with running_server(smollm2_gguf, path, prefix_cache=False) as (url, server):
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        client.model = server.models[0]
        client.server = server
        yield client
        assert exports(server) == [] and integrity(server) == (0, 0)


@pytest.fixture(scope="module")
def tiny(make_tiny, tmp_path_factory):
    quotas = Quotas(responses_per_user=3, user_share=None)
    path = tmp_path_factory.mktemp("responses-tiny")
    with running_server(make_tiny("llama"), path, users=(ALICE, BOB), quotas=quotas) as (url, server):  # fmt: skip
        clients = {}
        for acct in (ALICE, BOB):
            c = openai.OpenAI(base_url=url + "/v1", api_key=acct.token, max_retries=0)
            c.model = server.models[0]
            c.server = server
            clients[acct.user.name] = c
        yield clients


def create(client, **kw):
    return client.responses.create(model=client.model, **kw)


def test_a_follow_up_reuses_the_stored_kv(real):
    kw = dict(instructions="Answer in one sentence.", max_output_tokens=30, temperature=0)
    first = create(real, input="What is the capital of France?", **kw)
    assert first.status == "completed" and first.output_text == "The capital of France is Paris."
    assert first.usage.input_tokens_details.cached_tokens == 0
    assert exports(real.server) == [f"responses/{first.id}"]
    lp = dict(include=["message.output_text.logprobs"], top_logprobs=2)
    again = create(real, input="And of Italy?", previous_response_id=first.id, **kw, **lp)
    u = again.usage
    # the whole first conversation came from its export; only the new turn was computed
    assert u.input_tokens_details.cached_tokens == first.usage.total_tokens
    assert u.input_tokens_details.cache_write_tokens == u.input_tokens - first.usage.total_tokens
    assert again.output_text == "The capital of Italy is Rome."
    # the same follow-up once the export is gone (memory was short): the same tokens,
    # computed again, give the same answer
    name = f"responses/{first.id}"
    res = real.server.controller.models[real.model].resources
    call(real.server, lambda: res.unexport(None, name, "local"))
    redo = create(real, input="And of Italy?", previous_response_id=first.id, **kw, **lp)
    assert redo.usage.input_tokens_details.cached_tokens == 0
    assert redo.usage.input_tokens == u.input_tokens and redo.output_text == again.output_text
    a, b = again.output[0].content[0].logprobs, redo.output[0].content[0].logprobs
    assert [t.token for t in a] == [t.token for t in b] and len(a[0].top_logprobs) == 2
    assert max(abs(x.logprob - y.logprob) for x, y in zip(a, b, strict=True)) < 2e-3
    # a chain: the third turn reuses the second's export, which covers the first's
    third = create(real, input="And of Spain?", previous_response_id=again.id, **kw)
    assert third.usage.input_tokens_details.cached_tokens == again.usage.total_tokens
    # deleting a response drops its export
    for r in (first, again, redo, third):
        real.responses.delete(r.id)
    assert exports(real.server) == []


def test_function_calls_round_trip_like_the_agents_sdk(real):
    r = create(real, input="What is the weather in Paris?", instructions="Be brief.", tools=[WEATHER], tool_choice="required", temperature=0)  # fmt: skip
    [item] = r.output
    assert item.type == "function_call" and item.name == "get_weather"
    assert json.loads(item.arguments) == {"city": "Paris"} and item.call_id.startswith("call_")
    out = [{"type": "function_call_output", "call_id": item.call_id, "output": "sunny, 24 C"}]
    follow = create(real, previous_response_id=r.id, input=out, instructions="Be brief.", tools=[WEATHER], temperature=0, max_output_tokens=20)  # fmt: skip
    assert follow.usage.input_tokens_details.cached_tokens == r.usage.total_tokens
    assert follow.output[0].type == "message" and follow.output_text
    # without previous_response_id: the whole history as items (what a stateless client sends)
    items = [{"role": "user", "content": "What is the weather in Paris?"}, item.model_dump(exclude_none=True), *out]  # fmt: skip
    full = create(real, input=items, instructions="Be brief.", tools=[WEATHER], temperature=0, max_output_tokens=20, store=False)  # fmt: skip
    assert full.output[0].type == "message" and full.store is False
    # streamed: the call's events, and the same call as the plain answer
    events = list(create(real, input="What is the weather in Paris?", instructions="Be brief.", tools=[WEATHER], tool_choice="required", temperature=0, stream=True, store=False))  # fmt: skip
    kinds = [e.type for e in events]
    assert kinds == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed",
    ]  # fmt: skip
    done = events[-1].response
    assert [(o.name, o.arguments) for o in done.output] == [(item.name, item.arguments)]
    assert events[4].arguments == item.arguments and events[4].name == "get_weather"
    for r_ in (r, follow):
        real.responses.delete(r_.id)


def test_streamed_text_events_and_retrieve(tiny):
    c = tiny["alice"]
    kw = dict(input="Tell me a story.", max_output_tokens=12, temperature=0)
    plain = create(c, **kw, store=False)
    events = list(create(c, **kw, stream=True))
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert kinds == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", *["response.output_text.delta"] * len(deltas),
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.incomplete",
    ]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert final.status == "incomplete" and final.incomplete_details.reason == "max_output_tokens"
    assert "".join(e.delta for e in deltas) == final.output_text == plain.output_text
    assert events[0].response.status == "in_progress" and events[0].response.id == final.id
    assert all(e.item_id == final.output[0].id for e in deltas)
    got = c.responses.retrieve(final.id)
    assert got.model_dump() == final.model_dump()
    assert final.usage.output_tokens == 12 and plain.usage.output_tokens == 12
    c.responses.delete(final.id)


def test_structured_output(tiny):
    c = tiny["alice"]
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    fmt = {"format": {"type": "json_schema", "name": "num", "schema": schema, "strict": True}}
    for seed_text in ("Pick a number.", "Another one."):
        r = create(c, input=seed_text, text=fmt, max_output_tokens=40, temperature=1.0, store=False)  # fmt: skip
        if r.status == "completed":
            value = json.loads(r.output_text)
            assert set(value) == {"n"} and isinstance(value["n"], int)
        assert r.text.format.type == "json_schema"


def test_store_is_per_user_bounded_and_deletable(tiny):
    alice, bob = tiny["alice"], tiny["bob"]
    server = alice.server
    made = [create(alice, input=f"Hello {i}", max_output_tokens=2, temperature=0) for i in range(4)]  # fmt: skip
    # at most 3 per user: the oldest went, with its export
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(made[0].id)
    assert exports(server) == sorted(f"responses/{r.id}" for r in made[1:])
    with pytest.raises(openai.NotFoundError):  # another user's response does not exist for bob
        bob.responses.retrieve(made[1].id)
    with pytest.raises(openai.NotFoundError) as e:
        create(bob, input="Hi", previous_response_id=made[1].id, max_output_tokens=2)
    assert e.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        bob.responses.delete(made[1].id)
    # input items: this response's own, newest first by default
    r = create(alice, input=[{"role": "user", "content": "a"}, {"role": "user", "content": [{"type": "input_text", "text": "b"}]}], previous_response_id=made[3].id, max_output_tokens=2, temperature=0)  # fmt: skip
    items = alice.responses.input_items.list(r.id)
    assert [i.content[0].text for i in items.data] == ["b", "a"]
    asc = alice.responses.input_items.list(r.id, order="asc", limit=1)
    assert [i.content[0].text for i in asc.data] == ["a"] and asc.has_more
    # store false: not kept, nothing exported
    gone = create(alice, input="x", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(gone.id)
    for x in [*made[2:], r]:
        alice.responses.delete(x.id)
    assert exports(server) == [] and integrity(server) == (0, 0)


@pytest.mark.parametrize(
    "kw, param",
    [
        (dict(reasoning={"effort": "low"}), "reasoning"),
        (dict(background=True), "background"),
        (dict(tools=[{"type": "web_search"}]), "tools[0].type"),
        (dict(include=["file_search_call.results"]), "include[0]"),
        (dict(truncation="auto"), "truncation"),
        (
            dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]),
            "input[0].content[0]",  # a text model takes no images (tests/test_vision.py: a VLM)
        ),
        (dict(input=[{"type": "reasoning", "summary": []}]), "input[0].type"),
        (dict(max_output_tokens=0), "max_output_tokens"),
        (dict(text={"format": {"type": "json_schema", "name": "x"}}), "text.format"),
        (dict(tool_choice={"type": "allowed_tools", "tools": []}), "tool_choice"),
        (dict(temperature=3), "temperature"),
        (dict(max_tool_calls=2), "max_tool_calls"),
        (dict(input="x" * 50_000), "input"),
    ],
)
def test_refused_fields_name_themselves(tiny, kw, param):
    body = {"input": "Hi", **kw}
    with pytest.raises(openai.BadRequestError) as e:
        create(tiny["alice"], **body)
    assert e.value.body["param"] == param, e.value.body
