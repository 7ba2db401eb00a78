"""Safe to share (issue 17): each attack of the issue, tried against a real server.

Tenants are users named by tokens; these tests use three (alice, bob, carol; alice grants
carol read access) unless a test needs its own configuration. Uploaded programs run in the
WebAssembly sandbox, as a stranger's would.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
import urllib.error
import urllib.request
from http.client import HTTPConnection
from importlib import resources
from pathlib import Path

import pytest
from websockets.asyncio.client import connect

from pastry.cli import main as cli_main
from pastry.client import Client, InferletError, ServerError, ws_url
from pastry.control.events import Terminated
from pastry.control.quotas import Quotas
from pastry.control.users import Account, User, UsersError
from pastry.server.service import ConfigError, ServerConfig
from server_util import call, integrity, raw_ws, running_server, ws_send

pytest.importorskip("wasmtime")

ALICE = Account(User("alice"), "tok-alice")
BOB = Account(User("bob"), "tok-bob")
CAROL = Account(User("carol"), "tok-carol")
ROOT = Account(User("root", operator=True), "tok-root")


def run(coro, timeout: float = 60):
    return asyncio.run(asyncio.wait_for(coro, timeout))


@pytest.fixture(scope="module")
def plain(make_tiny, tmp_path_factory):
    """A server as `pastry serve` starts by default: loopback, no tokens (one local user)."""
    with running_server(make_tiny("llama"), tmp_path_factory.mktemp("plain")) as (u, s):
        yield u, s


@pytest.fixture(scope="module")
def shared(make_tiny, tmp_path_factory):
    """A server with three users; alice lets carol read her namespace."""
    cfg = dict(users=(ALICE, BOB, CAROL), grants=(("alice", "carol"),))
    with running_server(make_tiny("llama"), tmp_path_factory.mktemp("sec"), **cfg) as (u, s):
        yield u, s


def http(url: str, path: str, body: object = None, token: str | bytes | None = None,
         raw: bytes | None = None, timeout: float = 60) -> tuple[int, dict]:  # fmt: skip
    """``(status, JSON body)`` of a GET (no body) or POST."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(url + path, data=data)
    req.add_header("Content-Type", "application/json")
    if token is not None:
        value = b"Bearer " + (token if isinstance(token, bytes) else token.encode())
        req.add_unredirected_header("Authorization", value.decode("latin-1"))
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def wait_idle(srv, timeout: float = 10.0) -> None:
    deadline = time.time() + timeout
    while call(srv, lambda: len(srv.runtime.instances)):
        assert time.time() < deadline, "instances still running"
        time.sleep(0.02)


# ---------------------------------------------------------------------- built-ins

EVIL = """
async def main(args):
    return '{"choices": [{"index": 0, "text": "PWNED", "finish_reason": "stop"}], ' \\
        '"usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}'
"""


def test_no_upload_can_take_a_builtins_name(plain):
    """The issue's attack: upload a byte-identical copy of text_completion.py under another
    name, then any program as `text-completion` (main accepted it, and every user's
    `text-completion` and /v1/completions then ran the attacker's program)."""
    url, srv = plain
    builtin = resources.files("pastry.inferlets").joinpath("text_completion.py").read_text()
    model = srv.models[0]

    async def go():
        async with await Client.connect(url) as bob:
            await bob.upload(builtin, name="my-copy")
            for name in ("text-completion", "chat"):
                with pytest.raises(ServerError) as e:
                    await bob.upload(EVIL, name=name)
                assert e.value.code == "upload_rejected" and "built-in" in e.value.message
            with pytest.raises(ServerError):
                await bob.delete_program("text-completion")
            inst = await bob.launch("text-completion", ["Hello,"])
            await inst.result()
            return [p for p in await bob.list_programs() if p.name == "text-completion"]

    [listed] = run(go())
    assert listed.builtin
    status, body = http(url, "/v1/completions", {"model": model, "prompt": "Hi", "max_tokens": 2})
    assert status == 200 and "PWNED" not in body["choices"][0]["text"]


# ---------------------------------------------------------------------- shared state

EXPORT = """
import pastry.sdk as px
from pastry.sdk import Context

async def main(args):
    ctx = Context()
    ctx.fill(args[0])
    await ctx.flush(keep_last=False)
    await px.export_kvpages(ctx.queue, ctx.pages, args[1], True)
    px.store_set(args[1], "value of " + args[1])
    return str(len(ctx.pages))
"""

