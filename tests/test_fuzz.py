"""Property-based fuzzing of the client-facing APIs (issue 31, point 5): the OpenAI
endpoints, SGLang's ``/generate`` and ``/tokenize``-style helpers, and the WebSocket
client protocol, with ``hypothesis`` strategies shaped by each endpoint's schema (every
known field, with plausible values or any JSON at all, unknown fields, raw bytes).

Properties: no answer is a 5xx (nor, in a stream or on the WebSocket, the error a 5xx
would carry), every request is answered within a bound (no hang), and afterwards the
server still serves a plain request, with every page and embedding free again.

``PASTRY_FUZZ_EXAMPLES`` sets the examples per strategy (default 25 in the default suite;
the slow test runs 400 of each).
"""

from __future__ import annotations

import asyncio
import json
import os
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from websockets.asyncio.client import connect

from server_util import integrity, running_server

EXAMPLES = int(os.environ.get("PASTRY_FUZZ_EXAMPLES", "25"))
SLOW_EXAMPLES = 400
ANSWER_WITHIN_S = 120.0  # a request unanswered this long is a hang

# ----------------------------------------------------------------------------- JSON values

scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=40)
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def either(plausible):
    """Mostly plausible values for a field, sometimes any JSON at all."""
    return st.one_of(plausible, plausible, plausible, json_values)


small_ints = st.integers(-3, 12)
probabilities = st.floats(-0.5, 1.5, allow_nan=False)
tokens = st.lists(st.integers(-5, 70000), max_size=8)
texts = st.text(max_size=60)
regexes = st.sampled_from(
    ["[0-9]{2}", "(yes|no)", "a+b", "[a-z]{1,3}-[0-9]", "(", "a{99999}", ".*", "\\d+"]
)
schemas = (
    st.sampled_from(
        [
            {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
            {"type": "string", "maxLength": 4},
            {"enum": ["x", "y"]},
            {"type": "nonsense"},
            {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
            {"$ref": "#/nowhere"},
        ]
    )
    | json_values
)

COMMON = {
    "max_tokens": either(small_ints),
    "temperature": either(st.floats(-1, 3, allow_nan=False)),
    "top_p": either(probabilities),
    "top_k": either(st.integers(-2, 60)),
    "min_p": either(probabilities),
    "n": either(st.integers(-1, 3)),
    "stream": either(st.booleans()),
    "stop": either(texts | st.lists(texts, max_size=3)),
    "seed": either(st.integers(-(2**64), 2**64)),
    "presence_penalty": either(st.floats(-3, 3, allow_nan=False)),
    "frequency_penalty": either(st.floats(-3, 3, allow_nan=False)),
    "repetition_penalty": either(st.floats(-1, 3, allow_nan=False)),
    "logit_bias": either(
        st.dictionaries(
            st.integers(-5, 70000).map(str), st.floats(-200, 200, allow_nan=False), max_size=3
        )
    ),
    "user": either(texts),
    "ignore_eos": either(st.booleans()),
    "min_tokens": either(small_ints),
    "stop_token_ids": either(tokens),
    "guided_regex": either(regexes),
    "guided_json": either(schemas),
    "guided_choice": either(st.lists(texts, max_size=3)),
    "stream_options": either(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "unknown_field": json_values,
}


def completions(model: str):
    return st.fixed_dictionaries(
        {
            "model": either(st.just(model)),
            "prompt": either(texts | st.lists(texts, max_size=3) | tokens),
        },
        optional={
            **COMMON,
            "logprobs": either(st.integers(-1, 25)),
            "echo": either(st.booleans()),
            "best_of": either(st.integers(-1, 3)),
            "suffix": either(texts),
        },
    )


def messages():
    part = st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "image_url", "x"]), "text": texts}
    )
    message = st.fixed_dictionaries(
        {
            "role": either(
                st.sampled_from(["system", "user", "assistant", "tool", "developer", "x"])
            )
        },
        optional={
            "content": either(texts | st.lists(part, max_size=2)),
            "tool_calls": json_values,
            "tool_call_id": either(texts),
            "name": either(texts),
        },
    )
    return st.lists(message, max_size=4)


