"""The OpenAI-compatible HTTP API, through the official ``openai`` package, against a real
server on a tiny checkpoint."""

from __future__ import annotations

import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import openai
import pytest

from inferlet_util import load_engine
from pastry.engine.generate import FusedGenerator, Request
from pastry.wire.tokenizer import Tokenizer
from server_util import call, integrity, running_server


class Served:
    def __init__(self, url, server, ckpt) -> None:
        self.url, self.server = url, server
        self.client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        self.model = server.models[0]
        self.tok = Tokenizer.from_dir(ckpt)
        self.engine = load_engine(ckpt, page_size=16)

    def greedy(self, tokens: list[int], n: int) -> tuple[str, str]:
        """(text, finish reason) of the engine's greedy continuation (the fused loop)."""
        req = Request(list(tokens), n, stop_ids=tuple(self.engine.info.eos_token_ids))
        FusedGenerator(self.engine.execute, self.engine.info, max_running=4).run([req])
        out = req.output
        if out[-1] in req.stop_ids:
            return self.tok.decode(out[:-1]), "stop"
        return self.tok.decode(out), "length"

    def chat_tokens(self, messages) -> list[int]:
        return self.tok.encode(self.tok.apply_chat_template(messages))


@pytest.fixture(scope="module")
def served(make_tiny, tmp_path_factory):
    ckpt = make_tiny("llama")
    with running_server(ckpt, tmp_path_factory.mktemp("openai")) as (url, server):
        yield Served(url, server, ckpt)
        assert integrity(server) == (0, 0)


PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def test_models(served):
    [card] = served.client.models.list().data
    assert card.id == served.model and card.object == "model"
    assert served.client.models.retrieve(served.model).id == served.model
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        served.client.models.retrieve("no-such-model")


def test_completion_greedy_equals_the_engine(served):
    text, finish = served.greedy(served.tok.encode(PROMPT, True), 12)
    r = served.client.completions.create(
        model=served.model, prompt=PROMPT, max_tokens=12, temperature=0
    )
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.model == served.model
    assert [(c.index, c.text, c.finish_reason) for c in r.choices] == [(0, text, finish)]
    assert r.usage.prompt_tokens == len(served.tok.encode(PROMPT, True))
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens

    # several prompts (text and token ids), n choices each: index = prompt * n + choice
    other = served.tok.encode("Once upon a time", True)
    r = served.client.completions.create(
        model=served.model, prompt=[PROMPT, "Once upon a time"], max_tokens=12, n=2, temperature=0
    )
    assert [c.text for c in r.choices] == [text, text, *[served.greedy(other, 12)[0]] * 2]
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    r = served.client.completions.create(
        model=served.model, prompt=other, max_tokens=12, temperature=0
    )
    assert r.choices[0].text == served.greedy(other, 12)[0]


