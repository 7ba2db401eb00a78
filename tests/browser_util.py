"""Headless Chromium driven over the DevTools protocol (for the dashboard's page tests and
``scripts/dashboard_screenshot.py``): open a page, evaluate JavaScript in it, accept its
dialogs, take a screenshot. Uses only ``websockets``; Chromium is Debian's ``chromium``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import os
import re
import shutil
import subprocess
import tempfile
import urllib.request
from pathlib import Path

from websockets.asyncio.client import connect


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        if path := shutil.which(name):
            return path
    return None


class Browser:
    """One headless Chromium process; :meth:`open` gives a :class:`Page`."""

    def __init__(self, binary: str, width: int = 1400, height: int = 1000) -> None:
        self.profile = tempfile.mkdtemp(prefix="pastry-chromium-")
        args = [binary, "--headless=new", "--disable-gpu", "--no-first-run",
                "--no-default-browser-check", "--remote-debugging-port=0",
                f"--user-data-dir={self.profile}", f"--window-size={width},{height}",
                "--hide-scrollbars", "about:blank"]  # fmt: skip
        if os.geteuid() == 0:
            args.insert(1, "--no-sandbox")  # Chromium refuses its sandbox as root
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.port = self._port()

    def _port(self) -> int:
        seen = []
        assert self.proc.stderr is not None
        for raw in self.proc.stderr:
            line = raw.decode(errors="replace")
            seen.append(line)
            if m := re.search(r"DevTools listening on ws://[^:]+:(\d+)/", line):
                return int(m[1])
        raise RuntimeError("chromium did not start:\n" + "".join(seen[-20:]))

    async def open(self, url: str) -> Page:
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/json/new?about:blank", method="PUT")  # fmt: skip
        with urllib.request.urlopen(req, timeout=10) as r:
            target = json.load(r)
        page = Page(await connect(target["webSocketDebuggerUrl"], max_size=2**26))
        await page.start()
        await page.goto(url)
        return page

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        shutil.rmtree(self.profile, ignore_errors=True)


class Page:
    """One tab: commands answered by id; dialogs (``confirm``) are accepted."""

    def __init__(self, ws) -> None:
        self.ws = ws
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future] = {}
        self.console: list[str] = []  # what the page logged, errors included
        self._reader: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> None:
        self._reader = asyncio.create_task(self._read())
        for domain in ("Page.enable", "Runtime.enable"):
            await self.send(domain)

    async def _read(self) -> None:
        async for raw in self.ws:
            msg = json.loads(raw)
            if "id" in msg and (fut := self._waiting.pop(msg["id"], None)) is not None:
                if "error" in msg:
                    fut.set_exception(RuntimeError(f"DevTools: {msg['error']}"))
                else:
                    fut.set_result(msg.get("result", {}))
            elif msg.get("method") == "Page.javascriptDialogOpening":
                task = asyncio.create_task(self.send("Page.handleJavaScriptDialog", accept=True))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            elif msg.get("method") == "Runtime.consoleAPICalled":
                self.console.append(" ".join(str(a.get("value", a.get("description"))) for a in msg["params"]["args"]))  # fmt: skip
            elif msg.get("method") == "Runtime.exceptionThrown":
                self.console.append("exception: " + json.dumps(msg["params"]["exceptionDetails"])[:500])  # fmt: skip

    async def send(self, method: str, **params) -> dict:
        i = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._waiting[i] = fut
        await self.ws.send(json.dumps({"id": i, "method": method, "params": params}))
        return await asyncio.wait_for(fut, 30)

    async def goto(self, url: str) -> None:
        await self.send("Page.navigate", url=url)

    async def evaluate(self, expression: str):
        """The value of ``expression`` (awaited when it is a promise), as JSON."""
        r = await self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)  # fmt: skip
        if "exceptionDetails" in r:
            raise RuntimeError(f"in the page: {r['exceptionDetails']}")
        return r["result"].get("value")

    async def wait_for(self, expression: str, timeout: float = 20.0):
        """Until ``expression`` is truthy in the page; its value."""
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            with contextlib.suppress(RuntimeError):
                if value := await self.evaluate(expression):
                    return value
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"the page never had {expression!r}; it logged {self.console}")
            await asyncio.sleep(0.2)

    async def screenshot(self, path: Path) -> Path:
        shot = await self.send("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        path.write_bytes(base64.b64decode(shot["data"]))
        return path

    async def close(self) -> None:
        await self.ws.close()
        if self._reader is not None:
            self._reader.cancel()
