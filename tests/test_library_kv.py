"""The KV-cache-control built-ins of the Pie paper's Table 2, each checked by its defining
property against explicit engine calls (the tiny random model writes gibberish, so every
check holds for any model):

- ``prefix-cache``: later requests import the prefix's pages and forward only their own
  prompt (tokens counted on the engine), and generate what a full prefill generates.
- ``modular-cache``: modules composed from the cache generate exactly what one forward of
  the same modules at the same positions with the same block mask generates; each module
  is forwarded once across requests.
- ``attention-sink`` / ``windowed-attention``: the KV pages held stay bounded during a long
  generation, and the tokens equal a reference that keeps every page and passes the
  window + sink mask over the full context to each forward.
- ``hierarchical-attention``: equals a reference forward with the structure's mask written
  out by hand, and differs from plain causal attention.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import resources

import numpy as np
import pytest

from engine_util import Pages, Seq
from inferlet_util import load_engine, result
from pastry.control.controller import Controller
from pastry.control.events import Failed
from pastry.inferlets.hierarchical_attention import HEADER, hierarchical_mask
from pastry.runtime.trusted import Program, TrustedRuntime
from pastry.wire.calls import Forward, Sample
from pastry.wire.handle import InProcessEngine

PAGE = 4  # the page size of inferlet_util's engines


def source(name: str) -> str:
    return resources.files("pastry.inferlets").joinpath(f"{name}.py").read_text()


@pytest.fixture(scope="module")
def ckpt(make_tiny):
    return make_tiny("llama")


Launch = tuple[str, dict]  # a built-in's module name and its args


@dataclass
class Step:
    results: list[dict]  # of the inferlets launched together, in order
    forwarded: int  # input tokens of every Forward the engine ran for them
    peak_pages: int  # most KV pages in use when a batch ran


@dataclass
class Runs:
    steps: list[Step]
    exports: list[tuple[str, str, int]]  # what was still exported at the end
    pages_in_use: int  # KV pages in use at the end


def run_in_turn(ckpt, steps: Sequence[Sequence[Launch]]) -> Runs:
    """Run each step's inferlets together to their end, one step after another, on one
    engine and controller (so persistent exports carry over), counting per step the tokens
    the engine forwarded and the most KV pages in use.

    Every KV slot starts attendable, as on a server where each page has been used before:
    an inferlet that attends to slots it did not write (and did not mask) gets noise."""

    async def collect(inst) -> list:
        return [ev async for ev in inst.events()]

    async def go() -> Runs:
        engine = load_engine(ckpt)
        engine.kv.attendable.fill_(True)
        handle = InProcessEngine(engine)
        inner = handle.execute
        seen = {"tokens": 0, "peak": 0}

        async def execute(batch):
            seen["tokens"] += sum(c.num_inputs for c in batch if isinstance(c, Forward))
            seen["peak"] = max(seen["peak"], res.referenced("kv"))
            return await inner(batch)

        handle.execute = execute  # before the controller binds it
        controller = Controller([handle])
        res = next(iter(controller.models.values())).resources
        rt = TrustedRuntime(controller)
        out = []
        for launches in steps:
            seen.update(tokens=0, peak=0)
            insts = [
                rt.launch(Program.from_source(name, source(name)), [json.dumps(args)])
                for name, args in launches
            ]
            events = await asyncio.gather(*(collect(i) for i in insts))
            results = [json.loads(result(evs)) for evs in events]
            out.append(Step(results, seen["tokens"], seen["peak"]))
        res.check_integrity()
        runs = Runs(out, res.list_exports(), res.referenced("kv"))
        await controller.close()
        handle.close()
        return runs

    return asyncio.run(go())


def reference(
    ckpt,
    tokens: list[int],
    positions: list[int],
    attends: Callable[[int, int], bool],
    n_new: int,
) -> list[int]:
    """Greedy decoding with explicit engine calls on a fresh engine, every token's KV kept:
    ``tokens`` in one forward, then one token per step, each forward with the mask
    ``attends(i, j)`` (token ``i`` may attend token ``j``; indices into the sequence) over
    the whole sequence so far. Generated tokens take the positions after the last one."""
    eng = load_engine(ckpt)
    seq = Seq(Pages(eng))
    pos = list(positions)

    def mask(rows: range) -> np.ndarray:
        return np.array([[attends(i, j) for j in range(rows.stop)] for i in rows])

    calls, out = seq.forward_calls(tokens, pos, mask(range(len(tokens))))
    generated = []
    for _ in range(n_new):
        *rest, tok = eng.execute([*calls, Sample(out)])
        assert rest == [None, None], rest
        generated.append(tok)
        pos.append(pos[-1] + 1)
        calls, out = seq.forward_calls([tok], pos[-1:], mask(range(len(pos) - 1, len(pos))))
    return generated


def causal(i: int, j: int) -> bool:
    return j <= i


def random_tokens(seed: int, *lengths: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 7000, n).tolist() for n in lengths]


# ------------------------------------------------------------------------- prefix caching


@pytest.mark.parametrize("prefix_len", [10, 8])  # a partial last page, and none
def test_prefix_cache_prefills_the_prefix_once(ckpt, prefix_len):
    prefix, p1, p2, p3 = random_tokens(prefix_len, prefix_len, 5, 3, 4)
    m = 6

    def request(prompt: list[int]) -> Launch:
        args = {"prefix": prefix, "prompt": prompt, "max_tokens": m, "stop_at_eos": False}
        return "prefix_cache", args

    # One request, then two at once: both import the prefix and append to its last page.
    runs = run_in_turn(ckpt, [[request(p1)], [request(p2), request(p3)]])
    first, later = runs.steps
    for out, prompt in zip(first.results + later.results, (p1, p2, p3), strict=True):
        full = prefix + prompt
        assert out["tokens"] == reference(ckpt, full, list(range(len(full))), causal, m)
    # The first request prefilled the prefix; the later ones forwarded only their prompts
    # (then one token per generated token but the last).
    assert first.forwarded == prefix_len + len(p1) + m - 1
    assert later.forwarded == len(p2) + len(p3) + 2 * (m - 1)
    assert [(r["hit"], r["prefilled"]) for r in first.results + later.results] == [
        (False, prefix_len + 5),
        (True, 3),
        (True, 4),
    ]
    # The cache outlives its requests: one persistent export of the prefix's pages.
    pages = -(-prefix_len // PAGE)
    assert runs.exports == [(first.results[0]["cache"], "kv", pages)]
    assert runs.pages_in_use == pages


# ------------------------------------------------------------------------ modular caching


def test_modular_cache_composes_like_one_prefill(ckpt):
    system, doc_a, doc_b, doc_c, q1, q2, q3 = random_tokens(7, 5, 6, 3, 4, 3, 2, 4)
    schema = [
        {"name": "system", "content": system},
        {"name": "doc-a", "content": doc_a},
        {"name": "doc-b", "content": doc_b},
    ]
    larger = [*schema, {"name": "doc-c", "content": doc_c}]  # the others keep their positions
    m = 8
    requests = [
        (schema, None, q1),  # every module
        (schema, ["system", "doc-b"], q2),  # a gap where doc-a would be
        (larger, ["doc-c", "doc-a"], q3),  # composed in schema order
    ]
    args = {"max_tokens": m, "stop_at_eos": False}
    steps = [
        [("modular_cache", {"modules": s, "use": u, "prompt": q, **args})] for s, u, q in requests
    ]
    runs = run_in_turn(ckpt, steps)
    first, second, third = (step.results[0] for step in runs.steps)
    assert (first["prefilled"], first["reused"]) == (["system", "doc-a", "doc-b"], [])
    assert (second["prefilled"], second["reused"]) == ([], ["system", "doc-b"])
    assert (third["prefilled"], third["reused"]) == (["doc-c"], ["doc-a"])
    forwarded = [step.forwarded for step in runs.steps]
    assert forwarded == [14 + 3 + m - 1, 2 + m - 1, 4 + 4 + m - 1]
    assert [r["prefilled_tokens"] for r in (first, second, third)] == [17, 2, 8]

    # The reference: the used modules and the prompt in one forward, at the schema's
    # positions, each module attending only within itself, the rest to everything.
    starts = {"system": 0, "doc-a": 5, "doc-b": 11, "doc-c": 14}
    contents = {"system": system, "doc-a": doc_a, "doc-b": doc_b, "doc-c": doc_c}
    for run, (s, use, prompt) in zip((first, second, third), requests, strict=True):
        names = [d["name"] for d in s if use is None or d["name"] in use]
        tokens, positions, module = [], [], []
        for k, name in enumerate(names):
            tokens += contents[name]
            positions += range(starts[name], starts[name] + len(contents[name]))
            module += [k] * len(contents[name])
        end = sum(len(d["content"]) for d in s)
        n = len(tokens)

        def attends(i, j, module=module, n=n):
            return j <= i and (i >= n or module[i] == module[j])

        tokens += prompt
        positions += range(end, end + len(prompt))
        assert run["tokens"] == reference(ckpt, tokens, positions, attends, m)
        if run is first:  # not vacuous: modules attending to each other give other tokens
            assert run["tokens"] != reference(ckpt, tokens, positions, causal, m)
    assert runs.pages_in_use == sum(-(-len(c) // PAGE) for c in contents.values())
    assert len(runs.exports) == 4


# ------------------------------------------------------------ attention sink and windows


@pytest.mark.parametrize(
    "name, window, sink, prompt_len, n_new",
    [
        ("attention_sink", 16, None, 8, 200),  # StreamingLLM's 4 sink tokens (the default)
        ("attention_sink", 6, 2, 5, 40),  # sinks and window not page multiples
        ("windowed_attention", 10, 0, 30, 40),  # a prompt longer than the window
    ],
)
def test_windowed_attention_keeps_pages_bounded(ckpt, name, window, sink, prompt_len, n_new):
    [prompt] = random_tokens(prompt_len, prompt_len)
    args = {"prompt": prompt, "window": window, "max_tokens": n_new, "stop_at_eos": False}
    if sink is None:
        sink = 4
    else:
        args["sink"] = sink
    runs = run_in_turn(ckpt, [[(name, args)]])
    [step] = runs.steps
    [out] = step.results

    def attends(i, j):
        return j <= i and (j < sink or j > i - window)

    positions = list(range(prompt_len))
    assert out["tokens"] == reference(ckpt, prompt, positions, attends, n_new)
    assert out["tokens"] != reference(ckpt, prompt, positions, causal, n_new)  # not vacuous
    # Held: the sink pages and the pages of the window of the widest forward (a prompt
    # chunk of at most `window` tokens, or one token), never the whole sequence.
    widest = min(prompt_len, window)
    bound = -(-sink // PAGE) + -(-(window + widest - 2) // PAGE) + 1
    assert out["max_pages_held"] <= bound < -(-(prompt_len + n_new) // PAGE)
    assert step.peak_pages == out["max_pages_held"]  # what the engine saw in use
    assert runs.pages_in_use == 0


# ----------------------------------------------------------------- hierarchical attention

# A header of 2 tokens (H) with paragraphs a, b of 2 tokens each; a header of 1 (G) with
# paragraph c of 2. Row i: the tokens token i attends to (1) — the headers so far and its
# own paragraph, causally.
DOC_MASK = [
    # HHaabbGcc
    "1........",  # H
    "11.......",  # H
    "111......",  # a
    "1111.....",  # a
    "11..1....",  # b
    "11..11...",  # b
    "11....1..",  # G
    "11....11.",  # c
    "11....111",  # c
]


def test_hierarchical_mask_follows_the_structure():
    groups = [HEADER, HEADER, 0, 0, 1, 1, HEADER, 2, 2]
    assert hierarchical_mask(groups) == [[c == "1" for c in row] for row in DOC_MASK]


def test_hierarchical_attention_equals_the_explicit_mask(ckpt):
    h, a, b, g, c, prompt = random_tokens(11, 2, 2, 2, 1, 2, 3)
    sections = [{"header": h, "paragraphs": [a, b]}, {"header": g, "paragraphs": [c]}]
    m = 10
    args = {"sections": sections, "prompt": prompt, "max_tokens": m, "stop_at_eos": False}
    runs = run_in_turn(ckpt, [[("hierarchical_attention", args)]])
    [out] = runs.steps[0].results
    doc = h + a + b + g + c
    assert out["document_tokens"] == len(doc) == len(DOC_MASK)

    def attends(i, j):  # the document by DOC_MASK; the prompt and answer see everything
        return j <= i and (i >= len(doc) or DOC_MASK[i][j] == "1")

    tokens = doc + prompt
    assert out["tokens"] == reference(ckpt, tokens, list(range(len(tokens))), attends, m)
    assert out["tokens"] != reference(ckpt, tokens, list(range(len(tokens))), causal, m)
    assert runs.pages_in_use == 0


# ----------------------------------------------------------------------------- arguments


@pytest.mark.parametrize(
    "name",
    [
        "prefix_cache",
        "modular_cache",
        "attention_sink",
        "windowed_attention",
        "hierarchical_attention",
    ],
)
def test_unknown_args_fail_with_their_names(ckpt, name):
    async def go():
        handle = InProcessEngine(load_engine(ckpt))
        controller = Controller([handle])
        inst = TrustedRuntime(controller).launch(
            Program.from_source(name, source(name)), [json.dumps({"prompt": [1], "windw": 3})]
        )
        end = await inst.wait()
        await controller.close()
        handle.close()
        return end

    end = asyncio.run(go())
    assert isinstance(end, Failed) and "unknown args ['windw']" in end.error, end
