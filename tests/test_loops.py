"""Run-ahead generation (issue 28, point 1): ``generate`` runs the decode loop in the
control layer and gives exactly the tokens of the same ``step`` calls made one by one —
greedy, seeded, with penalties, logprobs, stop tokens and strings, ``min_tokens`` and a
grammar — on the trusted runner and in the sandbox; ``Context.generate`` uses it; a loop
that fails part-way returns what it did; pages are accounted."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from inferlet_util import SLOW_READER, load_engine, result, run_all, trusted_and_sandboxed

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


CONTEXT = (
    """
import asyncio
from pastry.sdk import Context, EosTokens, MaxTokens, Sampler, StopStrings
from pastry.sdk.steps import sample_next
from pastry.sdk.stop import StopCondition

class Own(StopCondition):
    # a condition of the program's own: after n tokens, or at a token of `at`; the loop
    # runs ahead and the program checks it on every token it hears
    def __init__(self, n, at=()):
        self.n = self.max_tokens = n
        self.at = set(at)
    def should_stop(self, tokens, text):
        return len(tokens) >= self.n or tokens[-1] in self.at

async def by_steps(ctx, sampler, n, at=()):
    # the reference: one sample per token, as Context.generate did before run-ahead
    out = []
    while True:
        tok = await sample_next(ctx, sampling=sampler.sampling(len(out)))
        out.append(tok)
        ctx.fill_tokens([tok])
        if len(out) >= n or tok in at:
            return ctx.api.detokenize(ctx.queue, out)

async def main(args):
    prompt = [int(t) for t in args[0].split(",")]
    sampler = Sampler(temperature=0.9, top_k=30, seed=int(args[1]))
    at = [int(t) for t in args[2].split(",")] if args[2] else []
    out = []
    for mode in ("loop", "own", "own slow", "steps"):
        ctx = Context()
        more = ctx.api.generate_more
        if mode == "own slow":
            ctx.api.generate_more = slow(more)
        ctx.fill_tokens(prompt)
        if mode == "steps":
            text = await by_steps(ctx, sampler, 16, at)
            again = await by_steps(ctx, sampler, 5)
        elif mode == "loop":  # checked by the loop itself
            text = await ctx.generate(sampler, MaxTokens(16) | EosTokens(at))
            again = await ctx.generate(sampler, MaxTokens(5))
        else:
            text = await ctx.generate(sampler, Own(16, at))
            again = await ctx.generate(sampler, Own(5))
        ctx.api.generate_more = more
        # and on from where it stopped: the context stays consistent
        out.append([ctx.tokens, text, again, ctx.kv_len, len(ctx.pages)])
        await ctx.release()
    return json.dumps(out)
"""
    + SLOW_READER
)


def test_context_generate_runs_ahead_with_the_per_step_tokens(eng):
    src = "import json\n" + CONTEXT
    launches = [(src, [PROMPT, str(seed), ""]) for seed in range(4)]
    events, _ = asyncio.run(run_all(eng, launches))
    tokens = [json.loads(result(ev))[3][0] for ev in events]
    # stopping at a token the loop does not know: the 4th generated one of each seed
    n = len(PROMPT.split(","))
    launches += [(src, [PROMPT, str(seed), str(t[n + 3])]) for seed, t in enumerate(tokens)]
    events, controller = asyncio.run(run_all(eng, launches))
    for i, ev in enumerate(events):
        loop, own, own_slow, steps = json.loads(result(ev))
        # the same tokens, text and forwarded length as one sample per token
        assert loop[:4] == steps[:4] and own[:4] == steps[:4] and own_slow[:4] == steps[:4], i
        # and the pages generate reserves with the prompt, less what the loop ran past
        assert own[4] == own_slow[4] == loop[4], i
        if i >= 4:
            assert len(steps[0]) < n + 16 + 5
    model = next(iter(controller.models.values()))
    model.resources.check_integrity()
    assert model.resources.referenced("kv") == 0


# ---------------------------------------------------------------------------- text-completion

# The built-in behind /v1/completions with its main replaced: each option set completed
# running ahead (its default), running ahead heard by a slow reader (each generate_more
# 10 ms late, so the loop runs on and the answers merge several tokens), and with one
# sample call per token (the reference).
COMPLETE = (
    """


