"""Constrained generation under concurrency on a cold server (issue 31, point 1).

32 regex, JSON-schema and choice-constrained generations at once through each of SGLang's
``/generate``, ``/v1/completions``, ``/v1/chat/completions`` and ``pastry.lang`` (and
SGLang's own frontend through ``run_batch(num_threads=2)`` when it is installed), sampled
at temperature 1 on the real model of a freshly started server: every answer is a 200 and
every output matches its constraint.

What failed before (4 of 32 on a fresh server): the sampler's Gumbel noise reached +inf
once per 2**24 draws, and a token the grammar's mask had removed won the race
(``engine/sampling.py``). It shows only with a large vocabulary and many draws, hence the
real 49k-token model and 160 generations; the noise itself is tested in
``test_sampling.py``.
"""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import jsonschema
import pytest

from server_util import integrity, running_server

N = 32
REGEX = r"[0-9]{3}-[a-z]{2}"
CHOICES = ["red", "green", "blue", "light yellow"]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "ok"],
    "additionalProperties": False,
}
MAX_TOKENS = 40  # more than any of the constraints' outputs takes


def matches(kind: str, text: str) -> bool:
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "choice":
        return text in CHOICES
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


KINDS = ("regex", "json", "choice")


def openai_body(kind: str, i: int, chat: bool, model: str) -> dict:
    body: dict = {"model": model, "max_tokens": MAX_TOKENS, "temperature": 1.0}
    text = f"Record {i}: give a {kind} answer."
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    if kind == "regex":
        body["guided_regex"] = REGEX
    elif kind == "choice":
        body["guided_choice"] = CHOICES
    elif chat:
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "record", "schema": SCHEMA},
        }
    else:
        body["guided_json"] = SCHEMA
    return body


def generate_body(kind: str, i: int) -> dict:
    sp: dict = {"max_new_tokens": MAX_TOKENS, "temperature": 1.0}
    if kind == "regex":
        sp["regex"] = REGEX
    elif kind == "choice":
        sp["regex"] = "(" + "|".join(re.escape(c) for c in CHOICES) + ")"
    else:
        sp["json_schema"] = json.dumps(SCHEMA)
    return {"text": f"Record {i}: give a {kind} answer.", "sampling_params": sp}


async def http_round(url: str, model: str) -> list[tuple[str, str, int, str]]:
    """N concurrent requests on each HTTP endpoint: (endpoint, kind, status, output)."""

    async def one(client, endpoint: str, kind: str, i: int):
        if endpoint == "/generate":
            r = await client.post(url + endpoint, json=generate_body(kind, i))
            out = r.json()["text"] if r.status_code == 200 else r.text
        else:
            chat = endpoint == "/v1/chat/completions"
            r = await client.post(url + endpoint, json=openai_body(kind, i, chat, model))
            if r.status_code != 200:
                out = r.text
            else:
                choice = r.json()["choices"][0]
                out = choice["message"]["content"] if chat else choice["text"]
        return endpoint, kind, r.status_code, out

    endpoints = ("/generate", "/v1/completions", "/v1/chat/completions")
    limits = httpx.Limits(max_connections=len(endpoints) * N)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        return await asyncio.gather(
            *(one(client, e, KINDS[i % 3], i) for e in endpoints for i in range(N))
        )


def lang_program(lib):
    @lib.function
    def record(s, i, kind):
        s += f"Record {i}: give a {kind} answer.\n"
        if kind == "regex":
            s += lib.gen("out", regex=REGEX, max_tokens=MAX_TOKENS, temperature=1.0)
        elif kind == "json":
            s += lib.gen("out", json_schema=json.dumps(SCHEMA), max_tokens=MAX_TOKENS, temperature=1.0)  # fmt: skip
        else:
            s += lib.select("out", choices=CHOICES)

    return record


@pytest.fixture(scope="module")
def cold_server(smollm2_gguf, tmp_path_factory):
    # trusted uploads: pastry.lang's programs run in the server (the local user is an
    # operator), so that this test needs no sandbox build
    with running_server(
        smollm2_gguf, tmp_path_factory.mktemp("cold"), trusted_uploads=True, num_pages=2048
    ) as s:
        yield s


def test_concurrent_constrained_generations_all_match(cold_server):
    url, server = cold_server
    model = server.models[0]
    import pastry.lang as pl

    ep = pl.Endpoint(url)
    try:
        batch = [{"i": i, "kind": KINDS[i % 3]} for i in range(N)]

        async def everything():
            http = asyncio.create_task(http_round(url, model))
            lang = asyncio.to_thread(lang_program(pl).run_batch, batch, backend=ep, num_threads=N)
            return await http, await lang

        answers, states = asyncio.run(everything())
    finally:
        ep.close()
    results = list(answers)
    for args, st in zip(batch, states, strict=True):
        err = st.error()
        out = repr(err) if err is not None else st["out"]
        results.append(("pastry.lang", args["kind"], 200 if err is None else 500, out))
    bad = [r for r in results if r[2] != 200 or not matches(r[1], r[3])]
    assert not bad, f"{len(bad)} of {len(results)}: {bad[:5]}"
    assert len(results) == 4 * N
    assert settled(server) == (0, 0)  # no page or embedding left held


def settled(server, timeout: float = 10.0) -> tuple[int, int]:
    """Pages and embeddings held once the last instances have ended (they end just after
    their answers are sent)."""
    deadline = time.monotonic() + timeout
    while (used := integrity(server)) != (0, 0) and time.monotonic() < deadline:
        time.sleep(0.05)
    return used


def test_sglang_frontend_run_batch_with_threads(cold_server):
    """The issue's own reproduction: SGLang's frontend, a regex ``gen`` in ``run_batch``
    with two threads, against ``/generate``."""
    sgl = pytest.importorskip("sglang", reason="SGLang's frontend is not installed")
    url, _ = cold_server
    program = lang_program(sgl)
    batch = [{"i": i, "kind": KINDS[i % 3]} for i in range(N)]
    states = program.run_batch(batch, backend=sgl.RuntimeEndpoint(url), num_threads=2)
    outs = [(a["kind"], st["out"]) for a, st in zip(batch, states, strict=True)]
    bad = [o for o in outs if not matches(*o)]
    assert not bad, bad[:5]