def chats(model: str):
    tool = st.fixed_dictionaries(
        {
            "type": either(st.just("function")),
            "function": st.fixed_dictionaries(
                {"name": either(st.sampled_from(["f", "g", ""]))},
                optional={
                    "parameters": either(schemas),
                    "description": texts,
                    "strict": st.booleans(),
                },
            ),
        }
    )
    return st.fixed_dictionaries(
        {"model": either(st.just(model)), "messages": either(messages())},
        optional={
            **COMMON,
            "tools": either(st.lists(tool, max_size=3)),
            "tool_choice": either(
                st.sampled_from(["none", "auto", "required"])
                | st.just({"type": "function", "function": {"name": "f"}})
            ),
            "response_format": either(
                st.sampled_from([{"type": "text"}, {"type": "json_object"}])
                | schemas.map(
                    lambda s: {"type": "json_schema", "json_schema": {"name": "o", "schema": s}}
                )
            ),
            "logprobs": either(st.booleans()),
            "top_logprobs": either(st.integers(-1, 25)),
            "max_completion_tokens": either(small_ints),
            "parallel_tool_calls": either(st.booleans()),
        },
    )


def generates():
    sampling = st.fixed_dictionaries(
        {},
        optional={
            "max_new_tokens": either(small_ints),
            "temperature": either(st.floats(-1, 3, allow_nan=False)),
            "top_p": either(probabilities),
            "top_k": either(st.integers(-2, 60)),
            "n": either(st.integers(-1, 3)),
            "stop": either(texts | st.lists(texts, max_size=2)),
            "regex": either(regexes),
            "json_schema": either(schemas.map(json.dumps) | schemas),
            "ignore_eos": either(st.booleans()),
            "min_new_tokens": either(small_ints),
            "frequency_penalty": either(st.floats(-3, 3, allow_nan=False)),
            "bogus": json_values,
        },
    )
    return st.fixed_dictionaries(
        {},
        optional={
            "text": either(texts | st.lists(texts, max_size=3)),
            "input_ids": either(tokens | st.lists(tokens, max_size=2)),
            "sampling_params": either(sampling | st.lists(sampling, max_size=2)),
            "stream": either(st.booleans()),
            "return_logprob": either(st.booleans()),
            "logprob_start_len": either(st.integers(-2, 10)),
            "top_logprobs_num": either(st.integers(-1, 25)),
            "rid": either(texts),
            "model": json_values,
        },
    )


def raw_bodies():
    return st.one_of(
        st.binary(max_size=200),
        json_values.map(lambda v: json.dumps(v).encode()),
        st.text(max_size=100).map(str.encode),
    )


PATHS = ["/v1/completions", "/v1/chat/completions", "/generate", "/tokenize", "/detokenize"]

# ----------------------------------------------------------------------------- checks


def check_http(r: httpx.Response, what: object) -> None:
    assert r.status_code < 500, f"{r.status_code} for {what!r:.500}: {r.text[:500]}"
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        assert '"server_error"' not in r.text, (
            f"an error in the stream for {what!r:.500}: {r.text[-500:]}"
        )
        assert "generation failed" not in r.text, f"{what!r:.500}: {r.text[-500:]}"


@pytest.fixture(scope="module")
def served(make_tiny, tmp_path_factory):
    with running_server(make_tiny("llama"), tmp_path_factory.mktemp("fuzz")) as s:
        yield s


@pytest.fixture(scope="module")
def client(served):
    with httpx.Client(base_url=served[0], timeout=ANSWER_WITHIN_S) as c:
        yield c


def still_serves(served) -> None:
    url, server = served
    assert httpx.get(f"{url}/health", timeout=30).json()["status"] == "ok"
    body = {"model": server.models[0], "prompt": "Hello", "max_tokens": 3}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    deadline = time.monotonic() + 30
    while integrity(server) != (0, 0):
        assert time.monotonic() < deadline, f"pages or embeddings left held: {integrity(server)}"
        time.sleep(0.1)


def fuzz_settings(n: int):
    return settings(
        max_examples=n,
        deadline=None,
        database=None,
        print_blob=True,
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.function_scoped_fixture,
        ],
    )


