"""Grammar-constrained decoding (the ``constrained`` built-in, :mod:`pastry.sdk.grammar`) on
the tiny random checkpoint, whose unconstrained text is gibberish.

- every output parses: for JSON schemas (``json.loads`` plus a hand-written check of the
  schema's types, bounds, required and extra keys), regular expressions (``re.fullmatch``)
  and Lark grammars (re-parsed by llguidance from the text's own tokenization, and checked
  by Python's parser or an equivalent regex) -- greedy and at several temperatures and
  seeds;
- greedy decoding is exactly "the most likely allowed token" at every step, checked against
  transformers' logits with the grammar replayed here, and ends where the grammar does;
- sampling is reproducible for a seed and varies across seeds;
- forced tokens are fast-forwarded (fewer forward calls than tokens);
- on a model whose output rows exceed the tokenizer's vocabulary, with padded rows that
  greedy decoding would pick, no padded id is ever emitted.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
from importlib import resources

import numpy as np
import pytest
import torch

from engine_util import hf_model
from inferlet_util import load_engine, result, run_all, start
from pastry.control.events import Failed
from pastry.wire.tokenizer import Tokenizer

llg = pytest.importorskip("llguidance")

SRC = resources.files("pastry.inferlets").joinpath("constrained.py").read_text()

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}
NUMBERS = {
    "type": "array",
    "items": {"type": "integer", "minimum": -50, "maximum": 50},
    "minItems": 1,
    "maxItems": 4,
}
NESTED = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "point": {
            "type": "object",
            "properties": {
                "x": {"type": "integer", "minimum": 0, "maximum": 9},
                "y": {"type": "integer", "minimum": 0, "maximum": 9},
            },
            "required": ["x", "y"],
            "additionalProperties": False,
        },
        "tags": {
            "type": "array",
            "items": {"type": "string", "maxLength": 4, "pattern": "^[a-z]+$"},
            "maxItems": 3,
        },
        "note": {"type": ["string", "null"], "maxLength": 5},
    },
    "required": ["color", "point"],
    "additionalProperties": False,
}
REGEXES = [
    r"[0-9]{3}-[0-9]{4}",
    r"(yes|no|maybe)",
    r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)",
    r"\((-?[1-9][0-9]?|0)(, (-?[1-9][0-9]?|0)){0,2}\)",
]
ARITH = """
start: expr
expr: term (OP term){0,3}
term: NUM | "(" NUM OP NUM ")"
NUM: /0|[1-9][0-9]{0,2}/
OP: "+" | "-" | "*"
"""
PAIRS = """
start: pair ("," pair){0,2}
pair: KEY "=" VALUE
KEY: /[a-z]{1,4}/
VALUE: /[0-9]{1,2}/
"""
# (temperature, seed): greedy, then sampling
SETTINGS = [(0.0, None), (0.7, 1), (1.0, 2), (1.0, 3), (1.5, 4)]


@pytest.fixture(scope="module")
def path(make_tiny):
    return make_tiny("llama")


@pytest.fixture(scope="module")
def tok(path):
    return Tokenizer.from_dir(path)


@pytest.fixture(scope="module")
def lltok(tok):
    """llguidance's tokenizer over the checkpoint's, built here (not through the API)."""

    class Wrapped:
        eos_token_id = tok.eos_token_ids[0]
        bos_token_id = None
        tokens = tok.get_vocabs()

        def __init__(self) -> None:
            special = re.compile(rb"<\|[^|]*\|>")
            self.special_token_ids = [i for i, b in enumerate(self.tokens) if special.fullmatch(b)]

        def __call__(self, text: str) -> list[int]:
            if not isinstance(text, str):
                raise TypeError("str only")
            return tok.encode(text)

    return llg.LLTokenizer(llg.TokenizerWrapper(Wrapped()), eos_token=tok.eos_token_ids)


def sandbox_or_skip() -> None:
    pytest.importorskip("wasmtime")
    from pastry.runtime import build_pyrt

    try:
        build_pyrt.build()
    except build_pyrt.BuildError as e:
        pytest.skip(f"cannot build the Python runtime component: {e}")


async def run_sandboxed(engine, launches):
    """``run_all``, with every source in the WebAssembly sandbox."""
    from pastry.runtime.wasm import sandboxed_program

    controller, rt, handle = await start(engine)
    insts = [rt.launch(sandboxed_program("test", src), args) for src, args in launches]

    async def collect(inst):
        return [ev async for ev in inst.events()]

    events = await asyncio.gather(*(collect(i) for i in insts))
    await controller.close()
    handle.close()
    return events, controller


def run(path, launches: list[dict], sandboxed: bool = False) -> list[dict]:
    """Run ``constrained`` with each options dict, concurrently (in the sandbox when
    ``sandboxed``); the parsed results. Checks that everything was released."""
    if sandboxed:
        sandbox_or_skip()
    go = run_sandboxed if sandboxed else run_all
    events, controller = asyncio.run(
        go(load_engine(path), [(SRC, [json.dumps(o)]) for o in launches])
    )
    res = next(iter(controller.models.values())).resources
    res.check_integrity()
    assert res.referenced("kv") == 0 and res.referenced("embed") == 0
    return [json.loads(result(ev)) for ev in events]


def launches(grammar: dict, max_tokens: int, prompts: list) -> list[dict]:
    return [
        {
            "prompt_tokens" if isinstance(p, list) else "prompt": p,
            "grammar": grammar,
            "max_tokens": max_tokens,
            "temperature": t,
            "seed": s,
        }
        for p in prompts
        for t, s in SETTINGS
    ]


def validate(value, schema: dict, where: str = "$") -> None:
    """A small JSON-schema check covering the keywords used here."""
    if "enum" in schema:
        assert value in schema["enum"], where
    types = schema.get("type")
    if types is None:
        return
    types = types if isinstance(types, list) else [types]
    pytypes = {
        "object": dict,
        "array": list,
        "string": str,
        "integer": int,
        "boolean": bool,
        "null": type(None),
    }
    assert any(
        isinstance(value, pytypes[t]) and not (t == "integer" and isinstance(value, bool))
        for t in types
    ), (where, value, types)
    if isinstance(value, dict):
        props = schema.get("properties", {})
        assert set(schema.get("required", [])) <= value.keys(), (where, value)
        if schema.get("additionalProperties") is False:
            assert value.keys() <= props.keys(), (where, value)
        for k, v in value.items():
            validate(v, props.get(k, {}), f"{where}.{k}")
    elif isinstance(value, list):
        assert schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", 1 << 30), where
        for i, v in enumerate(value):
            validate(v, schema.get("items", {}), f"{where}[{i}]")
    elif isinstance(value, str):
        assert schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", 1 << 30)
        if "pattern" in schema:
            assert re.search(schema["pattern"], value), (where, value)
    elif isinstance(value, int) and not isinstance(value, bool):
        assert schema.get("minimum", -(1 << 60)) <= value <= schema.get("maximum", 1 << 60)


def reparses(lltok, grammar: str, text: str) -> bool:
    """Whether llguidance accepts ``text`` (in its own tokenization) as a complete word."""
    m = llg.LLMatcher(lltok, llg.grammar_from("lark", grammar), log_level=0)
    return m.consume_tokens(lltok.tokenize_str(text)) and m.is_accepting()


# ---------------------------------------------------------------------------------- every output parses


@pytest.mark.parametrize("sandboxed", [False, True])
def test_json_schema_outputs_always_parse(path, sandboxed):
    """Trusted or sandboxed (the guest has no llguidance: the grammar lives on the host)."""
    prompts = ["A person: ", [101, 202, 303, 404, 505]]
    schemas = [PERSON, NUMBERS, NESTED]
    todo = [o for s in schemas for o in launches({"json_schema": s}, 96, prompts)]
    outs = run(path, todo, sandboxed)
    for o, out in zip(todo, outs, strict=True):
        assert out["complete"] and out["finish_reason"] == "stop", (o, out)
        validate(json.loads(out["text"]), o["grammar"]["json_schema"])
        # the keys and punctuation the schema forces are appended without their own forward
        assert out["forward_calls"] <= len(out["tokens"]), out
        if o["grammar"]["json_schema"]["type"] == "object":
            assert out["forward_calls"] < len(out["tokens"]), out
    texts = {out["text"] for out in outs}
    assert len(texts) > len(schemas) * 3  # sampling made different outputs


@pytest.mark.parametrize("sandboxed", [False, True])
def test_regex_outputs_always_match(path, sandboxed):
    todo = [o for rx in REGEXES for o in launches({"regex": rx}, 32, ["Answer: "])]
    for o, out in zip(todo, run(path, todo, sandboxed), strict=True):
        assert out["complete"], (o, out)
        assert re.fullmatch(o["grammar"]["regex"], out["text"]), (o, out)


def test_lark_outputs_always_parse(path, lltok):
    import ast

    todo = [o for g in (ARITH, PAIRS) for o in launches({"lark": g}, 64, ["Compute: ", [7, 8, 9]])]
    pair = re.compile(r"[a-z]{1,4}=[0-9]{1,2}")
    for o, out in zip(todo, run(path, todo), strict=True):
        text = out["text"]
        assert out["complete"], (o, out)
        assert reparses(lltok, o["grammar"]["lark"], text), text
        if o["grammar"]["lark"] is ARITH:
            ast.parse(text, mode="eval")  # a Python expression, too
            assert set(text) <= set("0123456789+-*()"), text
        else:
            assert all(pair.fullmatch(p) for p in text.split(",")), text
            assert 1 <= len(text.split(",")) <= 3, text


# ---------------------------------------------------------------------------------- greedy, seeds


def test_greedy_is_the_most_likely_allowed_token(path, tok, lltok):
    """Without fast-forwarding every token is the model's choice: replaying the grammar
    here, each must be the argmax of transformers' logits over the allowed tokens, and the
    output must end where the grammar stops or where end-of-sequence is the argmax."""
    prompt = [101, 202, 303, 404, 505]
    cases = [
        (
            {"json_schema": PERSON},
            llg.LLMatcher.grammar_from_json_schema(PERSON, defaults={"whitespace_flexible": False}),
        ),
        ({"regex": REGEXES[3]}, llg.grammar_from("regex", REGEXES[3])),
        ({"lark": ARITH}, llg.grammar_from("lark", ARITH)),
    ]
    opts = [
        {"prompt_tokens": prompt, "grammar": g, "max_tokens": 64, "fast_forward": False}
        for g, _ in cases
    ]
    hf = hf_model(path)
    eos = set(tok.eos_token_ids)
    for (_, grammar), out in zip(cases, run(path, opts), strict=True):
        toks = out["tokens"]
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + toks])).logits[0, len(prompt) - 1 :].float()
        m = llg.LLMatcher(lltok, grammar, log_level=0)
        for i, t in enumerate([*toks, None]):
            if t is None and m.is_stopped():
                assert out["forward_calls"] == len(toks)
                break  # the grammar admits nothing more: no step was taken
            bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), np.uint8), bitorder="little")
            allowed = torch.from_numpy(bits[: logits.shape[1]].astype(bool))
            best = int(logits[i].masked_fill(~allowed, -torch.inf).argmax())
            if t is None:
                assert best in eos  # the model chose to end, where the grammar may
                assert out["forward_calls"] == len(toks) + 1
            else:
                assert t == best, (i, t, best)
                assert m.consume_token(t)
        assert m.is_accepting()


def test_sampling_is_reproducible_per_seed(path):
    base = {"prompt": "List: ", "grammar": {"json_schema": NUMBERS}, "max_tokens": 48}
    todo = [{**base, "temperature": 1.2, "seed": s} for s in (1, 1, 2, 3, 4, 5)]
    outs = run(path, todo)
    assert outs[0] == outs[1]
    assert len({json.dumps(o["tokens"]) for o in outs[1:]}) > 2
    assert run(path, todo[:3], sandboxed=True) == outs[:3]  # the same draws in the sandbox


# ---------------------------------------------------------------------------------- padded vocabulary


def test_padded_rows_are_never_allowed(path, tmp_path, tok):
    """A copy of the checkpoint with 64 extra output rows whose logits beat the real ones:
    unconstrained greedy decoding picks them, constrained decoding never does."""
    from safetensors.torch import load_file, save_file

    padded = tmp_path / "padded"
    shutil.copytree(path, padded)
    cfg = json.loads((padded / "config.json").read_text())
    (weights,) = padded.glob("*.safetensors")
    w = load_file(weights)
    v = cfg["vocab_size"]
    gen = torch.Generator().manual_seed(0)
    rows = torch.randint(0, v, (64,), generator=gen)
    w["lm_head.weight"] = torch.cat([w["lm_head.weight"], 40 * w["lm_head.weight"][rows]])
    w["model.embed_tokens.weight"] = torch.cat(
        [w["model.embed_tokens.weight"], w["model.embed_tokens.weight"][rows]]
    )
    save_file(w, weights, metadata={"format": "pt"})
    cfg["vocab_size"] = v + 64
    (padded / "config.json").write_text(json.dumps(cfg))
    assert tok.vocab_size == v

    plain = """
