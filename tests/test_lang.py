"""pastry.lang inside the server, on the tiny model: each primitive's semantics, trusted
and sandboxed; select's scores against transformers; fork/join sharing pages (counted)."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from engine_util import hf_model
from inferlet_util import load_engine, start
from pastry.control.events import Failed, Finished
from pastry.lang.choices import (
    greedy_token_selection,
    token_length_normalized,
    unconditional_likelihood_normalized,
)
from pastry.runtime.trusted import Program

HEADER = """
import json
import pastry.sdk as px
from pastry.lang import (function, gen, select, user, assistant, system, gen_int,
                         greedy_token_selection, unconditional_likelihood_normalized)
from pastry.sdk import Context
"""


@pytest.fixture(scope="module")
def path(make_tiny):
    return make_tiny("llama")


@pytest.fixture(scope="module")
def eng(path):
    return load_engine(path, num_pages=256)


def run(eng, source: str, args=(), sandboxed: bool = False, count_forwards: bool = False):
    """Run one inferlet; its result (JSON-decoded when possible) and the controller's
    scheduler stats. Checks that every page came back."""

    async def go():
        controller, rt, handle = await start(eng)
        if sandboxed:
            from pastry.runtime.wasm import sandboxed_program

            prog = sandboxed_program("t", HEADER + source)
        else:
            prog = Program.from_source("t", HEADER + source)
        inst = rt.launch(prog, list(args))
        events = [ev async for ev in inst.events()]
        (model,) = controller.models.values()
        stats = model.scheduler.stats
        await controller.close()
        model.resources.check_integrity()
        assert model.resources.referenced("kv") == 0, "pages left after the instance ended"
        handle.close()
        return events[-1], stats

    end, stats = asyncio.run(go())
    if isinstance(end, Failed):
        return end, stats
    assert isinstance(end, Finished), end
    try:
        return json.loads(end.result), stats
    except (TypeError, ValueError):
        return end.result, stats


def sandbox_or_skip():
    from pastry.runtime import build_pyrt

    try:
        build_pyrt.build()
    except build_pyrt.BuildError as e:
        pytest.skip(f"cannot build the Python runtime component: {e}")


GREEDY = """
@function
def complete(s, prompt):
    s += prompt + gen("out", max_tokens=12, temperature=0)

async def main(args):
    st = await complete.arun(prompt=args[0])
    ctx = Context()
    ctx.fill(args[0])
    ref = await ctx.generate_until(max_tokens=12)
    return json.dumps({"lang": st["out"], "ref": ref, "text": st.text(),
                       "meta": st.get_meta_info("out")})
"""


@pytest.mark.parametrize("sandboxed", [False, True])
def test_greedy_gen_equals_the_context_loop(eng, sandboxed):
    if sandboxed:
        sandbox_or_skip()
    out, _ = run(eng, GREEDY, ["Once upon a time"], sandboxed)
    assert out["lang"] == out["ref"] and out["lang"]
    assert out["text"] == "Once upon a time" + out["ref"]
    meta = out["meta"]
    assert meta["completion_tokens"] == 12 and meta["finish_reason"]["type"] in ("length", "stop")


STOPS = """
@function
def p(s, ending):
    s += "one two three" + gen("free", max_tokens=10, temperature=0)
    s += "|" + gen("cut", max_tokens=10, temperature=0, stop=ending)
    s += "|" + gen("few", max_tokens=3, temperature=0)

async def main(args):
    st = await p.arun(ending=args[0])
    return json.dumps({"vars": st.stream.variables, "meta": st.stream.meta_info,
                       "text": st.text()})