def run_http(served, client, n: int) -> None:
    model = served[1].models[0]

    @fuzz_settings(n)
    @given(body=completions(model))
    def completion(body):
        check_http(client.post("/v1/completions", json=body), body)

    @fuzz_settings(n)
    @given(body=chats(model))
    def chat(body):
        check_http(client.post("/v1/chat/completions", json=body), body)

    @fuzz_settings(n)
    @given(body=generates())
    def generate(body):
        check_http(client.post("/generate", json=body), body)

    @fuzz_settings(n)
    @given(
        path=st.sampled_from(PATHS),
        body=raw_bodies(),
        ctype=st.sampled_from(
            ["application/json", "text/plain", "application/x-www-form-urlencoded", ""]
        ),
    )
    def raw(path, body, ctype):
        headers = {"content-type": ctype} if ctype else {}
        check_http(client.post(path, content=body, headers=headers), (path, body))

    @fuzz_settings(n)
    @given(
        body=st.fixed_dictionaries(
            {},
            optional={
                "model": either(st.just(model)),
                "prompt": either(texts),
                "messages": either(messages()),
                "tokens": either(tokens),
                "add_special_tokens": json_values,
                "add_generation_prompt": json_values,
            },
        ),
        path=st.sampled_from(["/tokenize", "/detokenize"]),
    )
    def helpers(body, path):
        check_http(client.post(path, json=body), (path, body))

    for test in (completion, chat, generate, raw, helpers):
        test()


# ----------------------------------------------------------------------------- WebSocket

WS_TYPES = [
    "auth",
    "upload",
    "launch",
    "send",
    "terminate",
    "attach",
    "list_programs",
    "list_instances",
    "delete_program",
    "nope",
]
UPLOAD = "async def main(args):\n    return ' '.join(args)\n"


def ws_frames():
    fields = {
        "id": either(st.integers(-5, 10**6)),
        "token": either(texts),
        "source": either(st.just(UPLOAD) | texts),
        "name": either(texts),
        "program": either(st.sampled_from(["text-completion", "chat", "echo", "ffffffff"]) | texts),
        "args": either(st.lists(texts, max_size=3)),
        "detached": either(st.booleans()),
        "instance": either(st.integers(-1, 2**60)),
        "message": either(texts),
        "reason": either(texts),
    }
    obj = st.fixed_dictionaries({"type": either(st.sampled_from(WS_TYPES))}, optional=fields)
    return st.one_of(
        obj.map(json.dumps), obj.map(json.dumps), st.text(max_size=80), st.binary(max_size=40)
    )


async def ws_exchange(url: str, frames: list) -> None:
    """Send ``frames`` on one connection; every frame is answered, none with ``internal``."""
    async with connect(url.replace("http", "ws", 1) + "/ws", max_size=None) as ws:
        hello = json.loads(await asyncio.wait_for(ws.recv(), 30))
        assert hello["type"] == "hello"
        for frame in frames:
            await ws.send(frame)
            while True:
                reply = json.loads(await asyncio.wait_for(ws.recv(), ANSWER_WITHIN_S))
                assert reply.get("code") != "internal", f"{reply} for {frame!r:.300}"
                if reply["type"] in ("ok", "error"):
                    break  # events of launched instances may come first


def run_ws(served, n: int) -> None:
    url = served[0]

    @fuzz_settings(n)
    @given(frames=st.lists(ws_frames(), min_size=1, max_size=5))
    def websocket(frames):
        asyncio.run(ws_exchange(url, frames))

    websocket()


# ----------------------------------------------------------------------------- tests


def test_fuzzed_http_apis_never_fail_with_5xx(served, client):
    run_http(served, client, EXAMPLES)
    still_serves(served)


def test_fuzzed_websocket_protocol_never_fails_internally(served):
    run_ws(served, EXAMPLES)
    still_serves(served)


@pytest.mark.slow
def test_fuzzed_apis_at_length(served, client):
    run_http(served, client, SLOW_EXAMPLES)
    run_ws(served, SLOW_EXAMPLES)
    still_serves(served)