import json
from pastry.sdk import Context, MaxTokens, Sampler

async def main(args):
    ctx = Context()
    ctx.fill_tokens([101, 202, 303])
    await ctx.generate(Sampler(), MaxTokens(8))
    return json.dumps(ctx.tokens[3:])
"""
    events, _ = asyncio.run(run_all(load_engine(padded), [(plain, [])]))
    assert any(t >= v for t in json.loads(result(events[0])))  # the trap works
    todo = [
        o
        for g in ({"json_schema": PERSON}, {"regex": REGEXES[2]}, {"lark": PAIRS})
        for o in launches(g, 64, [[101, 202, 303]])
    ]
    for o, out in zip(todo, run(padded, todo), strict=True):
        assert out["complete"] and all(t < v for t in out["tokens"]), (o, out)


# ---------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("grammar", "message"),
    [
        ({"lark": "start: foo("}, "invalid lark grammar"),
        ({"regex": "a(b"}, "invalid regex grammar"),
        ({"ebnf": "x"}, "grammar must be one of"),
        (None, 'give "grammar"'),
    ],
)
@pytest.mark.parametrize("sandboxed", [False, True])
def test_bad_grammars_fail_with_a_message(path, grammar, message, sandboxed):
    opts = {"prompt": "x", "grammar": grammar}
    if sandboxed:
        sandbox_or_skip()
    go = run_sandboxed if sandboxed else run_all
    events, _ = asyncio.run(go(load_engine(path), [(SRC, [json.dumps(opts)])]))
    end = events[0][-1]
    assert isinstance(end, Failed) and message in end.error, end


@pytest.mark.parametrize("sandboxed", [False, True])
def test_device_mask_equals_the_pull_path(path, sandboxed):
    """Greedy decoding with the mask applied on the device gives exactly the tokens of the
    inferlet-side pick over the pulled distribution, with the same number of steps; sampled
    outputs from the device path still parse."""
    grammars = [{"json_schema": PERSON}, {"regex": REGEXES[2]}, {"lark": PAIRS}]
    todo = [
        {"prompt_tokens": [11, 22, 33, 44], "grammar": g, "max_tokens": 48, "device_mask": d}
        for g in grammars
        for d in (True, False)
    ]
    outs = run(path, todo, sandboxed)
    for device, pulled in zip(outs[::2], outs[1::2], strict=True):
        assert device["tokens"] == pulled["tokens"]
        assert device["forward_calls"] == pulled["forward_calls"]
    hot = run(path, [{**todo[0], "temperature": 1.3, "seed": s} for s in range(4)], sandboxed)
    for o in hot:
        json.loads(o["text"])
