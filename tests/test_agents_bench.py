"""benchmarks/agents.py's pieces: BFCL's schema dialect made JSON Schema, the client's step
grammar (the same tool grammar the react inferlet writes under), and BFCL's own AST check
loaded from its wheel (skipped where the wheel cannot be fetched)."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

from pastry.control.constraints import HostConstraint
from pastry.engine.checkpoint import load_checkpoint
from pastry.sdk.tools import Tool

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"

FUNCTION = {  # BFCL's dialect: "dict", "float", "tuple", "any"
    "name": "geometry.area",
    "description": "Area of a shape.",
    "parameters": {
        "type": "dict",
        "properties": {
            "shape": {"type": "string", "enum": ["circle", "square"]},
            "size": {"type": "float", "description": "radius or side"},
            "origin": {"type": "tuple", "items": {"type": "integer"}},
            "note": {"type": "any"},
            "type": {"type": "string", "description": "a property named type"},
        },
        "required": ["shape", "size"],
        "optional": True,  # not JSON Schema: dropped
    },
}


@pytest.fixture(scope="module")
def bench():
    """benchmarks/agents.py and bfcl.py, the directory on sys.path only while importing
    (benchmarks/agents.py would shadow the openai-agents package ``agents``)."""
    sys.path.insert(0, str(BENCH))
    try:
        mods = importlib.import_module("bfcl"), importlib.import_module("agents")
    finally:  # agents.py inserts the directory too
        while str(BENCH) in sys.path:
            sys.path.remove(str(BENCH))
        sys.modules.pop("agents", None)
    return mods


def test_bfcl_schemas_become_json_schema(bench):
    bfcl, _ = bench
    tool = bfcl.openai_tool(FUNCTION, "http://127.0.0.1:1/geometry.area")
    params = tool["function"]["parameters"]
    assert params["type"] == "object" and "optional" not in params
    props = params["properties"]
    assert props["size"] == {"type": "number", "description": "radius or side"}
    assert props["origin"] == {"type": "array", "items": {"type": "integer"}}
    assert props["note"] == {}  # any value
    assert props["type"]["type"] == "string"  # a property's name is not a keyword
    assert params["required"] == ["shape", "size"]
    assert Tool.from_spec(tool).url.endswith("/geometry.area")


def test_the_clients_step_grammar_admits_what_react_writes(bench, smollm2_gguf):
    bfcl, agents = bench
    tools = [Tool.from_spec(bfcl.openai_tool(FUNCTION, "http://127.0.0.1:1/a"))]
    ckpt = load_checkpoint(smollm2_gguf)
    tok, eos = ckpt.tokenizer, ckpt.config.eos_token_ids

    def accepts(grammar: str, text: str) -> bool:
        c = HostConstraint(tok, ckpt.config.vocab_size, eos, json.dumps({"lark": grammar}))
        try:
            c.consume(tok.encode(text))
        except Exception:
            return False
        return c.state()[0]

    call = 'Action: geometry.area\nAction Input: {"shape": "circle", "size": 2.5}\n'
    grammar = agents.step_grammar(tools, act=True)
    assert accepts(grammar, "Thought: I need the area\n" + call)
    assert accepts(grammar, "Thought: I know it\nFinal Answer: 19.6")
    assert not accepts(grammar, "Thought: x\n" + call.replace("circle", "triangle"))
    assert not accepts(grammar, "Thought: x\nAction: area\nAction Input: {}\n")
    assert not accepts(grammar, call)  # a thought first
    final_only = agents.step_grammar(tools, act=False)
    assert accepts(final_only, "Thought: done\nFinal Answer: 4")
    assert not accepts(final_only, "Thought: again\n" + call)


def test_bfcl_ast_check_from_the_wheel(bench):
    bfcl, _ = bench
    try:
        tasks = bfcl.load_tasks("simple_python")
    except RuntimeError as e:  # no registry here
        pytest.skip(f"bfcl-eval's wheel cannot be fetched: {e}")
    assert len(tasks) == 400
    task = next(t for t in tasks if t.id == "simple_python_0")
    assert "triangle" in task.question
    good = {"calculate_triangle_area": {"base": 10, "height": 5}}
    assert bfcl.ast_check(task, [good]) == (True, "")
    valid, error = bfcl.ast_check(task, [{"calculate_triangle_area": {"base": 10, "height": 6}}])
    assert not valid and "height" in error
    assert not bfcl.ast_check(task, [{"calculate_area": {"base": 10, "height": 5}}])[0]
    assert not bfcl.ast_check(task, [])[0]
    dotted = next(t for t in tasks if t.id == "simple_python_1")  # math.factorial
    assert bfcl.ast_check(dotted, [{"math.factorial": {"number": 5}}])[0]
    assert len(bfcl.load_tasks("multiple")) == 200
