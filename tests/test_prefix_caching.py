"""The automatic prefix cache end to end: inferlets on the trusted and sandboxed runners over
a tiny checkpoint. Only canonical K/V is ever shared; every built-in gives the same greedy
output with the cache on and off; cached pages go before programs under memory pressure;
prefills wait for pages; the OpenAI endpoints report the cached prompt tokens."""

from __future__ import annotations

import asyncio
import contextlib
import json
from contextlib import asynccontextmanager
from pathlib import Path

import numpy as np
import pytest

import pastry.inferlets
from inferlet_util import load_engine, result
from pastry.control.controller import Controller
from pastry.control.events import Failed, Finished
from pastry.control.users import LOCAL
from pastry.runtime.trusted import Program, TrustedRuntime
from pastry.wire.handle import InProcessEngine

INFERLETS = Path(pastry.inferlets.__file__).parent


@asynccontextmanager
async def serving(engine, **kw):
    """(controller, runtime, model) over ``engine``; checks the page table at the end."""
    handle = InProcessEngine(engine)
    controller = Controller([handle], **kw)
    model = next(iter(controller.models.values()))
    try:
        yield controller, TrustedRuntime(controller), model
        model.resources.check_integrity()
    finally:
        await controller.close()
        handle.close()


async def events_of(inst) -> list:
    return [ev async for ev in inst.events()]


async def run_one(rt, source: str | Program, *args: str) -> str:
    prog = source if isinstance(source, Program) else Program.from_source("t", source)
    return result(await events_of(rt.launch(prog, list(args))))


@pytest.fixture(scope="module")
def ckpt(make_tiny):
    return make_tiny("llama")


@pytest.fixture(scope="module")
def eng(ckpt):
    return load_engine(ckpt, num_pages=256)


def prompt(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 500, n).tolist()


# ------------------------------------------------------------------------------ canonical KV

# Writes ``tokens`` into fresh pages with low-level calls, in the way the first argument
# names, then releases them (a certified page would now go to the cache).
WRITER = """
import json
import pastry.sdk as px

async def main(args):
    way, tokens = args[0], json.loads(args[1])
    q = px.create_queue(px.available_models()[0])
    ps, n = px.get_kv_page_size(q), len(tokens)
    pages = px.alloc_kvpages(q, -(-n // ps))
    emb = px.alloc_embeds(q, n)
    start = 3 if way == "shifted positions" else 0
    await px.embed_txt(q, tokens, list(range(start, start + n)), emb)
    if way == "non-text embeddings":  # inputs a forward wrote, not embed_txt
        await px.forward(q, [], 0, emb, [], 0, emb)
    if way == "adapter":
        await px.forward_with_adapter(q, "a", [], 0, emb, pages, 0, [])
    elif way == "custom mask":  # even one that equals the causal mask
        await px.forward(q, [], 0, emb, pages, 0, [], [[j <= i for j in range(n)] for i in range(n)])
    else:
        await px.forward(q, [], 0, emb, pages, 0, [])
    if way == "masked afterwards":
        await px.mask_kvpage(q, pages[0], [i == 0 for i in range(ps)])
    await px.dealloc_kvpages(q, pages)
    return "written"
"""

# Prefills ``tokens`` + one more through the cache; how many came from it, and the greedy
# next token.
READER = """
import json
import pastry.sdk as px

async def main(args):
    tokens = json.loads(args[0])
    q = px.create_queue(px.available_models()[0])
    [out] = px.alloc_embeds(q, 1)
    pages, cached = px.prefill(q, tokens, 0, [], [out])
    tok = await px.sample(q, out)
    return json.dumps({"cached": await cached, "pages": len(pages), "next": tok})
"""

WAYS = [
    "plain",
    "custom mask",
    "adapter",
    "shifted positions",
    "non-text embeddings",
    "masked afterwards",
]


@pytest.fixture(scope="module")
def lora_engine(request, make_tiny):
    try:
        adapters = request.getfixturevalue("adapters")
    except pytest.FixtureLookupError:
        pytest.skip("the adapters fixture (test_lora.py) is not available")
    _, dirs = adapters("llama")
    eng = load_engine(make_tiny("llama"), num_pages=256)
    eng.load_adapter(next(iter(dirs.values())), "a")
    return eng


