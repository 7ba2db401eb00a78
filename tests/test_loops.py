"""Run-ahead generation (issue 28, point 1): ``generate`` runs the decode loop in the
control layer and gives exactly the tokens of the same ``step`` calls made one by one —
greedy, seeded, with penalties, logprobs, stop tokens and strings, ``min_tokens`` and a
grammar — on the trusted runner and in the sandbox; ``Context.generate`` uses it; a loop
that fails part-way returns what it did; pages are accounted."""

from __future__ import annotations

import asyncio
import json

import pytest

from inferlet_util import load_engine, result, run_all, trusted_and_sandboxed

LOOP = """
import json, math
import pastry.sdk as px
from pastry.api import ApiError, Sampling

async def main(args):
    q = px.create_queue(px.available_models()[0])
    ps = px.get_kv_page_size(q)
    prompt = [int(t) for t in args[0].split(",")]
    n = len(prompt)

    async def prefill():
        # the prompt's pages only: the tokens to come need pages allocated on the way
        pages = px.alloc_kvpages(q, -(-n // ps))
        emb = px.alloc_embeds(q, n)
        px.embed_txt(q, prompt[:-1], list(range(n - 1)), emb[: n - 1])
        await px.forward(q, [], 0, emb[: n - 1], pages, 0, [])
        return pages, emb

    async def free(pages, emb):
        await px.dealloc_kvpages(q, pages)
        await px.dealloc_embeds(q, emb)

    async def by_steps(steps, stop_tokens=(), stop=(), min_tokens=0, **sampling):
        pages, emb = await prefill()
        tok, out, values = prompt[-1], [], []
        penalize = any(k.endswith("_penalty") for k in sampling)
        for i in range(steps):
            start = n - 1 + i
            if start // ps >= len(pages):
                pages += px.alloc_kvpages(q, 1)
            ctx = pages[: -(-start // ps)]
            last = start - (len(ctx) - 1) * ps
            kw = dict(sampling)
            if "seed" in kw:
                kw["seed"] = sampling["seed"] + i
            if penalize:
                kw["penalty_tokens"] = list(sampling.get("penalty_tokens", [])) + out
            if i < min_tokens and stop_tokens:
                kw["logit_bias"] = list(kw.get("logit_bias", [])) + [
                    (t, -math.inf) for t in sorted(stop_tokens)]
            v = await px.step(q, [tok], [start], [emb[0]], ctx, last,
                              pages[start // ps : start // ps + 1], start % ps, emb[1], **kw)
            values.append(v)
            tok = v if isinstance(v, int) else v[0]
            out.append(tok)
            if tok in stop_tokens:
                break
            if stop and any(s in px.detokenize(q, out[-(4 * max(map(len, stop)) + 1):])
                            for s in stop):
                break
        await free(pages, emb)
        return out, values

    async def by_loop(steps, stop_tokens=(), stop=(), min_tokens=0, **sampling):
        pages, emb = await prefill()
        toks, new, finish, error, lps, ids, tops = await px.generate(
            q, prompt[-1], n - 1, emb[0], emb[1], pages, steps, stop_tokens=list(stop_tokens),
            stop=list(stop), min_tokens=min_tokens, **sampling)
        assert len(set(new)) == len(new) and not set(new) & set(pages)
        await free(pages + new, emb)
        return toks, finish, error, lps, ids, tops

    out = {}
    ref, _ = await by_steps(12)
    got = await by_loop(12)
    out["greedy"] = [ref, got[0], got[1]]
    cases = {
        "seeded": dict(temperature=1.0, top_k=20, seed=7),
        "penalties": dict(frequency_penalty=0.7, presence_penalty=0.3, repetition_penalty=1.3,
                          penalty_tokens=[prompt[0]], temperature=0.8, seed=3),
        "bias": dict(logit_bias=[(11, 4.0)], top_p=0.9, temperature=0.7, seed=1),
    }
    for name, kw in cases.items():
        out[name] = [(await by_steps(10, **kw))[0], (await by_loop(10, **kw))[0]]
    ref, values = await by_steps(5, logprobs=3)
    toks, _, _, lps, ids, tops = await by_loop(5, logprobs=3)
    out["logprobs"] = [[v[0] for v in values], toks, [v[1] for v in values], lps,
                       [v[2] for v in values], ids]
    stop_tok = out["greedy"][0][4]
    out["stop_token"] = [(await by_steps(12, stop_tokens={stop_tok}))[0],
                         list(await by_loop(12, stop_tokens={stop_tok}))[:2]]
    # a stop string: the text of the greedy tokens 6 and 7
    s = px.detokenize(q, out["greedy"][0][6:8]).strip()
    out["stop_string"] = [s, (await by_steps(12, stop=[s]))[0], list(await by_loop(12, stop=[s]))[:2]]
    out["min_tokens"] = [(await by_steps(12, stop_tokens={stop_tok}, min_tokens=8))[0],
                         (await by_loop(12, stop_tokens={stop_tok}, min_tokens=8))[0]]
    c = px.create_constraint(q, json.dumps({"regex": "[0-9]{3}"}))
    toks, finish, *_ = await by_loop(20, constraint=c)
    out["grammar"] = [px.detokenize(q, toks), finish]
    px.free_constraint(c)
    errors = []
    for bad in (dict(max_tokens=0), dict(token=10**6), dict(position=999)):
        pages, emb = await prefill()
        call = {**dict(token=prompt[-1], position=n - 1, max_tokens=4), **bad}
        try:
            px.generate(q, call["token"], call["position"], emb[0], emb[1], pages,
                        call["max_tokens"])
        except ApiError as e:
            errors.append(str(e))
        await free(pages, emb)
    out["errors"] = errors
    return json.dumps(out)
"""