"""


def test_stop_strings_end_and_are_left_out(eng):
    free, _ = run(eng, STOPS, ["\x00never"])
    first = free["vars"]["cut"]
    assert len(first) > 3
    stop = first[2:4]  # a piece of what it would generate
    out, _ = run(eng, STOPS, [stop])
    cut = out["vars"]["cut"]
    assert stop not in cut and first.startswith(cut) and len(cut) < len(first)
    assert out["meta"]["cut"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["meta"]["few"]["finish_reason"] == {"type": "length", "length": 3}
    assert out["text"].startswith("one two three" + out["vars"]["free"] + "|" + cut + "|")


SELECT = """
@function
def p(s, prompt, choices, method):
    m = {"tln": None, "greedy": greedy_token_selection,
         "uncond": unconditional_likelihood_normalized}[method]
    s += prompt + (select("pick", choices=choices) if m is None else
                   select("pick", choices=choices, choices_method=m))

async def main(args):
    a = json.loads(args[0])
    st = await p.arun(**a)
    return json.dumps({"pick": st["pick"], "meta": st.get_meta_info("pick"),
                       "text": st.text()})
"""


def test_select_scores_equal_transformers(eng, path):
    from pastry.wire.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(path)
    prompt = "The weather today is"
    choices = [" sunny", " rainy and cold", " 42", "sunny"]
    args = json.dumps({"prompt": prompt, "choices": choices, "method": "tln"})
    out, _ = run(eng, SELECT, [args])
    hf = hf_model(path)
    scored = out["meta"]["input_token_logprobs"]

    def encode(text: str) -> list[int]:  # the prompt starts a sequence: BOS as a server adds
        return tok.encode(text, True)

    first = max(len(encode(prompt)) - 1, 1)
    means = []
    for choice, got in zip(choices, scored, strict=True):
        ids = encode(prompt + choice)
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0].float()
        ref = torch.log_softmax(logits, -1)
        want = [(ref[j - 1, ids[j]].item(), ids[j]) for j in range(first, len(ids))]
        assert [t for _, t, _ in got] == [t for _, t in want]
        for (lp, _, _), (w, _) in zip(got, want, strict=True):
            assert lp == pytest.approx(w, abs=2e-4)
        means.append(sum(w for w, _ in want) / len(want))
    assert out["meta"]["normalized_prompt_logprobs"] == pytest.approx(means, abs=2e-4)
    assert out["pick"] == choices[max(range(len(means)), key=means.__getitem__)]
    assert out["text"] == prompt + out["pick"]


@pytest.mark.parametrize("method", ["greedy", "uncond"])
def test_select_methods_run_in_the_server(eng, method):
    args = json.dumps({"prompt": "A or B? ", "choices": ["A", "B", "AB"], "method": method})
    out, _ = run(eng, SELECT, [args])
    assert out["pick"] in ("A", "B", "AB")
    key = (
        "greedy_logprob_matrix"
        if method == "greedy"
        else "normalized_unconditional_prompt_logprobs"
    )
    assert key in out["meta"]


def test_choice_methods_decide_exactly():
    lps = [[-1.0, -3.0], [-1.0, -1.5, -9.0], [-2.0]]
    d = token_length_normalized.decide(lps)
    assert d.meta_info["normalized_prompt_logprobs"] == pytest.approx([-2.0, -11.5 / 3, -2.0])
    assert d.choice == 0  # ties go to the earliest: choices 0 and 2 both average -2.0
    g = greedy_token_selection.decide(lps)  # position 0: 0 and 1 tie at -1; position 1: 1 wins
    assert g.choice == 1
    u = unconditional_likelihood_normalized.decide(
        [[-1.0, -2.0], [-1.0, -1.0]], [[0.0, -0.5], [0.0, -3.0]]
    )
    assert u.choice == 1  # means: (-1 - 1.5) / 2 = -1.25 vs (-1 + 2) / 2 = 0.5
    assert u.meta_info["normalized_unconditional_prompt_logprobs"] == [-1.25, 0.5]


FORK = """
@function
def p(s, prefix):
    s += prefix
    forks = s.fork(4)
    info = {"parent_kv": s.stream.ctx.kv_len, "parent_tokens": len(s.stream.ctx.tokens),
            "page_size": s.stream.ctx.page_size,
            "children": [[f.stream.ctx.kv_len, list(f.stream.ctx.pages)] for f in forks],
            "parent_pages": list(s.stream.ctx.pages)}
    for i, f in enumerate(forks):
        f += " branch " + str(i) + gen("x", max_tokens=3, temperature=0)
    forks.join()
    s["info"] = info
    s += " joined"

