"""The agent built-ins of the Pie paper's §7.1 (``react``, ``codeact``, ``swarm``), each
checked by its defining property (the tiny random model writes gibberish, so the agents'
structure comes from program logic and every check holds for any model):

- ``react``: under the action grammar every call is well-formed (a tool of the list,
  arguments of its schema) and reaches a local HTTP server as written; its answer is the
  observation; the engine forwards every token of the transcript once (no re-prefill after
  a tool call). The optimizations: an early call forwards while the tool runs; dropped
  observations are masked. (On real weights: ``tests/test_agents_text.py``.)
- ``codeact``: whatever the model wrote is run and its output or error fed back (the
  interpreter itself: ``tests/test_interpreter.py``).
- ``swarm``: every task and answer is delivered, and each worker's tokens (and the
  coordinator's summaries) equal the same generation run alone.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources

import numpy as np
import pytest

from agents_util import ToolServer
from inferlet_util import load_engine, result
from pastry.control.controller import Controller
from pastry.runtime.trusted import Program, TrustedRuntime
from pastry.wire.calls import Forward, MaskKv, Sample
from pastry.wire.handle import InProcessEngine


def source(name: str) -> str:
    return resources.files("pastry.inferlets").joinpath(f"{name}.py").read_text()


@pytest.fixture(scope="module")
def ckpt(make_tiny):
    return make_tiny("llama")


def random_tokens(seed: int, *lengths: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 7000, n).tolist() for n in lengths]


# ------------------------------------------------------------------------- running agents


@dataclass
class Counters:
    """What the engine ran, counted by a wrapper around the engine handle's ``execute``."""

    forwarded: int = 0  # input tokens of every Forward
    samples: int = 0  # Sample calls executed
    masks: int = 0  # MaskKv calls
    peak_pages: int = 0  # most KV pages in use when a batch ran
    batch_delay: float = 0.0  # seconds added to every batch (a slower engine)


@dataclass
class Runs:
    results: list[dict]
    counters: Counters
    exports: list[tuple[str, str, int]]
    pages_in_use: int  # at the end
    dropped_messages: int = 0


def run_agents(
    ckpt,
    launches: Sequence[tuple[str, dict]],
    counters: Counters | None = None,
    http_allow: Sequence[str] = ("127.0.0.1",),
    **pools,
) -> Runs:
    """Launch every (inferlet name or source, args) at once on one engine; their results."""
    counters = counters or Counters()

    async def go() -> Runs:
        handle = InProcessEngine(load_engine(ckpt, **pools))
        inner = handle.execute

        async def execute(batch):
            counters.forwarded += sum(c.num_inputs for c in batch if isinstance(c, Forward))
            counters.masks += sum(1 for c in batch if isinstance(c, MaskKv))
            counters.peak_pages = max(counters.peak_pages, res.referenced("kv"))
            out = await inner(batch)
            if counters.batch_delay:
                await asyncio.sleep(counters.batch_delay)
            counters.samples += sum(1 for c in batch if isinstance(c, Sample))
            return out

        handle.execute = execute  # before the controller binds it
        controller = Controller([handle], http_allow=list(http_allow))
        res = next(iter(controller.models.values())).resources
        rt = TrustedRuntime(controller)
        programs: dict[str, Program] = {}
        insts = []
        for name, args in launches:
            src = name if "\n" in name else source(name)
            prog = programs.get(src) or programs.setdefault(src, Program.from_source("t", src))
            insts.append(rt.launch(prog, [json.dumps(args)]))

        async def collect(inst):
            return [ev async for ev in inst.events()]

        events = await asyncio.gather(*(collect(i) for i in insts))
        res.check_integrity()
        out = Runs(
            [json.loads(result(e)) for e in events],
            counters,
            res.list_exports(),
            res.referenced("kv"),
        )
        await controller.close()
        handle.close()
        return out

    return asyncio.run(go())


# ------------------------------------------------------------------------- ReAct
# On the tiny random model the thoughts are gibberish; the grammar still makes every action
# a well-formed call (with "tool_choice": "required" the first one is a call).


@pytest.fixture
def weather():
    server = ToolServer({"weather": lambda a: f"Sunny in {a['city']}, 21 C."})
    yield server
    server.close()


