"""The generation techniques of the Pie paper's Table 2 as built-in inferlets, each checked by
its defining property on the tiny random checkpoint (whose text is gibberish, so nothing
here depends on what the model says):

- beam search: with ``expand = m`` and ``width = m ** (L - 1)`` it equals exhaustive search
  over the m^L sequences that take one of the top-m tokens at each step (scored with
  transformers), and width 1 is greedy;
- speculative decoding (n-gram prompt lookup): exactly greedy, in fewer forward calls than
  tokens on text that repeats itself, and exact when most drafts are rejected;
- Jacobi decoding: exactly greedy, never more forwards than tokens;
- watermarking: the detector's z-score separates watermarked from plain samples;
- output validation: candidate log-probabilities equal transformers' (1e-4, float32), and
  the greedy continuation ranks first among candidates that contain it.

"Greedy" is the engine's own greedy decoding through ``Context.generate`` (one token per
forward), which ``test_inferlets.py`` checks against transformers.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest
import torch

import pastry.inferlets
from engine_util import hf_model
from inferlet_util import load_engine, result, run_all

INFERLETS = Path(pastry.inferlets.__file__).parent

GREEDY = """
import json
from pastry.sdk import Context, MaxTokens, Sampler

async def main(args):
    opts = json.loads(args[0])
    ctx = Context()
    ctx.fill_tokens(opts["prompt_tokens"])
    await ctx.generate(Sampler(), MaxTokens(opts["max_tokens"]))
    return json.dumps(ctx.tokens[len(opts["prompt_tokens"]) :])
"""


def source(name: str) -> str:
    return (INFERLETS / f"{name}.py").read_text()


def run(path, launches, **engine_kw):
    """Run (program source or built-in name, options) pairs concurrently on a fresh engine;
    (parsed JSON results, scheduler stats). Checks that everything was released."""
    eng = load_engine(path, **engine_kw)
    progs = [(src if "\n" in src else source(src), [json.dumps(o)]) for src, o in launches]
    events, controller = asyncio.run(run_all(eng, progs))
    model = next(iter(controller.models.values()))
    model.resources.check_integrity()
    assert model.resources.referenced("kv") == 0 and model.resources.referenced("embed") == 0
    return [json.loads(result(ev)) for ev in events], model.scheduler.stats


def greedy(path, prompts, n):
    outs, _ = run(path, [(GREEDY, {"prompt_tokens": p, "max_tokens": n}) for p in prompts])
    return outs


@pytest.fixture(scope="module")
def path(make_tiny):
    return make_tiny("llama")


@pytest.fixture(scope="module")
def hf(path):
    return hf_model(path)


@pytest.fixture(scope="module")
def eos(path):
    return set(load_engine(path).info.eos_token_ids)


def random_prompts(n: int, length: int, seed: int, vocab: int = 7000) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, length).tolist() for _ in range(n)]


def seen_before(tokens: list[int], i: int) -> bool:
    """Whether the 3 tokens before position ``i`` occurred earlier (prompt lookup hits)."""
    return any(tokens[j : j + 3] == tokens[i - 3 : i] for j in range(i - 3))


@pytest.fixture(scope="module")
def looping_prompt(path):
    """A prompt whose greedy continuation repeats the prompt's own text (a greedy loop, which
    random models fall into): a random start plus the beginning of its greedy continuation,
    cut where at least 16 of the next 24 greedy tokens continue a 3-gram seen before."""
    starts = random_prompts(16, 6, seed=0)
    for start, cont in zip(starts, greedy(path, starts, 96), strict=True):
        tokens = start + cont
        for cut in range(len(start) + 8, len(tokens) - 24):
            if sum(seen_before(tokens, i) for i in range(cut, cut + 24)) >= 16:
                return tokens[:cut]
    raise AssertionError("no greedy loop found")


# ---------------------------------------------------------------------------------- beam search


def hf_logprobs(hf, seqs: list[list[int]]) -> torch.Tensor:
    """Next-token log-probabilities after every position, float32 [B, T, V] (equal lengths)."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor(seqs)).logits.float(), dim=-1)