async def main(args):
    st = await p.arun(prefix=args[0])
    return json.dumps({"x": st["x"], "info": st["info"], "text": st.text()})
"""


def test_fork_shares_the_prefix_pages_computed_once(eng):
    prefix = " ".join(f"word{i}" for i in range(60))
    out, _ = run(eng, FORK, [prefix])
    info = out["info"]
    ps, n = info["page_size"], info["parent_tokens"]
    # the prefix (but its last token) is in the KV before any branch runs
    assert info["parent_kv"] == n - 1
    full = (n - 1) // ps
    assert full >= 4
    handles = set(info["parent_pages"][:full])
    for kv, pages in info["children"]:
        assert kv == n - 1
        assert pages[:full] == info["parent_pages"][:full]  # shared, not copied
    distinct = set().union(*(set(pages) for _, pages in info["children"]), info["parent_pages"])
    # counted: the prefix's full pages once, plus one private partial page per branch
    assert len(distinct) <= len(info["parent_pages"]) + 4
    assert len(handles) * 5 > len(distinct) + 3 * full  # what copying would have needed
    assert isinstance(out["x"], list) and len(out["x"]) == 4  # join gathers into lists
    assert out["text"] == prefix + " joined"


NESTED = """
@function
def expand(s, tip):
    s += "Expand: " + tip + gen("para", max_tokens=10, temperature=0)

@function
def p(s, a, b):
    d1 = expand(tip=a)
    d2 = expand(tip=b)
    s += d1["para"] + "|" + d2["para"]

@function
def one(s, tip):
    s += "Expand: " + tip + gen("para", max_tokens=10, temperature=0)

async def main(args):
    if args[0] == "nested":
        st = await p.arun(a="first tip", b="second tip")
        return json.dumps(st.text())
    x = await one.arun(tip="first tip")
    y = await one.arun(tip="second tip")
    return json.dumps(x["para"] + "|" + y["para"])
"""


def test_nested_calls_run_concurrently(eng):
    nested, s1 = run(eng, NESTED, ["nested"])
    serial, s2 = run(eng, NESTED, ["serial"])
    assert nested == serial  # same results
    # the two nested programs decode together: about half the forward batches
    assert s1.forward_batches < 0.7 * s2.forward_batches
    assert s1.mean_batch > 1.5


ROLES = """
@function
def chat(s, q):
    s += system("Be brief.")
    s += user(q)
    s += assistant(gen("a", max_tokens=4, temperature=0))
    with s.user():
        s += "thanks"

async def main(args):
    st = await chat.arun(q=args[0])
    return json.dumps({"text": st.text(), "messages": st.messages(), "a": st["a"]})
"""


def test_roles_render_with_the_models_chat_template(eng, path):
    out, _ = run(eng, ROLES, ["hi there"])
    tok = _hf_tokenizer(path)
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi there"},
        {"role": "assistant", "content": out["a"].lstrip()},
        {"role": "user", "content": "thanks"},
    ]
    assert out["messages"] == msgs
    assert out["text"] == tok.apply_chat_template(msgs, tokenize=False)


GRAMMAR = """
@function
def p(s):
    s += "Number:" + gen("n", regex=r" [0-9]{2,4}", max_tokens=8, temperature=0)
    s += " As JSON:" + gen("j", json_schema=json.dumps(
        {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}},
         "required": ["a"], "additionalProperties": False}),
        max_tokens=32, temperature=0)
    s += " int:" + gen_int("i", max_tokens=6, temperature=0)