def weather_tool(server: ToolServer) -> dict:
    return server.tool("weather", "The weather in a city", {"city": {"type": "string"}})


def react_args(server: ToolServer, question: str, **kw) -> dict:
    return {"question": question, "tools": [weather_tool(server)], "tool_choice": "required",
            "thought_tokens": 6, "answer_tokens": 4, "max_steps": 3, **kw}  # fmt: skip


def test_react_calls_are_well_formed_and_the_kv_is_kept(ckpt, weather):
    """Three agents at once: every action is a call of the tool with arguments of its
    schema (a string city), received by the server as written in the transcript; its
    answer follows as the observation; each transcript token is forwarded once; the
    instruction with the tool list is shared through the prefix cache."""
    questions = ["Weather in Paris?", "Weather in Oslo?", "Weather in Lima?"]
    runs = run_agents(ckpt, [("react", react_args(weather, q)) for q in questions])
    calls = [args for _, args in weather.calls]
    made = [s["arguments"] for r in runs.results for s in r["steps"]]
    assert sorted(map(str, calls)) == sorted(map(str, made)) and made
    for r in runs.results:
        assert r["stop"] in ("final_answer", "max_tokens") and 1 <= len(r["steps"]) <= 3
        for s in r["steps"]:
            assert s["tool"] == "weather" and set(s["arguments"]) == {"city"}
            assert isinstance(s["arguments"]["city"], str) and s["ok"]
            assert s["observation"] == f"Sunny in {s['arguments']['city']}, 21 C."
            action = f"Action: weather\nAction Input: {json.dumps(s['arguments'])}\n"
            assert action + f"Observation: {s['observation']}\n" in r["text"]
    assert runs.counters.forwarded == sum(
        r["tokens"] - 1 - r["cached_tokens"] for r in runs.results
    )
    assert runs.pages_in_use == 0


def test_react_early_call_forwards_while_the_tool_runs(ckpt):
    """With ``early_call`` the agent forwards ``Observation:`` while the tool is still
    answering: when the tool replies, the engine has forwarded more than the same agent
    without it, which forwards nothing during the call; the tokens are the same."""
    seen: list[tuple[int, int]] = []  # (forwarded when the call arrived, when it answers)
    current = [Counters()]

    def slow(args: dict) -> str:
        before = current[0].forwarded
        time.sleep(0.3)
        seen.append((before, current[0].forwarded))
        return "done"

    server = ToolServer({"weather": slow})
    texts = []
    try:
        for early in (True, False):
            current[0] = Counters()
            args = react_args(server, "Weather?", early_call=early, max_steps=1)
            texts.append(run_agents(ckpt, [("react", args)], current[0]).results[0]["text"])
    finally:
        server.close()
    (_, early_end), (late_start, late_end) = seen
    assert late_end == late_start and early_end > late_end
    assert texts[0] == texts[1]


def test_react_drop_results_masks_read_observations(ckpt, weather):
    """With ``drop_results`` each observation's slots are masked once the thought after it
    is written: more ``mask_kvpage`` calls reach the engine than without."""
    counts = []
    for drop in (False, True):
        counters = Counters()
        run_agents(ckpt, [("react", react_args(weather, "Weather?", drop_results=drop))], counters)
        counts.append(counters.masks)
    assert counts[1] > counts[0]  # (others mask slots too: the prefix cache, say)


def test_react_without_calls_answers_and_repeats_end_the_calls(ckpt, weather):
    """``tool_choice`` "none" answers at once; a call that repeats an earlier one leaves
    only the final answer (no step after it)."""
    runs = run_agents(ckpt, [("react", react_args(weather, "Hi", tool_choice="none"))])
    assert runs.results[0]["steps"] == [] and "Final Answer:" in runs.results[0]["text"]
    runs = run_agents(ckpt, [("react", react_args(weather, "Weather?", max_steps=6))])
    steps = runs.results[0]["steps"]
    for k, s in enumerate(steps[:-1]):  # only the last call may repeat an earlier one
        assert all((s["arguments"] != t["arguments"]) for t in steps[:k])


# ------------------------------------------------------------------------- CodeACT


