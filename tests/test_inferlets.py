"""Inferlets end to end on the trusted runner: the paper's programs against transformers."""

from __future__ import annotations

import asyncio

import numpy as np
import torch

from engine_util import hf_model
from inferlet_util import load_engine, result, run_all
from pastry.control.events import Failed

THREE_LINES = """
from pastry.sdk import Context

async def main(args):
    ctx = Context()
    ctx.fill(args[0])
    return await ctx.generate_until(max_tokens=int(args[1]))
"""

# Pie §4.2: the explicit greedy loop with alloc / embed_txt / forward / get_next_dist,
# printing token ids so the test can compare them exactly.
GREEDY_LOOP = """
import pastry.sdk as px

async def main(args):
    tokens = [int(t) for t in args[0].split(",")]
    n_new = int(args[1])
    model = px.available_models()[0]
    q = px.create_queue(model)
    ps = px.get_kv_page_size(q)
    n = len(tokens)
    kv = px.alloc_kvpages(q, (n + n_new + ps - 1) // ps)
    emb = px.alloc_embeds(q, n + 1)
    await px.embed_txt(q, tokens, list(range(n)), emb[:n])
    await px.forward(q, [], 0, emb[:n], kv, 0, [emb[n]])
    out = []
    length = n
    for _ in range(n_new):
        ids, probs = await px.get_next_dist(q, emb[n])
        tok = ids[probs.index(max(probs))]
        out.append(tok)
        await px.embed_txt(q, [tok], [length], [emb[0]])
        ctx = kv[: (length + ps - 1) // ps]
        last = length - (len(ctx) - 1) * ps
        await px.forward(q, ctx, last, [emb[0]], kv[length // ps :], length % ps, [emb[n]])
        length += 1
    return ",".join(map(str, out))
"""

# Pie §4.2: 9 tokens in one forward vs 8 into KV pages then 1 on top (same output).
SPLIT_PREFILL = """
import pastry.sdk as px

async def main(args):
    tokens = [int(t) for t in args[0].split(",")]
    q = px.create_queue(px.available_models()[0])
    ps = px.get_kv_page_size(q)
    emb = px.alloc_embeds(q, 11)
    kv = px.alloc_kvpages(q, 3)
    await px.embed_txt(q, tokens, list(range(9)), emb[:9])
    f1 = px.forward(q, [], 0, emb[:9], [], 0, [emb[9]])
    f2 = px.forward(q, [], 0, emb[:8], kv, 0, [])
    f3 = px.forward(q, kv[: (8 + ps - 1) // ps], 8 - ((8 + ps - 1) // ps - 1) * ps, emb[8:9], kv[8 // ps:], 8 % ps, [emb[10]])
    await f1; await f2; await f3
    a_ids, a_p = await px.get_next_dist(q, emb[9], 8)
    b_ids, b_p = await px.get_next_dist(q, emb[10], 8)
    return repr((a_ids, a_p, b_ids, b_p))
"""


def hf_greedy(path, tokens, n):
    hf = hf_model(path)
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([tokens]),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(tokens) :].tolist()


def test_greedy_loop_matches_transformers(make_tiny):
    path = make_tiny("llama")
    eng = load_engine(path)
    tokens = np.random.default_rng(0).integers(0, eng.info.vocab_size, 9).tolist()
    events, _ = asyncio.run(run_all(eng, [(GREEDY_LOOP, [",".join(map(str, tokens)), "12"])]))
    got = [int(t) for t in result(events[0]).split(",")]
    assert got == hf_greedy(path, tokens, 12)


def test_split_prefill_through_kv_pages(make_tiny):
    eng = load_engine(make_tiny("llama"))
    tokens = np.random.default_rng(1).integers(0, eng.info.vocab_size, 9).tolist()
    events, _ = asyncio.run(run_all(eng, [(SPLIT_PREFILL, [",".join(map(str, tokens))])]))
    a_ids, a_p, b_ids, b_p = eval(result(events[0]))
    assert a_ids == b_ids
    np.testing.assert_allclose(a_p, b_p, atol=1e-6)


def test_three_line_context_matches_transformers(make_tiny):
    path = make_tiny("llama")
    eng = load_engine(path)
    tok = eng.info
    events, _ = asyncio.run(run_all(eng, [(THREE_LINES, ["Hello,", "10"])]))
    text = result(events[0])
    from pastry.wire.tokenizer import Tokenizer

    t = Tokenizer.from_json(tok.tokenizer_json, tok.chat_template, tok.special_tokens)
    prompt = t.encode("Hello,", True)
    ref = hf_greedy(path, prompt, 10)
    eos = set(tok.eos_token_ids)
    if any(x in eos for x in ref):
        ref = ref[: next(i for i, x in enumerate(ref) if x in eos)]
    assert text == t.decode(ref)


CONTEXT_TOKENS = """
from pastry.sdk import Context, MaxTokens, Sampler

async def main(args):
    ctx = Context()
    ctx.fill_tokens([int(t) for t in args[0].split(",")])
    await ctx.generate(Sampler(), MaxTokens(int(args[1])))
    return ",".join(map(str, ctx.tokens))
"""


