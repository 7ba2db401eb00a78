"""Every OpenAI / vLLM request field the server implements, through the official ``openai``
package against a live server on a tiny random checkpoint, checked against transformers
(log-probabilities, penalties) and against the grammar (structured outputs, tool calls)."""

from __future__ import annotations

import json
import math
import re
import urllib.request

import numpy as np
import openai
import pytest
import torch

from engine_util import hf_model
from pastry.server.openai_tools import HermesFormat
from pastry.wire.tokenizer import Tokenizer
from server_util import integrity, running_server

PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}


class Served:
    def __init__(self, url, server, ckpt) -> None:
        self.url, self.server = url, server
        self.client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        self.model = server.models[0]
        self.tok = Tokenizer.from_dir(ckpt)
        self.hf = hf_model(ckpt)

    def logprobs(self, tokens: list[int]) -> torch.Tensor:
        """transformers' log_softmax at every position of ``tokens``."""
        with torch.no_grad():
            return torch.log_softmax(self.hf(torch.tensor([tokens])).logits[0].float(), -1)

    def create(self, **kw):
        return self.client.completions.create(model=self.model, **kw)

    def chat(self, **kw):
        return self.client.chat.completions.create(model=self.model, **kw)

    def get(self, path: str) -> dict:
        with urllib.request.urlopen(self.url + path) as r:
            return json.loads(r.read())

    def post(self, path: str, body: dict) -> dict:
        req = urllib.request.Request(
            self.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req) as r:
            return json.loads(r.read())


@pytest.fixture(scope="module")
def served(make_tiny, tmp_path_factory):
    ckpt = make_tiny("llama")
    with running_server(ckpt, tmp_path_factory.mktemp("fields")) as (url, server):
        yield Served(url, server, ckpt)
        assert integrity(server) == (0, 0)


# ---------------------------------------------------------------------- log-probabilities


def test_completion_logprobs_equal_transformers(served):
    prompt = served.tok.encode(PROMPT)
    out = penalized_greedy(served, prompt, 6)
    ref = served.logprobs(prompt + out)
    r = served.create(prompt=prompt, max_tokens=6, temperature=0, logprobs=5)
    [c] = r.choices
    lp = c.logprobs
    assert lp.tokens == [served.tok.decode([t]) for t in out]
    for i, (got, top) in enumerate(zip(lp.token_logprobs, lp.top_logprobs, strict=True)):
        row = ref[len(prompt) - 1 + i]
        assert abs(got - float(row[out[i]])) < 1e-4 and got == max(top.values())
        want = [float(v) for v in row.topk(5).values]
        assert np.allclose(sorted(top.values(), reverse=True)[:5], want, atol=1e-4)
    assert "".join(lp.tokens) == c.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    # sampled: the chosen token's log-probability under the model
    r = served.create(prompt=prompt, max_tokens=1, temperature=1.0, seed=4, logprobs=0)
    [(tok_s, got)] = zip(
        r.choices[0].logprobs.tokens, r.choices[0].logprobs.token_logprobs, strict=False
    )
    [tok] = [t for t in range(ref.shape[1]) if served.tok.decode([t]) == tok_s][:1]
    assert abs(got - float(ref[len(prompt) - 1, tok])) < 1e-4


def test_echo_scores_the_prompt_like_lm_eval_asks(served):
    prompt = served.tok.encode("Paris is the capital of France")
    ref = served.logprobs(prompt)
    r = served.create(prompt=[prompt, prompt[:4]], max_tokens=1, temperature=0, logprobs=1, echo=True)  # fmt: skip
    c = r.choices[0]
    assert c.text.startswith(served.tok.decode(prompt))
    lp = c.logprobs.token_logprobs
    assert len(lp) == len(prompt) + 1 and lp[0] is None and c.logprobs.top_logprobs[0] is None
    want = ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])].numpy()
    np.testing.assert_allclose(lp[1 : len(prompt)], want, atol=1e-4)
    assert len(r.choices[1].logprobs.token_logprobs) == 5
    # max_tokens 0: the prompt alone
    r = served.create(prompt=prompt, max_tokens=0, logprobs=0, echo=True)
    assert r.choices[0].text == served.tok.decode(prompt) and r.usage.completion_tokens == 0
    np.testing.assert_allclose(r.choices[0].logprobs.token_logprobs[1:], want, atol=1e-4)
    # echo streamed: the prompt first
    chunks = list(served.create(prompt=prompt, max_tokens=3, temperature=0, echo=True, stream=True))
    assert chunks[0].choices[0].text == served.tok.decode(prompt)