@pytest.fixture(scope="module")
def eng(make_tiny):
    return load_engine(make_tiny("llama"), num_pages=256)


PROMPT = "5,17,42,8,99,3,250,31,7"


def check(out: dict) -> None:
    ref, got, finish = out["greedy"]
    assert got == ref and len(got) == 12 and finish == "length"
    for name in ("seeded", "penalties", "bias"):
        ref, got = out[name]
        assert got == ref and len(got) == 10, name
    toks_ref, toks, lp_ref, lps, ids_ref, ids = out["logprobs"]
    assert toks == toks_ref and ids == ids_ref
    assert lps == pytest.approx(lp_ref, abs=1e-5)
    ref, (toks, finish) = out["stop_token"]
    assert toks == ref == out["greedy"][0][:5] and finish == "stop"
    s, ref, (toks, finish) = out["stop_string"]
    assert s and toks == ref and finish == "stop" and len(toks) <= 8
    ref, got = out["min_tokens"]
    assert got == ref and len(got) >= 8
    text, finish = out["grammar"]
    assert text.isdigit() and len(text) == 3 and finish == "grammar"
    e0, e1, e2 = out["errors"]
    assert "max_tokens must be at least 1" in e0
    assert "outside the vocabulary" in e1
    assert "cannot hold" in e2


def test_generate_gives_the_tokens_of_the_same_steps(eng):
    events, controller = asyncio.run(run_all(eng, [(LOOP, [PROMPT])]))
    check(json.loads(result(events[0])))
    res = next(iter(controller.models.values())).resources
    res.check_integrity()
    assert res.referenced("embed") == 0 and res.referenced("kv") == 0


def test_generate_in_the_sandbox_matches_the_trusted_runner(eng):
    events = trusted_and_sandboxed(eng, LOOP, [PROMPT])
    trusted, boxed = (json.loads(result(e)) for e in events)
    check(boxed)
    assert boxed["greedy"] == trusted["greedy"] and boxed["seeded"] == trusted["seeded"]


CONTEXT = """
from pastry.sdk import Context, EosTokens, MaxTokens, Sampler, StopStrings
from pastry.sdk.stop import StopCondition

class PerStep(StopCondition):
    # a condition of the program's own: Context.generate checks it per token
    def __init__(self, n):
        self.n = self.max_tokens = n
    def should_stop(self, tokens, text):
        return len(tokens) >= self.n

async def main(args):
    prompt = [int(t) for t in args[0].split(",")]
    sampler = Sampler(temperature=0.9, top_k=30, seed=int(args[1]))
    out = []
    for stop in ("ahead", "per_step"):
        ctx = Context()
        ctx.fill_tokens(prompt)
        cond = MaxTokens(16) if stop == "ahead" else PerStep(16)
        text = await ctx.generate(sampler, cond)
        # and on from where it stopped: the context stays consistent
        more = await ctx.generate(sampler, MaxTokens(5) if stop == "ahead" else PerStep(5))
        out.append([ctx.tokens, text, more, ctx.kv_len])
        await ctx.release()
    return json.dumps(out)
"""


def test_context_generate_runs_ahead_with_the_per_step_tokens(eng):
    src = "import json\n" + CONTEXT
    launches = [(src, [PROMPT, str(seed)]) for seed in range(6)]
    events, controller = asyncio.run(run_all(eng, launches))
    for ev in events:
        ahead, per_step = json.loads(result(ev))
        assert ahead == per_step
    model = next(iter(controller.models.values()))
    model.resources.check_integrity()
    assert model.resources.referenced("kv") == 0