# Tries everything on another's export / key / topic named args[0]; returns the outcomes.
PROBE = """
import asyncio, json
import pastry.sdk as px

async def main(args):
    name = args[0]
    q = px.create_queue(px.available_models()[0])
    out = {"exports": [list(e) for e in px.list_exported_kvpages(q)]}
    def attempt(key, fn):
        try:
            out[key] = fn()
        except Exception as e:
            out[key] = "error: " + str(e)
    attempt("import", lambda: len(px.import_kvpages(q, name)))
    attempt("unexport", lambda: px.unexport_kvpages(q, name))
    attempt("get", lambda: px.store_get(name))
    attempt("exists", lambda: px.store_exists(name))
    attempt("keys", lambda: px.store_list_keys(name.rsplit("/", 1)[0] + "/" if "/" in name else ""))
    attempt("set", lambda: px.store_set(name, "overwritten"))
    attempt("delete", lambda: px.store_delete(name))
    return json.dumps(out)
"""


def _probe(url: str, token: str, name: str) -> dict:
    async def go():
        async with await Client.connect(url, token) as c:
            await c.upload(PROBE, name="probe")
            return json.loads(await (await c.launch("probe", [name])).result())

    return run(go())


def test_exports_and_store_are_per_user(shared):
    """Main: any inferlet could list, import, read, overwrite and unexport any other's KV
    exports and store keys (one namespace for everyone)."""
    url, srv = shared

    async def export():
        async with await Client.connect(url, "tok-alice") as alice:
            await alice.upload(EXPORT, name="export")
            return await (await alice.launch("export", ["my secret prefix", "secret"])).result()

    assert int(run(export())) >= 1
    bob = _probe(url, "tok-bob", "secret")
    assert bob["exports"] == []
    assert bob["import"].startswith("error: no export named 'secret'")
    assert bob["unexport"].startswith("error: no export named 'secret'")
    assert bob["get"] is None and bob["exists"] is False and bob["keys"] == []
    # bob's writes went to bob's own namespace
    alice = _probe(url, "tok-alice", "secret")
    assert [e[0] for e in alice["exports"]] == ["secret"] and alice["import"] >= 1
    assert alice["get"] == "value of secret"
    # another user's namespace can be named, but not read without a grant (it reads as
    # empty) nor ever written
    stolen = _probe(url, "tok-bob", "~alice/secret")
    assert "user alice has not granted user bob access" in stolen["import"]
    assert stolen["get"] is None and stolen["exists"] is False and stolen["keys"] == []
    assert "can only be read" in stolen["unexport"] and "can only be read" in stolen["set"]
    assert stolen["delete"] is False
    wait_idle(srv)
    integrity(srv)


def test_a_grant_lets_one_user_read_another(shared):
    url, srv = shared

    async def export():
        async with await Client.connect(url, "tok-alice") as alice:
            await alice.upload(EXPORT, name="export")
            await (await alice.launch("export", ["a shared system prompt", "system"])).result()

    run(export())
    carol = _probe(url, "tok-carol", "~alice/system")
    assert carol["import"] >= 1 and carol["get"] == "value of system" and carol["exists"]
    assert "~alice/system" in carol["keys"]
    assert "can only be read" in carol["set"] and "can only be read" in carol["unexport"]
    assert carol["delete"] is False
    alice = _probe(url, "tok-alice", "system")
    assert alice["get"] == "value of system"  # carol's writes changed nothing of alice's
    wait_idle(srv)
    integrity(srv)


LISTEN = """
import pastry.sdk as px

async def main(args):
    sub = px.subscribe(args[0])
    px.send("subscribed")
    return await px.next_message(sub)
"""

SHOUT = """
import pastry.sdk as px

async def main(args):
    return str(px.broadcast(args[0], "hello from " + args[1]))
"""


def test_topics_are_per_user(shared):
    """Main: one topic namespace, so any inferlet could listen to (or inject into) any
    other's messages."""
    url, _srv = shared

    async def go():
        async with (
            await Client.connect(url, "tok-alice") as alice,
            await Client.connect(url, "tok-bob") as bob,
            await Client.connect(url, "tok-carol") as carol,
        ):
            for c in (alice, bob, carol):
                await c.upload(LISTEN, name="listen")
                await c.upload(SHOUT, name="shout")
            alice_listens = await alice.launch("listen", ["news"])
            carol_listens = await carol.launch("listen", ["~alice/news"])
            for inst in (alice_listens, carol_listens):
                assert (await anext(inst.events())).data == "subscribed"
            reached_by_bob = await (await bob.launch("shout", ["news", "bob"])).result()
            with pytest.raises(InferletError, match="can only be read"):
                await (await carol.launch("shout", ["~alice/news", "carol"])).result()
            reached_by_alice = await (await alice.launch("shout", ["news", "alice"])).result()
            return (
                reached_by_bob,
                reached_by_alice,
                await alice_listens.result(),
                await carol_listens.result(),
            )

    assert run(go()) == ("0", "2", "hello from alice", "hello from alice")