with contextlib.suppress(pytest.skip.Exception):  # peft is not installed
    from test_lora import adapters  # noqa: F401  (the fixture that writes PEFT adapters)


@pytest.mark.parametrize("way", WAYS)
def test_the_cache_never_returns_pages_that_are_not_a_plain_causal_prefill(lora_engine, way):
    tokens = prompt(1, 12)  # three full pages of 4

    async def go():
        async with serving(lora_engine) as (_, rt, model):
            assert await run_one(rt, WRITER, way, json.dumps(tokens)) == "written"
            cache = model.resources.cache
            held = cache.match(tokens, touch=False, namespace=LOCAL).length
            got = json.loads(await run_one(rt, READER, json.dumps([*tokens, 7])))
            return held, got

    held, got = asyncio.run(go())
    if way == "plain":
        assert held == 12 and got["cached"] == 12  # the positive control
    else:
        assert held == 0 and got["cached"] == 0
    assert got["pages"] == 4


def test_prefill_reuses_prompts_and_outputs_and_equals_computing_them(eng):
    """A context's prompt *and* generated tokens are cached when it is released; a later
    prefill of them takes the cached pages and continues exactly as a fresh computation."""
    src = """
import json
from pastry.sdk import Context, MaxTokens, Sampler

async def main(args):
    ctx = Context()
    ctx.fill_tokens(json.loads(args[0]))
    await ctx.generate(Sampler(), MaxTokens(int(args[1])))
    out = {"tokens": ctx.tokens, "cached": ctx.cached_tokens}
    await ctx.release()
    return json.dumps(out)
"""
    tokens = prompt(2, 21)

    async def go(cache: bool):
        async with serving(eng, prefix_cache=cache) as (_, rt, model):
            first = json.loads(await run_one(rt, src, json.dumps(tokens), "6"))
            # the first run's prompt and output, two tokens more: generated tokens are reused
            again = json.loads(await run_one(rt, src, json.dumps(first["tokens"][:-1]), "8"))
            return first, again, model.prefiller.stats

    (f1, a1, stats), (f0, a0, _) = asyncio.run(go(True)), asyncio.run(go(False))
    assert f1["tokens"] == f0["tokens"] and a1["tokens"] == a0["tokens"]
    assert f1["cached"] == 0 and f0["cached"] == a0["cached"] == 0
    # 21 + 5 forwarded tokens cached (the 6th generated token was never forwarded); the
    # new prefill of 26 tokens must compute its last one: 24 from the cache (six pages)
    assert a1["cached"] == 24
    assert stats.cached_tokens == 24 and stats.prefills == 2


# ------------------------------------------------------------------------------ the built-ins


