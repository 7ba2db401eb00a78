"""The agent built-ins of the Pie paper's §7.1 (``react``, ``codeact``, ``swarm``), each
checked by its defining property (the tiny random model writes gibberish, so the agents'
structure comes from program logic and every check holds for any model):

- ``react``: tool calls reach a local HTTP server with arguments derived from the
  generated tokens; the tokens equal a reference run (the SDK's ``Context``) in which the
  tool results are known beforehand; the engine forwards every token of the transcript
  once (no re-prefill after a tool call). The optimizations: the tool documentation's KV
  is forwarded once for several agents; an early call overlaps generation (the server sees
  tokens sampled while it holds the request); dropped observations free their pages and
  the tokens equal one masked forward over the whole transcript.
- ``codeact``: the restricted evaluator computes what Python computes and rejects imports,
  attribute access, unknown calls and oversized values before running anything; the
  agent's programs, their outputs and tokens equal a reference run.
- ``swarm``: every task and answer is delivered, and each worker's tokens (and the
  coordinator's summaries) equal the same generation run alone.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from urllib.parse import parse_qs, urlsplit

import numpy as np
import pytest

from inferlet_util import load_engine, result
from pastry.control.controller import Controller
from pastry.runtime.trusted import Program, TrustedRuntime
from pastry.wire.calls import EmbedTxt, Forward, Sample, ids
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


# ------------------------------------------------------------------------- a tool server


def observation(step: int, tokens: list[int]) -> str:
    """What the test tool answers for a call (deterministic, so a reference can know it)."""
    return f"result {step}: {sum(tokens) % 1000}"


@dataclass
class ToolServer:
    """A local HTTP tool: ``GET /tool?step=k&tokens=a,b,...`` answers :func:`observation`
    after ``delay`` seconds, or, with ``hold``, once ``counters.samples`` has reached
    ``hold(step)`` (at most 10 s). Records every call as :class:`Call`."""

    delay: float = 0.0
    counters: Counters | None = None
    hold: Callable[[int], int] | None = None
    calls: list[Call] = field(default_factory=list)

    def __post_init__(self) -> None:
        tool = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                query = parse_qs(urlsplit(self.path).query)
                step = int(query["step"][0])
                tokens = [int(t) for t in query["tokens"][0].split(",")]
                samples = (lambda: tool.counters.samples) if tool.counters else (lambda: 0)
                arrival = samples()
                if tool.hold is None:
                    time.sleep(tool.delay)
                else:
                    deadline = time.monotonic() + 10.0
                    while samples() < tool.hold(step) and time.monotonic() < deadline:
                        time.sleep(0.001)
                tool.calls.append(Call(step, tokens, arrival, samples()))
                body = observation(step, tokens).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, args=(0.02,), daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/tool"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@dataclass(frozen=True)
class Call:
    step: int
    tokens: list[int]
    arrival: int  # tokens the engine had sampled when the request arrived
    reply: int  # ... when it was answered


@pytest.fixture
def tool():
    servers = []

    def make(**kw) -> ToolServer:
        servers.append(ToolServer(**kw))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


# ------------------------------------------------------------------------- ReAct

# The same agent written plainly on the SDK's Context, the tool results computed locally.
REACT_REFERENCE = """
import json
from pastry.sdk import Context, MaxTokens, Sampler

async def main(args):
    o = json.loads(args[0])
    ctx = Context()
    ctx.fill_tokens(o.get("tools", []) + o["prompt"])
    steps = []
    for k in range(o["steps"]):
        ctx.fill("\\nThought:")
        n0 = len(ctx.tokens)
        await ctx.generate(Sampler(), MaxTokens(o["thought_tokens"]))
        thought = ctx.tokens[n0:]
        used = thought[: o.get("call_after") or o["thought_tokens"]]
        ctx.fill("\\nObservation: result %d: %d\\n" % (k, sum(used) % 1000))
        steps.append(thought)
    ctx.fill("\\nAnswer:")
    n0 = len(ctx.tokens)
    await ctx.generate(Sampler(), MaxTokens(o["answer_tokens"]))
    return json.dumps({"steps": steps, "answer": ctx.tokens[n0:], "tokens": len(ctx.tokens)})