def test_completion_stream(served):
    text, finish = served.greedy(served.tok.encode(PROMPT, True), 12)
    chunks = list(
        served.client.completions.create(
            model=served.model,
            prompt=PROMPT,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].object == "text_completion"
    *pieces, last, usage = chunks
    assert "".join(c.choices[0].text for c in pieces) == text and len(pieces) > 6
    assert [c.choices[0].finish_reason for c in pieces] == [None] * len(pieces)
    assert last.choices[0].finish_reason == finish
    assert usage.choices == [] and usage.usage.completion_tokens == 12


def test_chat(served):
    text, finish = served.greedy(served.chat_tokens(MESSAGES), 10)
    r = served.client.chat.completions.create(
        model=served.model, messages=MESSAGES, max_tokens=10, temperature=0
    )
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    [choice] = r.choices
    assert choice.message.role == "assistant" and choice.message.content == text
    assert choice.finish_reason == finish
    assert r.usage.prompt_tokens == len(served.chat_tokens(MESSAGES))

    chunks = list(
        served.client.chat.completions.create(
            model=served.model,
            messages=MESSAGES,
            max_completion_tokens=10,
            temperature=0,
            stream=True,
        )
    )
    assert {c.object for c in chunks} == {"chat.completion.chunk"}
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == finish


def test_n_and_seed(served):
    def sample(seed, stream=False):
        r = served.client.completions.create(
            model=served.model, prompt=PROMPT, max_tokens=16, n=2, seed=seed, stream=stream
        )
        if not stream:
            return [c.text for c in r.choices]
        texts = ["", ""]
        for chunk in r:
            for c in chunk.choices:
                texts[c.index] += c.text
        return texts

    a = sample(7)
    assert len(set(a)) == 2  # two different choices
    assert sample(7) == a and sample(7, stream=True) == a  # reproducible, streamed or not
    assert sample(8) != a


def test_stop_strings(served):
    full, _ = served.greedy(served.tok.encode(PROMPT, True), 24)
    stop = full[10:13]
    want = full[: full.find(stop)]
    kw = dict(model=served.model, prompt=PROMPT, max_tokens=24, temperature=0)
    r = served.client.completions.create(**kw, stop=stop)
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    chunks = list(served.client.completions.create(**kw, stop=[stop, "zzz"], stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want


def test_concurrent_requests_batch_together(served):
    prompts = [f"{PROMPT} {word}" for word in ("not", "Paris", "a", "the", "big", "old")]
    want = [served.greedy(served.tok.encode(p, True), 8)[0] for p in prompts]

    def complete(p):
        r = served.client.completions.create(
            model=served.model, prompt=p, max_tokens=8, temperature=0
        )
        return r.choices[0].text

    with ThreadPoolExecutor(len(prompts)) as pool:
        assert list(pool.map(complete, prompts)) == want


BAD_COMPLETIONS = [
    (dict(max_tokens=-1), "max_tokens"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=2048), "max_tokens"),  # prompt + max_tokens over the context length
    (dict(temperature=2.5), "temperature"),
    (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(n=0), "n"),
    (dict(n=17), "n"),
    (dict(prompt=5), "prompt"),
    (dict(prompt=[{"text": "hi"}]), "prompt"),
    (dict(prompt=[10**9]), "prompt"),
    (dict(prompt=""), "prompt"),
    (dict(stop=[1]), "stop"),
    (dict(seed="x"), "seed"),
    (dict(stream="yes"), "stream"),
    (dict(logprobs=21), "logprobs"),
    (dict(suffix="x"), "suffix"),
    (dict(n=2, best_of=1), "best_of"),
    (dict(n=2, best_of=3, stream=True), "best_of"),
    (dict(logit_bias={"x": 1}), "logit_bias"),
    (dict(logit_bias={"5": 101}), "logit_bias"),
    (dict(frequency_penalty=3), "frequency_penalty"),
    (dict(extra_body={"min_tokens": 5}), "min_tokens"),  # more than max_tokens
    (dict(extra_body={"stop_token_ids": [-1]}), "stop_token_ids"),
    (dict(extra_body={"no_such_field": 1}), "no_such_field"),
    (dict(extra_body={"guided_regex": "a", "guided_choice": ["b"]}), "guided_choice"),
    (dict(extra_body={"guided_json": {"type": "nonsense"}}), "guided_json"),
]
BAD_CHATS = [
    (dict(messages=[]), "messages"),
    (dict(messages="hi"), "messages"),
    (dict(messages=[{"role": "user"}]), "messages[0].content"),
    (dict(messages=[{"content": "hi"}]), "messages[0]"),
    (dict(messages=[{"role": "robot", "content": "hi"}]), "role"),
    (dict(max_completion_tokens=-5), "max_completion_tokens"),
    (dict(messages=[{"role": "user", "content": "hi " * 2100}]), "maximum context length"),
    (dict(top_logprobs=2), "top_logprobs"),  # without logprobs
    (dict(response_format={"type": "xml"}), "response_format"),
    (dict(tool_choice="required"), "tool_choice"),  # without tools
    (dict(tools=[{"type": "function"}]), "tools"),
    (dict(functions=[{"name": "f"}]), "functions"),
]


def test_bad_requests_are_rejected_and_named(served):
    c, model = served.client, served.model
    for kw, name in BAD_COMPLETIONS:
        with pytest.raises(openai.BadRequestError, match=name) as e:
            c.completions.create(**{"model": model, "prompt": "Hi", "max_tokens": 4, **kw})
        assert e.value.body["param"] == name, kw
    for kw, name in BAD_CHATS:
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(**{"model": model, "messages": MESSAGES, **kw})
        assert name in str(e.value), (kw, str(e.value))
    with pytest.raises(openai.NotFoundError, match="no-such-model") as e:
        c.completions.create(model="no-such-model", prompt="Hi")
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="no-such-model", messages=MESSAGES)
    # and the server still serves
    r = c.completions.create(model=model, prompt=PROMPT, max_tokens=3, temperature=0)
    assert r.choices[0].text == served.greedy(served.tok.encode(PROMPT, True), 3)[0]


def post_and_leave(url: str, path: str, body: dict, first_chunk: bool) -> None:
    """POST ``body``, read up to the first SSE chunk if asked, then close the connection."""
    parts = urlsplit(url)
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    with socket.create_connection((parts.hostname, parts.port)) as s:
        s.sendall(head.encode() + data)
        got = b""
        while first_chunk and b"data: " not in got:
            got += s.recv(4096)


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_leaving_ends_its_instance(served, stream):
    server, reasons = served.server, []
    runtime = server.runtime
    terminate = runtime.terminate

    def recording(iid, reason):
        reasons.append(reason)
        terminate(iid, reason)

    call(server, lambda: setattr(runtime, "terminate", recording))
    try:
        # greedy decoding of this prompt runs for thousands of tokens without an end token
        body = {"model": served.model, "prompt": PROMPT, "max_tokens": 2000, "temperature": 0}
        post_and_leave(served.url, "/v1/completions", {**body, "stream": stream}, stream)
        deadline = time.time() + 10
        while not reasons or call(server, lambda: len(runtime.instances)):
            assert time.time() < deadline, "the instance did not end"
            time.sleep(0.01)
    finally:
        call(server, lambda: delattr(runtime, "terminate"))
    assert reasons == ["the client that launched it disconnected"]
    assert integrity(server) == (0, 0)


def test_the_api_key_is_the_servers_token(make_tiny, tmp_path):
    with running_server(make_tiny("llama"), tmp_path, auth_token="s3cret") as (url, server):
        kw = dict(model=server.models[0], prompt=PROMPT, max_tokens=2, temperature=0)
        wrong = openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            wrong.completions.create(**kw)
        right = openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0)
        assert right.completions.create(**kw).usage.completion_tokens == 2