def builtin_launches(tool: dict | None, topic: str) -> dict[str, list[dict]]:
    """One run of every built-in (a list of launches run together), greedy or seeded."""
    p = prompt(3, 14)
    return {
        "text_completion": [{"prompt": p, "max_tokens": 6, "temperature": 0, "n": 2}],
        "chat": [
            {
                "messages": [{"role": "user", "content": "Hi there"}],
                "max_tokens": 6,
                "temperature": 0,
            }
        ],
        "beam_search": [{"prompt": p, "width": 2, "max_tokens": 4}],
        "speculative_ngram": [{"prompt": p + p[:6], "max_tokens": 8}],
        "jacobi": [{"prompt": p, "max_tokens": 8}],
        "watermark": [{"prompt": p, "max_tokens": 6, "seed": 3}],
        "output_validation": [{"prompt": p, "candidates": [" jumps", " is"]}],
        "constrained": [{"prompt": p, "grammar": {"regex": "[0-9]{3}"}, "max_tokens": 8}],
        "prefix_cache": [{"prefix": p, "prompt": p[:5], "max_tokens": 5}],
        "modular_cache": [
            {
                "modules": [{"name": "sys", "content": p[:6]}, {"name": "doc", "content": p[6:]}],
                "prompt": p[:3],
                "max_tokens": 5,
            }
        ],
        "attention_sink": [{"prompt": p, "window": 8, "max_tokens": 10}],
        "windowed_attention": [{"prompt": p, "window": 8, "max_tokens": 10}],
        "hierarchical_attention": [
            {
                "sections": [{"header": p[:2], "paragraphs": [p[2:5], p[5:8]]}],
                "prompt": p[8:11],
                "max_tokens": 5,
            }
        ],
        "tree_of_thought": [
            {"prompt": p, "breadth": 2, "keep": 1, "depth": 2, "thought_tokens": 3}
        ],
        "graph_of_thought": [
            {"prompt": p[:4], "chunks": [p[4:9], p[9:]], "summary_tokens": 3, "merge_tokens": 3}
        ],
        "recursion_of_thought": [
            {
                "prompt": p[:4],
                "problem": p[4:],
                "branch": 2,
                "depth": 2,
                "question_chars": 4,
                "answer_tokens": 3,
            }
        ],
        "sglang_generate": [
            {
                "input_ids": p,
                "sampling_params": {"max_new_tokens": 6, "temperature": 0, "n": 2},
                "return_logprob": True,
                "top_logprobs_num": 2,
            }
        ],
        "skeleton_of_thought": [{"prompt": p, "points": 2, "point_chars": 6, "point_tokens": 4}],
        "react": [
            {
                "question": "Weather in Paris?",
                "tools": [tool] if tool else [],
                "tool_choice": "required" if tool else "auto",
                "max_steps": 2,
                "thought_tokens": 4,
                "answer_tokens": 3,
            }
        ],
        "codeact": [
            {"question": "Compute 6 * 7.", "max_steps": 2, "code_tokens": 4, "answer_tokens": 3}
        ],
        "swarm": [
            {
                "role": "coordinator",
                "topic": topic,
                "task": p[:4],
                "workers": 2,
                "rounds": 2,
                "summary_tokens": 3,
            },
            {"role": "worker", "topic": topic, "name": "w0", "persona": p[4:7], "answer_tokens": 3},
            {
                "role": "worker",
                "topic": topic,
                "name": "w1",
                "persona": p[7:10],
                "answer_tokens": 3,
            },
        ],
    }


@pytest.fixture
def tool_server():
    """An HTTP tool for ``react`` (tests/agents_util.py)."""
    from agents_util import ToolServer

    server = ToolServer({"weather": lambda a: f"Sunny in {a.get('city')}."})
    yield server
    server.close()


def test_every_builtin_gives_the_same_greedy_output_with_the_cache_on_and_off(ckpt, tool_server):
    server = tool_server
    names = sorted(p.stem for p in INFERLETS.glob("*.py") if p.stem != "__init__")
    assert sorted(builtin_launches(None, "")) == names  # a new built-in needs a line here

    async def run(cache: bool, rounds: int):
        """Every built-in ``rounds`` times in turn on one server; results per round."""
        engine = load_engine(ckpt, num_pages=512)
        out = []
        async with serving(engine, prefix_cache=cache, http_allow=["127.0.0.1"]) as (
            _,
            rt,
            model,
        ):
            for r in range(rounds):
                tool = server.tool("weather", "The weather", {"city": {"type": "string"}})
                launches = builtin_launches(tool, f"swarm-{r}")
                done = {}
                for name in names:
                    prog = Program.from_source(name, (INFERLETS / f"{name}.py").read_text())
                    insts = [rt.launch(prog, [json.dumps(o)]) for o in launches[name]]
                    done[name] = [result(e) for e in await asyncio.gather(*map(events_of, insts))]
                out.append(done)
            return out, model.prefiller.stats

    def same(a: list[str], b: list[str]) -> bool:
        """Equal results (tokens, text) but for the cached-token counts, which the cache
        changes, and scores (log-probabilities), equal to float rounding: K/V reused from
        another batch were computed in a matrix product of another shape."""

        def parse(text: str):
            out = json.loads(text) if text and text[0] in "{[" else text
            if isinstance(out, dict) and isinstance(out.get("usage"), dict):
                out["usage"].pop("prompt_tokens_details", None)
            if isinstance(out, dict):  # the agents' counts of what came from the cache
                out.pop("cached_tokens", None)
                out.pop("forwarded", None)
                for step in out.get("steps") or ():  # react's tool latency
                    if isinstance(step, dict):
                        step.pop("seconds", None)
            for item in out if isinstance(out, list) else ():  # sglang-generate's meta_info
                if isinstance(item, dict) and isinstance(item.get("meta_info"), dict):
                    item["meta_info"].pop("cached_tokens", None)
            return out

        def approx(x):
            if isinstance(x, float):
                return pytest.approx(x, rel=1e-5)
            if isinstance(x, dict):
                return {k: approx(v) for k, v in x.items()}
            if isinstance(x, list):
                return [approx(v) for v in x]
            return x

        return [parse(x) for x in a] == approx([parse(x) for x in b])

    # Two rounds each: what a built-in keeps across runs (explicit exports) is the same
    off, _ = asyncio.run(run(False, 2))
    on, stats = asyncio.run(run(True, 2))
    for name in names:
        for r in range(2):
            assert same(on[r][name], off[r][name]), (name, r, on[r][name], off[r][name])
    assert stats.cached_tokens > 0.3 * stats.tokens, stats  # the second round hit


