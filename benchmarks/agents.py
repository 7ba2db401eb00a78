"""ReAct agents as inferlets vs as a client script over a completion API (Pie §7.1,
Figures 6 and 7).

    python benchmarks/agents.py [--quick] [--model DIR] [--device cpu|cuda]
                                [--delay-ms 100] [--client openai|inprocess]

Without --model, uses the random-weight ``small`` llama checkpoint of
``engine_decode.py`` (written into ~/.cache/pastry/bench/ once), bf16, greedy, page size
16, the adaptive batching policy.

The workflow: a prompt of ``tools`` documentation tokens (shared by every agent) and
``question`` tokens of its own (seeded random ids within the tokenizer's vocabulary); then
``steps`` times: "\nThought:", ``thought`` greedy tokens, a GET to a local tool server
(``?step=k&tokens=`` the first ``call_after`` thought tokens; a thread per request) that
answers after a fixed delay (``--delay-ms``) with a fixed-length text, appended as
"\nObservation: <text>\n"; then "\nAnswer:" and ``answer`` tokens. A wave of C agents
starts at once; latency is an agent's start to its end (mean over the wave), throughput is
C / (the wave's start to its last agent's end), in agents/s. Each configuration runs
``reps`` waves, interleaved with the configurations it is compared with, and reports its
best throughput (the machine is shared and noisy).

- (i) inferlet: the built-in ``react`` inferlet. The agent and its tool calls run next to
  the model; its context's KV stays across the calls, so every token is forwarded once.
- (ii) client: a script that calls a completion endpoint for every thought and for the
  answer, re-sending the whole transcript (one round trip and one re-prefill per call),
  and calls the tool itself in between. Two backends:

  - ``--client openai`` (default): a real server (``tests/server_util.running_server``:
    uvicorn, engine in-process); the client runs in a child process and calls
    ``POST /v1/completions`` through the ``openai`` package with the transcript as token
    ids; the inferlets are launched on the same server's runtime. The endpoint returns
    text, so the client encodes the generated text back to ids. The small checkpoint's
    output layer has 32000 rows but its tokenizer 7672 tokens: most generated ids decode to
    nothing, so the client's transcript is shorter than the inferlet's (see "forwarded"),
    and its outputs differ ("same output" 0): a favourable baseline.
  - ``--client inprocess``: no server; each run gets a fresh controller and trusted
    runtime over one ``InProcessEngine``, and the completion "endpoint" is a function that
    launches an inferlet filling a fresh context with the whole prompt (token ids in, token
    ids out: the same transcript as the inferlet's). No network round trip at all: a lower
    bound on a client's cost.

(b) Figure 7 (at 32 agents): the inferlet with the paper's three application-specific
optimizations added one after another: (#1) ``export_tools``: the documentation's KV is
prefilled once per wave (by the first agent; the others wait for its export) and imported;
exports are dropped between waves, so every wave starts cold; (#2) ``early_call``: the
tool request starts after ``call_after`` thought tokens and runs while the rest of the
thought is generated; (#3) ``drop_results``: once the next thought has read an
observation, its KV pages are freed and its slots in shared pages masked (later tokens
attend fewer tokens; the tokens differ from the plain run from then on).

"forwarded" is the number of input tokens the engine ran per agent (prefill plus decode);
"same output" counts agents whose tokens equal the plain inferlet's (a different batch
composition can flip a bf16 greedy choice; #3 changes the context on purpose).

Prints tables, then as the last line one JSON object with the headline numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import numpy as np
import torch

from machine import cpu_name  # benchmarks/ is on the path (the script's dir)
from pastry.control.controller import Controller
from pastry.control.events import Finished
from pastry.control.http import HttpClient
from pastry.control.users import LOCAL
from pastry.engine.engine import Engine
from pastry.inferlets.react import ANSWER, OBSERVATION, THOUGHT, tool_url
from pastry.runtime.trusted import Instance, Program, TrustedRuntime
from pastry.wire.calls import Call, Forward, Result
from pastry.wire.config import EngineConfig
from pastry.wire.handle import InProcessEngine
from pastry.wire.tokenizer import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_decode import small_checkpoint

PAGE_SIZE = 16
CONCURRENCY = (1, 8, 32, 64)
FIGURE7_AGENTS = 32
FILLER = [
    "alpha",
    "bravo",
    "charlie",
    "delta",
    "echo",
    "foxtrot",
    "golf",
    "hotel",
    "india",
    "juliett",
    "kilo",
    "lima",
]

COMPLETION = """
import json
from pastry.sdk import Context, MaxTokens, Sampler

