"""The server end to end: the WebSocket protocol, pastry.client and the CLI against a real
uvicorn server (engine in-process) on a tiny checkpoint."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from websockets.asyncio.client import connect

from pastry.cli import main
from pastry.client import (
    Client,
    ClientError,
    InferletError,
    InstanceTerminated,
    ServerError,
    ws_url,
)
from pastry.client import run as client_run
from pastry.server.service import ConfigError, ServerConfig
from server_util import call, free_port, integrity, running_server

# Streams args[0] generated pieces as messages, returns them joined.
STREAM = """
import pastry.sdk as px
from pastry.sdk import Context, Greedy, MaxTokens

async def main(args):
    ctx = Context()
    ctx.fill("Hello,")
    out = []
    for _ in range(int(args[0])):
        piece = await ctx.generate(Greedy(), MaxTokens(1))
        px.send(piece)
        out.append(piece)
    return "".join(out)
"""

# Generates and streams until terminated.
FOREVER = """
import pastry.sdk as px
from pastry.sdk import Context, Greedy, MaxTokens

async def main(args):
    ctx = Context()
    ctx.fill("Once")
    while True:
        px.send(await ctx.generate(Greedy(), MaxTokens(1)))
"""

# Echoes every message until "bye"; returns how many it echoed.
ECHO = """
import pastry.sdk as px

async def main(args):
    n = 0
    while (m := await px.receive()) != "bye":
        px.send(m.upper())
        n += 1
    return str(n)
"""

# Holds a KV page, then returns args[0] after args[1] seconds.
SLEEPY = """
import asyncio
from pastry.sdk import Context

async def main(args):
    ctx = Context()
    ctx.fill("Hi there")
    await ctx.flush()
    await asyncio.sleep(float(args[1]))
    return args[0]
"""

GREETER = """
import pastry.sdk as px

async def main(args):
    px.send("hi ")
    px.send(args[0])
    return "bye " + args[-1]
"""

FAILS = """
async def main(args):
    raise ValueError("boom: " + args[0])
"""


@pytest.fixture(scope="module")
def server(make_tiny, tmp_path_factory):
    """One server shared by the tests that need no special configuration."""
    with running_server(make_tiny("llama"), tmp_path_factory.mktemp("srv")) as (url, srv):
        yield url, srv


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


def wait_idle(srv, timeout: float = 5.0) -> None:
    """Until no instance runs on ``srv`` (the end of a disconnect is asynchronous)."""
    deadline = time.time() + timeout
    while call(srv, lambda: len(srv.runtime.instances)):
        assert time.time() < deadline, "instances still running"
        time.sleep(0.02)


async def raw(url: str):
    """A bare protocol connection and the server's hello."""
    ws = await connect(ws_url(url))
    return ws, json.loads(await ws.recv())


async def request(ws, **msg) -> dict:
    await ws.send(json.dumps(msg))
    return json.loads(await ws.recv())


# ---------------------------------------------------------------------- programs


def test_upload_launch_streams_messages_then_result(server):
    url, srv = server

    async def go():
        async with await Client.connect(url) as c:
            digest = await c.upload(STREAM, name="stream")
            inst = await c.launch("stream", ["5"])
            assert inst.program == digest and inst.name == "stream"
            events = [ev async for ev in inst.events()]
            by_hash = await (await c.launch(digest[:12], ["2"])).result()
            return events, by_hash

    events, by_hash = run(go())
    assert [e.kind for e in events] == ["message"] * 5 + ["result"]
    assert events[-1].data == "".join(e.data for e in events[:-1])
    assert events[-1].data.startswith(by_hash)  # greedy: the same first two pieces
    wait_idle(srv)
    assert integrity(srv) == (0, 0)


def test_builtin_text_completion_by_name(server):
    url, _srv = server

    async def go():
        async with await Client.connect(url) as c:
            names = {p.name for p in await c.list_programs() if p.builtin}
            inst = await c.launch("text-completion", ["Hello,"])
            return names, [ev async for ev in inst.events()]

    names, events = run(go())
    assert "text-completion" in names
    assert events[-1].kind == "result", events[-1]
    assert [e.kind for e in events[:-1]] == ["message"] * (len(events) - 1)
    assert "".join(e.data for e in events[:-1])  # streamed text deltas