# ------------------------------------------------------------------------------ the API


def test_prefill_from_trusted_and_sandboxed_inferlets(eng):
    pytest.importorskip("wasmtime")
    from pastry.runtime import build_pyrt
    from pastry.runtime.wasm import WasmSandbox, sandboxed_program

    try:
        build_pyrt.build()
    except build_pyrt.BuildError as e:
        pytest.skip(f"cannot build the Python runtime component: {e}")
    box = WasmSandbox()
    tokens = prompt(4, 19)
    trusted = Program.from_source("t", READER)
    boxed = sandboxed_program("s", READER, box=box)

    async def go():
        async with serving(eng) as (_, rt, _model):
            arg = json.dumps(tokens)
            first = await run_one(rt, trusted, arg)
            return [first] + [json.loads(await run_one(rt, p, arg)) for p in (boxed, trusted)]

    first, boxed_run, trusted_run = asyncio.run(go())
    first = json.loads(first)
    assert first["cached"] == 0 and first["pages"] == 5
    # the READER never released its pages: they went to the cache when it ended. Of the 18
    # tokens that may come from it (the 19th is computed for its output), the last two sit
    # in the page the prefill ends in: computed again rather than copied (a copy and a mask
    # of one page would take two batches)
    assert boxed_run == trusted_run == {"cached": 16, "pages": 5, "next": first["next"]}


def test_prefill_rejects_bad_arguments(eng):
    src = """
import pastry.sdk as px

async def main(args):
    q = px.create_queue(px.available_models()[0])
    emb = px.alloc_embeds(q, 4)
    errors = []
    for call in [
        lambda: px.prefill(q, [1, 2], 2, [], []),
        lambda: px.prefill(q, [1, 2, 3], 0, [], emb),
        lambda: px.prefill(q, [1, 2, 3], 1, [], []),
        lambda: px.prefill(q, [1, 2, 3], 0, [77], []),
    ]:
        try:
            call()
        except px.ApiError as e:
            errors.append(str(e))
    return "\\n".join(errors)
"""

    async def go():
        async with serving(eng) as (_, rt, _):
            return (await run_one(rt, src)).splitlines()

    errors = asyncio.run(go())
    assert len(errors) == 4
    assert "nothing is new" in errors[0]
    assert "4 output embeds for 3 new tokens" in errors[1]
    assert "cannot hold the context's 1 tokens" in errors[2]
    assert "kv page handle 77" in errors[3]


# Prefills ``tokens`` through the cache, reports, waits for a message, then masks its first
# page: allowed only when no other inferlet uses that page.
MASKER = """
import json
import pastry.sdk as px

async def main(args):
    tokens = json.loads(args[0])
    q = px.create_queue(px.available_models()[0])
    pages, cached = px.prefill(q, tokens, 0, [], [])
    px.send(str(await cached))
    await px.receive()
    try:
        await px.mask_kvpage(q, pages[0], [True] * px.get_kv_page_size(q))
        return "masked"
    except px.ApiError as e:
        return "refused: " + str(e)
"""


