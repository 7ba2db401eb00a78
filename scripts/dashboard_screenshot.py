"""The README's screenshot of the dashboard, taken the way tests/test_dashboard_browser.py
takes its own (tests/browser_util.py): a server on a small random model with programs of
two users and OpenAI requests sharing a prefix, watched for a while by headless Chromium.

    .venv/bin/python scripts/dashboard_screenshot.py [docs/dashboard.png] [--seconds 45]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import httpx  # noqa: E402

from browser_util import Browser, find_chromium  # noqa: E402
from pastry.client import Client  # noqa: E402
from pastry.control.users import Account, User  # noqa: E402
from pastry.engine.tiny import create_tiny  # noqa: E402
from server_util import running_server  # noqa: E402

USERS = (Account(User("alice"), "tok-alice"), Account(User("bob"), "tok-bob"),
         Account(User("ops", operator=True), "tok-ops"))  # fmt: skip

# An agent-like program: bursts of generation with pauses between (its "tool calls").
AGENT = """
import asyncio
import pastry.sdk as px
from pastry.sdk import Context, Greedy, MaxTokens

async def main(args):
    burst, pause = int(args[0]), float(args[1])
    while True:  # one task after another, each a few bursts long
        async with Context() as ctx:
            ctx.fill("You are a careful assistant. Plan the trip step by step.")
            for _ in range(6):
                await ctx.generate(Greedy(), MaxTokens(burst))
                await asyncio.sleep(pause)
"""

PREFIX = "Answer the question about the document below in one sentence. " * 6


async def requests(url: str, token: str, stop: asyncio.Event) -> None:
    rng = random.Random(token)
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        while not stop.is_set():
            body = {"model": "tiny", "prompt": PREFIX + f"Question {rng.randint(1, 99)}?",
                    "max_tokens": rng.randint(8, 32)}  # fmt: skip
            await http.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {token}"})  # fmt: skip


async def shoot(out: Path, seconds: float) -> None:
    home = Path(tempfile.mkdtemp(prefix="pastry-shot-"))
    model = create_tiny(home / "tiny", arch="llama")
    with running_server(model, home, users=USERS) as (url, _):
        clients = []
        for account, agents in ((USERS[0], 4), (USERS[1], 3)):
            c = await Client.connect(url, account.token)
            await c.upload(AGENT, name="planner")
            for k in range(agents):
                await c.launch("planner", [str(8 + 4 * k), str(0.2 + 0.1 * k)])
            clients.append(c)
        stop = asyncio.Event()
        load = [asyncio.create_task(requests(url, a.token, stop)) for a in USERS[:2] for _ in range(3)]  # fmt: skip
        browser = Browser(find_chromium() or sys.exit("no chromium (apt install chromium)"), 1280, 1200)  # fmt: skip
        try:
            page = await browser.open(f"{url}/dashboard#token={USERS[2].token}")
            await asyncio.sleep(seconds)
            await page.screenshot(out)
            await page.close()
        finally:
            browser.close()
            stop.set()
            await asyncio.gather(*load, return_exceptions=True)
            for c in clients:
                await c.close()
    print(f"wrote {out} ({out.stat().st_size // 1024} KiB)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", nargs="?", type=Path, default=ROOT / "docs" / "dashboard.png")
    p.add_argument("--seconds", type=float, default=45.0, help="how long the page watches")
    args = p.parse_args()
    asyncio.run(shoot(args.out, args.seconds))


if __name__ == "__main__":
    main()
