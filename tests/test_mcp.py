"""MCP tools for inferlets (``control/mcp.py``, the ``mcp_*`` requests of the API) against
a real MCP server written with the ``mcp`` package (``tests/mcp_server.py``), started as a
process over stdio and over streamable HTTP: list the tools, call one (a result and an
error result), list and read a resource; per-user permission; the HTTP allowlist for URLs;
the same calls from a trusted and a sandboxed inferlet."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("mcp")

from inferlet_util import load_engine, result, start
from pastry.control.mcp import McpDenied, McpFailed, McpHub, McpServer
from pastry.runtime.trusted import Program

SERVER = str(Path(__file__).with_name("mcp_server.py"))
STDIO = McpServer("records", (sys.executable, SERVER))

ROUND_TRIP = """
import json
import pastry.sdk as px

async def main(args):
    servers = px.mcp_list_servers()
    tools = json.loads(await px.mcp_list_tools("records"))
    found = json.loads(await px.mcp_call_tool("records", "lookup_employee", '{"name": "alice"}'))
    failed = json.loads(await px.mcp_call_tool("records", "fail", "{}"))
    resources = json.loads(await px.mcp_list_resources("records"))
    memo = await px.mcp_read_resource("records", "memo://policy")
    try:
        await px.mcp_call_tool("elsewhere", "x", "{}")
        denied = None
    except Exception as e:
        denied = str(e)
    return json.dumps({"servers": servers, "tools": [t["name"] for t in tools],
                       "found": found, "failed": failed, "resources": resources,
                       "memo": memo, "denied": denied})
"""


def check_round_trip(out: dict) -> None:
    assert out["servers"] == ["records"]
    assert out["tools"] == ["lookup_employee", "add", "fail"]
    assert out["found"]["text"] == "Alice's employee number is 48213."
    assert out["found"]["is_error"] is False
    assert out["failed"]["text"].endswith("this tool always fails") and out["failed"]["is_error"]
    assert [r["uri"] for r in out["resources"]] == ["memo://policy"]
    assert out["memo"] == "Employee numbers are five digits and never change."
    assert out["denied"].startswith(
        "no MCP server named 'elsewhere' for this user (yours: records)"
    )


def test_hub_over_stdio():
    async def go():
        hub = McpHub(
            [STDIO, McpServer("theirs", (sys.executable, SERVER), users=frozenset({"bob"}))]
        )
        try:
            tools = json.loads(await hub.list_tools("local", "records"))
            schema = tools[1]["input_schema"]
            assert schema["properties"]["a"]["type"] == "integer" and schema["required"] == [
                "a",
                "b",
            ]
            added = json.loads(await hub.call_tool("local", "records", "add", '{"a": 2, "b": 40}'))
            assert added["text"] == "42" and not added["is_error"]
            # concurrent calls share the one connection
            many = await asyncio.gather(
                *(
                    hub.call_tool("local", "records", "add", json.dumps({"a": i, "b": 1}))
                    for i in range(8)
                )
            )
            assert [json.loads(m)["text"] for m in many] == [str(i + 1) for i in range(8)]
            assert hub.names("local") == ["records"] and hub.names("bob") == ["records", "theirs"]
            with pytest.raises(McpDenied, match="no MCP server named 'theirs'"):
                await hub.list_tools("local", "theirs")
            with pytest.raises(ValueError, match="arguments must be a JSON object"):
                await hub.call_tool("local", "records", "add", "[1, 2]")
        finally:
            await hub.close()
        assert all(c.task is None for c in hub._connections.values())

    asyncio.run(go())


def test_a_server_that_cannot_start_is_an_error_and_is_retried():
    async def go():
        hub = McpHub([McpServer("broken", (sys.executable, "-c", "import sys; sys.exit(3)"))])
        try:
            for _ in range(2):  # opened again on the next call
                with pytest.raises(McpFailed, match="MCP server broken"):
                    await hub.list_tools("local", "broken")
        finally:
            await hub.close()

    asyncio.run(go())


def test_server_specs_parse():
    s = McpServer.parse("files=python -m my_server --root '/tmp/a b'")
    assert (s.name, s.command) == ("files", ("python", "-m", "my_server", "--root", "/tmp/a b"))
    assert McpServer.parse("web=http://127.0.0.1:9000/mcp").url == "http://127.0.0.1:9000/mcp"
    with pytest.raises(ValueError, match="NAME=COMMAND or NAME=URL"):
        McpServer.parse("nothing")
    with pytest.raises(ValueError, match="exactly one"):
        McpServer("x")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def http_server():
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, SERVER, "--http", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.1)
        else:
            pytest.fail("the MCP test server did not start listening within 30 s")
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        proc.terminate()
        proc.wait(10)


def test_hub_over_streamable_http_on_the_allowlist(http_server):
    from pastry.control.http import HttpClient

    async def go(allow):
        hub = McpHub([McpServer("web", url=http_server)], check_url=HttpClient(allow).check)
        try:
            return json.loads(await hub.call_tool("local", "web", "add", '{"a": 1, "b": 2}'))
        finally:
            await hub.close()

    assert asyncio.run(go(["127.0.0.1"]))["text"] == "3"
    with pytest.raises(McpFailed, match="HttpDenied"):
        asyncio.run(go(["example.com"]))


@pytest.fixture(scope="module")
def eng(make_tiny):
    return load_engine(make_tiny("llama"), num_pages=64)


def run_inferlet(eng, program: Program, servers=(STDIO,)) -> dict:
    async def go():
        controller, rt, handle = await start(eng, mcp_servers=list(servers))
        try:
            return [ev async for ev in rt.launch(program, []).events()]
        finally:
            await controller.close()
            handle.close()

    return json.loads(result(asyncio.run(go())))


def test_trusted_inferlet_round_trip(eng):
    check_round_trip(run_inferlet(eng, Program.from_source("mcp", ROUND_TRIP)))


def test_sandboxed_inferlet_round_trip(eng):
    pytest.importorskip("wasmtime")
    pytest.importorskip("componentize_py")
    from pastry.runtime.wasm import sandboxed_program
    from wasm_util import make_sandbox

    box = make_sandbox(pool_size=1)
    try:
        check_round_trip(run_inferlet(eng, sandboxed_program("mcp", ROUND_TRIP, box=box)))
    finally:
        box.close()