def test_a_shared_page_is_never_written_but_its_only_user_may(eng):
    tokens = prompt(5, 16)

    async def go():
        async with serving(eng) as (_, rt, model):
            prog = Program.from_source("m", MASKER)
            a = rt.launch(prog, [json.dumps(tokens)])
            first = await anext(a.events())
            b = rt.launch(prog, [json.dumps(tokens)])
            second = await anext(b.events())
            b.send("go")  # a still reads page 0 too
            refused = result(await events_of(b))
            a.send("go")  # a is now its only user
            masked = result(await events_of(a))
            left = model.resources.cache.match(tokens, touch=False, namespace=LOCAL).length
            return first.text, second.text, refused, masked, left

    first, second, refused, masked, left = asyncio.run(go())
    assert (first, second) == ("0", "16")  # b shared a's pages (inserted when prefilled)
    assert refused.startswith("refused: ") and "shared through the prefix cache" in refused
    assert masked == "masked"
    assert left == 0  # the masked page and everything after it left the cache


# ------------------------------------------------------------------------------ memory


HOLDER = """
import pastry.sdk as px

async def main(args):
    q = px.create_queue(px.available_models()[0])
    pages = px.alloc_kvpages(q, int(args[0]))
    px.send("holding")
    await px.receive()
    return str(len(pages))
"""

FILLER = """
import json
from pastry.sdk import Context, MaxTokens, Sampler

async def main(args):
    ctx = Context()
    ctx.fill_tokens(json.loads(args[0]))
    await ctx.generate(Sampler(), MaxTokens(2))
    return "done"
"""


def test_cached_pages_are_evicted_before_any_inferlet_is_terminated(ckpt):
    eng = load_engine(ckpt, num_pages=40)  # pages of 4 tokens

    async def go():
        async with serving(eng) as (_, rt, model):
            res = model.resources
            for seed in range(4):  # 4 x 8 pages of prompts end up cached
                assert await run_one(rt, FILLER, json.dumps(prompt(10 + seed, 30))) == "done"
            cached = res.cache.cached_pages
            # 30 pages: there are only 8 free, so cached pages make way (LRU first)
            first = rt.launch(Program.from_source("h", HOLDER), ["30"])
            assert (await anext(first.events())).text == "holding"
            after = res.cache.cached_pages, dict(res.cache_events)
            # 12 more: 2 free and 8 evictable; the FCFS termination policy ends the newest
            second = rt.launch(Program.from_source("h", HOLDER), ["12"])
            second_end = (await events_of(second))[-1]
            first.send("go")
            first_end = (await events_of(first))[-1]
            return cached, after, second_end, first_end, res.cache.cached_pages

    cached, (kept, events), second_end, first_end, left = asyncio.run(go())
    assert cached == 32
    # 22 were short: the three least recently used prompts (whole leaves of 8 pages) went
    assert events["evicted"] == 24 and kept == 8
    assert isinstance(second_end, Failed) and "FCFS policy" in second_end.error
    assert "12 KV pages" in second_end.error and left == 0  # evicted everything first
    assert isinstance(first_end, Finished) and first_end.result == "30"


def test_prefills_wait_for_pages_instead_of_ending_programs(ckpt):
    """Eight prompts of 41 tokens (11 pages each) at once on 30 pages: without admission
    control the termination policy would end programs; instead the prefills wait."""
    eng = load_engine(ckpt, num_pages=30)

    async def go(admission):
        async with serving(eng) as (_, rt, model):
            prog = Program.from_source("f", FILLER)
            insts = [rt.launch(prog, [json.dumps(prompt(20 + i, 41))]) for i in range(8)]
            ends = [e[-1] for e in await asyncio.gather(*map(events_of, insts))]
            return ends, model.prefiller.stats

    ends, stats = asyncio.run(go(None))
    assert all(isinstance(e, Finished) for e in ends), ends
    assert stats.deferred > 0 and stats.prefills == 8


# ------------------------------------------------------------------------------ OpenAI


