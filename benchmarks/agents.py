"""ReAct agents on the model's text: the in-server ``react`` inferlet vs the same agent
driven by a client over an OpenAI-compatible completion server (Pie §7.1, Figures 6-7).

    python benchmarks/agents.py [--quick] [--agents 1,8,32] [--delay-ms 100]
                                [--baseline-url URL --baseline-model NAME]

The model is the embedded default, SmolLM2-135M-Instruct (``pastry model fetch-default``),
served by an in-process Pastry server (uvicorn, engine in-process, float32, page 16). The
task: "What is <name>'s employee number?" for seeded names, with one tool,
``lookup_employee(name)``, answered by a local HTTP server after a fixed latency
(``--delay-ms``); an answer is correct when it contains the employee's number. A wave of C
agents starts at once; latency is an agent's start to its end (mean), throughput C / the
wave's length, in agents/s; each configuration runs ``--reps`` waves and keeps its best.

- (i) ``inferlet``: the built-in ``react`` (its action under the tool grammar, the call as
  soon as the action is written, the KV kept across calls, the instruction shared through
  the prefix cache); launched on the server's runtime.
- (ii) ``client``: the same prompt and format as a client script: ``POST /v1/completions``
  (the ``openai`` package) with the whole transcript each step, stopping at
  ``Observation:``, the action parsed from the text (``pastry.sdk.tools.parse_action``,
  tolerant), the tool called by the client, its answer appended. Against Pastry's own
  server (``client_pastry``) and against ``--baseline-url`` (``client_baseline``: any
  OpenAI-compatible server with the same weights, e.g. vLLM; skipped without it).

The last line is one JSON object: per configuration and C, agents/s, mean latency, prompt
tokens sent (client) or forwarded (inferlet) per agent, accuracy; and the ratios the issue
asks for (``agents_per_s_inferlet_over_client_pastry_32`` and, with a baseline,
``agents_per_s_inferlet_over_client_vllm_32``; null without one).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from pastry.control.events import Finished
from pastry.control.http import HttpClient
from pastry.inferlets.react import SYSTEM
from pastry.sdk.tools import Action, FinalAnswer, Tool, parse_action, tools_prompt

NAMES = ["alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi", "ivan", "judy"]


def numbers(seed: int = 0) -> dict[str, str]:
    rng = random.Random(seed)
    return {n: str(rng.randrange(10000, 99999)) for n in NAMES}


class ToolServer:
    """``POST /lookup_employee`` with ``{"name": ...}`` after ``delay`` seconds."""

    def __init__(self, table: dict[str, str], delay: float) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                time.sleep(delay)
                try:
                    name = str(json.loads(body).get("name", "")).strip().lower()
                except ValueError:
                    name = ""
                n = table.get(name)
                text = f"{name.title()}'s employee number is {n}." if n else "no such employee"
                data = text.encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, args=(0.02,), daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/lookup_employee"

    def spec(self) -> dict:
        return {
            "type": "function",
            "function": {
                "name": "lookup_employee",
                "description": "Look up an employee's record by first name",
                "parameters": {"type": "object", "properties": {"name": {"type": "string"}}},
            },
            "http": {"url": self.url},
        }


def question(name: str) -> str:
    return f"What is {name.title()}'s employee number?"


# ------------------------------------------------------------------------- (i) inferlet


async def inferlet_wave(server, tool: dict, names: list[str]) -> tuple[float, list]:
    async def one(name: str):
        t0 = time.perf_counter()
        args = json.dumps({"question": question(name), "tools": [tool], "max_steps": 3})
        end = await server.launch("react", [args], builtin=True).wait()
        if not isinstance(end, Finished):
            raise RuntimeError(f"react did not finish: {end}")
        out = json.loads(end.result)
        return time.perf_counter() - t0, out["answer"] or "", out["forwarded"]

    t0 = time.perf_counter()
    ends = await asyncio.gather(*(one(n) for n in names))
    return time.perf_counter() - t0, ends


# ------------------------------------------------------------------------- (ii) client


async def client_agent(client, model: str, prompt: str, tool: Tool, http: HttpClient):
    """One ReAct agent driven from the client; (answer, prompt tokens sent)."""
    text, sent = prompt + "Thought:", 0
    for _ in range(4):
        r = await client.completions.create(
            model=model, prompt=text, max_tokens=128, temperature=0, stop=["\nObservation:"]
        )
        sent += r.usage.prompt_tokens if r.usage else 0
        written = r.choices[0].text
        text += written
        step = parse_action(written, [tool])
        if isinstance(step, FinalAnswer):
            return step.answer, sent
        if isinstance(step, Action) and step.arguments is not None:
            resp = await http.post(tool.url, json.dumps(step.arguments))
            observation = " ".join(resp.text.split())
        else:
            observation = step.error if isinstance(step, Action) else "write an Action"
        text += f"\nObservation: {observation}\nThought:"
    return "", sent


async def client_wave(url: str, model: str, render, tool: Tool, names: list[str]):
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600)
    http = HttpClient(["127.0.0.1"])

    async def one(name: str):
        t0 = time.perf_counter()
        answer, sent = await client_agent(client, model, render(question(name)), tool, http)
        return time.perf_counter() - t0, answer, sent

    t0 = time.perf_counter()
    ends = await asyncio.gather(*(one(n) for n in names))
    await client.close()
    return time.perf_counter() - t0, ends


# ------------------------------------------------------------------------- running


def summary(wall: float, ends: list, table: dict[str, str], names: list[str]) -> dict:
    n = len(ends)
    correct = sum(table[name] in answer for name, (_, answer, _) in zip(names, ends, strict=True))
    return {
        "agents_per_s": round(n / wall, 4),
        "latency_s": round(sum(e[0] for e in ends) / n, 3),
        "tokens_per_agent": round(sum(e[2] for e in ends) / n, 1),
        "accuracy": round(correct / n, 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 and 4 agents, one rep")
    ap.add_argument("--agents", default="1,8,32")
    ap.add_argument("--delay-ms", type=float, default=100.0)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--baseline-url", help="an OpenAI-compatible server (e.g. vLLM's)")
    ap.add_argument("--baseline-model", help="the model name it serves")
    a = ap.parse_args()
    sizes = [1, 4] if a.quick else [int(x) for x in a.agents.split(",")]
    reps = 1 if a.quick else a.reps

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from pastry.engine.checkpoint import load_checkpoint
    from pastry.paths import default_gguf
    from server_util import running_server

    gguf = default_gguf()
    if not gguf.is_file():
        sys.exit(f"the default model is missing ({gguf}): run `pastry model fetch-default`")
    table = numbers()
    tools = ToolServer(table, a.delay_ms / 1000)
    spec = tools.spec()
    tool = Tool.from_spec(spec)
    tok = load_checkpoint(gguf).tokenizer
    system = SYSTEM.replace("{tools}", tools_prompt([tool])).replace("{{", "{").replace("}}", "}")

    def render(q: str) -> str:
        return tok.apply_chat_template([{"role": "system", "content": system},
                                        {"role": "user", "content": q}])  # fmt: skip

    results: dict[str, dict] = {}
    with (
        tempfile.TemporaryDirectory() as tmp,
        running_server(
            gguf, Path(tmp), dtype="float32", page_size=16, num_pages=4096,
            num_embeds=8192, http_allow=("127.0.0.1",),
        ) as (url, server),
    ):  # fmt: skip
        model = server.models[0]
        for n in sizes:
            names = [NAMES[i % len(NAMES)] for i in range(n)]
            best: dict[str, dict] = {}
            for _ in range(reps):
                runs = {
                    "inferlet": lambda names=names: asyncio.run_coroutine_threadsafe(
                        inferlet_wave(server, spec, names), server.loop
                    ).result(),
                    "client_pastry": lambda names=names: asyncio.run(
                        client_wave(url, model, render, tool, names)
                    ),
                }
                if a.baseline_url:
                    runs["client_baseline"] = lambda names=names: asyncio.run(
                        client_wave(a.baseline_url, a.baseline_model, render, tool, names)
                    )
                for key, go in runs.items():
                    s = summary(*go(), table, names)
                    if key not in best or s["agents_per_s"] > best[key]["agents_per_s"]:
                        best[key] = s
            for key, s in best.items():
                results[f"{key}_{n}"] = s
                print(f"{key:16s} C={n:3d} {json.dumps(s)}", flush=True)
    tools.server.shutdown()
    top = max(sizes)

    def ratio(k: str) -> float | None:
        other = results.get(f"{k}_{top}")
        return (
            None
            if other is None
            else round(results[f"inferlet_{top}"]["agents_per_s"] / other["agents_per_s"], 3)
        )

    out = {
        "machine": "see benchmarks/RESULTS.md",
        "model": "SmolLM2-135M-Instruct (Q4_1 GGUF as float32)",
        "delay_ms": a.delay_ms,
        "results": results,
        f"agents_per_s_inferlet_over_client_pastry_{top}": ratio("client_pastry"),
        f"agents_per_s_inferlet_over_client_vllm_{top}": ratio("client_baseline"),
        "accuracy_inferlet": results[f"inferlet_{top}"]["accuracy"],
        "accuracy_client_baseline": (results.get(f"client_baseline_{top}") or {}).get("accuracy"),
        "baseline": a.baseline_url or "none given (the vLLM run is pending)",
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