"""

REACT = {"steps": 3, "thought_tokens": 6, "call_after": 3, "answer_tokens": 5}


def react_args(tool: ToolServer, prompt: list[int], **kw) -> dict:
    return {"prompt": prompt, "tool_url": tool.url, **REACT, **kw}


def test_react_keeps_the_kv_across_tool_calls(ckpt, tool):
    """Three agents at once: every tool call reaches the server with the arguments derived
    from that step's thought; the tokens equal the reference that knows the tool results;
    the engine forwards each transcript token once (the last generated one never)."""
    server = tool(delay=0.02)
    prompts = random_tokens(1, 7, 5, 9)
    runs = run_agents(ckpt, [("react", react_args(server, p)) for p in prompts])
    ref = run_agents(ckpt, [(REACT_REFERENCE, {"prompt": p, **REACT}) for p in prompts])
    for got, want in zip(runs.results, ref.results, strict=True):
        assert [s["thought"] for s in got["steps"]] == want["steps"]
        assert got["answer"] == want["answer"] and got["tokens"] == want["tokens"]
        assert got["tools_cache"] == "off"
        for k, s in enumerate(got["steps"]):
            assert s["status"] == 200 and s["observation"] == observation(k, s["thought"][:3])
            assert f"step={k}&tokens=" in s["url"]
    calls = sorted((c.step, c.tokens) for c in server.calls)
    made = sorted((k, s["thought"][:3]) for r in runs.results for k, s in enumerate(r["steps"]))
    assert calls == made and len(calls) == 3 * REACT["steps"]
    # no re-prefill: every transcript token but the last is forwarded once
    assert [r["forwarded"] for r in runs.results] == [r["tokens"] - 1 for r in runs.results]
    assert runs.counters.forwarded == sum(r["tokens"] - 1 for r in runs.results)
    assert runs.pages_in_use == 0


def test_react_exports_the_tool_docs_once(ckpt, tool):
    """With export_tools, of three agents starting together one prefills the tools' KV and
    exports it; the others wait for it and import it: the engine forwards the tools once
    for them, and the tokens equal the reference that prefills everything (and a fourth
    agent without the option). The export outlives the agents."""
    server = tool()
    tools, *prompts = random_tokens(2, 22, 6, 4, 8)  # 22: a partial last page
    launches = [("react", react_args(server, p, tools=tools, export_tools=True)) for p in prompts]
    runs = run_agents(ckpt, [*launches, ("react", react_args(server, prompts[0], tools=tools))])
    ref = run_agents(
        ckpt, [(REACT_REFERENCE, {"prompt": p, "tools": tools, **REACT}) for p in prompts]
    )
    shared, plain = runs.results[:3], runs.results[3]
    assert sorted(r["tools_cache"] for r in shared) == ["hit", "hit", "miss"]
    for got, want in zip(shared, ref.results, strict=True):
        assert [s["thought"] for s in got["steps"]] == want["steps"]
        assert got["answer"] == want["answer"]
        imported = len(tools) if got["tools_cache"] == "hit" else 0
        assert got["forwarded"] == got["tokens"] - 1 - imported
    assert plain["steps"] == shared[0]["steps"] and plain["answer"] == shared[0]["answer"]
    own = sum(r["forwarded"] for r in shared)
    assert runs.counters.forwarded == own + plain["tokens"] - 1
    [(name, kind, pages)] = runs.exports  # persistent: it outlives the agents
    assert name.startswith("react-tools/") and kind == "kv" and pages == 6
    assert runs.pages_in_use == 6


def test_react_early_call_overlaps_generation(ckpt, tool):
    """early_call: the request of step k is sent after call_after thought tokens and the
    server holds it until the engine has sampled the rest of the thought; without it, the
    request comes after the whole thought and nothing is sampled while it is out. The
    tokens are the same. (The engine is slowed to 40 ms a batch, so the request surely
    arrives before the thought is complete.)"""
    T, after = REACT["thought_tokens"], REACT["call_after"]
    prompt = random_tokens(3, 6)[0]
    early_counters = Counters(batch_delay=0.04)
    early = tool(counters=early_counters, hold=lambda k: (k + 1) * T)
    late_counters = Counters()
    late = tool(counters=late_counters, delay=0.05)
    [overlapped] = run_agents(
        ckpt, [("react", react_args(early, prompt, early_call=True))], early_counters
    ).results
    [waited] = run_agents(ckpt, [("react", react_args(late, prompt))], late_counters).results
    strip = [{k: v for k, v in s.items() if k != "url"} for s in waited["steps"]]
    assert [{k: v for k, v in s.items() if k != "url"} for s in overlapped["steps"]] == strip
    assert overlapped["answer"] == waited["answer"]
    assert [c.step for c in early.calls] == [c.step for c in late.calls] == [0, 1, 2]
    for k, c in enumerate(early.calls):
        assert k * T + after <= c.arrival < (k + 1) * T <= c.reply, c
    for k, c in enumerate(late.calls):
        assert c.arrival == c.reply == (k + 1) * T, c


def transcript(tok, prompt: list[int], res: dict) -> tuple[list[int], list[int], list[range]]:
    """The agent's tokens, the indices of the generated ones, and each observation's span."""
    from pastry.inferlets.react import ANSWER, OBSERVATION, THOUGHT

    seq, generated, spans = list(prompt), [], []
    for s in res["steps"]:
        seq += tok.encode(THOUGHT)
        generated += range(len(seq), len(seq) + len(s["thought"]))
        seq += s["thought"]
        obs = tok.encode(OBSERVATION.format(s["observation"]))
        spans.append(range(len(seq), len(seq) + len(obs)))
        seq += obs
    seq += tok.encode(ANSWER)
    generated += range(len(seq), len(seq) + len(res["answer"]))
    return seq + res["answer"], generated, spans


def masked_greedy(ckpt, seq: list[int], at: list[int], mask: np.ndarray) -> list[int]:
    """One forward over ``seq`` with ``mask`` on a fresh engine: the greedy token after
    each position ``i - 1`` for ``i`` in ``at``."""
    eng = load_engine(ckpt)
    n, m = len(seq), len(at)
    calls = [
        EmbedTxt(ids(seq), ids(range(n)), ids(range(n))),
        Forward(
            in_embeds=ids(range(n)),
            out_embeds=ids(range(n, n + m)),
            out_indices=ids([i - 1 for i in at]),
            mask=mask,
        ),
        *(Sample(n + j) for j in range(m)),
    ]
    return eng.execute(calls)[2:]


def test_react_drops_used_observations(ckpt, tool):
    """drop_results: each observation's pages are freed once the thought after it is
    complete, so the agent holds fewer pages; the tokens equal one forward over the whole
    transcript in which, from the last token of that thought on, no token attends to the
    observation. Without dropping, the same forward with a causal mask gives the plain
    agent's tokens."""
    from pastry.wire.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(ckpt)
    server = tool()
    prompt = random_tokens(4, 5)[0]
    args = react_args(server, prompt, steps=4)
    runs = run_agents(ckpt, [("react", {**args, "drop_results": True}), ("react", args)])
    dropped, kept = runs.results
    assert runs.pages_in_use == 0
    assert dropped["max_pages_held"] < kept["max_pages_held"]
    for res, drop in ((dropped, True), (kept, False)):
        seq, generated, spans = transcript(tok, prompt, res)
        assert len(seq) == res["tokens"]
        mask = np.tril(np.ones((len(seq), len(seq)), dtype=bool))
        if drop:
            for k, span in enumerate(spans[:-1]):  # the last one is read by the answer
                last_of_next_thought = generated[(k + 2) * REACT["thought_tokens"] - 1]
                mask[last_of_next_thought:, span.start : span.stop] = False
        assert masked_greedy(ckpt, seq, generated, mask) == [seq[i] for i in generated]