def test_second_launch_does_not_recompile(server):
    url, srv = server

    async def go():
        async with await Client.connect(url) as c:
            await c.upload(SLEEPY, name="sleepy")
            before = srv.registry.compiles
            assert await c.upload(SLEEPY, name="sleepy")  # same bytes: no compile either
            results = [await (await c.launch("sleepy", [str(i), "0"])).result() for i in range(3)]
            return before, results

    before, results = run(go())
    assert results == ["0", "1", "2"]
    assert srv.registry.compiles == before


def test_syntax_error_in_an_upload_is_reported(server):
    url, _ = server

    async def go():
        async with await Client.connect(url) as c:
            with pytest.raises(ServerError) as e:
                await c.upload("async def main(args):\n    return (\n", name="broken")
            assert e.value.code == "invalid_program"
            assert "broken: syntax error at line 2" in e.value.message
            with pytest.raises(ServerError) as e:
                await c.upload("def main(args):\n    return 1\n")
            assert "async def main(args)" in e.value.message
            with pytest.raises(ServerError) as e:
                await c.launch("broken")
            assert e.value.code == "unknown_program"
            return await c.list_programs()  # the connection still works

    assert "broken" not in {p.name for p in run(go())}


def test_exception_goes_to_its_client_only(server):
    url, srv = server

    async def go():
        async with await Client.connect(url) as a, await Client.connect(url) as b:
            await a.upload(FAILS, name="fails")
            await b.upload(STREAM, name="stream")
            bad = await a.launch("fails", ["x"])
            good = await b.launch("stream", ["3"])
            with pytest.raises(InferletError) as e:
                await bad.result()
            events = [ev async for ev in good.events()]
            return e.value.traceback, events, a._queues, b._queues

    tb, events, a_queues, b_queues = run(go())
    assert "Traceback" in tb and "ValueError: boom: x" in tb and "<inferlet fails" in tb
    assert [e.kind for e in events] == ["message"] * 3 + ["result"]
    assert not a_queues and not b_queues  # nothing left over for anyone else
    wait_idle(srv)
    assert integrity(srv) == (0, 0)


def test_upload_over_the_size_limit(make_tiny, tmp_path):
    with running_server(make_tiny("llama"), tmp_path, max_upload_bytes=256) as (url, _):

        async def go():
            async with await Client.connect(url) as c:
                with pytest.raises(ServerError) as e:
                    await c.upload(ECHO + "#" * 256)
                assert e.value.code == "upload_rejected"
                assert "over the upload limit of 256 bytes" in e.value.message
                return await c.upload(FAILS)  # small enough

        assert run(go())


# ---------------------------------------------------------------------- messaging


def test_send_receive_round_trip(server):
    url, _ = server

    async def go():
        async with await Client.connect(url) as c:
            await c.upload(ECHO, name="echo")
            inst = await c.launch("echo")
            got = []
            for word in ("a", "bc", "déf"):
                await inst.send(word)
                got.append(await anext(inst.events()))
            await inst.send("bye")
            return got, await inst.result()

    got, result = run(go())
    assert [(e.kind, e.data) for e in got] == [
        ("message", "A"),
        ("message", "BC"),
        ("message", "DÉF"),
    ]
    assert result == "3"


def test_sync_run_helper(server):
    url, _ = server
    got = []
    result = client_run(url, "greeter", ["you"], source=GREETER, on_message=got.append)
    assert (got, result) == (["hi ", "you"], "bye you")
    with pytest.raises(InferletError, match="ValueError: boom: sync"):
        client_run(url, "fails", ["sync"], source=FAILS)


def test_terminate(server):
    url, srv = server

    async def go():
        async with await Client.connect(url) as c:
            await c.upload(FOREVER, name="forever")
            inst = await c.launch("forever")
            await anext(inst.events())
            await inst.terminate("enough")
            with pytest.raises(InstanceTerminated) as e:
                await inst.result()
            assert e.value.reason == "enough"
            with pytest.raises(ServerError) as e:
                await inst.send("late")
            assert e.value.code == "unknown_instance"

    run(go())
    wait_idle(srv)
    assert integrity(srv) == (0, 0)


