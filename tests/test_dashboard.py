"""The dashboard's data (docs/dashboard.md): /dashboard/state and /events per user, the
page's files without a token, terminate from the page, the series on /metrics, `pastry top`.

The page in a real browser: tests/test_dashboard_browser.py.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path

import httpx
import pytest

from pastry.client import Client, InstanceTerminated
from pastry.control.users import Account, User
from server_util import call, running_server

ROOT = Path(__file__).resolve().parent.parent
ALICE = Account(User("alice"), "tok-alice")
BOB = Account(User("bob"), "tok-bob")
OPS = Account(User("ops", operator=True), "tok-ops")

# Generates args[0] tokens (holding their KV), says so, then waits for a message.
HOLD = """
import pastry.sdk as px
from pastry.sdk import Context, Greedy, MaxTokens

async def main(args):
    ctx = Context()
    ctx.fill("Once upon a time there was")
    for _ in range(int(args[0])):
        await ctx.generate(Greedy(), MaxTokens(1))
    px.send("ready")
    await px.receive()
    return "done"
"""


@pytest.fixture(scope="module")
def server(make_tiny, tmp_path_factory):
    path = tmp_path_factory.mktemp("dash")
    with running_server(make_tiny("llama"), path, users=(ALICE, BOB, OPS)) as (url, srv):
        yield url, srv


def auth(account: Account) -> dict:
    return {"Authorization": f"Bearer {account.token}"}


async def launch_holders(url: str, account: Account, n: int, tokens: int = 5):
    """``n`` HOLD instances of ``account``, each past its generation (its client, and them)."""
    c = await Client.connect(url, account.token)
    await c.upload(HOLD, name="hold")
    insts = [await c.launch("hold", [str(tokens)]) for _ in range(n)]
    for inst in insts:
        assert (await anext(inst.events())).data == "ready"
    return c, insts


async def sampled_after(http: httpx.AsyncClient, account: Account, t: float) -> dict:
    """The first state whose newest sample was taken after ``t`` (server clock)."""
    for _ in range(50):
        state = (await http.get("/dashboard/state", headers=auth(account))).json()
        points = state["engines"][0]["points"]
        if points and points[-1]["t"] > t:
            return state
        await asyncio.sleep(0.1)
    raise AssertionError("no new sample within 5 s")


def test_state_shows_each_user_its_own_programs_and_the_operator_all(server):
    url, srv = server

    async def go():
        a, a_insts = await launch_holders(url, ALICE, 2)
        b, b_insts = await launch_holders(url, BOB, 1)
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            t = (await http.get("/dashboard/state", headers=auth(OPS))).json()["now"]
            views = {acc.user.name: await sampled_after(http, acc, t) for acc in (ALICE, BOB, OPS)}
        held = call(srv, lambda: {
            i.id: sum(m.resources.charged(i.id, "kv") for m in srv.controller.all_engines())
            for i in srv.runtime.instances.values()
        })  # fmt: skip
        owners = call(srv, lambda: srv.controller.all_engines()[0].resources.kv_owners())
        for inst in a_insts + b_insts:
            await inst.send("bye")
        await a.close()
        await b.close()
        return views, held, owners, {i.id for i in a_insts}, {i.id for i in b_insts}

    views, held, owners, alices, bobs = asyncio.run(asyncio.wait_for(go(), 60))
    assert {r["id"] for r in views["alice"]["programs"]} == alices
    assert {r["id"] for r in views["bob"]["programs"]} == bobs
    assert {r["id"] for r in views["ops"]["programs"]} >= alices | bobs
    assert (views["alice"]["operator"], views["ops"]["operator"]) == (False, True)
    for row in views["ops"]["programs"]:
        if row["id"] in alices | bobs:
            assert row["name"] == "hold" and row["runtime"] == "sandboxed"
            assert row["state"] == "running" and row["tokens"] >= 5
            assert row["pages"] == held[row["id"]] > 0
    assert views["alice"]["counts"]["total"] == 2
    point = views["ops"]["engines"][0]["points"][-1]
    assert point["kv"] == owners  # nothing ran between the sample and the check
    assert point["kv"]["programs"] >= sum(held[i] for i in alices | bobs)
    assert point["kv"]["programs"] + point["kv"]["cache"] + point["kv"]["free"] == point["kv"]["total"]  # fmt: skip


def test_page_needs_no_token_but_its_data_does(server):
    url, _ = server
    with httpx.Client(base_url=url, timeout=10) as http:
        page = http.get("/dashboard")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "/dashboard/static/dashboard.js" in page.text
        js = http.get("/dashboard/static/dashboard.js")
        assert js.status_code == 200 and "text/javascript" in js.headers["content-type"]
        assert http.get("/dashboard/static/dashboard.css").status_code == 200
        for path in ("/dashboard/static/../service.py", "/dashboard/static/..%2Fservice.py"):
            assert http.get(path, headers=auth(OPS)).status_code == 404  # only its own files
        assert http.get("/dashboard/static/secrets.txt", headers=auth(OPS)).status_code == 404
        for path in ("/dashboard/state", "/dashboard/events"):
            assert http.get(path).status_code == 401
        assert http.post("/dashboard/terminate", json={"instance": 1}).status_code == 401
        assert http.get("/dashboard/state?history=2", headers=auth(OPS)).status_code == 400


def test_events_stream_one_sample_a_second_after_the_history(server):
    url, _ = server

    async def go():
        events = []
        async with (
            httpx.AsyncClient(base_url=url, timeout=10) as http,
            http.stream("GET", "/dashboard/events", headers=auth(ALICE)) as r,
        ):
            assert r.headers["content-type"].startswith("text/event-stream")
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
                    if len(events) == 3:
                        break
        return events

    first, second, third = asyncio.run(asyncio.wait_for(go(), 20))
    assert len(first["engines"][0]["points"]) >= 1  # the history so far
    a, b = second["engines"][0]["points"], third["engines"][0]["points"]
    assert len(a) == len(b) == 1 and 0.5 < b[0]["t"] - a[0]["t"] < 2.5
    assert first["user"] == "alice"


def test_a_program_is_terminated_from_the_page_by_whoever_may(server):
    url, _ = server

    async def go():
        a, (inst,) = await launch_holders(url, ALICE, 1, tokens=1)
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            end = lambda acc, body: http.post("/dashboard/terminate", json=body, headers=auth(acc))  # noqa: E731
            bobs = await end(BOB, {"instance": inst.id})
            bad = await end(ALICE, {"instance": "x"})
            mine = await end(ALICE, {"instance": inst.id})
            with pytest.raises(InstanceTerminated) as e:
                await inst.result()
            again = await end(ALICE, {"instance": inst.id})
        await a.close()
        return bobs, bad, mine, again, e.value.reason

    bobs, bad, mine, again, reason = asyncio.run(asyncio.wait_for(go(), 30))
    assert bobs.status_code == 404  # another user's program does not exist for bob
    assert bad.status_code == 400 and "'instance'" in bad.json()["error"]["message"]
    assert mine.status_code == 200 and reason == "terminated from the dashboard by alice"
    assert again.status_code == 404


def test_metrics_carry_the_dashboards_series(server):
    url, srv = server

    async def go():
        a, insts = await launch_holders(url, ALICE, 2)
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            text = (await http.get("/metrics", headers=auth(OPS))).text
        owners = call(srv, lambda: srv.controller.all_engines()[0].resources.kv_owners())
        for inst in insts:
            await inst.send("bye")
        await a.close()
        return text, owners

    text, owners = asyncio.run(asyncio.wait_for(go(), 60))
    running = re.findall(r'^pastry_programs\{level="[^"]+",state="running"\} (\S+)$', text, re.M)
    assert sum(float(v) for v in running) >= 2
    for owner in ("programs", "cache", "free"):
        (value,) = re.findall(rf'^pastry_kv_pages\{{engine="[^"]+",owner="{owner}"\}} (\S+)$', text, re.M)  # fmt: skip
        assert float(value) == owners[owner]
    assert re.search(r"^pastry_prefix_cache_prompt_tokens_total\{engine=", text, re.M)
    assert re.search(r"^pastry_prefix_cache_hit_tokens_total\{engine=", text, re.M)
    assert re.search(r"^pastry_prefix_cache_evictions_total\{engine=", text, re.M)
    # every series the example Grafana dashboard plots is one the server exports
    exported = set(re.findall(r"^# HELP (\S+)", text, re.M)) | set(
        re.findall(r"^(\w+)[{ ]", text, re.M)
    )
    grafana = json.loads((ROOT / "examples" / "grafana" / "pastry.json").read_text())
    exprs = [t["expr"] for p in grafana["panels"] for t in p["targets"]]
    named = {n.removesuffix("_bucket") for e in exprs for n in re.findall(r"\bpastry_\w+", e)}
    assert len(named) >= 12 and named <= exported, named - exported


def test_pastry_top_once_prints_the_programs_and_engines(server, capsys):
    from pastry.cli import main

    url, _ = server

    async def go():
        a, insts = await launch_holders(url, BOB, 1)
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            t = (await http.get("/dashboard/state", headers=auth(BOB))).json()["now"]
            await sampled_after(http, BOB, t)
        code = await asyncio.to_thread(main, ["top", "--once", "--server", url, "--token", BOB.token])  # fmt: skip
        refused = await asyncio.to_thread(main, ["top", "--once", "--server", url])
        for inst in insts:
            await inst.send("bye")
        await a.close()
        return code, refused, insts[0].id

    code, refused, iid = asyncio.run(asyncio.wait_for(go(), 60))
    out = capsys.readouterr().out
    assert code == 0 and str(iid) in out and "hold" in out and "bob" in out
    assert "KV pages" in out and "tok/s" in out
    assert refused == 1 and "wants a token" in out


def test_latency_counts_from_when_a_token_was_asked_for_not_the_programs_pauses():
    """ITL of a token = its arrival minus max(previous token, when it was asked for); TTFT =
    first token minus the instance's start; tokens counted per instance and per engine."""
    from types import SimpleNamespace as NS

    from pastry.control.commands import Stage
    from pastry.server.dashboard_state import EngineLog, Recorder, _percentiles

    clock = [1000.0]
    runtime = NS(instances={7: NS(started=999.5)})
    rec = Recorder(NS(runtime=runtime), clock=lambda: clock[0])
    log = EngineLog("m", 0)
    observe = rec._observer(log)
    queue = NS(instance=7, qid=1)

    def token(asked: float) -> None:  # a command asked for `asked` s ago comes back now
        observe([NS(queue=queue, end_stage=Stage.OUTPUT, created=time.perf_counter() - asked)], 0.001)  # fmt: skip

    token(0.0)  # the first token: 0.5 s after the start
    time.sleep(0.3)  # the program thinks, then asks for the next token, which takes 10 ms
    token(0.01)
    observe([NS(queue=queue, end_stage=Stage.FORWARD, created=0.0)], 0.001)  # not a token
    assert rec.tokens == {7: 2} and (log.tokens, log.batches, log.queues) == (2, 3, 3)
    ttft = _percentiles("ttft", log.ttft, clock[0])
    itl = _percentiles("itl", log.itl, clock[0])
    assert ttft["ttft_p50_ms"] == 500.0
    assert 10 <= itl["itl_p50_ms"] < 100  # not the 300 ms pause
    clock[0] += 61  # a minute later the window is empty
    assert _percentiles("itl", log.itl, clock[0]) == {"itl_p50_ms": None, "itl_p99_ms": None}