async def main(args):
    st = await p.arun()
    return json.dumps(st.stream.variables)
"""


@pytest.mark.parametrize("sandboxed", [False, True])
def test_regex_and_json_schema_gen_always_match(eng, sandboxed):
    """The grammar lives on the host: a sandboxed program (no llguidance in the guest)
    gets the same constrained output as a trusted one."""
    import re

    if sandboxed:
        sandbox_or_skip()
    out, _ = run(eng, GRAMMAR, sandboxed=sandboxed)
    assert re.fullmatch(r" [0-9]{2,4}", out["n"])
    assert isinstance(json.loads(out["j"])["a"], int)
    assert re.fullmatch(r"[-+]?[0-9]+", out["i"].strip()) or out["i"] == ""
    if sandboxed:
        assert out == run(eng, GRAMMAR)[0]


ERRORS = """
@function
def p(s, which):
    s += "x"
    if which == "missing":
        s["nope"]
    elif which == "penalty":
        s += gen("g", max_tokens=2, frequency_penalty=3.0)
        s["g"]
    elif which == "raise":
        raise ValueError("from the body")

async def main(args):
    await p.arun(which=args[0])
    return "ok"
"""


@pytest.mark.parametrize(
    ("which", "message"),
    [
        ("missing", "no variable 'nope'"),
        ("penalty", "frequency_penalty"),
        ("raise", "from the body"),
    ],
)
def test_failures_name_the_problem(eng, which, message):
    end, _ = run(eng, ERRORS, [which])
    assert isinstance(end, Failed) and message in end.error


STREAM = """
@function
def p(s):
    s += "Count:" + gen("a", max_tokens=6, temperature=0) + " and" + select(
        "b", choices=[" yes", " no"])

async def main(args):
    pieces = []
    st = await p.arun(on_text=pieces.append)
    return json.dumps({"pieces": pieces, "text": st.text()})
"""


@pytest.mark.parametrize("sandboxed", [False, True])
def test_streaming_sends_the_text_as_it_grows(eng, sandboxed):
    if sandboxed:
        sandbox_or_skip()
    out, _ = run(eng, STREAM, sandboxed=sandboxed)
    assert "".join(out["pieces"]) == out["text"]
    assert len(out["pieces"]) >= 5


BATCH = """
@function
def p(s, q):
    s += "Q: " + q + " A:" + gen("a", max_tokens=5, temperature=0)

async def main(args):
    states = await p.arun_batch([{"q": q} for q in ["one", "two", "three"]], num_threads=2)
    singles = [(await p.arun(q=q))["a"] for q in ["one", "two", "three"]]
    return json.dumps({"batch": [s["a"] for s in states], "single": singles})
"""


@pytest.mark.parametrize("sandboxed", [False, True])
def test_run_batch_in_an_inferlet(eng, sandboxed):
    if sandboxed:
        sandbox_or_skip()
    out, _ = run(eng, BATCH, sandboxed=sandboxed)
    assert out["batch"] == out["single"]


def test_the_prompt_is_tokenized_whole_like_a_server_would(eng, path):
    """After appending text the context holds exactly tokenize(full text): the next gen
    equals a fresh greedy continuation of the whole text."""
    src = """
@function
def p(s):
    s += "Hello wor" + gen("x", max_tokens=3, temperature=0)
    s += "ld, again"
    s += gen("y", max_tokens=6, temperature=0)

async def main(args):
    st = await p.arun()
    ctx = Context()
    ctx.fill(st.text()[: len(st.text()) - len(st["y"])])
    ref = await ctx.generate_until(max_tokens=6)
    return json.dumps({"y": st["y"], "ref": ref})