def exhaustive(hf, prompt, m: int, length: int) -> list[tuple[list[int], float]]:
    """Every sequence of ``length`` tokens taking one of the top-m tokens at each step, with
    its summed log-probability, best first."""
    seqs: list[tuple[list[int], float]] = [([], 0.0)]
    for _ in range(length):
        lp = hf_logprobs(hf, [prompt + s for s, _ in seqs])[:, -1]
        top = lp.topk(m, dim=-1)
        seqs = [
            ([*s, int(t)], score + float(v))
            for (s, score), vs, ts in zip(seqs, top.values, top.indices, strict=True)
            for v, t in zip(vs, ts, strict=True)
        ]
    return sorted(seqs, key=lambda x: -x[1])


def test_beam_search_is_exhaustive_search_when_wide_enough(path, hf, eos):
    m, length = 3, 3
    width = m ** (length - 1)  # every prefix survives: the search is exhaustive
    prompt = random_prompts(1, 9, seed=1)[0]
    ref = exhaustive(hf, prompt, m, length)
    assert not any(eos.intersection(s) for s, _ in ref)  # no beam ends early
    (out,), stats = run(
        path,
        [
            (
                "beam_search",
                {"prompt_tokens": prompt, "width": width, "expand": m, "max_tokens": length},
            )
        ],
    )
    beams = out["beams"]
    assert [b["tokens"] for b in beams] == [s for s, _ in ref[:width]]
    np.testing.assert_allclose(
        [b["logprob"] for b in beams], [s for _, s in ref[:width]], atol=1e-4
    )
    # one forward per live beam and step (1, 3, 9), each step's beams in one batch
    assert (stats.forward_items, stats.forward_batches) == (1 + 3 + 9, 3)


def test_beam_search_of_width_one_is_greedy(path):
    prompt = random_prompts(1, 7, seed=2)[0]
    (want,) = greedy(path, [prompt], 10)
    (out,), _ = run(
        path, [("beam_search", {"prompt_tokens": prompt, "width": 1, "max_tokens": 10})]
    )
    assert [b["tokens"] for b in out["beams"]] == [want]


# ------------------------------------------------------------------------ speculative decoding


def test_speculative_ngram_is_greedy_in_fewer_forwards(path, looping_prompt):
    random = random_prompts(1, 6, seed=3)[0]
    repeated = random * 3  # lookup proposes drafts the model (mostly) rejects
    n = 24
    want = greedy(path, [looping_prompt, repeated, random], n)
    opts = {"max_tokens": n, "num_draft": 8}
    outs, stats = run(
        path,
        [
            ("speculative_ngram", {**opts, "prompt_tokens": p})
            for p in (looping_prompt, repeated, random)
        ],
    )
    assert [o["tokens"] for o in outs] == want
    loop, rejected, _ = outs
    assert loop["forwards"] <= n // 2, loop  # prompt lookup hits: several tokens per forward
    assert rejected["drafted"] > rejected["accepted"], rejected  # rejected drafts leave no trace
    assert all(o["forwards"] == n - o["accepted"] for o in outs)
    # the forward counts the inferlets report are the engine's
    assert stats.forward_items == sum(o["forwards"] for o in outs)


# ----------------------------------------------------------------------------- Jacobi decoding


def test_jacobi_is_greedy(path, looping_prompt):
    prompts = [*random_prompts(2, 6, seed=4), looping_prompt]
    n = 16
    want = greedy(path, prompts, n)
    launches = [("jacobi", {"prompt_tokens": p, "max_tokens": n, "block": 4}) for p in prompts]
    launches.append(("jacobi", {"prompt_tokens": prompts[0], "max_tokens": n, "block": 1}))
    outs, stats = run(path, launches)
    assert [o["tokens"] for o in outs] == [*want, want[0]]
    for o in outs:
        assert sum(o["committed"]) == n and min(o["committed"]) >= 1
        assert o["forwards"] == len(o["committed"]) <= n
    assert outs[-1]["forwards"] == n  # block 1: one token per forward, plain greedy
    assert stats.forward_items == sum(o["forwards"] for o in outs)


# -------------------------------------------------------------------------------- watermarking