def test_openai_reports_cached_prompt_tokens(ckpt, tmp_path):
    import openai

    from server_util import integrity, running_server

    messages = [{"role": "user", "content": "What is the capital of France? " * 3}]

    def turns(url):
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        model = client.models.list().data[0].id
        kw = dict(model=model, max_tokens=6, temperature=0)
        first = client.chat.completions.create(messages=messages, **kw)
        reply = {"role": "assistant", "content": first.choices[0].message.content}
        again = [*messages, reply, {"role": "user", "content": "And of Spain?"}]
        second = client.chat.completions.create(messages=again, **kw)
        prompt_text = "Once upon a time, " * 6
        c1 = client.completions.create(prompt=prompt_text, **kw)
        c2 = client.completions.create(prompt=prompt_text, **kw)
        return [r.usage for r in (first, second, c1, c2)], [
            first.choices[0].message.content,
            second.choices[0].message.content,
            c1.choices[0].text,
            c2.choices[0].text,
        ]

    with running_server(ckpt, tmp_path / "on") as (url, server):
        on, texts_on = turns(url)
        assert integrity(server) == (0, 0)
    with running_server(ckpt, tmp_path / "off", prefix_cache=False) as (url, server):
        off, texts_off = turns(url)
    assert texts_on == texts_off
    cached = [u.prompt_tokens_details.cached_tokens for u in on]
    assert cached[0] == 0 and cached[2] <= 1  # (at most the BOS the chat also began with)
    assert cached[1] >= 16  # the second turn reuses the first one's pages (16 tokens each)
    assert cached[3] >= on[3].prompt_tokens - 16  # the same prompt again
    assert [u.prompt_tokens_details.cached_tokens for u in off] == [0, 0, 0, 0]


def test_forks_share_the_prompt_and_each_continuation_is_cached(eng):
    src = """
import asyncio
import json
from pastry.sdk import Context, MaxTokens, Sampler

async def main(args):
    ctx = Context()
    ctx.fill_tokens(json.loads(args[0]))
    kids = [await ctx.fork() for _ in range(2)]
    await asyncio.gather(*(k.generate(Sampler(), MaxTokens(6)) for k in kids))
    out = [k.tokens for k in kids]
    for k in kids:
        await k.release()
    return json.dumps({"seqs": out, "cached": ctx.cached_tokens})
"""
    tokens = prompt(7, 22)

    async def go():
        async with serving(eng) as (_, rt, model):
            first = json.loads(await run_one(rt, src, json.dumps(tokens)))
            cache = model.resources.cache
            held = [
                cache.match(seq[:-1], touch=False, namespace=LOCAL).length for seq in first["seqs"]
            ]
            again = json.loads(await run_one(rt, READER, json.dumps(first["seqs"][1][:-1])))
            return first, held, again

    first, held, again = asyncio.run(go())
    assert first["cached"] == 0 and first["seqs"][0][:22] == first["seqs"][1][:22] == tokens
    # both forks' generated tokens (all but the last, never forwarded) are in the tree
    assert held == [len(seq) - 1 for seq in first["seqs"]]
    assert again["cached"] == 24  # 26 tokens: 6 full pages of 4, the last two computed


def test_serve_flags_reach_the_server_config(monkeypatch):
    import pastry.server.app
    from pastry.cli import main

    seen = []

    async def fake_serve(config, log_level="info"):
        seen.append(config)

    monkeypatch.setattr(pastry.server.app, "serve", fake_serve)
    assert main(["serve", "--no-prefix-cache", "--admission", "fcfs"]) == 0
    assert main(["serve"]) == 0
    (off, on) = seen
    assert (off.prefix_cache, off.admission) == (False, "fcfs")
    assert (on.prefix_cache, on.admission) == (True, "lpm")


def test_users_never_match_each_others_cached_text(eng):
    """One tree per user (docs/security.md): what alice computed is not matched for bob
    (cached_tokens 0, the cache's pages are never his), but is for alice's next program;
    bob's own second run hits his own tree."""
    tokens = prompt(11, 40)
    reader = Program.from_source("r", READER)

    async def cached(rt, user: str) -> int:
        events = [ev async for ev in rt.launch(reader, [json.dumps(tokens)], user=user).events()]
        return json.loads(result(events))["cached"]

    async def go():
        async with serving(eng) as (_, rt, model):
            got = [
                await cached(rt, "alice"),
                await cached(rt, "bob"),
                await cached(rt, "alice"),
                await cached(rt, "bob"),
            ]
            cache = model.resources.cache
            trees = [cache.match(tokens, touch=False, namespace=u).length for u in ("alice", "bob")]
            return got, trees

    (a1, b1, a2, b2), trees = asyncio.run(go())
    assert a1 == 0 and b1 == 0  # bob's first run computes everything again
    assert a2 > 0 and b2 == a2
    assert trees[0] == trees[1] > 0  # two copies, one per user