def test_chat_logprobs_and_top_logprobs(served):
    prompt = served.tok.encode(served.tok.apply_chat_template(MESSAGES))
    r = served.chat(messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    ref = served.logprobs(prompt)[-1]
    first = content[0]
    assert abs(first.logprob - float(ref.max())) < 1e-4
    assert [round(t.logprob, 4) for t in first.top_logprobs] == [
        round(float(v), 4) for v in ref.topk(3).values
    ]
    assert bytes(first.bytes).decode("utf-8", "replace") == first.token
    chunks = list(
        served.chat(
            messages=MESSAGES,
            max_tokens=4,
            temperature=0,
            logprobs=True,
            top_logprobs=3,
            stream=True,
        )
    )
    streamed = [e for ch in chunks for c in ch.choices if c.logprobs for e in c.logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    r = served.chat(messages=MESSAGES, max_tokens=2, logprobs=True)
    assert all(e.top_logprobs == [] for e in r.choices[0].logprobs.content)


def test_completion_stream_logprobs(served):
    kw = dict(prompt=PROMPT, max_tokens=8, temperature=0, logprobs=2)
    plain = served.create(**kw).choices[0].logprobs
    chunks = list(served.create(**kw, stream=True))
    got = [x for ch in chunks for c in ch.choices if c.logprobs for x in c.logprobs.token_logprobs]
    assert got == plain.token_logprobs


# ---------------------------------------------------------------------- sampling fields


def penalized_greedy(served, prompt, n, rep=1.0, freq=0.0, pres=0.0, bias=None) -> list[int]:
    """vLLM's penalties on transformers' logits, greedily."""
    out: list[int] = []
    for _ in range(n):
        with torch.no_grad():
            x = served.hf(torch.tensor([prompt + out])).logits[0, -1].double()
        for t, b in (bias or {}).items():
            x[t] += b
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=len(x)).double()
        seen = counts > 0
        seen[prompt] = True
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
        x = x - freq * counts - pres * (counts > 0).double()
        out.append(int(x.argmax()))
    return out


def test_penalties_and_bias_match_a_reference(served):
    prompt = served.tok.encode(PROMPT)
    first = penalized_greedy(served, prompt, 1)[0]
    cases = [
        dict(rep=1.8),
        dict(freq=1.5),
        dict(pres=1.2),
        dict(rep=1.3, freq=0.5, pres=0.4, bias={first: -5.0}),
    ]
    for case in cases:
        want = penalized_greedy(served, prompt, 8, **case)
        extra = {"repetition_penalty": case.get("rep", 1.0)}
        r = served.create(
            prompt=prompt,
            max_tokens=8,
            temperature=0,
            frequency_penalty=case.get("freq", 0.0),
            presence_penalty=case.get("pres", 0.0),
            logit_bias={str(t): b for t, b in (case.get("bias") or {}).items()},
            extra_body=extra,
            logprobs=0,
        )
        assert r.choices[0].logprobs.tokens == [served.tok.decode([t]) for t in want], case
        assert r.choices[0].text == served.tok.decode(want), case


def test_logit_bias_top_k_min_p_stop_token_ids(served):
    prompt = served.tok.encode(PROMPT)
    greedy = penalized_greedy(served, prompt, 6)
    r = served.create(prompt=prompt, max_tokens=3, temperature=1.0, seed=1, logit_bias={"42": 100})
    assert r.choices[0].text == served.tok.decode([42, 42, 42])
    text = served.tok.decode(greedy)
    for extra in ({"top_k": 1}, {"min_p": 1.0}):
        r = served.create(prompt=prompt, max_tokens=6, temperature=1.0, seed=3, extra_body=extra)
        assert r.choices[0].text == text, extra
    r = served.create(prompt=prompt, max_tokens=6, temperature=0, extra_body={"stop_token_ids": [greedy[2]]})  # fmt: skip
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 3
    assert r.choices[0].text == served.tok.decode(greedy[:2])


def test_ignore_eos_and_min_tokens(served):
    eos = served.tok.eos_token_ids[0]
    kw = dict(prompt=PROMPT, max_tokens=5, temperature=0, logit_bias={str(eos): 100})
    r = served.create(**kw)
    assert r.usage.completion_tokens == 1 and r.choices[0].finish_reason == "stop"
    r = served.create(**kw, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"
    r = served.create(**kw, extra_body={"min_tokens": 3})
    assert r.usage.completion_tokens == 4 and r.choices[0].finish_reason == "stop"


def test_best_of_returns_the_most_likely(served):
    kw = dict(prompt=PROMPT, max_tokens=6, temperature=1.0, seed=11)
    three = served.create(**kw, n=3, logprobs=0).choices
    score = {c.text: sum(c.logprobs.token_logprobs) for c in three}
    best = served.create(**kw, n=1, best_of=3).choices
    assert [c.text for c in best] == [max(score, key=score.get)]
    two = served.create(**kw, n=2, best_of=3).choices
    assert [c.text for c in two] == sorted(score, key=score.get, reverse=True)[:2]


def test_usage_details_and_stream_usage(served):
    r = served.create(prompt=PROMPT, max_tokens=2)
    # (earlier tests of this module may have left the prompt in the prefix cache)
    assert 0 <= r.usage.prompt_tokens_details.cached_tokens < r.usage.prompt_tokens
    long = served.create(prompt=PROMPT * 4, max_tokens=2)
    again = served.create(prompt=PROMPT * 4, max_tokens=2)  # its full pages are cached now
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached > long.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < again.usage.prompt_tokens
    chunks = list(
        served.chat(
            messages=MESSAGES, max_tokens=2, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[-1].usage.completion_tokens == 2 and chunks[-1].choices == []
    usage = chunks[-1].usage
    assert 0 <= usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens


# ---------------------------------------------------------------------- structured outputs


def check_person(text: str) -> None:
    obj = json.loads(text)
    assert set(obj) == {"name", "age"} and isinstance(obj["name"], str)
    assert isinstance(obj["age"], int) and 0 <= obj["age"] <= 120 and len(obj["name"]) <= 10


def test_response_format_json_schema_and_object(served):
    fmt = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": PERSON, "strict": True},
    }
    for temperature, seed in [(0, None), (0.8, 1), (1.0, 2), (1.3, 3)]:
        r = served.chat(messages=MESSAGES, max_tokens=60, temperature=temperature, seed=seed, response_format=fmt)  # fmt: skip
        check_person(r.choices[0].message.content)
    r = served.chat(messages=MESSAGES, max_tokens=60, temperature=0, response_format={"type": "json_object"})  # fmt: skip
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = served.create(
        prompt=PROMPT, max_tokens=60, temperature=0.7, seed=5, extra_body={"response_format": fmt}
    )
    check_person(r.choices[0].text)


def test_vllm_structured_outputs(served):
    cases = [
        ({"structured_outputs": {"regex": r"[0-9]{3}-[0-9]{2}"}}, r"[0-9]{3}-[0-9]{2}"),
        ({"structured_outputs": {"choice": ["red", "green", "blue"]}}, "red|green|blue"),
        (
            {"structured_outputs": {"grammar": 'start: "(" NUM ")"\nNUM: /[1-9][0-9]?/'}},
            r"\([1-9][0-9]?\)",
        ),
        ({"guided_regex": r"(yes|no)!"}, r"(yes|no)!"),
        ({"guided_choice": ["A", "B"]}, "A|B"),
    ]
    for extra, pattern in cases:
        for seed in (None, 1, 2):
            temperature = 0 if seed is None else 1.2
            r = served.chat(messages=MESSAGES, max_tokens=20, temperature=temperature, seed=seed, extra_body=extra)  # fmt: skip
            assert re.fullmatch(pattern, r.choices[0].message.content), (extra, r.choices[0])
    r = served.create(prompt=PROMPT, max_tokens=40, temperature=0, extra_body={"guided_json": PERSON})  # fmt: skip
    check_person(r.choices[0].text)


# ---------------------------------------------------------------------- tool calls


def test_named_and_required_tool_calls(served):
    kw = dict(messages=MESSAGES, tools=[WEATHER, TIME], max_tokens=60)
    for temperature, seed in [(0, None), (1.0, 1), (1.2, 2)]:
        named = {"type": "function", "function": {"name": "get_weather"}}
        r = served.chat(**kw, tool_choice=named, temperature=temperature, seed=seed)
        [call] = r.choices[0].message.tool_calls
        assert call.function.name == "get_weather" and call.id.startswith("call_")
        args = json.loads(call.function.arguments)
        assert set(args) == {"city"} and isinstance(args["city"], str)
        r = served.chat(
            **kw, tool_choice="required", parallel_tool_calls=False, temperature=temperature,
            seed=seed,
        )  # fmt: skip
        [call] = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls"
        assert_valid(call)
    # parallel calls: an array the random model may not close within max_tokens
    r = served.chat(**{**kw, "max_tokens": 200}, tool_choice="required", temperature=0)
    if r.choices[0].finish_reason == "tool_calls":
        for call in r.choices[0].message.tool_calls:
            assert_valid(call)
    else:
        assert r.choices[0].finish_reason == "length" and not r.choices[0].message.tool_calls


def assert_valid(call) -> None:
    args = json.loads(call.function.arguments)
    assert call.function.name in ("get_weather", "get_time")
    assert set(args) == ({"city"} if call.function.name == "get_weather" else {"zone"})


def accumulate(chunks) -> tuple[str, list[dict], str]:
    """Content, tool calls and finish reason from streamed chat chunks (as clients do)."""
    content, calls, finish = "", {}, None
    for ch in chunks:
        for c in ch.choices:
            content += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = call["id"] or d.id
                call["name"] += (d.function.name or "") if d.function else ""
                call["arguments"] += (d.function.arguments or "") if d.function else ""
            finish = c.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def test_streamed_tool_calls_equal_plain_ones(served):
    kw = dict(messages=MESSAGES, tools=[WEATHER, TIME], max_tokens=60, temperature=0)
    for choice in ({"type": "function", "function": {"name": "get_time"}}, "required"):
        plain = served.chat(**kw, tool_choice=choice, parallel_tool_calls=False).choices[0]
        _, calls, finish = accumulate(
            served.chat(**kw, tool_choice=choice, parallel_tool_calls=False, stream=True)
        )
        want = [(c.function.name, c.function.arguments) for c in plain.message.tool_calls]
        assert [(c["name"], c["arguments"]) for c in calls] == want
        assert all(c["id"] for c in calls) and finish == plain.finish_reason


def test_auto_tool_calls_are_parsed_from_the_models_format(served):
    """With tool_choice auto the model writes calls in its own format: here a regex makes
    the random model write one, and the endpoint must turn it into tool_calls."""
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    kw = dict(
        messages=MESSAGES,
        tools=[WEATHER],
        max_tokens=80,
        temperature=0,
        extra_body={"guided_regex": "Sure\\. " + re.escape(call)},
    )
    r = served.chat(**kw).choices[0]
    assert r.message.content == "Sure." and r.finish_reason == "tool_calls"
    [c] = r.message.tool_calls
    assert c.function.name == "get_weather" and json.loads(c.function.arguments) == {
        "city": "Paris"
    }
    content, calls, finish = accumulate(served.chat(**kw, stream=True))
    assert content.strip() == "Sure." and finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", {"city": "Paris"})]  # fmt: skip
    # a follow-up turn with the call and its result renders and answers
    history = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [c.model_dump()]},
        {"role": "tool", "tool_call_id": c.id, "content": "sunny"},
    ]
    r = served.chat(messages=history, tools=[WEATHER], max_tokens=3, temperature=0)
    assert r.choices[0].message.role == "assistant"


def test_hermes_stream_parser_pieces():
    fmt = HermesFormat()
    text = 'Hi <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call><tool_call>{"name": "g"}</tool_call>'
    content, calls = fmt.parse(text)
    assert content == "Hi" and [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"a": 1}), ("g", {})]  # fmt: skip
    for size in (1, 3, 7):
        stream, shown, got = fmt.stream(), "", []
        for i in range(0, len(text), size):
            s, cs = stream.feed(text[i : i + size])
            shown += s
            got += cs
        shown += stream.close()
        assert shown == "Hi " and [c.name for c in got] == ["f", "g"]
    assert fmt.parse("<tool_call>not json</tool_call>")[1] == []