# ---------------------------------------------------------------------- connections


def test_disconnect_ends_its_instances_only(server):
    url, srv = server

    async def go():
        b = await Client.connect(url)
        await b.upload(ECHO, name="echo")
        survivor = await b.launch("echo")
        a = await Client.connect(url)
        await a.upload(FOREVER, name="forever")
        doomed = await a.launch("forever")
        await anext(doomed.events())  # mid-stream
        a._ws.transport.abort()  # gone without a close handshake
        await a.close()
        for _ in range(200):
            if not any(i.id == doomed.id for i in await b.list_instances()):
                break
            await asyncio.sleep(0.01)
        else:
            raise AssertionError("the disconnected client's instance is still running")
        await survivor.send("still there?")
        echoed = await anext(survivor.events())
        await survivor.send("bye")
        result = await survivor.result()
        await b.close()
        return echoed.data, result

    assert run(go()) == ("STILL THERE?", "1")
    wait_idle(srv)
    assert integrity(srv) == (0, 0)


def test_detached_instance_survives_and_can_be_attached(server):
    url, srv = server

    async def go():
        a = await Client.connect(url)
        await a.upload(ECHO, name="echo")
        await a.upload(SLEEPY, name="sleepy")
        waiting = await a.launch("echo", detached=True)
        quick = await a.launch("sleepy", ["done", "0.05"], detached=True)
        owned = await a.launch("echo")
        await a.close()
        await asyncio.sleep(0.3)  # `quick` ends while nobody is attached

        async with await Client.connect(url) as b:
            rows = {i.id: i for i in await b.list_instances()}
            assert rows[waiting.id].detached and rows[waiting.id].state == "running"
            assert not rows[waiting.id].attached
            assert rows[quick.id].state == "ended"
            assert owned.id not in rows  # ended with its connection
            with pytest.raises(ServerError) as e:
                await b.attach(owned.id)
            assert e.value.code == "unknown_instance"
            with pytest.raises(ServerError) as e:
                await b._request("send", instance=waiting.id, message="x")
            assert e.value.code == "not_permitted" and "attach to it first" in e.value.message

            ended = await b.attach(quick.id)
            assert await ended.result() == "done"  # the end that came while detached
            again = await b.attach(waiting.id)
            await again.send("hi")
            assert (await anext(again.events())).data == "HI"
            await again.send("bye")
            assert await again.result() == "1"

    run(go())
    wait_idle(srv)
    assert integrity(srv) == (0, 0)


def test_only_the_owner_may_use_an_instance(server):
    url, _srv = server

    async def go():
        async with await Client.connect(url) as a, await Client.connect(url) as b:
            await a.upload(ECHO, name="echo")
            inst = await a.launch("echo")
            for kind, body in (("send", {"message": "x"}), ("terminate", {}), ("attach", {})):
                with pytest.raises(ServerError) as e:
                    await b._request(kind, instance=inst.id, **body)
                assert e.value.code == "not_permitted", kind
                assert "belongs to another connection" in e.value.message
            mine = {i.id: i.mine for i in await a.list_instances()}
            theirs = {i.id: i.mine for i in await b.list_instances()}
            assert mine[inst.id] and not theirs[inst.id]
            await inst.send("bye")
            return await inst.result()

    assert run(go()) == "0"