async def main(args):
    out = []
    for case in json.loads(args[0]):
        opts = {**OPTIONS, **case}
        got = {}
        for mode in ("ahead", "slow", "steps"):
            px.send(json.dumps({"mode": mode}))
            ctx = Context()
            more = ctx.api.generate_more
            if mode == "slow":
                ctx.api.generate_more = slow(more)
            ctx.fill_tokens(opts["prompt"])
            got[mode] = await complete(ctx, opts, run_ahead=mode != "steps")
            ctx.api.generate_more = more
            await ctx.flush(keep_last=False)  # as chat does before it exports the KV
            got[mode]["ctx"] = [ctx.tokens, ctx.kv_len, len(ctx.pages)]
            await ctx.release()
        out.append(got)
    return json.dumps(out)
"""
    + SLOW_READER
)

JSON_ITEMS = r'\[\{"a":[12]\}(,\{"a":[12]\}){2,}\]'  # the third item repeats one
MODES = ("ahead", "slow", "steps")


def completion_cases(prompt: list[int], greedy: list[int]) -> list[dict]:
    """Option sets over ``prompt``; ``greedy``: its greedy continuation (stop tokens from
    it are sampled, and banned before ``min_tokens``)."""
    base = {"prompt": prompt, "max_tokens": 14, "temperature": 0}
    return [
        base,
        {**base, "temperature": 1.0, "top_k": 20, "seed": 5, "n": 2},
        {**base, "temperature": 0.8, "seed": 3, "repetition_penalty": 1.3,
         "frequency_penalty": 0.5, "presence_penalty": 0.2},
        {**base, "temperature": 0.7, "top_p": 0.9, "seed": 1, "logprobs": 3,
         "logit_bias": {"11": 3.0}},
        {**base, "stream": True, "stop": ["e", "a"], "max_tokens": 24},
        {**base, "ignore_eos": True, "stop_token_ids": greedy[3:5]},
        {**base, "ignore_eos": True, "min_tokens": 6, "stop_token_ids": greedy[3:5]},
        {**base, "temperature": 1.0, "seed": 2, "grammar": {"regex": "[0-9]{5}"},
         "stream": True},
        {**base, "temperature": 1.0, "seed": 4, "max_tokens": 40, "stream": True,
         "grammar": {"regex": JSON_ITEMS}, "stop_repeated_item": True},
        {**base, "temperature": 1.0, "seed": 9, "best_of": 3, "logprobs": 1},
        {**base, "stream": True, "max_tokens": 30, "logprobs": 2},
    ]  # fmt: skip


def completion_source() -> str:
    from pastry.inferlets import text_completion

    return Path(text_completion.__file__).read_text() + COMPLETE


def greedy_cases(eng) -> list[dict]:
    prompt = [int(t) for t in PROMPT.split(",")]
    first = [{"prompt": prompt, "max_tokens": 8, "temperature": 0}]
    events, _ = asyncio.run(run_all(eng, [(completion_source(), [json.dumps(first)])]))
    [got] = json.loads(result(events[0]))
    return completion_cases(prompt, got["steps"]["choices"][0]["tokens"])


def streamed(events) -> dict[str, list[tuple[dict, int]]]:
    """Per mode, per case: the deltas concatenated per choice index, and how many."""
    out: dict[str, list[tuple[dict, int]]] = {m: [] for m in MODES}
    mode = ""
    for ev in events[:-1]:
        m = json.loads(ev.text)
        if "mode" in m:
            mode = m["mode"]
            out[mode].append(({}, 0))
        else:
            texts, n = out[mode][-1]
            texts[m["index"]] = texts.get(m["index"], "") + m["delta"]
            out[mode][-1] = (texts, n + 1)
    return out


def plain(choice: dict) -> dict:
    """A choice without its log-probabilities (compared to a tolerance)."""
    return {k: v for k, v in choice.items() if k not in ("logprobs", "cumulative_logprob")}


def check_completions(events) -> list:
    """Every mode gave the reference's choices, usage and streamed text; the cases."""
    cases = json.loads(result(events))
    for i, got in enumerate(cases):
        ref = got["steps"]
        for mode in ("ahead", "slow"):
            choices = got[mode]["choices"]
            assert [plain(c) for c in choices] == [plain(c) for c in ref["choices"]], (i, mode)
            for c, r in zip(choices, ref["choices"], strict=True):
                assert (c["logprobs"] is None) == (r["logprobs"] is None)
                if r["logprobs"] is not None:
                    assert [e[0] for e in c["logprobs"]] == [e[0] for e in r["logprobs"]]
                    lps, ref_lps = ([e[1] for e in x["logprobs"]] for x in (c, r))
                    assert lps == pytest.approx(ref_lps, abs=1e-5)
            # the runs after the first find its prompt in the prefix cache
            assert got[mode]["ctx"] == ref["ctx"], (i, mode)  # what it leaves to export
            usage = {k: v for k, v in got[mode]["usage"].items() if k != "prompt_tokens_details"}
            assert usage == {k: v for k, v in ref["usage"].items() if k != "prompt_tokens_details"}
    texts = streamed(events)
    assert [t for t, _ in texts["ahead"]] == [t for t, _ in texts["steps"]]
    assert [t for t, _ in texts["slow"]] == [t for t, _ in texts["steps"]]
    return cases


