"""Grammars are compiled once, off the event loop (issue 31, point 2): the endpoints that
take a grammar compile it in their worker thread (``constraints.prepare``), the instance
serving the request copies the matcher made there, and concurrent requests with the same
grammar compile it once."""

from __future__ import annotations

import json
import threading
import uuid

import httpx
import pytest

from pastry.control import constraints
from pastry.control.constraints import HostConstraint, prepare
from pastry.engine.tiny import train_tokenizer
from server_util import running_server

pytest.importorskip("llguidance")

# compiled grammars are cached process-wide: each test's grammars are its own
TAG = uuid.uuid4().hex[:8]


@pytest.fixture
def counted(monkeypatch):
    """Every compile and every matcher built from scratch, with the thread it ran on."""
    seen: dict[str, list[str]] = {"compile": [], "matcher": []}
    compile_, llg = constraints._compile, constraints._llguidance()

    def compile_counted(spec):
        seen["compile"].append(threading.current_thread().name)
        return compile_(spec)

    class CountingMatcher:  # llguidance's LLMatcher: its constructor counted
        def __getattr__(self, name):
            return getattr(llg.LLMatcher, name)

        def __call__(self, *a, **kw):
            seen["matcher"].append(threading.current_thread().name)
            return llg.LLMatcher(*a, **kw)

    class Counting:
        LLMatcher = CountingMatcher()

        def __getattr__(self, name):
            return getattr(llg, name)

    monkeypatch.setattr(constraints, "_compile", compile_counted)
    monkeypatch.setattr(constraints, "_llguidance", lambda: Counting())
    return seen


def _vocab():
    from pastry.wire.tokenizer import Tokenizer

    tok = Tokenizer(train_tokenizer("llama"))
    return tok, tok.vocab_size, (0,)


def test_prepared_grammar_is_copied_not_compiled_again(counted):
    tok, rows, eos = _vocab()
    spec = {"regex": f"(cat|dog)[0-9]{{2}} {TAG}"}
    prepare(tok, rows, eos, spec)
    prepare(tok, rows, eos, spec)
    assert len(counted["compile"]) == 1 and len(counted["matcher"]) == 1
    a = HostConstraint(tok, rows, eos, json.dumps(spec))
    b = HostConstraint(tok, rows, eos, json.dumps(spec))
    assert len(counted["compile"]) == 1 and len(counted["matcher"]) == 1
    # the copies are independent of each other and of the cached matcher
    a.consume(tok.encode("cat"))
    assert a.state()[2] != b.state()[2] or a.mask().tolist() != b.mask().tolist()
    c = HostConstraint(tok, rows, eos, json.dumps(spec))
    assert c.mask().tolist() == b.mask().tolist()


def test_a_bad_grammar_is_refused_once_and_remembered(counted):
    tok, rows, eos = _vocab()
    for _ in range(3):
        with pytest.raises(ValueError, match="regex"):
            prepare(tok, rows, eos, {"regex": f"(unclosed{TAG}"})
    assert len(counted["compile"]) == 1 and counted["matcher"] == []


def test_concurrent_requests_compile_a_grammar_once(counted):
    tok, rows, eos = _vocab()
    spec = {"json_schema": {"type": "object", "properties": {f"p{i}{TAG}": {"type": "integer"} for i in range(300)}}}  # fmt: skip
    errors: list[BaseException] = []

    def one():
        try:
            prepare(tok, rows, eos, spec)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=one) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(counted["compile"]) == 1 and len(counted["matcher"]) == 1


def test_the_event_loop_never_compiles_a_request_grammar(make_tiny, tmp_path, counted):
    schema = {"type": "object", "properties": {TAG: {"type": "integer"}}, "required": [TAG]}
    with running_server(make_tiny("llama"), tmp_path) as (url, server):
        model = server.models[0]
        requests = [
            ("/v1/completions", {"model": model, "prompt": "x", "max_tokens": 8, "guided_regex": f"[0-9]{{2}}{TAG}"}),
            ("/v1/chat/completions", {"model": model, "max_tokens": 12, "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema", "json_schema": {"name": "o", "schema": schema}}}),
            ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 8, "regex": f"[a-c]{{3}}{TAG}"}}),
        ]  # fmt: skip
        for path, body in requests:
            r = httpx.post(url + path, json=body, timeout=60)
            assert r.status_code == 200, r.text
        loop_thread = _loop_thread_name(server)
    assert len(counted["compile"]) == 3 and len(counted["matcher"]) == 3
    assert loop_thread not in counted["compile"] + counted["matcher"]


def _loop_thread_name(server) -> str:
    import asyncio

    async def name():
        return threading.current_thread().name

    return asyncio.run_coroutine_threadsafe(name(), server.loop).result(10)