# ------------------------------------------------------------------------- CodeACT


def python_run(program: str, variables: dict):
    """What Python itself gives for a program the sandbox accepts (trusted test input): the
    value of the last statement, and the variables after it."""
    import ast

    env = dict(variables)
    *body, last = ast.parse(program).body
    exec(compile(ast.Module(body, []), "<test>", "exec"), {}, env)
    if isinstance(last, ast.Expr):
        return eval(compile(ast.Expression(last.value), "<test>", "eval"), {}, env), env
    exec(compile(ast.Module([last], []), "<test>", "exec"), {}, env)
    target = last.targets[0] if isinstance(last, ast.Assign) else last.target
    return env[target.id], env


SANDBOX_OK = [
    "x = 3\ny = x * 4 + 1\ny // 2",
    "max(1, 2, abs(-5)) - min(7, 3)",
    "1 < 2 < 3 and not False",
    "z = 10\nz += 5\nz %= 4",
    "7 / 2 if 7 > 2 else -1.5",
    "round(2.675, 2) + int(3.9) + float(1)",
    "2 ** 64 - 1",
    "(0 or 4) and 9",
]

SANDBOX_REJECTED = [
    ("import os", "import is not allowed"),
    ("from os import path", "import is not allowed"),
    ("open('f')", "call of open is not allowed"),
    ("x = 'f'", "str constant"),
    ("open(1)", "call of open is not allowed"),
    ("__import__('os')", "not allowed"),
    ("(1).__class__", "attribute access is not allowed"),
    ("x = 1\nx.__class__.__bases__", "attribute access is not allowed"),
    ("exec(1)", "call of exec is not allowed"),
    ("getattr(1, 2)", "call of getattr is not allowed"),
    ("globals()", "call of globals is not allowed"),
    ("lambda: 1", "lambda is not allowed"),
    ("[1, 2]", "List is not allowed"),
    ("def f(): pass", "def is not allowed"),
    ("while 1: pass", "while is not allowed"),
    ("_x = 1", "name '_x' is not allowed"),
    ("abs(x=1)", "positional"),
    ("y = 1\nimport sys", "import is not allowed"),  # nothing runs: y stays undefined
    ("10 ** 5000", "too large"),
    ("2 ** 4000 * 2 ** 4000", "bits"),
    ("1 // 0", "ZeroDivisionError"),
    ("undefined + 1", "not defined"),
    ("(-8) ** 0.5", "complex"),
]