def test_text_completion_runs_ahead_with_the_per_token_results(eng):
    cases = greedy_cases(eng)
    events, controller = asyncio.run(run_all(eng, [(completion_source(), [json.dumps(cases)])]))
    got = check_completions(events[0])
    finishes = [[c["finish_reason"] for c in g["ahead"]["choices"]] for g in got]
    assert finishes[5] == ["stop"] and finishes[6] == ["length"]  # the ban held
    repeated = got[8]["ahead"]["choices"][0]
    assert repeated["finish_reason"] == "stop" and repeated["text"].count("{") >= 2
    # the slow reader heard the 30 streamed tokens in fewer, merged messages
    texts = streamed(events[0])
    assert texts["slow"][-1][1] < texts["steps"][-1][1]
    res = next(iter(controller.models.values())).resources
    res.check_integrity()
    assert res.referenced("embed") == 0 and res.referenced("kv") == 0


def test_text_completion_runs_ahead_in_the_sandbox(eng):
    cases = greedy_cases(eng)
    trusted, boxed = trusted_and_sandboxed(eng, completion_source(), [json.dumps(cases)])
    boxed_cases, trusted_cases = check_completions(boxed), check_completions(trusted)
    for got, ref in zip(boxed_cases, trusted_cases, strict=True):  # logprobs: checked above
        assert {m: [plain(c) for c in got[m]["choices"]] for m in MODES} == {
            m: [plain(c) for c in ref[m]["choices"]] for m in MODES
        }


HEARD = """
import json
import pastry.sdk as px
from pastry.api import ApiError
from pastry.sdk import Context, MaxTokens, Sampler
from pastry.sdk.stop import StopCondition

class PerStep(StopCondition):
    def __init__(self, n):
        self.n = self.max_tokens = n
    def should_stop(self, tokens, text):
        return len(tokens) >= self.n

async def main(args):
    prompt = [int(t) for t in args[0].split(",")]
    errors, heard = [], []
    ctx = Context()
    ctx.fill_tokens(prompt)
    await ctx.generate(Sampler(), MaxTokens(1))  # the prompt forwarded, one token pending
    try:
        px.generate_more(ctx.queue)
    except ApiError as e:
        errors.append(str(e))

    def hear(tokens, logprobs):
        heard.append(list(tokens))
        if len(heard) == 1:  # the loop runs on meanwhile: a second one is refused
            try:
                px.generate(ctx.queue, ctx.pending[0], ctx.kv_len, 0, 1, list(ctx.pages), 4)
            except ApiError as e:
                errors.append(str(e))
        return len(heard) == 2  # enough: stop the loop

    tokens, finish, _ = await ctx.run_ahead(60, every=3, hear=hear)
    more = await ctx.generate(Sampler(), MaxTokens(6))  # on from where it stopped
    ref = Context()
    ref.fill_tokens(prompt)
    await ref.generate(Sampler(), PerStep(1 + len(tokens) + 6))
    return json.dumps({"errors": errors, "heard": heard, "tokens": tokens, "finish": finish,
                       "ctx": [ctx.tokens, ctx.kv_len], "ref": [ref.tokens, ref.kv_len]})
"""


def test_a_heard_loop_merges_stops_and_leaves_the_context_whole(eng):
    events, controller = asyncio.run(run_all(eng, [(HEARD, [PROMPT])]))
    out = json.loads(result(events[0]))
    no_loop, busy = out["errors"]
    assert "no generation loop runs on queue" in no_loop
    assert "a generation loop runs on queue" in busy
    heard = out["heard"]
    # two answers of at least 3 tokens, then the token of the step in flight at the stop
    assert out["finish"] == "cancelled" and [len(h) >= 3 for h in heard[:2]] == [True] * 2
    assert [len(h) for h in heard[2:]] == [1]
    assert [t for h in heard for t in h] == out["tokens"] and len(out["tokens"]) < 60
    assert out["ctx"] == out["ref"]  # the same tokens, every one but the last forwarded
    res = next(iter(controller.models.values())).resources
    res.check_integrity()
