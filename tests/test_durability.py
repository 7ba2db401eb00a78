"""Nothing lost across a server restart (issue 31, point 4): uploaded programs survive
SIGKILL and SIGTERM of the server, in the middle of uploads; a torn or damaged file is
found at start, moved aside and reported, never loaded."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from pastry import durable
from pastry.client import Client, ClientError
from pastry.server.registry import ProgramRegistry
from server_util import free_port

SERVER = textwrap.dedent(
    """
    import asyncio, sys
    from pathlib import Path
    from pastry.server.app import serve
    from pastry.server.service import ServerConfig

    model, programs, port = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    responses = Path(sys.argv[4]) if len(sys.argv) > 4 else None
    cfg = ServerConfig(model=Path(model), port=port, in_process=True, programs_dir=programs,
                       trusted_uploads=True, num_pages=128, num_embeds=512, dtype="float32",
                       responses_dir=responses)
    asyncio.run(serve(cfg, log_level="warning"))
    """
)


def program(i: int, size: int) -> str:
    pad = "#" * size
    return f"async def main(args):\n    return 'p{i}'\n{pad}\n"


class Server:
    """A server process on ``programs``: ``pastry serve`` as a library call (in-process
    engine, so that killing it kills everything)."""

    def __init__(self, model: Path, programs: Path, responses: Path | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        extra = [] if responses is None else [str(responses)]
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SERVER, str(model), str(programs), str(self.port), *extra],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        deadline = time.monotonic() + 120
        try:
            while True:
                try:
                    asyncio.run(self._ping())
                    return
                except (OSError, ClientError):
                    if self.proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError("the server did not start") from None
                    time.sleep(0.2)
        except BaseException:
            out = self.stop(signal.SIGKILL)  # never leave it running
            raise RuntimeError(f"the server did not start:\n{out}") from None

    async def _ping(self) -> None:
        client = await Client.connect(self.url, timeout=2)
        await client.close()

    def stop(self, sig: int) -> str:
        self.proc.send_signal(sig)
        try:
            out = self.proc.communicate(timeout=60)[0]
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out = self.proc.communicate()[0]
        return out


async def upload_until_killed(url: str, acked: list[tuple[str, str]], sizes: list[int]) -> None:
    """Upload programs one after another, recording each one the server acknowledged."""
    client = await Client.connect(url)
    try:
        for i, size in enumerate(sizes):
            name = f"prog-{i}"
            await client.upload(program(i, size), name)
            acked.append((name, hashlib.sha256(program(i, size).encode()).hexdigest()))
    except Exception:  # the server went away mid-upload: that is the test
        return
    finally:
        with contextlib.suppress(Exception):
            await client.close()


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_uploads_survive_the_server_being_killed_mid_upload(make_tiny, tmp_path, sig):
    model, programs = make_tiny("llama"), tmp_path / "programs"
    server = Server(model, programs)
    acked: list[tuple[str, str]] = []
    sizes = [(i * 7919) % (600 << 10) + 1000 for i in range(400)]  # up to 600 KiB each

    async def run() -> None:
        task = asyncio.create_task(upload_until_killed(server.url, acked, sizes))
        while len(acked) < 5:  # kill it while uploads are going on
            await asyncio.sleep(0.01)
        server.proc.send_signal(sig)
        await task

    try:
        asyncio.run(run())
    finally:
        server.stop(sig)
    assert 5 <= len(acked) < len(sizes)
    again = Server(model, programs)
    try:

        async def check() -> tuple[dict, list]:
            client = await Client.connect(again.url)
            try:
                listed = {p.name: p.hash for p in await client.list_programs()}
                results = []
                for name, _ in acked:
                    inst = await client.launch(name, [])
                    results.append(await inst.result())
                return listed, results
            finally:
                await client.close()

        listed, results = asyncio.run(check())
    finally:
        log = again.stop(signal.SIGTERM)
    for name, digest in acked:  # every acknowledged upload is there, whole
        assert listed.get(name) == digest, (name, listed.get(name))
    assert results == [f"p{name.split('-')[1]}" for name, _ in acked]
    assert not list(programs.glob(".tmp-*"))
    assert "damaged" not in log and "lost" not in log, log
    files = {p.stem for p in programs.glob("*.py")}  # no file but the listed programs'
    assert files <= set(listed.values()) and len(files) >= len(acked)


def test_a_damaged_store_is_reported_and_never_loaded(tmp_path, caplog):
    reg = ProgramRegistry(tmp_path)
    a = reg.upload(program(1, 10), "a")
    b = reg.upload(program(2, 10), "b")
    reg.upload(program(3, 10), "c")  # the index before this upload is index.json.prev
    reg.close()
    # a torn index (a write cut short by a crash with no atomic rename)
    index = tmp_path / "index.json"
    index.write_text(index.read_text()[:40])
    # a program file whose bytes no longer match its hash
    (tmp_path / f"{b.hash}.py").write_text("async def main(args):\n    return 'tampered'\n")
    # an unfinished write a killed server left
    (tmp_path / ".tmp-index.json-abc").write_text("[")
    with caplog.at_level("ERROR", logger="pastry.server.registry"):
        again = ProgramRegistry(tmp_path)
    names = {i.name for i in again.list() if not i.builtin}
    assert names == {"a"}  # b is damaged; c came after the last good index
    assert again.get("a").name == "a" and again.info("a").hash == a.hash
    problems = "\n".join(again.problems)
    assert "index.json is damaged" in problems and "index.json.corrupt" in problems
    assert "using index.json.prev" in problems
    assert f"{b.hash}.py does not hold the program of that hash" in problems
    assert "'b'" in problems and "lost" in problems
    assert (tmp_path / "index.json.corrupt").exists()
    assert (tmp_path / f"{b.hash}.py.corrupt").exists()
    assert not (tmp_path / ".tmp-index.json-abc").exists()
    assert all(p in caplog.text for p in again.problems)
    again.upload(program(4, 10), "d")  # and it goes on: the next write is a good index
    assert {i.name for i in ProgramRegistry(tmp_path).list() if not i.builtin} == {"a", "d"}


KILLED_WRITER = textwrap.dedent(
    """
    import hashlib, json, os, sys
    from pathlib import Path
    from pastry.durable import atomic_write

    path = Path(sys.argv[1])
    i = 0
    while True:
        body = os.urandom(1 + (i * 104729) % (2 << 20)).hex()
        atomic_write(path, json.dumps({"i": i, "sha": hashlib.sha256(body.encode()).hexdigest(), "body": body}), keep_previous=True)
        i += 1
    """
)


def test_atomic_write_leaves_old_or_new_never_a_mix(tmp_path):
    """A writer SIGKILLed at random moments: the file is always one whole version."""
    path = tmp_path / "state.json"
    for round_ in range(8):
        proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(path)])
        time.sleep(0.3 + 0.11 * round_)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        for p in (path, path.with_name("state.json.prev")):
            if p.exists():
                state = json.loads(p.read_text())
                assert hashlib.sha256(state["body"].encode()).hexdigest() == state["sha"]
        assert path.exists()
        durable.leftovers(tmp_path)
        assert not list(tmp_path.glob(".tmp-*"))


def test_stored_responses_survive_kills_and_restarts(make_tiny, tmp_path):
    """Stored /v1/responses are on the disk before the client hears of them: after SIGKILL
    every one is retrievable with its input items, a follow-up continues the conversation
    as it would have before (its KV export is gone: computed again), deleted and unstored
    ones stay gone; a damaged file is moved aside and reported, never loaded."""
    model, programs, responses = make_tiny("llama"), tmp_path / "programs", tmp_path / "responses"

    def call(server: Server, method: str, path: str, body: dict | None = None) -> httpx.Response:
        return httpx.request(method, server.url + path, json=body, timeout=60)

    def create(server: Server, **body) -> dict:
        r = call(server, "POST", "/v1/responses", {"model": name, "max_output_tokens": 4, "temperature": 0, **body})  # fmt: skip
        assert r.status_code == 200, r.text
        return r.json()

    def text(r: dict) -> list[str]:
        return [c["text"] for item in r["output"] for c in item["content"]]

    server = Server(model, programs, responses)
    try:
        name = call(server, "GET", "/v1/models").json()["data"][0]["id"]
        r1 = create(server, input="Hello there")
        r2 = create(server, input="And again", previous_response_id=r1["id"])
        items = call(server, "GET", f"/v1/responses/{r2['id']}/input_items").json()
        follow = create(server, input="More", previous_response_id=r2["id"], store=False)
        gone = create(server, input="Forget me")
        assert call(server, "DELETE", f"/v1/responses/{gone['id']}").status_code == 200
        unstored = create(server, input="Not kept", store=False)
    finally:
        server.stop(signal.SIGKILL)
    again = Server(model, programs, responses)
    try:
        for r in (r1, r2):
            assert call(again, "GET", f"/v1/responses/{r['id']}").json() == r
        assert call(again, "GET", f"/v1/responses/{r2['id']}/input_items").json() == items
        for r in (gone, unstored, follow):
            assert call(again, "GET", f"/v1/responses/{r['id']}").status_code == 404
        later = create(again, input="More", previous_response_id=r2["id"], store=False)
        assert text(later) == text(follow)  # the same conversation, recomputed
        assert later["usage"]["input_tokens"] == follow["usage"]["input_tokens"]
        assert later["usage"]["input_tokens_details"]["cached_tokens"] == 0  # the KV was lost
    finally:
        log = again.stop(signal.SIGTERM)
    assert "damaged" not in log, log
    files = sorted(responses.rglob("*.json"))
    assert [f.stem for f in files] == sorted([r1["id"], r2["id"]])
    assert all(f.stat().st_mode & 0o077 == 0 for f in files)  # the server's user only
    damaged = next(f for f in files if f.stem == r1["id"])
    damaged.write_text(damaged.read_text().replace("Hello", "Jello"))  # not its digest
    third = Server(model, programs, responses)
    try:
        assert call(third, "GET", f"/v1/responses/{r1['id']}").status_code == 404
        assert call(third, "GET", f"/v1/responses/{r2['id']}").json() == r2
    finally:
        log = third.stop(signal.SIGTERM)
    assert "damaged" in log and damaged.with_name(damaged.name + ".corrupt").exists(), log