def test_sandbox_computes_what_python_computes():
    from pastry.inferlets.codeact import Sandbox

    box, env = Sandbox(), {}
    for program in SANDBOX_OK:
        want, env = python_run(program, env)
        got = box.run(program)
        assert got == want and type(got) is type(want), program
        assert box.variables == env, program


@pytest.mark.parametrize("program,why", SANDBOX_REJECTED)
def test_sandbox_rejects_everything_else(program, why):
    from pastry.inferlets.codeact import Sandbox, SandboxError

    box = Sandbox()
    box.run("x = 5")
    with pytest.raises(SandboxError, match=why):
        box.run(program)
    assert box.variables == {"x": 5}  # a failed program changes nothing


CODEACT_REFERENCE = """
import json
from pastry.sdk import Context, MaxTokens, Sampler
from pastry.inferlets.codeact import CODE, RESULT, ANSWER

async def main(args):
    o = json.loads(args[0])
    ctx = Context()
    ctx.fill_tokens(o["prompt"])
    steps = []
    for s in o["steps"]:
        ctx.fill(CODE)
        n0 = len(ctx.tokens)
        await ctx.generate(Sampler(), MaxTokens(o["code_tokens"]))
        steps.append(ctx.tokens[n0:])
        ctx.fill(RESULT.format(s["program"], s["output"]))
    ctx.fill(ANSWER)
    n0 = len(ctx.tokens)
    await ctx.generate(Sampler(), MaxTokens(o["answer_tokens"]))
    return json.dumps({"steps": steps, "answer": ctx.tokens[n0:], "tokens": len(ctx.tokens)})
"""


def test_codeact_runs_derived_programs_and_keeps_the_kv(ckpt):
    """Each step's program is derived from that step's tokens, its output is what Python
    computes, the next program uses the previous result, and the tokens equal a reference
    that appends the same programs and outputs; every token is forwarded once."""
    from pastry.inferlets.codeact import derive_program

    prompts = random_tokens(5, 6, 9)
    opts = {"steps": 4, "code_tokens": 5, "answer_tokens": 4}
    runs = run_agents(ckpt, [("codeact", {"prompt": p, **opts}) for p in prompts])
    refs = run_agents(
        ckpt,
        [
            (CODEACT_REFERENCE, {**opts, "prompt": p, "steps": r["steps"]})
            for p, r in zip(prompts, runs.results, strict=True)
        ],
    )
    for r, ref in zip(runs.results, refs.results, strict=True):
        env, previous = {}, None
        for k, s in enumerate(r["steps"]):
            assert s["program"] == derive_program(k, s["tokens"], previous)
            try:
                value, env = python_run(s["program"], env)
            except ZeroDivisionError:
                assert not s["ok"] and "ZeroDivisionError" in s["output"]
                continue
            assert s["ok"] and s["output"] == repr(value)
            previous = f"x{k}"
        assert r["variables"] == env
        assert [s["tokens"] for s in r["steps"]] == ref["steps"]
        assert r["answer"] == ref["answer"] and r["tokens"] == ref["tokens"]
    assert runs.counters.forwarded == sum(r["tokens"] - 1 for r in runs.results)
    assert runs.pages_in_use == 0


def test_codeact_reports_rejected_programs_to_the_model(ckpt):
    """A forbidden program does not end the agent: its error is the step's output."""
    programs = ["y = 6 * 7", "import os", "y + 1", "open(1)"]
    [r] = run_agents(
        ckpt, [("codeact", {"prompt": "Compute.", "steps": 4, "programs": programs})]
    ).results
    assert [s["output"] for s in r["steps"]][::2] == ["42", "43"]
    assert [s["ok"] for s in r["steps"]] == [True, False, True, False]
    assert "import is not allowed" in r["steps"][1]["output"]
    assert "call of open is not allowed" in r["steps"][3]["output"]
    assert r["variables"] == {"y": 42}


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
