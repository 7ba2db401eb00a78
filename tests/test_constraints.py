"""Grammar constraints held by the host (``create_constraint`` and friends, ``sample(...,
constraint=)``): every function from a trusted inferlet and the same source in the
WebAssembly sandbox, misuse errors, and the per-instance limit on handles."""

from __future__ import annotations

import asyncio
import json
import re

import pytest

from inferlet_util import load_engine, result, run_all, start
from pastry.control.constraints import MAX_GRAMMAR_BYTES
from pastry.control.events import Failed

pytest.importorskip("llguidance")

API = """
import json
import pastry.sdk as px

async def main(args):
    model = px.available_models()[0]
    q = px.create_queue(model)
    out = {}
    c = px.create_constraint(q, json.dumps({"regex": "(ab|cd)[0-9]{3}"}))
    out["start"] = px.constraint_state(c)
    mask = px.constraint_mask(c)
    out["mask_bytes"] = len(mask)
    out["allowed"] = [t for t in range(px.get_vocab_size(q)) if mask[t >> 3] >> (t & 7) & 1]
    toks = px.tokenize(q, "ab1")
    px.constraint_consume(c, toks)
    out["after_ab1"] = px.constraint_state(c)
    emb = px.alloc_embeds(q, 1)
    kv = px.alloc_kvpages(q, 1)
    await px.embed_txt(q, [toks[-1]], [0], emb)
    await px.forward(q, [], 0, emb, kv, 0, emb)
    sampled = []
    for _ in range(3):
        tok, lp, ids, lps = await px.sample(q, emb[0], logprobs=2, constraint=c)
        sampled.append(tok)
        if px.constraint_state(c)[1]:
            break
    out["sampled"] = sampled
    out["end"] = px.constraint_state(c)
    fut = px.sample(q, emb[0], constraint=c)
    try:
        px.sample(q, emb[0], constraint=c)
    except px.ApiError as e:
        out["busy"] = str(e)
    await fut
    d = px.create_constraint(q, json.dumps({"regex": "x+"}))
    try:
        px.constraint_consume(d, px.tokenize(q, "y"))
    except px.ApiError as e:
        out["bad_token"] = str(e)
    px.free_constraint(c)
    for name, call in [
        ("freed", lambda: px.constraint_state(c)),
        ("not_json", lambda: px.create_constraint(q, "[0-9]+")),
        ("bad_regex", lambda: px.create_constraint(q, json.dumps({"regex": "a(b"}))),
        ("bad_kind", lambda: px.create_constraint(q, json.dumps({"ebnf": "x"}))),
        ("too_big", lambda: px.create_constraint(q, json.dumps({"regex": "a" * int(args[0])}))),
    ]:
        try:
            call()
            out[name] = None
        except px.ApiError as e:
            out[name] = str(e)
    px.send(json.dumps(out))  # a sandboxed instance ends at the limit (below)
    held = [d]
    try:
        while True:
            held.append(px.create_constraint(q, json.dumps({"regex": "[0-9]"})))
    except px.ApiError as e:
        out["limit"] = [len(held), type(e).__name__, str(e)]
    px.free_constraint(held.pop())
    held.append(px.create_constraint(q, json.dumps({"regex": "[0-9]"})))  # room again
    return json.dumps(out)
"""


@pytest.fixture(scope="module")
def eng(make_tiny):
    return load_engine(make_tiny("llama"), num_pages=64)


def released(controller) -> None:
    res = next(iter(controller.models.values())).resources
    res.check_integrity()
    assert res.referenced("kv") == 0 and res.usage("embed")[1] == 0  # (the cache may keep KV)


def check(out: dict) -> None:
    assert out["start"] == [False, False, []]
    assert out["mask_bytes"] >= 4 * ((max(out["allowed"]) + 32) // 32)
    assert out["allowed"]  # tokens starting "a", "ab", "c", "cd" (and no end token)
    assert out["after_ab1"][:2] == [False, False]
    complete, stopped, _ = out["end"]
    assert complete and stopped  # two more digits, then only the end could follow
    assert len(out["sampled"]) <= 3
    assert "in flight" in out["busy"]
    assert "grammar error" in out["bad_token"]
    assert "does not exist" in out["freed"]
    assert "not JSON" in out["not_json"]
    assert "invalid regex grammar" in out["bad_regex"]
    assert "grammar must be one of" in out["bad_kind"]
    assert "limit" in out["too_big"]


def test_constraint_api_trusted_and_sandboxed(eng):
    pytest.importorskip("wasmtime")
    from pastry.runtime import build_pyrt
    from pastry.runtime.wasm import SandboxLimits, sandboxed_program

    try:
        build_pyrt.build()
    except build_pyrt.BuildError as e:
        pytest.skip(f"cannot build the Python runtime component: {e}")
    args = [str(MAX_GRAMMAR_BYTES)]
    events, controller = asyncio.run(run_all(eng, [(API, args)]))
    released(controller)
    trusted = json.loads(result(events[0]))
    check(trusted)
    n, kind, message = trusted["limit"]  # trusted: a QuotaError the inferlet can catch
    assert n == 64 and kind == "QuotaError" and "free_constraint" in message

    async def boxed():
        controller, rt, handle = await start(eng)
        prog = sandboxed_program("c", API, SandboxLimits(max_constraints=8))
        inst = rt.launch(prog, args)
        evs = [ev async for ev in inst.events()]
        await controller.close()
        handle.close()
        return evs

    evs = asyncio.run(boxed())
    sandboxed = json.loads(evs[0].text)
    check(sandboxed)
    # in the sandbox, going over a limit ends the instance, naming the limit
    assert isinstance(evs[-1], Failed) and "holds 8 grammar constraints" in evs[-1].error
    for key in ("start", "allowed", "after_ab1", "sampled", "end"):
        assert sandboxed[key] == trusted[key], key


def test_a_sampled_token_always_keeps_the_output_in_the_grammar(eng):
    """Sampling hot with the constraint, every output is a word of the regex."""
    src = """
import json
import pastry.sdk as px
from pastry.sdk import Context
from pastry.sdk.grammar import Constraint, generate

async def main(args):
    outs = []
    for seed in range(6):
        async with Context() as ctx:
            ctx.fill("Code: ")
            with Constraint(ctx, {"regex": "[A-Z]{2}-[0-9]{2,3}"}) as c:
                got = await generate(ctx, c, 16, temperature=1.5, seed=seed)
            outs.append([ctx.api.detokenize(ctx.queue, got.tokens), got.complete])
    return json.dumps(outs)
"""
    events, controller = asyncio.run(run_all(eng, [(src, [])]))
    released(controller)
    outs = json.loads(result(events[0]))
    assert all(complete and re.fullmatch(r"[A-Z]{2}-[0-9]{2,3}", t) for t, complete in outs)
    assert len({t for t, _ in outs}) > 1