ECHO = """
import pastry.sdk as px

async def main(args):
    while (m := await px.receive()) != "bye":
        px.send(m.upper())
    return "done"
"""


def test_instances_are_per_user_and_ids_are_not_guessable(shared):
    """Main: list_instances showed everyone's arguments (OpenAI prompts included), and any
    client could attach to or terminate another's detached instance by guessing its
    sequential id."""
    url, _srv = shared

    async def go():
        async with await Client.connect(url, "tok-alice") as alice:
            await alice.upload(ECHO, name="echo")
            detached = [await alice.launch("echo", ["my secret"], detached=True) for _ in range(3)]
        async with await Client.connect(url, "tok-bob") as bob:
            assert [i for i in await bob.list_instances() if i.id in {d.id for d in detached}] == []
            for inst in detached:
                for kind, body in (("attach", {}), ("terminate", {}), ("send", {"message": "x"})):
                    with pytest.raises(ServerError) as e:
                        await bob._request(kind, instance=inst.id, **body)
                    assert e.value.code == "unknown_instance", (kind, e.value)
                    assert "no instance" in e.value.message
        async with await Client.connect(url, "tok-alice") as alice:
            rows = {i.id: i for i in await alice.list_instances()}
            assert all(rows[d.id].args == ["my secret"] for d in detached)
            for d in detached:
                inst = await alice.attach(d.id)
                await inst.send("bye")
                assert await inst.result() == "done"
        return [d.id for d in detached]

    ids = run(go())
    assert len(set(ids)) == 3
    assert all(i >= 2**20 for i in ids)  # random 53-bit ids, not 1, 2, 3
    assert sorted(ids) != list(range(min(ids), min(ids) + 3))


def test_openai_requests_are_invisible_to_other_users(shared):
    """Main's list_instances showed every instance's arguments: OpenAI prompts included."""
    url, srv = shared
    model = srv.models[0]
    seen: dict[str, list] = {"alice": [], "bob": []}
    done = threading.Event()

    def watch():
        async def go():
            async with (
                await Client.connect(url, "tok-alice") as alice,
                await Client.connect(url, "tok-bob") as bob,
            ):
                while not done.is_set():
                    for name, c in (("alice", alice), ("bob", bob)):
                        seen[name].extend(await c.list_instances())
                    await asyncio.sleep(0.002)

        run(go())

    t = threading.Thread(target=watch)
    t.start()
    try:
        body = {"model": model, "prompt": "a secret prompt", "max_tokens": 48, "n": 4}
        assert http(url, "/v1/completions", body, token="tok-alice")[0] == 200
    finally:
        done.set()
        t.join()
    assert any(i.name == "text-completion" for i in seen["alice"]), "never observed"
    assert seen["bob"] == []


# ---------------------------------------------------------------------- memory

HOG = """
import pastry.sdk as px

async def main(args):
    q = px.create_queue(px.available_models()[0])
    kind = args[0]
    alloc = px.alloc_kvpages if kind == "kv" else px.alloc_embeds
    got = 0
    for n in [int(x) for x in args[1:]]:
        alloc(q, n)
        got += n
        px.send(str(got))
    await px.receive()
    return str(got)
"""