def test_malformed_and_unknown_messages_get_errors(server):
    url, _ = server

    async def go():
        ws, hello = await raw(url)
        assert hello["type"] == "hello" and hello["protocol"] == 1
        assert hello["auth_required"] is False and hello["models"]
        replies = []
        for msg in (
            "{not json",
            b"\x00binary",
            [1, 2],
            {"id": 1},
            {"type": "frobnicate", "id": 2},
            {"type": "launch", "id": 3},
            {"type": "launch", "id": 4, "program": "text-completion", "args": "Hello"},
            {"type": "launch", "id": 5, "program": "text-completion", "detached": "yes"},
            {"type": "send", "id": 6, "instance": 99999, "message": "x"},
            {"type": "terminate", "id": "seven", "instance": "1"},
            {"type": "attach", "id": 8, "instance": True},
        ):
            await ws.send(msg if isinstance(msg, str | bytes) else json.dumps(msg))
            replies.append(json.loads(await ws.recv()))
        ok = await request(ws, type="list_programs", id=9)
        await ws.close()
        # a new connection works too
        ws2, _ = await raw(url)
        ok2 = await request(ws2, type="list_instances", id="x")
        await ws2.close()
        return replies, ok, ok2

    replies, ok, ok2 = run(go())
    assert all(r["type"] == "error" for r in replies)
    got = [(r["id"], r["code"]) for r in replies]
    assert got == [
        (None, "bad_json"),
        (None, "bad_request"),
        (None, "bad_request"),
        (1, "bad_request"),
        (2, "unknown_type"),
        (3, "bad_request"),
        (4, "bad_request"),
        (5, "bad_request"),
        (6, "unknown_instance"),
        ("seven", "bad_request"),
        (8, "bad_request"),
    ]
    msgs = [r["message"] for r in replies]
    assert "not valid JSON" in msgs[0]
    assert "missing field 'type'" in msgs[3]
    assert "'frobnicate'" in msgs[4] and "known: auth, upload" in msgs[4]
    assert msgs[5] == "launch: missing field 'program'"
    assert msgs[6] == "launch: field 'args' must be a list of strings"
    assert msgs[7] == "launch: field 'detached' must be true or false"
    assert "no instance 99999" in msgs[8]
    assert msgs[9] == "terminate: field 'instance' must be an integer"
    assert ok["type"] == "ok" and ok["id"] == 9 and ok["programs"]
    assert ok2 == {"type": "ok", "id": "x", "instances": []}


# ---------------------------------------------------------------------- auth


def test_auth(make_tiny, tmp_path):
    with running_server(make_tiny("llama"), tmp_path, auth_token="s3cret") as (url, _srv):

        def health(token=None):
            req = urllib.request.Request(url + "/health")
            if token:
                req.add_header("Authorization", f"Bearer {token}")
            try:
                with urllib.request.urlopen(req, timeout=5) as r:
                    return r.status
            except urllib.error.HTTPError as e:
                return e.code

        assert (health(), health("wrong"), health("s3cret")) == (401, 401, 200)

        async def go():
            with pytest.raises(ClientError, match="requires a token"):
                await Client.connect(url)
            with pytest.raises(ServerError) as e:
                await Client.connect(url, token="wrong")
            assert e.value.code == "auth_failed"
            # anything before auth: an error, then the server closes the connection
            ws, hello = await raw(url)
            assert hello["auth_required"] is True and "models" not in hello
            reply = await request(ws, type="list_programs", id=1)
            assert (reply["code"], reply["id"]) == ("auth_required", 1)
            await ws.wait_closed()
            assert ws.close_code == 1008
            async with await Client.connect(url, token="s3cret") as c:
                assert c.models
                await c.upload(ECHO, name="echo")
                inst = await c.launch("echo")
                await inst.send("bye")
                return await inst.result()

        assert run(go()) == "0"


def test_non_loopback_needs_a_token(capsys, monkeypatch):
    def must_not_serve(*a, **kw):
        raise AssertionError("served without a token on 0.0.0.0")

    monkeypatch.setattr("pastry.server.app.serve", must_not_serve)
    with pytest.raises(ConfigError, match="without an auth token"):
        ServerConfig(host="0.0.0.0")
    assert ServerConfig(host="0.0.0.0", auth_token="t").host == "0.0.0.0"
    assert ServerConfig(host="localhost").auth_token is None
    assert main(["serve", "--host", "0.0.0.0", "--auth-token", ""]) == 2
    assert "without an auth token" in capsys.readouterr().err


# ---------------------------------------------------------------------- CLI


