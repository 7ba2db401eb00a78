"""The deliberate prompting strategies of the Pie paper's Table 2 (tree-, recursion-, graph-
and skeleton-of-thought) as built-in inferlets, on the tiny random checkpoint.

The model writes gibberish, so the structure comes from the programs (fixed branching and
depth, scores from log-probabilities; skeleton-of-thought's points from the model's list,
written under a grammar) and each test checks three properties:

- pages are shared, not copied: every ``Context.fork`` the strategy makes (recorded by a
  wrapper program around the built-in) gives the child the parent's own page handles for
  every full page and a private copy of the partial one; and the peak number of physical KV
  pages in use (sampled at every allocation) stays well below what the contexts alive at
  once would hold if each owned its pages;
- branches batch together: the scheduler's forward batches carry several items (about the
  branching factor), or exactly the count a lock-step schedule needs;
- every branch is greedy-consistent: with ``trace`` each piece of text comes with the tokens
  before it, and a plain program generating greedily from those tokens alone gives the same
  tokens (and the most likely first tokens where a strategy branches on them).
"""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict

import numpy as np
import pytest

from inferlet_util import load_engine, result, run_all, start
from pastry.control.events import Failed
from pastry.runtime.trusted import Program
from pastry.wire.tokenizer import Tokenizer

PS = 4  # KV page size of inferlet_util's pools

# Runs a built-in with Context.fork wrapped to record, for each fork, the parent's number of
# full pages, whether the child got exactly those handles, and whether the child's other
# pages overlap the parent's (they must not: the partial page is a private copy).
SPY = """
import json
from pastry.sdk.context import Context
from pastry.inferlets import {name} as target

async def main(args):
    orig = Context.fork
    log = []

    async def fork(self):
        child = await orig(self)
        full = self.kv_len // self.page_size
        log.append([full, child.pages[:full] == self.pages[:full],
                    bool(set(child.pages[full:]) & set(self.pages))])
        return child

    Context.fork = fork
    try:
        out = json.loads(await target.main(args))
    finally:
        Context.fork = orig
    out["_forks"] = log
    return json.dumps(out)
"""

# Greedy reference: the top-k next tokens after a context, or its greedy continuation of up
# to n tokens (stopping at, and leaving out, an end-of-sequence token), under a regular
# expression when one is given.
REF = """
import json
from pastry.sdk import Context, EosTokens, MaxTokens, Sampler
from pastry.sdk.grammar import Constraint, generate
from pastry.sdk.steps import next_dist

async def main(args):
    o = json.loads(args[0])
    ctx = Context()
    ctx.fill_tokens(o["context"])
    if o.get("top"):
        ids, _ = await next_dist(ctx, o["top"])
        return json.dumps(ids)
    if o.get("regex"):
        with Constraint(ctx, {"regex": o["regex"]}) as c:
            return json.dumps((await generate(ctx, c, o["n"])).tokens)
    eos = set(ctx.eos_ids)
    await ctx.generate(Sampler(), MaxTokens(o["n"]) | EosTokens(eos))
    return json.dumps([t for t in ctx.tokens[len(o["context"]):] if t not in eos])
"""


@pytest.fixture(scope="module")
def path(make_tiny):
    return make_tiny("llama")


@pytest.fixture(scope="module")
def tok(path):
    return Tokenizer.from_dir(path)


def prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 7000, n).tolist()


def run_spied(path, name: str, opts: dict):
    """Run built-in ``name`` alone under SPY: (result, scheduler stats, peak physical KV
    pages in use, fork log). Checks that everything was released."""
    eng = load_engine(path)

    async def go():
        controller, rt, handle = await start(eng)
        model = next(iter(controller.models.values()))
        res, peak = model.resources, [0]
        alloc = res.alloc

        def alloc_and_count(instance, kind, n):
            handles = alloc(instance, kind, n)
            if kind == "kv":
                peak[0] = max(peak[0], res.referenced("kv"))
            return handles

        res.alloc = alloc_and_count
        inst = rt.launch(Program.from_source("spy", SPY.format(name=name)), [json.dumps(opts)])
        events = [ev async for ev in inst.events()]
        await controller.close()
        handle.close()
        return events, model, peak[0]

    events, model, peak = asyncio.run(go())
    model.resources.check_integrity()
    assert model.resources.referenced("kv") == 0 and model.resources.referenced("embed") == 0
    out = json.loads(result(events))
    return out, model.scheduler.stats, peak, out.pop("_forks")


