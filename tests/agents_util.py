"""Running the agent built-ins in tests: local tool servers (HTTP) and a harness that runs
inferlets on an engine and records what the engine was asked to do."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from inferlet_util import result
from pastry.control.controller import Controller
from pastry.runtime.trusted import Program, TrustedRuntime
from pastry.wire.calls import EmbedTxt, Forward
from pastry.wire.handle import InProcessEngine


def source(name: str) -> str:
    return resources.files("pastry.inferlets").joinpath(f"{name}.py").read_text()


@dataclass
class ToolServer:
    """Local HTTP tools: ``POST /name`` with a JSON body (or ``GET /name?k=v``) answers
    ``handlers[name](arguments)`` (text; an exception answers 500). Every call is kept
    in ``calls`` as (name, arguments)."""

    handlers: Mapping[str, Callable[[dict], str]]
    calls: list[tuple[str, dict]] = field(default_factory=list)

    def __post_init__(self) -> None:
        tools = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                self.answer(json.loads(body or b"{}"))

            def do_GET(self):
                self.answer(dict(parse_qsl(urlsplit(self.path).query)))

            def answer(self, args: dict) -> None:
                name = urlsplit(self.path).path.strip("/")
                tools.calls.append((name, args))
                try:
                    status, text = 200, tools.handlers[name](args)
                except Exception as e:
                    status, text = 500, f"{type(e).__name__}: {e}"
                data = text.encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, args=(0.02,), daemon=True).start()
        self.base = f"http://127.0.0.1:{self.server.server_address[1]}"

    def tool(self, name: str, description: str, properties: dict, method: str = "POST") -> dict:
        """The OpenAI-style tool entry of handler ``name``, bound to this server."""
        return {
            "type": "function",
            "function": {
                "name": name,
                "description": description,
                "parameters": {"type": "object", "properties": properties},
            },
            "http": {"url": f"{self.base}/{name}", "method": method},
        }

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@dataclass
class Recorded:
    """What the engine ran: every Forward's input count, and every EmbedTxt's tokens."""

    forwarded: int = 0
    embedded: list[list[int]] = field(default_factory=list)


@dataclass
class Runs:
    results: list[dict]
    recorded: Recorded
    pages_in_use: int


def run_builtins(
    engine,
    launches: Sequence[tuple[str, dict]],
    *,
    http_allow: Sequence[str] = ("127.0.0.1",),
    controller_kw: Mapping[str, Any] | None = None,
    sequential: bool = False,
) -> Runs:
    """Run every (built-in name, args) on ``engine`` (at once, or one after the other
    with ``sequential``); their results (a failure raises, with its traceback)."""
    recorded = Recorded()

    async def go() -> Runs:
        handle = InProcessEngine(engine)
        inner = handle.execute

        async def execute(batch):
            recorded.forwarded += sum(c.num_inputs for c in batch if isinstance(c, Forward))
            recorded.embedded += [c.tokens.tolist() for c in batch if isinstance(c, EmbedTxt)]
            return await inner(batch)

        handle.execute = execute
        controller = Controller([handle], http_allow=list(http_allow), **(controller_kw or {}))
        res = next(iter(controller.models.values())).resources
        rt = TrustedRuntime(controller)
        programs = {name: Program.from_source(name, source(name)) for name, _ in launches}

        async def one(name: str, args: dict) -> dict:
            events = [ev async for ev in rt.launch(programs[name], [json.dumps(args)]).events()]
            return json.loads(result(events))

        try:
            if sequential:
                results = [await one(n, a) for n, a in launches]
            else:
                results = list(await asyncio.gather(*(one(n, a) for n, a in launches)))
            res.check_integrity()
            return Runs(results, recorded, res.referenced("kv"))
        finally:
            await controller.close()
            handle.close()

    return asyncio.run(go())