@pytest.mark.parametrize("kind", ["kv", "embed"])
def test_one_instance_cannot_take_the_whole_pool(plain, kind):
    """Main: no per-instance quota, one upload could hold every KV page or embedding."""
    url, srv = plain
    size = call(srv, lambda: next(iter(srv.controller.models.values())).resources.usage(kind)[2])

    async def go():
        async with await Client.connect(url) as bob:
            await bob.upload(HOG, name="hog")
            inst = await bob.launch("hog", [kind, str(size // 4), str(size // 4), str(size // 4)])
            events = [ev async for ev in inst.events()]
            return events

    events = run(go())
    assert [e.data for e in events[:2]] == [str(size // 4), str(size // 2)]
    assert events[-1].kind == "error" and "quota exceeded" in events[-1].data
    assert "--instance-share 0.5" in events[-1].data
    wait_idle(srv)
    assert integrity(srv) == (0, 0)


PERSIST = """
import pastry.sdk as px

async def main(args):
    q = px.create_queue(px.available_models()[0])
    pages = px.alloc_kvpages(q, int(args[0]))
    await px.export_kvpages(q, pages, args[1], True)
    return "left " + args[1]
"""


def test_persistent_exports_left_behind_are_reclaimed(make_tiny, tmp_path):
    """Main: a persistent export of all pages, left by an inferlet that then exits, kept the
    pool full for everyone. Now it counts against its owner's quota and is dropped (least
    recently used first) when memory is short."""
    cfg = dict(users=(ALICE, BOB), quotas=Quotas(instance_share=0.6, user_share=0.75))
    with running_server(make_tiny("llama"), tmp_path, **cfg) as (url, srv):
        pool = call(srv, lambda: next(iter(srv.controller.models.values())).resources)
        most = int(0.6 * pool.usage("kv")[2])  # what one instance may hold

        async def go():
            async with (
                await Client.connect(url, "tok-alice") as alice,
                await Client.connect(url, "tok-bob") as bob,
            ):
                await alice.upload(PERSIST, name="persist")
                await bob.upload(HOG, name="hog")
                await (await alice.launch("persist", [str(most), "a"])).result()
                # a second export would take alice over her 3/4: her older one goes
                await (await alice.launch("persist", [str(most), "b"])).result()
                names = call(srv, lambda: [n for n, _, _ in pool.list_exports("alice")])
                assert names == ["b"]
                # bob needs more than is free: alice's export is reclaimed, nobody ends
                inst = await bob.launch("hog", ["kv", str(most)])
                assert (await anext(inst.events())).data == str(most)
                left = call(srv, lambda: pool.list_exports())
                await inst.send("done")
                await inst.result()
                return left

        assert run(go()) == []
        wait_idle(srv)
        assert integrity(srv) == (0, 0)


def test_the_heaviest_user_gives_way(make_tiny, tmp_path):
    """Main's FCFS policy ended the newest inferlet, so a user who came first and held the
    pool kept it. Now, when swapping to host memory cannot help, the user holding the most
    loses its newest instance."""
    cfg = dict(users=(ALICE, BOB), quotas=Quotas(instance_share=0.5, user_share=1.0))
    cfg["engine_kwargs"] = {"num_host_pages": 1}  # no room to swap: ending someone is left
    with running_server(make_tiny("llama"), tmp_path, **cfg) as (url, srv):
        size = call(
            srv, lambda: next(iter(srv.controller.models.values())).resources.usage("kv")[2]
        )

        async def go():
            async with (
                await Client.connect(url, "tok-alice") as alice,
                await Client.connect(url, "tok-bob") as bob,
            ):
                await alice.upload(HOG, name="hog")
                await bob.upload(HOG, name="hog")
                first = await alice.launch("hog", ["kv", str(size // 2)])
                second = await alice.launch("hog", ["kv", str(size // 2 - 8)])
                for inst in (first, second):
                    await anext(inst.events())
                mine = await bob.launch("hog", ["kv", "16"])
                assert (await anext(mine.events())).data == "16"
                ends = []
                for inst in (first, second, mine):
                    with contextlib.suppress(ServerError):  # one has ended
                        await inst.send("done")
                    ends.append([ev async for ev in inst.events()][-1])
                return ends

        first, second, mine = run(go())
        assert first.kind == "result" and mine.kind == "result", (first, mine)
        assert second.kind == "terminated" and "holding the most" in second.data


# ---------------------------------------------------------------------- messages, results

FLOOD = """
import asyncio
import pastry.sdk as px

async def main(args):
    chunk = "x" * 65536
    while True:
        px.send(chunk)
        await asyncio.sleep(0.005)
"""


def test_a_client_that_does_not_read_ends_its_instance(make_tiny, tmp_path):
    """Main: the server's outgoing queue to a slow client was unbounded (RSS +1 GB from one
    sender). Now the sender is ended with a clear error once its backlog is over quota, and
    what the server holds for the connection stays bounded."""
    quotas = Quotas(backlog_bytes=1 << 20)
    with running_server(make_tiny("llama"), tmp_path, quotas=quotas) as (url, srv):
        sock = raw_ws(url)  # reads nothing from here on
        try:
            ws_send(sock, {"type": "upload", "id": 1, "source": FLOOD, "name": "flood"})
            ws_send(sock, {"type": "launch", "id": 2, "program": "flood"})
            deadline = time.time() + 20
            while not call(srv, lambda: srv.runtime.instances) and time.time() < deadline:
                time.sleep(0.01)
            [inst] = call(srv, lambda: list(srv.runtime.instances.values()))
            while not inst.done.is_set() and time.time() < deadline:
                held = call(srv, lambda: inst.session.outbox.qsize()) * 65536
                assert held <= (1 << 20) + 2 * 65536, held
                time.sleep(0.05)
            assert inst.done.is_set(), "the flooding instance was not ended"
            queued = call(srv, lambda: [c.queued for s in srv.streams.live.values()
                                        for c in s.subscribers])  # fmt: skip
        finally:
            sock.close()
        end = inst.end
        assert isinstance(end, Terminated), end
        assert "has not read" in end.reason and "--max-backlog-bytes" in end.reason
        assert all(q <= (1 << 20) + (1 << 17) for q in queued), queued
        wait_idle(srv)
        assert integrity(srv) == (0, 0)


DEAF = """
import pastry.sdk as px

async def main(args):
    sub = px.subscribe("nothing-ever")
    return await px.next_message(sub)  # never reads what its client sends
"""


def test_a_client_cannot_pile_messages_into_an_instance(make_tiny, tmp_path):
    """Main queued every `send` to an instance, read or not: server memory without bound."""
    with running_server(make_tiny("llama"), tmp_path, quotas=Quotas(backlog_bytes=1 << 20)) as (
        url,
        _srv,
    ):

        async def go():
            async with await Client.connect(url) as c:
                await c.upload(DEAF, name="deaf")
                inst = await c.launch("deaf")
                chunk = "y" * 65536
                for sent in range(200):
                    try:
                        await inst.send(chunk)
                    except ServerError as e:
                        await inst.terminate()
                        return sent, e
                return 200, None

        sent, error = run(go())
        assert error is not None and error.code == "quota_exceeded", sent
        assert "--max-backlog-bytes" in error.message and sent <= 17


def test_detached_backlog_is_bounded(make_tiny, tmp_path):
    """Main: a detached instance nobody attached to kept 1000 messages of any size forever."""
    quotas = Quotas(detached_backlog_bytes=256 << 10)
    with running_server(make_tiny("llama"), tmp_path, quotas=quotas) as (url, srv):
        # The launching connection is subscribed until it closes: messages sent before that
        # go to it, not to the backlog. The burst waits until it has surely closed.
        source = (
            FLOOD.replace("while True:", "await asyncio.sleep(2)\n    for _ in range(64):")
            + "    return 'end'\n"
        )

        async def go():
            async with await Client.connect(url) as c:
                await c.upload(source, name="burst")
                inst = await c.launch("burst", detached=True)
            wait_idle(srv)
            async with await Client.connect(url) as c:
                again = await c.attach(inst.id)
                events = [ev async for ev in again.events()]
            return again.dropped, events

        dropped, events = run(go())
        kept = [e for e in events if e.kind == "message"]
        assert sum(len(e.data) for e in kept) <= 256 << 10
        assert dropped > 50 and len(kept) + dropped <= 64
        assert events[-1].kind == "result" and events[-1].data == "end"


BIG = """
async def main(args):
    return "x" * int(args[0])
"""


def test_result_size_is_capped(make_tiny, tmp_path):
    """Main: results had no size cap."""
    with running_server(make_tiny("llama"), tmp_path, quotas=Quotas(result_bytes=1000)) as (
        url,
        _srv,
    ):

        async def go():
            async with await Client.connect(url) as c:
                await c.upload(BIG, name="big")
                ok = await (await c.launch("big", ["1000"])).result()
                with pytest.raises(InferletError) as e:
                    await (await c.launch("big", ["1001"])).result()
                return ok, e.value.traceback

        ok, error = run(go())
        assert ok == "x" * 1000
        assert "1001 bytes, over the result quota of 1000 bytes (--max-result-bytes)" in error


# ---------------------------------------------------------------------- uploads


def test_upload_count_and_size_quotas(make_tiny, tmp_path):
    """Main: uploads had no size or count quota per user."""
    quotas = Quotas(uploads_per_user=3, upload_bytes_per_user=600)
    cfg = dict(users=(ALICE, BOB), quotas=quotas)
    with running_server(make_tiny("llama"), tmp_path, **cfg) as (url, _srv):

        async def go():
            async with await Client.connect(url, "tok-alice") as alice:
                for i in range(3):
                    await alice.upload(f"async def main(args):\n    return '{i}'\n", name=f"p{i}")
                await alice.upload("async def main(args):\n    return 'new'\n", name="p0")
                with pytest.raises(ServerError) as count:
                    await alice.upload("async def main(args):\n    return '3'\n", name="p3")
                await alice.delete_program("p2")
                with pytest.raises(ServerError) as size:
                    await alice.upload("async def main(args):\n    return 1  #" + "x" * 600)
                await alice.upload("async def main(args):\n    return '3'\n", name="p3")
                names = sorted(p.name for p in await alice.list_programs() if not p.builtin)
            async with await Client.connect(url, "tok-bob") as bob:  # bob's quota is his own
                for i in range(3):
                    await bob.upload(f"async def main(args):\n    return 'b{i}'\n", name=f"p{i}")
                bobs = sorted(p.name for p in await bob.list_programs() if not p.builtin)
            return count.value, size.value, names, bobs

        count, size, names, bobs = run(go())
        assert count.code == "quota_exceeded" and "--max-uploads-per-user 3" in count.message
        assert size.code == "quota_exceeded" and "--max-upload-bytes-per-user" in size.message
        assert names == ["p0", "p1", "p3"] and bobs == ["p0", "p1", "p2"]


# ---------------------------------------------------------------------- requests


def test_request_body_size_limit(make_tiny, tmp_path):
    """Main: no request body limit (a 20 MB prompt was read, then tokenized on the loop).
    Now a body over the limit is refused before it is read (by its Content-Length), or as
    soon as it passes the limit (chunked)."""
    limit = 1 << 20
    with running_server(make_tiny("llama"), tmp_path, quotas=Quotas(request_bytes=limit)) as (
        url,
        srv,
    ):
        host, port = url.split("//")[1].split(":")
        model = srv.models[0]

        def post(chunked: bool) -> tuple[int, dict]:
            conn = HTTPConnection(host, int(port), timeout=60)
            conn.putrequest("POST", "/v1/completions")
            conn.putheader("Content-Type", "application/json")
            if chunked:
                conn.putheader("Transfer-Encoding", "chunked")
                conn.endheaders()
                piece = b"x" * 65536
                for _ in range(64):  # up to 4 MiB, or until the server answers
                    try:
                        conn.send(b"%x\r\n%s\r\n" % (len(piece), piece))
                    except OSError:
                        break
            else:
                conn.putheader("Content-Length", str(4 * limit))
                conn.endheaders()  # and no body: the answer must not wait for it
            r = conn.getresponse()
            return r.status, json.loads(r.read())

        for chunked in (False, True):
            status, body = post(chunked)
            assert status == 413 and "--max-request-bytes" in body["error"]["message"]
        status, _ = http(url, "/v1/completions", {"model": model, "prompt": "Hi", "max_tokens": 2})
        assert status == 200


def test_prompts_are_tokenized_off_the_event_loop(make_tiny, tmp_path):
    """Main tokenized a prompt on the event loop before checking its length: /health waited
    for it (23 s for 20 MB). Now a prompt that cannot fit the context is refused without
    being tokenized, and the others are tokenized in a worker thread, without the global
    lock; the built-in serving the request then finds the tokens ready."""
    quotas = Quotas(request_bytes=16 << 20)
    with running_server(make_tiny("llama"), tmp_path, quotas=quotas) as (url, srv):
        model = srv.models[0]
        tokens = call(srv, lambda: srv.controller.models[model].tokens)
        seen: list[tuple[str, int]] = []
        encode = tokens.encode_batch

        def spy(texts, *args):
            seen.append((threading.current_thread().name, sum(map(len, texts))))
            return encode(texts, *args)

        tokens.encode_batch = spy
        loop_thread = call(srv, lambda: threading.current_thread().name)
        huge = " ".join(f"w{i % 9973}" for i in range(1_500_000))  # ~9 MB
        status, body = http(url, "/v1/completions", {"model": model, "prompt": huge})
        assert status == 400 and "maximum context length" in body["error"]["message"]
        assert seen == []  # never tokenized: it cannot fit
        long = "hello " * 40_000  # 80,000 tokens, yet it might fit by its length alone
        bos = int(tokens.tokenizer.add_bos_token)  # a prompt starts a sequence (issue 9)
        status, body = http(url, "/v1/completions", {"model": model, "prompt": long})
        assert status == 400 and f"has {80000 + bos}" in body["error"]["message"], body
        fits = " " * 16 * 1500  # 1,500 tokens of 16 spaces (24,000 characters)
        status, body = http(url, "/v1/completions", {"model": model, "prompt": fits,
                                                      "max_tokens": 2})  # fmt: skip
        assert status == 200 and body["usage"]["prompt_tokens"] == 1500 + bos
        before = tokens.hits  # SGLang's built-in tokenizes the text itself: found ready
        body = {"text": fits + " ", "sampling_params": {"max_new_tokens": 2}}
        assert http(url, "/generate", body)[0] == 200
        assert tokens.hits == before + 1
        status, body = http(url, "/tokenize", {"model": model, "prompt": fits})
        assert status == 200 and body["count"] >= 1500  # with the tokenizer's specials
        assert [n for _, n in seen] == [len(long), len(fits), len(fits) + 1, len(fits)]
        assert all(name != loop_thread for name, _ in seen), (seen, loop_thread)


def test_prompts_times_n_is_capped(plain):
    """Main: a list of 2,000 prompts with n=16 bypassed the n <= 16 cap (32,000 choices)."""
    url, srv = plain
    model = srv.models[0]
    body = {"model": model, "prompt": ["Hi"] * 5, "n": 16, "max_tokens": 1}
    status, reply = http(url, "/v1/completions", body)
    assert status == 400
    assert "5 prompts x n=16 is 80 choices" in reply["error"]["message"]
    assert "--max-request-choices" in reply["error"]["message"]
    body = {"model": model, "prompt": ["Hi"] * 4, "n": 16, "max_tokens": 1}
    assert http(url, "/v1/completions", body)[0] == 200
    # SGLang's native API too
    body = {"text": ["Hi"] * 5, "sampling_params": {"n": 16, "max_new_tokens": 1}}
    status, reply = http(url, "/generate", body)
    assert status == 400 and "--max-request-choices" in reply["error"]["message"], reply
    body = {"text": ["Hi"] * 4, "sampling_params": {"n": 16, "max_new_tokens": 1}}
    assert http(url, "/generate", body)[0] == 200
    body = {"text": "word " * 1_000_000, "sampling_params": {"max_new_tokens": 1}}
    status, reply = http(url, "/generate", body)
    assert status == 400 and "over this model's context" in reply["error"]["message"], reply


def test_bad_json_gets_a_4xx_never_a_500(plain):
    """Main answered 500 to deeply nested JSON and to a lone surrogate in a prompt."""
    url, srv = plain
    model = srv.models[0]
    deep = '{{"model": "{}", "prompt": {}}}'.format(model, "[" * 100_000 + "]" * 100_000)
    status, body = http(url, "/v1/completions", raw=deep.encode())
    assert status == 400 and "nested deeper than 64" in body["error"]["message"]
    nested = json.dumps({"model": model, "prompt": "Hi", "x": 1}).replace(
        "1}", "[" * 70 + "1" + "]" * 70 + "}"
    )
    status, body = http(url, "/v1/completions", raw=nested.encode())
    assert status == 400 and "nested deeper than 64" in body["error"]["message"]
    lone = f'{{"model": "{model}", "prompt": "bad \\ud800 text", "max_tokens": 2}}'
    status, body = http(url, "/v1/completions", raw=lone.encode())
    assert status == 400 and "lone surrogate" in body["error"]["message"]
    lone = f'{{"model": "{model}", "messages": [{{"role": "user", "content": "\\udfff"}}]}}'
    status, body = http(url, "/v1/chat/completions", raw=lone.encode())
    assert status == 400 and "lone surrogate" in body["error"]["message"]
    paired = f'{{"model": "{model}", "prompt": "ok \\ud83d\\ude00", "max_tokens": 2}}'
    assert http(url, "/v1/completions", raw=paired.encode())[0] == 200
    assert http(url, "/v1/completions", raw=b"\xff\xfe{")[0] == 400

    async def ws_cases():
        replies = []
        ws = await connect(ws_url(url))
        await ws.recv()  # hello
        for msg in (
            '{"type": "list_programs", "id": 1, "x": ' + "[" * 5000 + "]" * 5000 + "}",
            '{"type": "upload", "id": 2, "name": "s", "source": "async def main(a): return \\"\\ud800\\""}',
            '{"type": "upload", "id": 3, "name": "\\udc00", "source": "async def main(a): pass"}',
            '{"type": "launch", "id": 4, "program": "text-completion", "args": ["\\ud800"]}',
        ):
            await ws.send(msg)
            replies.append(json.loads(await ws.recv()))
        await ws.close()
        return replies

    for reply in run(ws_cases()):
        assert reply["type"] == "error" and reply["code"] == "bad_request", reply
    assert "nested deeper" in reply["message"] or "surrogate" in reply["message"]


def test_non_ascii_tokens_get_401_never_a_500(make_tiny, tmp_path):
    """Main answered 500 to a non-ASCII bearer token."""
    with running_server(make_tiny("llama"), tmp_path, auth_token="tok-admin") as (url, _srv):
        for token in ("pässwörd".encode("latin-1"), "pässwörd".encode(), b"tok-admin\xe9"):
            status, body = http(url, "/health", token=token)
            assert status == 401 and "wrong bearer token" in body["error"]["message"], token
        assert http(url, "/health", token="tok-admin")[0] == 200

        async def auth(token):
            ws = await connect(ws_url(url))
            await ws.recv()  # hello
            await ws.send(json.dumps({"type": "auth", "id": 0, "token": token}))
            reply = json.loads(await ws.recv())
            await ws.close()
            return reply

        for token in ("tök", "tok-admin\u00e9"):
            assert run(auth(token))["code"] == "auth_failed", token
        assert run(auth("\ud800"))["code"] == "bad_request"  # not even valid text
        assert run(auth("tok-admin"))["type"] == "ok"


def test_a_non_ascii_configured_token_is_refused_at_start(capsys):
    """Main accepted it, and then no client could send it: everyone was locked out."""
    for token in ("pässwörd", "two words", "tab\there"):
        with pytest.raises(ConfigError, match="printable ASCII"):
            ServerConfig(auth_token=token)
    with pytest.raises(UsersError, match="printable ASCII"):
        Account(User("x"), "ünï")
    assert cli_main(["serve", "--auth-token", "pässwörd"]) == 2
    assert "printable ASCII" in capsys.readouterr().err


def test_errors_shown_to_tenants_name_no_server_paths(plain):
    """A built-in failing on a tenant's bad arguments used to send a traceback full of the
    server's file paths."""
    url, _srv = plain
    src = str(Path(__file__).resolve().parents[1])

    async def go():
        async with await Client.connect(url) as bob:
            inst = await bob.launch("text-completion", [json.dumps({"max_tokens": "many"})])
            with pytest.raises(InferletError) as e:
                await inst.result()
            return e.value.traceback

    tb = run(go())
    assert "Traceback" in tb and 'File "pastry/' in tb
    assert src not in tb and "site-packages" not in tb and '"/' not in tb


# ---------------------------------------------------------------------- trust

SNOOP = """
import os

async def main(args):
    try:
        open("/etc/hostname").read()
        return "trusted"
    except OSError:
        return "sandboxed"
"""


def test_trust_is_decided_per_upload(make_tiny, tmp_path, caplog):
    """Main: --trusted-uploads logged nothing, and programs uploaded earlier to a sandboxed
    server ran trusted after a restart with the flag."""
    ckpt = make_tiny("llama")

    async def upload_and_run(url, token, name):
        async with await Client.connect(url, token) as c:
            await c.upload(SNOOP.replace('"trusted"', f'"trusted {name}"'), name=name)
            return await (await c.launch(name)).result()

    async def launch(url, token, name):
        async with await Client.connect(url, token) as c:
            return await (await c.launch(name)).result()

    # one local user (an operator of its own server)
    with running_server(ckpt, tmp_path / "local") as (url, _):
        assert run(upload_and_run(url, None, "early")) == "sandboxed"
    caplog.clear()
    with (
        caplog.at_level(logging.WARNING, logger="pastry.server.service"),
        running_server(ckpt, tmp_path / "local", trusted_uploads=True) as (url, _),
    ):
        assert any("--trusted-uploads" in r.message for r in caplog.records), caplog.text
        assert run(launch(url, None, "early")) == "sandboxed"  # recorded sandboxed
        assert run(upload_and_run(url, None, "late")) == "trusted late"
    # several users: only operators' uploads run trusted
    users = dict(users=(ROOT, ALICE))
    with running_server(ckpt, tmp_path / "users", trusted_uploads=True, **users) as (url, _):
        assert run(upload_and_run(url, "tok-root", "root")) == "trusted root"
        assert run(upload_and_run(url, "tok-alice", "alices")) == "sandboxed"
    with running_server(ckpt, tmp_path / "users", **users) as (url, _):
        assert run(launch(url, "tok-root", "root")) == "sandboxed"  # the flag is off now


# ---------------------------------------------------------------------- the whole picture


def test_identity(make_tiny, tmp_path):
    """--auth-token names one user (admin, an operator); --users adds more; a wrong token
    is refused everywhere."""
    cfg = dict(auth_token="tok-admin", users=(ALICE,))
    with running_server(make_tiny("llama"), tmp_path, **cfg) as (url, _srv):

        async def go():
            async with (
                await Client.connect(url, "tok-admin") as admin,
                await Client.connect(url, "tok-alice") as alice,
            ):
                return admin.user, alice.user

        assert run(go()) == ("admin", "alice")
        assert http(url, "/health", token="tok-alice")[0] == 200
        assert http(url, "/health", token="tok-nobody")[0] == 401
        assert http(url, "/health")[0] == 401


def test_engine_wide_endpoints_are_the_operators(make_tiny, tmp_path):
    """Microserving's HTTP calls act on the engines for everyone (and swap the router that
    sees every request): a tenant who is not an operator gets 403."""
    with running_server(make_tiny("llama"), tmp_path, users=(ROOT, ALICE)) as (url, _srv):
        for path, body in (
            ("/microserving/router", {"router": "least-loaded"}),
            ("/microserving/prep_recv", {"engine": 0, "prompt": [1], "end": 1}),
        ):
            status, reply = http(url, path, body, token="tok-alice")
            assert status == 403 and "not an operator" in reply["error"]["message"]
        status, reply = http(url, "/microserving/router", {"router": "least-loaded"},
                             token="tok-root")  # fmt: skip
        assert status == 200 and reply["router"] == "least-loaded"