# ---------------------------------------------------------------------- tokenizer endpoints, metrics


def test_tokenize_detokenize_tokenizer_info(served):
    got = served.post("/tokenize", {"prompt": PROMPT, "add_special_tokens": False})
    assert got["tokens"] == served.tok.encode(PROMPT) and got["count"] == len(got["tokens"])
    assert got["max_model_len"] > 0 and got["token_strs"] is None
    strs = served.post("/tokenize", {"prompt": PROMPT, "return_token_strs": True})["token_strs"]
    assert len(strs) == got["count"] + (served.tok.bos_token_id is not None)
    chat = served.post("/tokenize", {"messages": MESSAGES, "model": served.model})
    assert chat["tokens"] == served.tok.encode(served.tok.apply_chat_template(MESSAGES))
    assert served.post("/detokenize", {"tokens": got["tokens"]}) == {"prompt": PROMPT}
    info = served.get("/tokenizer_info")
    assert info["eos_token"] == served.tok.special_tokens["eos_token"]
    assert info["tokenizer_class"] and info["chat_template"] == served.tok.chat_template


def test_metrics(served):
    served.create(prompt=PROMPT, max_tokens=4, temperature=0)
    with urllib.request.urlopen(served.url + "/metrics") as r:
        text = r.read().decode()

    def value(name: str) -> float:
        found = [float(v) for line in text.splitlines() if line.startswith(name) for v in line.split()[-1:]]  # fmt: skip
        assert found, name
        return sum(found)

    assert value('pastry_requests_total{endpoint="/v1/completions",status="200"}') >= 1
    assert value('pastry_generation_tokens_total{endpoint="/v1/completions"}') >= 4
    assert value("pastry_batch_size_count") > 0 and value("pastry_engine_step_seconds_count") > 0
    assert value('pastry_time_to_first_token_seconds_count{endpoint="/v1/completions"}') >= 1
    assert value('pastry_inter_token_latency_seconds_count{endpoint="/v1/completions"}') >= 3
    assert value("pastry_kv_pages_free") > 0 and not math.isnan(value("pastry_kv_pages_used"))
    assert "pastry_inferlets_running" in text and "pastry_inferlets_waiting" in text