def test_watermark_z_score_separates_watermarked_from_plain(path):
    from pastry.inferlets.watermark import detect

    n, count = 64, 20
    prompts = random_prompts(count, 4, seed=5)
    marked = [
        {"prompt_tokens": p, "max_tokens": n, "seed": i, "stop_at_eos": False}
        for i, p in enumerate(prompts)
    ]
    plain = [{**o, "delta": 0.0} for o in marked]  # same sampling, no bias
    launches = [("watermark", o) for o in [*marked, *plain, marked[0]]]
    outs, _ = run(path, launches, num_pages=1024)
    z_marked = [o["z"] for o in outs[:count]]
    z_plain = [o["z"] for o in outs[count : 2 * count]]
    assert all(len(o["tokens"]) == n for o in outs)
    assert outs[-1]["tokens"] == outs[0]["tokens"]  # seeded: reproducible
    # Thresholds: each watermarked sample z > 4 (expected ~8 at gamma 0.25, delta 2, high
    # entropy); each plain one z < 4 (P(z > 4) ~ 3e-5 under the null); the plain mean is
    # within 1 of 0 (its standard error is 1/sqrt(20) ~ 0.22).
    assert min(z_marked) > 4, z_marked
    assert max(z_plain) < 4, z_plain
    assert abs(np.mean(z_plain)) < 1, z_plain
    # the detector needs the key: the same texts under another key look plain
    z_other = [detect(o["tokens"], key=12345, gamma=0.25)["z"] for o in outs[:count]]
    assert max(z_other) < 4 and abs(np.mean(z_other)) < 1, z_other
    # detection through the inferlet's args agrees with the function
    (det,), _ = run(path, [("watermark", {"detect": outs[0]["tokens"]})])
    assert det["z"] == pytest.approx(z_marked[0]) and det["scored"] == n - 1


# --------------------------------------------------------------------------- output validation


def test_output_validation_matches_transformers(path, hf):
    prompt = random_prompts(1, 6, seed=6)[0]
    (cont,) = greedy(path, [prompt], 5)
    lp = hf_logprobs(hf, [prompt + cont])[0]
    second = int(lp[len(prompt) + 3].topk(2).indices[1])  # runner-up for the last token
    candidates = [
        *random_prompts(3, 5, seed=7),
        [*cont[:4], second],
        cont,
        cont[:2],
        random_prompts(1, 1, seed=8)[0],
    ]
    (out,), stats = run(
        path, [("output_validation", {"prompt_tokens": prompt, "candidate_tokens": candidates})]
    )
    want = [
        float(
            hf_logprobs(hf, [prompt + c])[0, len(prompt) - 1 : -1]
            .gather(1, torch.tensor(c)[:, None])
            .sum()
        )
        for c in candidates
    ]
    got = [s["logprob"] for s in out["scores"]]
    np.testing.assert_allclose(got, want, atol=1e-4)
    assert out["ranking"] == sorted(range(len(want)), key=lambda i: -want[i])
    full = [i for i, c in enumerate(candidates) if len(c) == 5]
    assert max(full, key=lambda i: got[i]) == candidates.index(cont)
    # prompt once, then every candidate in one forward, all in one batch
    assert (stats.forward_items, stats.forward_batches) == (1 + len(candidates), 2)


# ------------------------------------------------------------------------------- shared paths


def test_text_prompts_equal_token_prompts(path):
    from pastry.wire.tokenizer import Tokenizer

    info = load_engine(path).info
    tok = Tokenizer.from_json(info.tokenizer_json, info.chat_template, info.special_tokens)
    text = "The quick brown fox"
    ids = tok.encode(text, True)
    cases = [
        ("beam_search", {"width": 2, "max_tokens": 3}),
        ("speculative_ngram", {"max_tokens": 6}),
        ("jacobi", {"max_tokens": 6}),
        ("watermark", {"max_tokens": 6}),
        ("output_validation", {"candidates": [" jumps", " is"]}),
    ]
    by_text, _ = run(path, [(name, {**o, "prompt": text}) for name, o in cases])
    by_ids, _ = run(path, [(name, {**o, "prompt_tokens": ids}) for name, o in cases])
    assert by_text == by_ids