async def main(args):
    o = json.loads(args[0])
    ctx = Context()
    ctx.fill_tokens(o["prompt"])
    await ctx.generate(Sampler(), MaxTokens(o["max_tokens"]))
    out = ctx.tokens[len(o["prompt"]) :]
    await ctx.release()
    return json.dumps(out)
"""

# Figure 7's steps: (label, JSON key, react options), each adding one optimization.
STEPS = (
    ("inferlet (KV kept)", "kept", {}),
    ("+ #1 export tool docs", "export", {"export_tools": True}),
    ("+ #2 call while generating", "early", {"export_tools": True, "early_call": True}),
    (
        "+ #3 drop used observations",
        "optimized",
        {"export_tools": True, "early_call": True, "drop_results": True},
    ),
)


@dataclass(frozen=True)
class Workload:
    tools: int  # documentation tokens, shared
    question: int  # tokens of each agent's own prompt
    steps: int  # tool calls per agent
    thought: int  # tokens generated before each call
    call_after: int  # thought tokens the call's arguments depend on
    answer: int
    delay: float  # seconds the tool takes per call
    observation_words: int  # length of the tool's answer


@dataclass
class Wave:
    latency: float  # mean seconds per agent
    makespan: float  # seconds from the start to the last agent's end
    forwarded: float  # engine input tokens per agent
    outputs: list[tuple[list[list[int]], list[int]]]  # (thoughts, answer) per agent
    pages: float = 0.0  # mean over the agents of the most KV pages each held (inferlets)

    @property
    def throughput(self) -> float:
        return len(self.outputs) / self.makespan


class CountingEngine:
    """An engine that counts the input tokens of every ``Forward`` (on the worker thread)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.info = engine.info
        self.forwarded = 0

    def execute(self, batch: Sequence[Call]) -> list[Result]:
        self.forwarded += sum(c.num_inputs for c in batch if type(c) is Forward)
        return self.engine.execute(batch)


class _Server(ThreadingHTTPServer):
    request_queue_size = 256  # a wave's requests arrive together
    daemon_threads = True


