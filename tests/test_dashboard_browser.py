"""The dashboard in a real browser: headless Chromium opens /dashboard, waits for the live
data, and what it shows must be the server's state (tests/browser_util.py drives it).

Skipped where Chromium is absent (scripts/test.sh installs Debian's `chromium` where it
can).
"""

from __future__ import annotations

import asyncio

import pytest

from browser_util import Browser, find_chromium
from server_util import call, running_server
from test_dashboard import ALICE, BOB, OPS, launch_holders

CHROMIUM = find_chromium()
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium (apt install chromium)")

ROWS = """[...document.querySelectorAll('#programs tbody tr[data-instance]')].map(tr => ({
  id: tr.dataset.instance, state: tr.dataset.state, pages: Number(tr.dataset.pages),
  text: tr.innerText}))"""
KV = "Object.assign({}, document.querySelector('#charts .engine .kv-now')?.dataset)"


@pytest.fixture(scope="module")
def server(make_tiny, tmp_path_factory):
    path = tmp_path_factory.mktemp("dash-browser")
    with running_server(make_tiny("llama"), path, users=(ALICE, BOB, OPS)) as (url, srv):
        yield url, srv


@pytest.fixture(scope="module")
def browser():
    b = Browser(CHROMIUM)
    yield b
    b.close()


def charged(srv) -> dict[str, int]:
    """Every running instance's KV pages, as the server counts them (by id, as text)."""
    return call(srv, lambda: {
        str(i.id): sum(m.resources.charged(i.id, "kv") for m in srv.controller.all_engines())
        for i in srv.runtime.instances.values()
    })  # fmt: skip


def test_the_page_shows_the_running_programs_and_pages(server, browser, tmp_path):
    url, srv = server

    async def go():
        a, a_insts = await launch_holders(url, ALICE, 2)
        b, b_insts = await launch_holders(url, BOB, 1)
        page = await browser.open(f"{url}/dashboard#token={OPS.token}")
        n = len(a_insts) + len(b_insts)
        await page.wait_for(f"document.body.dataset.updated && {ROWS}.length === {n}")
        # a sample taken after every program was ready: the pages shown are today's
        await page.wait_for(f"Number(document.body.dataset.updated) > {await page.evaluate('Date.now() / 1000')} ")  # fmt: skip
        rows, kv = await page.evaluate(ROWS), await page.evaluate(KV)
        address = await page.evaluate("location.href")
        shot = await page.screenshot(tmp_path / "dashboard.png")
        server_pages = charged(srv)
        owners = call(srv, lambda: srv.controller.all_engines()[0].resources.kv_owners())
        await page.close()
        for inst in a_insts + b_insts:
            await inst.send("bye")
        await a.close()
        await b.close()
        ids = {str(i.id) for i in a_insts + b_insts}
        return rows, kv, address, shot, server_pages, owners, ids

    rows, kv, address, shot, server_pages, owners, ids = asyncio.run(asyncio.wait_for(go(), 90))
    assert {r["id"] for r in rows} == ids == set(server_pages)
    for r in rows:
        assert r["state"] == "running" and r["pages"] == server_pages[r["id"]] > 0
        assert "hold" in r["text"] and "sandboxed" in r["text"]
    assert {k: int(v) for k, v in kv.items()} == {k: owners[k] for k in ("programs", "cache", "free")}  # fmt: skip
    assert "token" not in address  # the page took the token out of its address
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_another_users_programs_are_not_shown_and_own_ones_can_be_ended(server, browser):
    url, _ = server

    async def go():
        a, a_insts = await launch_holders(url, ALICE, 2)
        b, (mine,) = await launch_holders(url, BOB, 1)
        page = await browser.open(f"{url}/dashboard#token={BOB.token}")
        await page.wait_for(f"{ROWS}.length === 1")
        seen = await page.evaluate(ROWS)
        who = await page.evaluate("document.getElementById('who').textContent")
        # the terminate button (its confirm dialog accepted by the driver)
        await page.evaluate(f"document.querySelector('tr[data-instance=\"{mine.id}\"] button.end').click()")  # fmt: skip
        reason = None
        try:
            await asyncio.wait_for(mine.result(), 10)
        except Exception as e:  # InstanceTerminated
            reason = getattr(e, "reason", repr(e))
        await page.wait_for(f"{ROWS}.length === 0")
        await page.close()
        for inst in a_insts:
            await inst.send("bye")
        await a.close()
        await b.close()
        return seen, who, reason, {str(i.id) for i in a_insts}, str(mine.id)

    seen, who, reason, alices, bobs = asyncio.run(asyncio.wait_for(go(), 90))
    assert [r["id"] for r in seen] == [bobs] and not alices & {r["id"] for r in seen}
    assert who.startswith("bob (your programs)")
    assert reason == "terminated from the dashboard by bob"