TRUNCATE = """
import json
from pastry.sdk import Context, MaxTokens, Sampler
from pastry.sdk.steps import truncate

async def main(args):
    opts = json.loads(args[0])
    ctx = Context()
    ctx.fill_tokens(opts["prompt_tokens"])
    child = await ctx.fork()
    shared_before = child.pages[1] == ctx.pages[1]
    await truncate(child, opts["keep"])   # into the second page, shared with the parent
    child.fill_tokens([opts["new"]])
    shared_after = child.pages[1] == ctx.pages[1]
    a = await child.generate(Sampler(), MaxTokens(4))
    b = await ctx.generate(Sampler(), MaxTokens(4))
    n = len(opts["prompt_tokens"])
    await child.release()
    await ctx.release()
    return json.dumps([shared_before, shared_after, child.tokens[opts["keep"] + 1 :], ctx.tokens[n:]])
"""


def test_truncate_copies_a_page_shared_with_a_fork(path):
    prompt = random_prompts(1, 10, seed=9)[0]  # page size 4: pages 0 and 1 are shared
    keep, new = 6, 123
    (out,), _ = run(path, [(TRUNCATE, {"prompt_tokens": prompt, "keep": keep, "new": new})])
    want = greedy(path, [[*prompt[:keep], new], prompt], 4)
    assert out == [True, False, *want]


HOLDER = """
import json
import pastry.sdk as px
from pastry.sdk import Context, MaxTokens, Sampler

async def main(args):
    opts = json.loads(args[0])
    go = px.subscribe("go")
    ctx = Context()
    ctx.fill_tokens(opts["prompt_tokens"])
    await ctx.flush()  # its full pages are in the prefix cache, and still its own
    px.store_set("held", "yes")
    await px.next_message(go)
    await ctx.generate(Sampler(), MaxTokens(4))
    await ctx.release()
    return json.dumps(ctx.tokens[len(opts["prompt_tokens"]) :])
"""

MASKER = """
import asyncio, json
import pastry.sdk as px
from pastry.api import ApiError
from pastry.sdk import Context, MaxTokens, Sampler
from pastry.sdk.steps import own_page

async def main(args):
    opts = json.loads(args[0])
    while opts["wait"] and px.store_get("held") is None:
        await asyncio.sleep(0.005)
    try:
        return await mask(opts)
    finally:
        if opts["wait"]:
            px.broadcast("go", "now")

async def mask(opts):
    prompt, hide = opts["prompt_tokens"], opts["hide"]
    ctx = Context()
    ctx.fill_tokens(prompt)
    await ctx.flush()
    mask = [i < hide for i in range(ctx.page_size)]
    refused = None
    old = page = ctx.pages[0]
    calls, again, more = [], page, []
    if opts["wait"]:  # page 0 came from the holder through the prefix cache
        try:
            await px.mask_kvpage(ctx.queue, page, mask)
        except ApiError as e:
            refused = str(e)
        page, calls = own_page(ctx, 0)
        again, more = own_page(ctx, 0)
    await asyncio.gather(*calls, px.mask_kvpage(ctx.queue, page, mask))
    await ctx.generate(Sampler(), MaxTokens(4))
    await ctx.release()
    return json.dumps([refused, ctx.cached_tokens, page != old, again == page and not more,
                       ctx.tokens[len(prompt) :]])
"""


def test_own_page_copies_a_page_another_inferlet_reads_through_the_prefix_cache(path):
    """A page that came from the prefix cache while its first inferlet still reads it
    cannot be masked (the server refuses); ``own_page`` copies it (once) and the copy is
    masked: the other inferlet's tokens are unchanged, and the masked generation equals the
    same mask written in place by the masker alone (no one else reads its page)."""
    prompt = random_prompts(1, 10, seed=11)[0]  # page size 4: pages 0 and 1 full
    hide = 3
    (held, shared), _ = run(
        path,
        [
            (HOLDER, {"prompt_tokens": prompt[:9]}),
            (MASKER, {"prompt_tokens": prompt, "hide": hide, "wait": True}),
        ],
    )
    [(alone_refused, alone_cached, _, _, alone)], _ = run(
        path, [(MASKER, {"prompt_tokens": prompt, "hide": hide, "wait": False})]
    )
    refused, cached, copied, stable, tokens = shared
    assert refused is not None and "shared through the prefix cache" in refused
    assert cached == 8 and copied and stable  # pages 0 and 1 from the cache; page 0 copied
    assert alone_refused is None and alone_cached == 0
    assert tokens == alone
    assert held == greedy(path, [prompt[:9]], 4)[0]  # the holder did not see the mask