def test_200_concurrent_inferlets_batch_together(make_tiny):
    from pastry.engine.generate import FusedGenerator, Request

    path = make_tiny("llama")
    eng = load_engine(path, num_pages=2048, num_embeds=4096)
    rng = np.random.default_rng(2)
    prompts = [
        rng.integers(0, eng.info.vocab_size, int(rng.integers(3, 12))).tolist() for _ in range(200)
    ]
    launches = [(CONTEXT_TOKENS, [",".join(map(str, p)), "8"]) for p in prompts]
    events, controller = asyncio.run(run_all(eng, launches))
    stats = next(iter(controller.models.values())).scheduler.stats
    # reference: the fused loop straight over a fresh engine
    ref_eng = load_engine(path, num_pages=2048, num_embeds=4096)
    reqs = [Request(p, 8) for p in prompts]
    FusedGenerator(ref_eng.execute, ref_eng.info, max_running=200).run(reqs)
    for ev, p, r in zip(events, prompts, reqs, strict=True):
        assert [int(t) for t in result(ev).split(",")] == p + r.output
    assert stats.mean_batch > 100, stats
    res = next(iter(controller.models.values())).resources
    res.check_integrity()
    assert res.referenced("kv") == 0 and res.referenced("embed") == 0  # everything released


MISUSE = """
import pastry.sdk as px
from pastry.sdk import ApiError

async def main(args):
    case = args[0]
    q = px.create_queue(px.available_models()[0])
    pages = px.alloc_kvpages(q, 2)
    embs = px.alloc_embeds(q, 2)
    try:
        if case == "freed":
            await px.dealloc_kvpages(q, pages)
            await px.forward(q, pages, 1, embs[:1], [], 0, [])
        elif case == "double-free":
            await px.dealloc_embeds(q, embs)
            await px.dealloc_embeds(q, embs)
        elif case == "foreign":
            await px.forward(q, [10_000], 1, embs[:1], [], 0, [])
        elif case == "wrong-queue":
            await px.embed_txt(q + 99, [1], [0], embs[:1])
        elif case == "lengths":
            await px.embed_txt(q, [1, 2], [0], embs[:2])
        elif case == "bad-token":
            await px.embed_txt(q, [10**9], [0], embs[:1])
        elif case == "model":
            px.create_queue("no-such-model")
        else:
            raise AssertionError(case)
    except ApiError as e:
        return "ApiError: " + str(e)
    return "no error"
"""

CRASH = """
async def main(args):
    raise KeyError("boom-" + args[0])
"""


def test_misuse_fails_only_that_inferlet(make_tiny):
    eng = load_engine(make_tiny("llama"))
    cases = ["freed", "double-free", "foreign", "wrong-queue", "lengths", "bad-token", "model"]
    healthy = (THREE_LINES, ["Hello,", "6"])
    launches = [(MISUSE, [c]) for c in cases] + [(CRASH, ["x"]), healthy]
    events, controller = asyncio.run(run_all(eng, launches))
    expect = {
        "freed": "freed",
        "double-free": "freed",
        "foreign": "not owned",
        "wrong-queue": "queue",
        "lengths": "positions",
        "bad-token": "vocab",
        "model": "no-such-model",
    }
    for case, ev in zip(cases, events[: len(cases)], strict=True):
        msg = result(ev)
        assert msg.startswith("ApiError: "), (case, msg)
        assert expect[case] in msg, (case, msg)
    crash = events[len(cases)][-1]
    assert isinstance(crash, Failed), crash
    assert "KeyError: 'boom-x'" in crash.error and "raise KeyError" in crash.error
    # the healthy inferlet next to them finished with its normal output
    alone, _ = asyncio.run(run_all(load_engine(make_tiny("llama")), [healthy]))
    assert result(events[-1]) == result(alone[0])
    res = next(iter(controller.models.values())).resources
    res.check_integrity()
    assert res.referenced("kv") == 0 and res.referenced("embed") == 0


FORK = """
import asyncio, json
from pastry.sdk import Context, MaxTokens, Sampler

async def main(args):
    ctx = Context()
    ctx.fill_tokens([int(t) for t in args[0].split(",")])
    kids = await asyncio.gather(*(ctx.fork() for _ in range(3)))  # concurrent forks
    outs = await asyncio.gather(*(k.generate(Sampler(), MaxTokens(4)) for k in kids))
    shared = [k.pages[:2] == ctx.pages[:2] and k.pages[2] != ctx.pages[2] for k in kids]
    for k in kids:
        await k.release()
    await ctx.release()
    return json.dumps({"tokens": [k.tokens for k in kids], "shared": shared})
"""


def test_fork_shares_full_pages_and_branches_batch(make_tiny):
    import json

    eng = load_engine(make_tiny("llama"))
    prefix = np.random.default_rng(5).integers(0, eng.info.vocab_size, 10).tolist()
    p = ",".join(map(str, prefix))
    events, controller = asyncio.run(run_all(eng, [(FORK, [p])]))
    out = json.loads(result(events[0]))
    assert out["shared"] == [True, True, True]
    plain, _ = asyncio.run(run_all(load_engine(make_tiny("llama")), [(CONTEXT_TOKENS, [p, "4"])]))
    want = [int(t) for t in result(plain[0]).split(",")]
    assert out["tokens"] == [want] * 3
    stats = next(iter(controller.models.values())).scheduler.stats
    # the three branches decode together: 1 prefill + 4 steps in batches of 3 forwards
    assert stats.forward_items / stats.forward_batches > 2, stats
    res = next(iter(controller.models.values())).resources
    res.check_integrity()
    assert res.referenced("kv") == 0