def test_codeact_runs_what_the_model_wrote(ckpt):
    """The tiny model's code (gibberish) is run and its error fed back as the output; the
    agent ends at a final answer or its token budget, within ``max_steps`` programs."""
    args = {"question": "Compute 6 * 7.", "max_steps": 2, "code_tokens": 8, "answer_tokens": 4}
    [r] = run_agents(ckpt, [("codeact", args)]).results
    assert 1 <= len(r["steps"]) <= 2 and r["stop"] in ("final_answer", "max_tokens")
    for s in r["steps"]:
        shown = (s["output"] + (s["error"] or "")).strip() or "(nothing printed)"
        assert f"Output:\n{shown}\n" in r["text"]
        assert r["text"].count("```python\n") == len(r["steps"])


# ------------------------------------------------------------------------- Swarm

SWARM_WORKER_ALONE = """
import json
from pastry.sdk import Context, MaxTokens, Sampler
from pastry.inferlets.swarm import TASK

async def main(args):
    o = json.loads(args[0])
    ctx = Context()
    ctx.fill_tokens(o["persona"])
    out = []
    for task in o["tasks"]:
        ctx.fill(TASK.format(task))
        n0 = len(ctx.tokens)
        await ctx.generate(Sampler(), MaxTokens(o["answer_tokens"]))
        out.append(ctx.tokens[n0:])
    return json.dumps(out)
"""

SWARM_COORDINATOR_ALONE = """
import json
import pastry.sdk as px
from pastry.sdk import Context, MaxTokens, Sampler
from pastry.inferlets.swarm import REPLY, SUMMARY

async def main(args):
    o = json.loads(args[0])
    ctx = Context()
    ctx.fill(o["task"])
    out = []
    for answers in o["answers"]:
        for name in sorted(answers):
            ctx.fill(REPLY.format(name, px.detokenize(ctx.queue, answers[name])))
        ctx.fill(SUMMARY)
        n0 = len(ctx.tokens)
        await ctx.generate(Sampler(), MaxTokens(o["summary_tokens"]))
        out.append(ctx.tokens[n0:])
    return json.dumps(out)
"""


def test_swarm_delivers_every_message_and_matches_solo_runs(ckpt):
    """A coordinator and three workers (one launched before it, two after): every task
    reaches every worker and every answer the coordinator; each worker's tokens equal its
    generation run alone on the tasks it got, and the summaries equal the coordinator's
    generation alone on those answers; each round's task is the last summary."""
    names = ["ant", "bee", "cat"]
    personas = random_tokens(6, 5, 7, 4)
    task = "Plan the picnic."
    workers = [
        ("swarm", {"role": "worker", "topic": "t1", "name": n, "persona": p, "answer_tokens": 5})
        for n, p in zip(names, personas, strict=True)
    ]
    boss = {"role": "coordinator", "topic": "t1", "task": task, "workers": 3, "rounds": 3}
    runs = run_agents(ckpt, [workers[0], ("swarm", {**boss, "summary_tokens": 6}), *workers[1:]])
    w0, coord, w1, w2 = runs.results
    assert coord["workers"] == names
    rounds = coord["rounds"]
    assert [r["delivered"] for r in rounds] == [3, 3, 3]
    assert rounds[0]["task"] == task
    for w in (w0, w1, w2):
        assert [r["round"] for r in w["rounds"]] == [0, 1, 2]
        assert [r["task"] for r in w["rounds"]] == [r["task"] for r in rounds]
        assert [r["tokens"] for r in w["rounds"]] == [r["answers"][w["name"]] for r in rounds]
    tasks = [r["task"] for r in rounds]
    alone = run_agents(
        ckpt,
        [(SWARM_WORKER_ALONE, {"persona": p, "tasks": tasks, "answer_tokens": 5}) for p in personas]
        + [
            (
                SWARM_COORDINATOR_ALONE,
                {"task": task, "answers": [r["answers"] for r in rounds], "summary_tokens": 6},
            )
        ],
    ).results
    for w, solo in zip((w0, w1, w2), alone[:3], strict=True):
        assert [r["tokens"] for r in w["rounds"]] == solo
    assert [r["summary"] for r in rounds] == alone[3]
    from pastry.wire.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(ckpt)
    assert tasks[1:] == [tok.decode(r["summary"]) for r in rounds[:-1]]
    assert runs.pages_in_use == 0
