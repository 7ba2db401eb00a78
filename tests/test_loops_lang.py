"""Run-ahead generation for ``pastry.lang``'s ``gen`` and SGLang's ``/generate`` (issue 28,
point 1): :func:`pastry.lang.generation.generate` runs the tokens after the first as one
loop in the control layer and gives what one ``sample`` per token gives — the tokens,
text, finish reason, log-probabilities, streamed text and the context it leaves — with a
fast and a slow reader (answers merged), trusted and sandboxed."""

from __future__ import annotations

import asyncio
import json

import pytest

from inferlet_util import SLOW_READER, load_engine, result, run_all, trusted_and_sandboxed

GENERATE = (
    """
import asyncio
import json
from pastry.lang.expr import SamplingParams
from pastry.lang.generation import generate
from pastry.sdk import Context

async def main(args):
    prompt = [int(t) for t in args[0].split(",")]
    out = []
    for case in json.loads(args[1]):
        stream = case.pop("stream", False)
        case["logit_bias"] = tuple(tuple(b) for b in case.get("logit_bias", ()))
        params = SamplingParams(**{k: tuple(v) if isinstance(v, list) else v
                                   for k, v in case.items()})
        got = {}
        for mode in ("ahead", "slow", "steps"):
            ctx = Context()
            more = ctx.api.generate_more
            if mode == "slow":
                ctx.api.generate_more = slow(more)
            ctx.fill_tokens(prompt)
            pieces = []
            g = await generate(ctx, params, pieces.append if stream else None,
                               run_ahead=mode != "steps")
            ctx.api.generate_more = more
            got[mode] = {"text": g.text, "tokens": g.tokens, "reason": g.finish_reason,
                         "logprobs": g.logprobs, "tops": g.top_logprobs,
                         "pieces": len(pieces), "streamed": "".join(pieces),
                         "ctx": [ctx.tokens, ctx.kv_len, ctx.pending]}
            await ctx.release()
        out.append(got)
    return json.dumps(out)
"""
    + SLOW_READER
)

PROMPT = "5,17,42,8,99,3,250,31,7"


def cases(greedy: list[int]) -> list[dict]:
    base = {"max_new_tokens": 14, "temperature": 0}
    return [
        base,
        {**base, "temperature": 1.0, "top_k": 20, "seed": 5},
        {**base, "temperature": 0.8, "seed": 3, "repetition_penalty": 1.3,
         "frequency_penalty": 0.5, "presence_penalty": 0.2},
        {**base, "temperature": 0.7, "top_p": 0.9, "seed": 1, "return_logprob": True,
         "top_logprobs_num": 3, "logit_bias": [[11, 3.0]]},
        {**base, "stream": True, "stop": ["e", "a"], "max_new_tokens": 24},
        {**base, "ignore_eos": True, "stop_token_ids": greedy[3:5]},
        {**base, "ignore_eos": True, "min_new_tokens": 6, "stop_token_ids": greedy[3:5]},
        {**base, "temperature": 1.0, "seed": 2, "regex": "[0-9]{5}", "return_logprob": True},
        {**base, "stream": True, "max_new_tokens": 30},
    ]  # fmt: skip


@pytest.fixture(scope="module")
def eng(make_tiny):
    return load_engine(make_tiny("llama"), num_pages=256)


def greedy(eng) -> list[int]:
    first = json.dumps([{"max_new_tokens": 8, "temperature": 0}])
    events, _ = asyncio.run(run_all(eng, [(GENERATE, [PROMPT, first])]))
    return json.loads(result(events[0]))[0]["steps"]["tokens"]


def plain(g: dict) -> dict:
    """A generation without its log-probabilities (compared to a tolerance) and the number
    of streamed pieces (fewer when answers merge)."""
    return {k: v for k, v in g.items() if k not in ("logprobs", "tops", "pieces")}


def check(events) -> list:
    """Both run-ahead modes gave the per-step reference's generations; the cases."""
    got = json.loads(result(events))
    for i, modes in enumerate(got):
        ref = modes["steps"]
        for mode in ("ahead", "slow"):
            g = modes[mode]
            assert plain(g) == plain(ref), (i, mode)
            assert (g["logprobs"] is None) == (ref["logprobs"] is None), (i, mode)
            if ref["logprobs"] is not None:
                assert [t for _, t in g["logprobs"]] == [t for _, t in ref["logprobs"]]
                lps, ref_lps = ([x for x, _ in h["logprobs"]] for h in (g, ref))
                assert lps == pytest.approx(ref_lps, abs=1e-5)
                assert [[t for _, t in r] for r in g["tops"]] == [
                    [t for _, t in r] for r in ref["tops"]
                ]
    return got


def test_gen_runs_ahead_with_the_per_token_results(eng):
    events, controller = asyncio.run(
        run_all(eng, [(GENERATE, [PROMPT, json.dumps(cases(greedy(eng)))])])
    )
    got = check(events[0])
    reasons = [g["ahead"]["reason"]["type"] for g in got]
    assert reasons[5] == "stop" and reasons[6] == "length"  # the ban held
    assert reasons[4] == "stop" and got[4]["ahead"]["streamed"] == got[4]["ahead"]["text"]
    assert got[-1]["slow"]["pieces"] < got[-1]["steps"]["pieces"]  # merged answers
    res = next(iter(controller.models.values())).resources
    res.check_integrity()
    assert res.referenced("embed") == 0 and res.referenced("kv") == 0


def test_gen_runs_ahead_in_the_sandbox(eng):
    args = [PROMPT, json.dumps(cases(greedy(eng)))]
    trusted, boxed = trusted_and_sandboxed(eng, GENERATE, args)
    got, ref = check(boxed), check(trusted)
    assert [[plain(g[m]) for m in g] for g in got] == [[plain(g[m]) for m in g] for g in ref]