def test_cli_run_and_ls_against_a_server(server, tmp_path, capsys):
    url, srv = server
    assert main(["run", "text-completion", "--server", url, "--", "Hello,"]) == 0
    out = capsys.readouterr().out
    assert len(out.strip()) > 0 and out.endswith("\n")

    prog = tmp_path / "greet.py"
    prog.write_text(GREETER)
    assert main(["run", str(prog), "--server", url, "--", "there", "-x"]) == 0
    assert capsys.readouterr().out == "hi there\nbye -x\n"

    bad = tmp_path / "bad.py"
    bad.write_text(FAILS)
    assert main(["run", "--server", url, str(bad), "--", "cli"]) == 1
    captured = capsys.readouterr()
    assert "ValueError: boom: cli" in captured.err and "Traceback" in captured.err
    assert {"greet", "bad"} <= {p.name for p in call(srv, srv.registry.list)}  # not embedded

    assert main(["run", "no-such-program", "--server", url]) == 1
    assert "no program 'no-such-program'" in capsys.readouterr().err

    assert main(["ls", "--server", url]) == 0
    out = capsys.readouterr().out
    assert "text-completion" in out and "greet" in out and "built-in" in out


def test_cli_detach_and_attach(server, capsys, monkeypatch):
    url, srv = server
    monkeypatch.delenv("PASTRY_SERVER", raising=False)
    call(srv, lambda: srv.registry.upload(SLEEPY, "sleepy"))
    assert main(["run", "sleepy", "--detach", "--server", url, "--", "later", "0.2"]) == 0
    iid = int(capsys.readouterr().out)
    assert main(["attach", str(iid), "--server", url]) == 0
    assert capsys.readouterr().out == "later\n"
    assert main(["run", "sleepy", "--detach"]) == 2  # no server to stay on


def test_cli_run_embedded(make_tiny, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PASTRY_HOME", str(tmp_path))
    monkeypatch.delenv("PASTRY_SERVER", raising=False)
    prog = tmp_path / "hello.py"
    prog.write_text(STREAM)
    model = str(make_tiny("llama"))
    assert main(["run", str(prog), "--model", model, "--num-pages", "64", "--", "4"]) == 0
    out = capsys.readouterr().out
    assert out.strip()
    assert (tmp_path / "programs" / "index.json").exists()  # stored under PASTRY_HOME


def test_cli_serve_until_sigterm(make_tiny, tmp_path):
    """`pastry serve` in its own process: engine process up, /health, SIGTERM: all gone."""
    port = free_port()
    env = {**os.environ, "PASTRY_HOME": str(tmp_path), "PASTRY_AUTH_TOKEN": ""}
    cmd = [sys.executable, "-m", "pastry", "serve", "--model", str(make_tiny("llama"))]
    cmd += ["--port", str(port), "--num-pages", "64", "--num-embeds", "256"]
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    try:
        # A cold $PASTRY_HOME: the native kernels are built first (~15 s alone, several
        # times that on a loaded 2-core CI machine); the decode step compiles in the
        # background. A hang detector, not a speed bar (benchmarks/startup.py times it).
        deadline = time.time() + 300
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    assert json.load(r)["status"] == "ok"
                break
            except OSError:
                assert proc.poll() is None and time.time() < deadline, "serve did not start"
                time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "64 KV pages x 16 tokens" in err and f"serving on http://127.0.0.1:{port}" in err
    pid = int(re.search(r"engine process (\d+) serving", err).group(1))
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert "Application shutdown complete" in err


SNOOP = """
import os

async def main(args):
    try:
        open("/etc/passwd").read()
        return "read it"
    except OSError as e:
        return f"denied: {type(e).__name__}; env empty: {os.environ == {}}"
"""


def test_uploads_run_sandboxed_unless_the_operator_trusts_them(make_tiny, tmp_path):
    pytest.importorskip("wasmtime")

    async def go(url):
        async with await Client.connect(url) as c:
            await c.upload(SNOOP, name="snoop")
            inst = await c.launch("snoop")
            return await inst.result()

    with running_server(make_tiny("llama"), tmp_path / "a") as (url, _srv):
        assert run(go(url)) == "denied: FileNotFoundError; env empty: True"
    with running_server(make_tiny("llama"), tmp_path / "b", trusted_uploads=True) as (url, _srv):
        assert run(go(url)) == "read it"