def references(path, queries: list[dict]) -> list:
    """REF for each query ({"context", "n"} or {"context", "top"}), run concurrently."""
    unique = {json.dumps(q, sort_keys=True): q for q in queries}
    events, _ = asyncio.run(run_all(load_engine(path), [(REF, [k]) for k in unique]))
    answers = {k: json.loads(result(ev)) for k, ev in zip(unique, events, strict=True)}
    return [answers[json.dumps(q, sort_keys=True)] for q in queries]


def check_forks_share(forks: list) -> int:
    """Every fork shared the parent's full page handles and copied only the partial page;
    returns the number of pages shared."""
    assert forks
    for _, same, overlap in forks:
        assert same and not overlap
    shared = sum(full for full, _, _ in forks)
    assert shared > 0
    return shared


def pages(n_tokens: int) -> int:
    return -(-n_tokens // PS)


# ---------------------------------------------------------------------------------- tree of thought


def test_tree_of_thought(path, tok):
    P = prompt(32, seed=1)
    opts = {
        "prompt_tokens": P,
        "breadth": 3,
        "keep": 2,
        "depth": 3,
        "thought_tokens": 6,
        "answer_tokens": 4,
        "trace": True,
        "score": "logprob",  # the model's evaluations: tests/test_agents_text.py
    }
    out, stats, peak, forks = run_spied(path, "tree_of_thought", opts)
    levels = out["levels"]
    assert [len(lv) for lv in levels] == [3, 6, 6]
    for i, lv in enumerate(levels):
        assert [s["kept"] for s in lv] == [True, True] + [False] * (len(lv) - 2)
        scores = [s["score"] for s in lv]
        assert scores == sorted(scores, reverse=True)  # best first
        # each kept state of the previous level (its first two) proposed three thoughts
        parents = sorted(s["parent"] for s in lv)
        assert parents == ([-1] * 3 if i == 0 else [0, 0, 0, 1, 1, 1])
    best = out["best"]
    assert best["tokens"][-1] == levels[-1][0]["tokens"]
    assert best["score"] == levels[-1][0]["score"]

    # (c) thought i of a state starts with the state's i-th most likely token and goes on
    # greedily; the answer is the greedy continuation of the best path.
    states = [s for lv in levels for s in lv]
    eos = set(tok.eos_token_ids)
    queries = [{"context": s["context"], "top": 3 + len(eos)} for s in states]
    queries += [{"context": s["context"] + s["tokens"][:1], "n": 5} for s in states]
    last = levels[-1][0]
    answer_ctx = last["context"] + last["tokens"] + tok.encode("\nAnswer:")
    queries.append({"context": answer_ctx, "n": 4})
    refs = references(path, queries)
    tops, conts, answer = refs[: len(states)], refs[len(states) : -1], refs[-1]
    siblings = defaultdict(list)
    for s, top in zip(states, tops, strict=True):
        siblings[json.dumps(s["context"])].append(
            (s["tokens"][0], [t for t in top if t not in eos][:3])
        )
    for group in siblings.values():
        assert sorted(first for first, _ in group) == sorted(group[0][1])
    for s, cont in zip(states, conts, strict=True):
        assert s["tokens"][1:] == cont
    assert best["answer_tokens"] == answer
    # every state's context is the prompt then its parent's thoughts
    assert all(s["context"][: len(P)] == P for s in states)

    # (a) shared pages: 2 + 2 * (2 + 2) forks; the last level's six states alone would hold
    # more than twice the pages that were ever in use at once.
    assert len(forks) == 2 + 2 * 2 * 2
    check_forks_share(forks)
    copies = sum(pages(len(s["context"]) + len(s["tokens"])) for s in levels[-1])
    assert peak * 2 < copies, (peak, copies)
    # (b) the proposals of a level decode together (3, then 6 per batch)
    assert stats.mean_batch > 3, stats


# ---------------------------------------------------------------------------------- recursion of thought


def test_recursion_of_thought(path, tok):
    """The sub-problems are the model's own: its greedy plan under the plan grammar,
    parsed; each is solved in its own context and only its answer comes back."""
    from pastry.inferlets.recursion_of_thought import parse_plan, plan_regex

    P = prompt(64, seed=2)
    chars, at = 10, 5
    opts = {
        "prompt_tokens": P,
        "problem": "What is 12 + 30?",
        "branch": 2,
        "min_branch": 2,  # the random model's plans: always two sub-problems
        "depth": 2,
        "question_chars": chars,
        "answer_tokens": at,
        "trace": True,
    }
    out, stats, peak, forks = run_spied(path, "recursion_of_thought", opts)
    assert out["problems"] == 7
    nodes, queue = [], [(out["tree"], 0)]
    while queue:
        node, level = queue.pop()
        nodes.append(node)
        assert len(node["subproblems"]) == (2 if level < 2 else 0)
        assert ("plan_tokens" in node) == (level < 2)
        queue += [(s, level + 1) for s in node["subproblems"]]
    root = out["tree"]
    assert root["question_tokens"] == tok.encode("What is 12 + 30?")
    assert out["answer"] == root["answer"]
    go, plan = tok.encode("\nProblem:"), tok.encode("\nSub-problems:\n")
    planned = [n for n in nodes if n["subproblems"]]
    for node in nodes:
        # a problem's context is the instructions, the problem, then its plan and each
        # sub-problem's answer, solved in its own context -- never the parent's context
        q = node["question_tokens"]
        head = P + go + q
        assert node["context"][: len(head)] == head
        if not node["subproblems"]:
            assert node["context"] == head + tok.encode("\nAnswer:")
            continue
        assert node["plan_context"] == head + plan
        asked = parse_plan(tok.decode(node["plan_tokens"]))
        assert [s["question"] for s in node["subproblems"]] == asked
        tail = node["plan_context"] + node["plan_tokens"]
        for i, sub in enumerate(node["subproblems"], start=1):
            assert sub["question_tokens"] == tok.encode(asked[i - 1])
            tail += tok.encode(f"\nSub-answer {i}:") + sub["answer_tokens"]
        assert node["context"] == tail + tok.encode("\nAnswer:")

    # (c) every plan is the greedy output under the grammar, every answer greedy
    regex = plan_regex(2, chars, 2)
    refs = references(
        path,
        [{"context": n["context"], "n": at} for n in nodes]
        + [
            {"context": n["plan_context"], "n": 2 * (chars + 4) + 2, "regex": regex}
            for n in planned
        ],
    )
    assert [n["answer_tokens"] for n in nodes] + [n["plan_tokens"] for n in planned] == refs

    # (a) every context forks the instructions: their 16 full pages are shared; the seven
    # problems' contexts alive together would hold far more pages than were ever in use.
    shared = check_forks_share(forks)
    assert shared >= 7 * len(P) // PS
    copies = sum(pages(len(n["context"])) for n in nodes)
    assert peak * 2 < copies, (peak, copies)
    # (b) sibling sub-problems decode together: the two level-1 plans in lock step, the four
    # leaves' answers, then the two level-1 answers, then the root's (a plan is one stream)
    kids = root["subproblems"]
    steps = len(root["plan_tokens"]) + max(len(k["plan_tokens"]) for k in kids) + 3 * at
    assert stats.forward_batches <= steps + 4, (stats, steps)


# ---------------------------------------------------------------------------------- graph of thought


def test_graph_of_thought(path, tok):
    P = prompt(32, seed=3)
    chunks = ["The cat sat.", "On the mat.", [500, 501, 502], "Then it left.", "The end."]
    opts = {
        "prompt_tokens": P,
        "chunks": chunks,
        "summary_tokens": 6,
        "merge_tokens": 6,
        "candidates": 2,
        "trace": True,
    }
    out, stats, peak, forks = run_spied(path, "graph_of_thought", opts)
    nodes = out["nodes"]
    gen = [n for n in nodes if n["op"] == "generate"]
    agg = [n for n in nodes if n["op"] == "aggregate"]
    assert len(gen) == 5 and len(agg) == 2 * 4  # 5 parts -> 3 -> 2 -> 1, two candidates each
    kept = [n for n in agg if n["kept"]]
    assert len(kept) == 4
    by_id = {n["id"]: n for n in nodes}
    for k in kept:  # KeepBest: the kept candidate scores at least as well as its sibling
        other = [n for n in agg if n["parents"] == k["parents"] and n is not k]
        assert len(other) == 1 and k["score"] >= other[0]["score"]
    # the merge rounds: (0,1) (2,3) | 4 -> (m01,m23) | 4 -> (m,4)
    gids = [n["id"] for n in gen]
    rounds = [k["parents"] for k in kept]
    assert rounds[:2] == [gids[:2], gids[2:4]]
    assert rounds[2] == [kept[0]["id"], kept[1]["id"]]
    assert rounds[3] == [kept[2]["id"], gids[4]]
    assert out["tokens"] == kept[-1]["tokens"]
    # an aggregation reads both parents' thoughts after the instructions
    for n in agg:
        a, b = (by_id[i]["tokens"] for i in n["parents"])
        want = P + tok.encode("\nSummary 1:") + a + tok.encode("\nSummary 2:") + b
        assert n["context"] == want + tok.encode("\nCombined:")
    for n, c in zip(gen, chunks, strict=True):
        part = c if isinstance(c, list) else tok.encode(c)
        assert n["context"] == P + tok.encode("\nText:") + part + tok.encode("\nSummary:")

    # (c) summaries are greedy; merge candidates start with the two most likely tokens and
    # go on greedily
    eos = set(tok.eos_token_ids)
    queries = [{"context": n["context"], "n": 6} for n in gen]
    queries += [{"context": n["context"], "top": 2 + len(eos)} for n in agg]
    queries += [{"context": n["context"] + n["tokens"][:1], "n": 5} for n in agg]
    refs = references(path, queries)
    assert [n["tokens"] for n in gen] == refs[:5]
    tops, conts = refs[5 : 5 + len(agg)], refs[5 + len(agg) :]
    for i in range(0, len(agg), 2):
        firsts = sorted(n["tokens"][0] for n in agg[i : i + 2])
        assert firsts == sorted([t for t in tops[i] if t not in eos][:2])
    assert [n["tokens"][1:] for n in agg] == conts

    # (a) 5 + 4 aggregation contexts fork the instructions, 4 candidates fork those
    assert len(forks) == 5 + 4 + 4
    check_forks_share(forks)
    # the five summaries' contexts alone would hold more than the peak in use
    copies = sum(pages(len(n["context"]) + len(n["tokens"])) for n in gen)
    assert peak * 1.5 < copies, (peak, copies)
    # (b) the five summaries, then the merges of a round, decode together
    assert stats.mean_batch > 2, stats


# ---------------------------------------------------------------------------------- skeleton of thought


def test_skeleton_of_thought(path, tok):
    """The points are the model's own: its greedy skeleton under the list grammar, parsed;
    every point it wrote is expanded."""
    from pastry.inferlets.skeleton_of_thought import parse_skeleton, skeleton_regex

    P = prompt(40, seed=4)
    points, least, chars, pt = 5, 3, 12, 10
    opts = {
        "prompt_tokens": P,
        "points": points,
        "min_points": least,
        "point_chars": chars,
        "point_tokens": pt,
        "trace": True,
    }
    out, stats, peak, forks = run_spied(path, "skeleton_of_thought", opts)
    ctxs = out["contexts"]
    assert ctxs["skeleton"] == P + tok.encode("\nSkeleton:\n")
    # (c) the skeleton is the model's greedy output under the grammar, and the points are
    # its complete lines
    regex = skeleton_regex(points, chars, least)
    (ref,) = references(
        path, [{"context": ctxs["skeleton"], "n": points * (chars + 4), "regex": regex}]
    )
    assert out["skeleton_tokens"] == ref
    text = tok.decode(out["skeleton_tokens"])
    heads = out["skeleton"]
    assert heads == parse_skeleton(text) and least <= len(heads) <= points
    assert len(out["points"]) == len(out["point_tokens"]) == len(heads)
    # every expansion sees the whole skeleton, and is greedy
    skeleton_ctx = ctxs["skeleton"] + out["skeleton_tokens"]
    for i, c in enumerate(ctxs["points"], start=1):
        assert c == skeleton_ctx + tok.encode(f"\nExpand point {i}:")
    refs = references(path, [{"context": c, "n": pt} for c in ctxs["points"]])
    assert out["point_tokens"] == refs
    assert all(len(t) == pt for t in out["point_tokens"]), "an end-of-sequence token came"

    # (a) the forks share the prompt and skeleton; the expansions' contexts would hold more
    # than twice the pages in use at the peak
    n = len(heads)
    assert len(forks) == n - 1
    assert check_forks_share(forks) == (n - 1) * ((len(skeleton_ctx) - 1) // PS)
    copies = sum(pages(len(c) + pt) for c in ctxs["points"])
    assert peak * 2 < copies, (peak, copies)
    # (b) at most one forward per skeleton token, then the expansions in lock step
    assert stats.forward_items <= len(out["skeleton_tokens"]) + 1 + n * pt
    assert stats.forward_batches <= len(out["skeleton_tokens"]) + pt + 3, stats


# ---------------------------------------------------------------------------------- arguments


@pytest.mark.parametrize(
    "name", ["tree_of_thought", "recursion_of_thought", "graph_of_thought", "skeleton_of_thought"]
)
def test_bad_arguments_fail_with_a_message(path, name):
    from pastry.inferlets import __file__ as pkg

    src = (__import__("pathlib").Path(pkg).parent / f"{name}.py").read_text()
    events, _ = asyncio.run(run_all(load_engine(path), [(src, [json.dumps({"bogus": 1})])]))
    end = events[0][-1]
    assert isinstance(end, Failed) and "unknown args ['bogus']" in end.error, end