"""
    out, _ = run(eng, src)
    assert out["y"] == out["ref"]


def _hf_tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


# ---------------------------------------------------------------------- real weights

REAL = """
@function
def quiz(s, question, choices):
    s += "Q: " + question + "\\nA:" + select("answer", choices=choices)

@function
def fill(s, prompt, pattern):
    s += prompt + gen("out", regex=pattern, max_tokens=24)

@function
def person(s, schema):
    s += user("Describe a fictional person as JSON with a name and an age.")
    s += assistant(gen("out", json_schema=schema, max_tokens=48))

async def main(args):
    a = json.loads(args[0])
    picks = [(await quiz.arun(question=q, choices=c))["answer"] for q, c in a["quiz"]]
    outs = []
    for prompt, pattern, temperature, seed in a["gen"]:
        st = await fill.arun(prompt=prompt, pattern=pattern, temperature=temperature, seed=seed)
        outs.append(st["out"])
    people = []
    for temperature, seed in a["json"]:
        st = await person.arun(schema=a["schema"], temperature=temperature, seed=seed)
        people.append(st["out"])
    return json.dumps({"picks": picks, "outs": outs, "people": people})
"""
QUIZ = [
    ("What is the capital of France?", [" London", " Paris", " Madrid"], " Paris"),
    ("What color is the sky on a clear day?", [" Green", " Purple", " Blue"], " Blue"),
    ("What is 2 + 2?", [" 4", " 7", " 9"], " 4"),
    ("What is the opposite of hot?", [" Tall", " Green", " Cold"], " Cold"),
    ("How many days are there in a week?", [" 3", " 20", " 7"], " 7"),
]
PATTERNS = [
    ("Call me at ", r"\(\d{3}\) \d{3}-\d{4}"),
    ("The meeting is on ", r"(Monday|Tuesday|Friday) at [1-9](am|pm)"),
    ("My email address is ", r"[a-z]{3,8}@[a-z]{3,8}\.(com|org)"),
]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,11}$"},
        "age": {"type": "integer", "minimum": 1, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
SETTINGS = ((0.0, None), (0.9, 1), (1.3, 2))  # greedy and sampled


def check_real_weights(engine, sandboxed: bool) -> None:
    """On a real model: ``select`` over obvious choices picks the right one; regex and
    JSON-schema ``gen`` always give a match, greedy and sampled."""
    import re

    cases = [(p, rx, t, s) for p, rx in PATTERNS for t, s in SETTINGS]
    args = {"quiz": [(q, c) for q, c, _ in QUIZ], "gen": cases, "json": SETTINGS}
    out, _ = run(engine, REAL, [json.dumps({**args, "schema": json.dumps(PERSON)})], sandboxed)
    assert out["picks"] == [want for _, _, want in QUIZ], out
    for (_, rx, _, _), text in zip(cases, out["outs"], strict=True):
        assert re.fullmatch(rx, text), (rx, text)
    assert len(out["people"]) == len(SETTINGS)
    for text in out["people"]:
        person = json.loads(text)
        assert set(person) == {"name", "age"}, text
        assert re.fullmatch("[A-Z][a-z]{1,11}", person["name"]), text
        assert type(person["age"]) is int and 1 <= person["age"] <= 120, text


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    return load_engine(smollm2_gguf, num_pages=512, page_size=16)


@pytest.mark.parametrize("sandboxed", [False, True])
def test_real_weights_select_regex_json(smollm2, sandboxed):
    if sandboxed:
        sandbox_or_skip()
    check_real_weights(smollm2, sandboxed)


def test_api_speculative_execution_is_refused_by_name():
    """SGLang's num_api_spec_tokens speeds up API-backend calls; pastry.lang has none, so
    the decorator refuses it instead of taking it and doing nothing."""
    from pastry.lang import function

    def program(s):
        s += "x"

    with pytest.raises(ValueError, match="num_api_spec_tokens"):
        function(num_api_spec_tokens=64)(program)
    assert function(program).__name__ == "program"  # unset: fine