class ToolServer:
    """A local HTTP tool that answers every GET after ``delay`` seconds with a text of
    ``words`` words (one thread per request)."""

    def __init__(self, delay: float, words: int) -> None:
        self.calls = 0
        tool = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                query = parse_qs(urlsplit(self.path).query)
                step = int(query["step"][0])
                tokens = query.get("tokens", [""])[0]
                value = sum(int(t) for t in tokens.split(",") if t) % 1000
                time.sleep(delay)
                tool.calls += 1
                filler = " ".join(FILLER[(value + i) % len(FILLER)] for i in range(words))
                body = f"result {step}: {value:03d}; {filler}".encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        self.server = _Server(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/tool"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Agents:
    """The workload's prompts and the react arguments, shared by both backends."""

    def __init__(self, vocab: int, tool_url: str, wl: Workload) -> None:
        self.wl, self.tool_url = wl, tool_url
        rng = np.random.default_rng(0)
        self.tools = rng.integers(3, vocab, wl.tools).tolist()
        self.questions = [
            rng.integers(3, vocab, wl.question).tolist() for _ in range(max(CONCURRENCY))
        ]

    def react_args(self, question: list[int], options: dict) -> str:
        wl = self.wl
        return json.dumps(
            {
                "prompt": question,
                "tools": self.tools,
                "tool_url": self.tool_url,
                "steps": wl.steps,
                "thought_tokens": wl.thought,
                "call_after": wl.call_after,
                "answer_tokens": wl.answer,
                **options,
            }
        )


async def react_wave(launch, agents: Agents, n: int, options: dict) -> tuple[float, list]:
    """Launch ``n`` react inferlets at once (``launch(args) -> Instance``); (start, ends)."""
    t0 = time.perf_counter()
    insts = [launch(agents.react_args(q, options)) for q in agents.questions[:n]]
    return t0, await asyncio.gather(*(_finish(i) for i in insts))


def react_wave_result(t0: float, ends: list[tuple[float, str]], forwarded: int) -> Wave:
    results = [json.loads(data) for _, data in ends]
    outputs = [([s["thought"] for s in r["steps"]], r["answer"]) for r in results]
    wave = _wave(t0, [t for t, _ in ends], outputs, forwarded)
    wave.pages = float(np.mean([r["max_pages_held"] for r in results]))
    return wave


async def client_agent(complete, http, tok, agents: Agents, question: list[int]):
    """One agent driven from outside: a completion call (``complete(prompt ids, n) -> ids``)
    per thought and for the answer, each re-prefilling the whole transcript, and the tool
    call in between. Returns (end time, (thoughts, answer))."""
    wl = agents.wl
    seq = agents.tools + question
    thoughts = []
    for k in range(wl.steps):
        seq += tok.encode(THOUGHT)
        thought = await complete(seq, wl.thought)
        seq += thought
        response = await http.get(tool_url(agents.tool_url, k, thought[: wl.call_after]))
        seq += tok.encode(OBSERVATION.format(response.text))
        thoughts.append(thought)
    seq += tok.encode(ANSWER)
    answer = await complete(seq, wl.answer)
    return time.perf_counter(), (thoughts, answer)


class InProcess:
    """Backend ``inprocess``: a fresh controller and trusted runtime over the engine per
    wave; the client's completion service launches an inferlet per call."""

    name = "in-process completion service (a fresh context per call; no network)"

    def __init__(self, engine: Engine, tool_url: str, wl: Workload) -> None:
        self.counter = CountingEngine(engine)
        self.handle = InProcessEngine(self.counter)
        info = engine.info
        self.tok = Tokenizer.from_json(info.tokenizer_json, info.chat_template, info.special_tokens)
        self.agents = Agents(self.tok.vocab_size, tool_url, wl)
        self.react = Program.from_source(
            "react", resources.files("pastry.inferlets").joinpath("react.py").read_text()
        )
        self.completion = Program.from_source("completion", COMPLETION)

    def inferlets(self, n: int, options: dict) -> Wave:
        async def go():
            controller = Controller([self.handle], http_allow=["127.0.0.1"])
            rt = TrustedRuntime(controller)
            t0, ends = await react_wave(
                lambda a: rt.launch(self.react, [a]), self.agents, n, options
            )
            await controller.close()
            await self.handle.execute([])  # batches run in order: waits for those in flight
            return t0, ends

        counted = self.counter.forwarded
        t0, ends = asyncio.run(go())
        return react_wave_result(t0, ends, self.counter.forwarded - counted)

    def clients(self, n: int) -> Wave:
        async def go():
            controller = Controller([self.handle], http_allow=["127.0.0.1"])
            rt = TrustedRuntime(controller)
            http = HttpClient(["127.0.0.1"])

            async def complete(prompt: list[int], max_tokens: int) -> list[int]:
                args = json.dumps({"prompt": prompt, "max_tokens": max_tokens})
                _, data = await _finish(rt.launch(self.completion, [args]))
                return json.loads(data)

            t0 = time.perf_counter()
            runs = await asyncio.gather(
                *(
                    client_agent(complete, http, self.tok, self.agents, q)
                    for q in self.agents.questions[:n]
                )
            )
            await controller.close()
            await self.handle.execute([])
            return t0, runs

        counted = self.counter.forwarded
        t0, runs = asyncio.run(go())
        return _wave(
            t0, [t for t, _ in runs], [o for _, o in runs], self.counter.forwarded - counted
        )

    def close(self) -> None:
        self.handle.close()


class Served:
    """Backend ``openai``: a real server (``tests/server_util.running_server``: uvicorn,
    engine in-process); the inferlets are launched on its runtime, the client script runs
    in a child process and calls ``POST /v1/completions`` through the ``openai`` package
    with the transcript as token ids (the generated text is encoded back to ids)."""

    name = "POST /v1/completions through the openai package (client in its own process)"

    def __init__(self, path: Path, cfg: EngineConfig, tool_url: str, wl: Workload) -> None:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from server_util import running_server

        self._tmp = tempfile.TemporaryDirectory()
        self._cm = running_server(
            path,
            Path(self._tmp.name),
            dtype=cfg.dtype,
            page_size=cfg.page_size,
            num_pages=cfg.num_pages,
            num_embeds=cfg.num_embeds,
            engine_devices=(cfg.device,),
            http_allow=("127.0.0.1",),
        )
        self.url, self.server = self._cm.__enter__()
        self.model = self.server.models[0]
        m = self.server.controller.models[self.model]
        self.counter = m.engine.engine = CountingEngine(m.engine.engine)  # read per batch
        self.resources = m.resources
        self.path, self.wl = path, wl
        self.agents = Agents(m.tokenizer.vocab_size, tool_url, wl)
        spawn = multiprocessing.get_context("spawn")
        self.pool = ProcessPoolExecutor(1, mp_context=spawn)

    def _on_server(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.server.loop).result()

    def inferlets(self, n: int, options: dict) -> Wave:
        async def go():
            out = await react_wave(
                lambda a: self.server.launch("react", [a]), self.agents, n, options
            )
            for name, _, _ in self.resources.list_exports(LOCAL):  # the next wave starts cold
                if name.startswith("react-tools/"):
                    self.resources.unexport(None, name, owner=LOCAL)  # the local user's
            return out

        counted = self.counter.forwarded
        t0, ends = self._on_server(go())
        return react_wave_result(t0, ends, self.counter.forwarded - counted)

    def clients(self, n: int) -> Wave:
        counted = self.counter.forwarded
        t0, ends, outputs = self.pool.submit(
            openai_wave, self.url, self.model, self.path, self.agents, n
        ).result()
        return _wave(t0, ends, outputs, self.counter.forwarded - counted)

    def close(self) -> None:
        self.pool.shutdown()
        self._cm.__exit__(None, None, None)
        self._tmp.cleanup()


def openai_wave(url: str, model: str, path: Path, agents: Agents, n: int):
    """(Child process) ``n`` client agents at once against ``/v1/completions``."""
    import openai

    tok = Tokenizer.from_dir(path)

    async def go():
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        http = HttpClient(["127.0.0.1"])

        async def complete(prompt: list[int], max_tokens: int) -> list[int]:
            r = await client.completions.create(
                model=model, prompt=prompt, max_tokens=max_tokens, temperature=0
            )
            return tok.encode(r.choices[0].text)

        t0 = time.perf_counter()
        runs = await asyncio.gather(
            *(client_agent(complete, http, tok, agents, q) for q in agents.questions[:n])
        )
        await client.close()
        return t0, [t for t, _ in runs], [o for _, o in runs]

    return asyncio.run(go())


async def _finish(inst: Instance) -> tuple[float, str]:
    """(end time, result) of an instance; raises if it did not end with a result."""
    end = await inst.wait()
    if not isinstance(end, Finished):
        raise RuntimeError(f"{inst.program.name} ended with {end}")
    return time.perf_counter(), end.result


def _wave(t0: float, ends: list[float], outputs: list, forwarded: int) -> Wave:
    return Wave(float(np.mean(ends)) - t0, max(ends) - t0, forwarded / len(outputs), outputs)


def best(waves: list[Wave]) -> Wave:
    return max(waves, key=lambda w: w.throughput)


def same(a: Wave, b: Wave) -> int:
    return sum(x == y for x, y in zip(a.outputs, b.outputs, strict=True))


# --------------------------------------------------------------------------- sections


def section_concurrency(bench: InProcess | Served, levels: Sequence[int], reps: int) -> dict:
    print(
        "(a) inferlet vs client script, agents/s over one wave of C agents started together "
        f"(best of {reps}); latency = mean seconds per agent; forwarded = engine input tokens "
        "per agent"
    )
    print(
        "| agents | client s | client agents/s | client forwarded | inferlet s "
        "| inferlet agents/s | inferlet forwarded | **throughput inferlet / client** "
        "| latency client / inferlet | same output |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    out: dict[str, float] = {}
    for c in levels:
        ws_c, ws_i = [], []
        for _ in range(reps):  # alternate, so that slow phases of the machine hit both
            ws_c.append(bench.clients(c))
            ws_i.append(bench.inferlets(c, {}))
        cl, inf = best(ws_c), best(ws_i)
        ratio = inf.throughput / cl.throughput
        out[f"throughput_ratio_inferlet_vs_client_{c}"] = round(ratio, 3)
        out[f"agents_per_s_client_{c}"] = round(cl.throughput, 3)
        out[f"agents_per_s_inferlet_{c}"] = round(inf.throughput, 3)
        out[f"latency_s_client_{c}"] = round(cl.latency, 3)
        out[f"latency_s_inferlet_{c}"] = round(inf.latency, 3)
        print(
            f"| {c} | {cl.latency:.2f} | {cl.throughput:.2f} | {cl.forwarded:.0f} "
            f"| {inf.latency:.2f} | {inf.throughput:.2f} | {inf.forwarded:.0f} | {ratio:.2f}x "
            f"| {cl.latency / inf.latency:.2f}x | {same(cl, inf)}/{c} |"
        )
    return out


def section_optimizations(bench: InProcess | Served, n: int, reps: int) -> dict:
    print(
        f"(b) Figure 7: the inferlet at {n} agents with the three optimizations added one "
        f"after another, and the client script again, all interleaved (best of {reps})"
    )
    print(
        "| configuration | latency s | agents/s | forwarded/agent | KV pages/agent (max) "
        "| vs previous | **vs client** | same output as plain |"
    )
    print("|---|---|---|---|---|---|---|---|")
    clients: list[Wave] = []
    waves: dict[str, list[Wave]] = {key: [] for _, key, _ in STEPS}
    for _ in range(reps):
        clients.append(bench.clients(n))
        for _, key, options in STEPS:
            waves[key].append(bench.inferlets(n, options))
    cl = best(clients)
    client, plain = cl.throughput, best(waves["kept"])
    print(
        f"| client script (re-prefill per call) | {cl.latency:.2f} | {client:.2f} "
        f"| {cl.forwarded:.0f} | | | 1.00x | {same(cl, plain)}/{n} |"
    )
    out: dict[str, float] = {f"agents_per_s_client_b_{n}": round(client, 3)}
    previous = client
    for label, key, _ in STEPS:
        w = best(waves[key])
        out[f"agents_per_s_{key}_{n}"] = round(w.throughput, 3)
        out[f"throughput_ratio_{key}_vs_client_{n}"] = round(w.throughput / client, 3)
        print(
            f"| {label} | {w.latency:.2f} | {w.throughput:.2f} | {w.forwarded:.0f} "
            f"| {w.pages:.1f} | {w.throughput / previous:.2f}x | {w.throughput / client:.2f}x "
            f"| {same(w, plain)}/{n} |"
        )
        previous = w.throughput
    return out


# --------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="reduced run (same JSON keys)")
    ap.add_argument("--model", type=Path, help="checkpoint directory (default: the small one)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--delay-ms", type=float, default=100.0, help="tool latency per call")
    ap.add_argument(
        "--client",
        choices=("openai", "inprocess"),
        default="openai",
        help="how the client script reaches the model (see the module docstring)",
    )
    args = ap.parse_args()
    t_start = time.perf_counter()
    torch.manual_seed(0)
    path = args.model or small_checkpoint(args.device)
    delay = args.delay_ms / 1e3
    if args.quick:
        wl = Workload(48, 8, 3, 8, 4, 4, delay, 4)
        levels, reps = (1, 8, 32), 1
    else:
        wl = Workload(64, 8, 4, 8, 4, 4, delay, 4)
        levels, reps = CONCURRENCY, 2
    length = wl.tools + wl.question + wl.steps * (wl.thought + 8 * wl.observation_words + 24)
    cfg = EngineConfig(
        device=args.device,
        dtype="bfloat16",
        page_size=PAGE_SIZE,
        num_pages=max(levels) * (length // PAGE_SIZE + 8) * 2 + 256,
        num_embeds=max(levels) * (length + 8) * 2 + 1024,
        num_host_pages=1,
    )
    tool = ToolServer(wl.delay, wl.observation_words)
    if args.client == "openai":
        bench: InProcess | Served = Served(path, cfg, tool.url, wl)
    else:
        bench = InProcess(Engine.load(path, cfg), tool.url, wl)
    info = bench.counter.info
    tok = Tokenizer.from_json(info.tokenizer_json, info.chat_template, info.special_tokens)
    words = " ".join(FILLER[: wl.observation_words])
    obs = len(tok.encode(OBSERVATION.format(f"result 0: 000; {words}")))
    engine = bench.counter.engine
    print(f"# agents: {info.model_name} ({engine.cfg.num_params / 1e6:.0f}M params, bf16)")
    print(
        f"# machine: {cpu_name()}, {os.cpu_count()} cpus, "
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, device {args.device}"
    )
    print(
        f"# workload: tools {wl.tools} + question {wl.question} tokens; {wl.steps} tool calls "
        f"of {wl.delay * 1e3:.0f} ms, each after {wl.thought} thought tokens (arguments from "
        f"the first {wl.call_after}); observations {obs} tokens; answer {wl.answer} tokens; "
        f"page size {PAGE_SIZE}; quick={args.quick}"
    )
    print(f"# client script: {bench.name}")
    bench.inferlets(2, {})  # warm up both paths
    bench.clients(2)
    out: dict[str, object] = {}
    print()
    out.update(section_concurrency(bench, levels, reps))
    print()
    out.update(section_optimizations(bench, FIGURE7_AGENTS, reps))
    bench.close()
    tool.close()
    out.update(
        {
            "client": args.client,
            "tool_calls": tool.calls,
            "quick": args.quick,
            "device": args.device,
            "seconds": round(time.perf_counter() - t_start),
        }
    )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
