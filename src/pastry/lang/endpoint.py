"""``Endpoint``: run programs on a Pastry server from a client process.

Each ``run`` ships the program to the server as one inferlet (:mod:`pastry.lang.ship`,
uploaded once per program and connection) and launches it with the call's arguments over
the WebSocket protocol (:mod:`pastry.client`); the program's streams, forks and nested
calls run inside the server next to their KV, and only the final state (and, when
streaming, the text as it grows) comes back. ``run_batch`` launches many at once over the
same connection. The connection lives on a background event loop thread, so ``run`` can
be called from ordinary synchronous code and from many threads.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import queue
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from typing import Any

from pastry.lang.function import Function
from pastry.lang.inferlet import encode_arguments
from pastry.lang.ship import program_source
from pastry.lang.stream import ProgramError

_END = object()


class Endpoint:
    """A Pastry server, as a backend of ``run`` / ``run_batch``.

    ``base_url``: ``http://HOST:PORT``; ``api_key``: the server's auth token, if any
    (SGLang's ``RuntimeEndpoint`` spells it the same); ``adapter``: a LoRA adapter loaded on
    the server (``/v1/models`` lists it) that every run applies unless it names its own."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        *,
        adapter: str | None = None,
        timeout: float = 30,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.adapter = adapter
        self.timeout = timeout
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="pastry.lang endpoint", daemon=True
        )
        self._thread.start()
        self._client: Any = None
        self._uploaded: dict[str, str] = {}  # source digest -> program hash on the server
        self._lock: asyncio.Lock | None = None
        self.models: list[str] = self._call(self._connect()).models

    def __repr__(self) -> str:
        return f"Endpoint({self.base_url!r})"

    # ------------------------------------------------------------------ the backend API

    def run(
        self,
        fn: Function,
        arguments: dict[str, Any],
        sampling: dict[str, Any],
        stream: bool,
        adapter: str | None = None,
    ) -> RemoteState:
        state = RemoteState(fn.__name__, stream)
        state._future = asyncio.run_coroutine_threadsafe(
            self._launch(fn, arguments, sampling, state, adapter), self._loop
        )
        if not stream:
            state._future.result()
            if state._error is not None:
                raise state._error
        return state

    def run_batch(
        self,
        fn: Function,
        batch: Sequence[dict[str, Any]],
        sampling: dict[str, Any],
        num_threads: int | str = "auto",
        progress_bar: bool = False,
        adapter: str | None = None,
    ) -> list[RemoteState]:
        limit = max(96, (_cpus() or 1) * 16) if num_threads == "auto" else int(num_threads)
        states = [RemoteState(fn.__name__, False) for _ in batch]

        async def all_of() -> None:
            gate = asyncio.Semaphore(max(1, min(limit, len(batch))))

            async def one(args: dict[str, Any], state: RemoteState) -> None:
                async with gate:
                    await self._launch(fn, args, sampling, state, adapter)

            await asyncio.gather(*(one(a, s) for a, s in zip(batch, states, strict=True)))

        self._call(all_of(), timeout=None)
        return states

    def close(self) -> None:
        if self._client is not None:
            self._call(self._client.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    # SGLang's RuntimeEndpoint has these too.

    def get_model_name(self) -> str:
        return self.models[0] if self.models else ""

    def get_server_info(self) -> dict[str, Any]:
        return self._http("GET", "/get_server_info")

    def flush_cache(self) -> Any:
        return self._http("POST", "/flush_cache")

    # ------------------------------------------------------------------ internals

    def _call(self, coro, timeout: float | None = 30) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _connect(self):
        from pastry.client import Client

        if self._client is None or self._client.closed is not None:
            self._client = await Client.connect(self.base_url, self.api_key, timeout=self.timeout)
            self._uploaded.clear()
        return self._client

    async def _program(self, fn: Function) -> str:
        source = program_source(fn)
        digest = hashlib.sha256(source.encode()).hexdigest()
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            client = await self._connect()
            if digest not in self._uploaded:
                self._uploaded[digest] = await client.upload(source)
        return self._uploaded[digest]

    async def _launch(
        self,
        fn: Function,
        arguments: dict[str, Any],
        sampling: dict[str, Any],
        state: RemoteState,
        adapter: str | None,
    ) -> None:
        from pastry.client import InferletError

        try:
            request = json.dumps(
                {
                    "function": fn.__name__,
                    "arguments": encode_arguments(arguments),
                    "sampling": sampling,
                    "stream": state.streaming,
                    "adapter": self.adapter if adapter is None else adapter,
                }
            )
        except TypeError as e:
            state._fail(ProgramError(f"the arguments of {fn.__name__} must be JSON data: {e}"))
            return
        try:
            program = await self._program(fn)
            inst = await (await self._connect()).launch(program, [request])
            async for ev in inst.events():
                if ev.kind == "message" and state.streaming:
                    state._pieces.put(json.loads(ev.data or "{}").get("text", ""))
            state._finish(json.loads(await inst.result() or "{}"))
        except InferletError as e:
            last = (e.traceback.strip().splitlines() or ["failed"])[-1]
            state._fail(ProgramError(f"{fn.__name__} failed on the server: {last}\n{e.traceback}"))
        except Exception as e:  # the connection, an upload refused...
            state._fail(e)

    def _http(self, method: str, path: str) -> Any:
        import urllib.request

        req = urllib.request.Request(
            self.base_url + path, method=method, data=b"" if method == "POST" else None
        )
        if self.api_key:
            req.add_header("Authorization", f"Bearer {self.api_key}")
        with urllib.request.urlopen(req, timeout=self.timeout) as r:
            body = r.read().decode()
        try:
            return json.loads(body)
        except ValueError:
            return body


class RemoteState:
    """The state of a program that ran on a server: its text, variables and meta info
    (reading waits until the program has finished)."""

    def __init__(self, name: str, streaming: bool) -> None:
        self.name = name
        self.streaming = streaming
        self._done = threading.Event()
        self._result: dict[str, Any] = {}
        self._error: BaseException | None = None
        self._pieces: queue.SimpleQueue = queue.SimpleQueue()
        self._future: Future | None = None

    def _finish(self, result: dict[str, Any]) -> None:
        self._result = result
        self._done.set()
        self._pieces.put(_END)

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self._done.set()
        self._pieces.put(_END)

    def _wait(self) -> dict[str, Any]:
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._result

    def sync(self) -> None:
        self._done.wait()

    def error(self) -> BaseException | None:
        self._done.wait()
        return self._error

    def text(self) -> str:
        return self._wait()["text"]

    def messages(self) -> list[dict[str, str]]:
        return self._wait()["messages"]

    def __getitem__(self, name: str) -> Any:
        variables = self._wait()["variables"]
        if name not in variables:
            raise KeyError(f"no variable {name!r} (variables: {', '.join(variables) or 'none'})")
        return variables[name]

    get_var = __getitem__

    def __contains__(self, name: str) -> bool:
        return name in self._wait()["variables"]

    def get_meta_info(self, name: str) -> dict[str, Any] | None:
        return self._wait()["meta_info"].get(name)

    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        """With ``stream=True``: the program's text piece by piece as it is produced (a
        variable: its value once complete)."""
        if var_name is not None or not self.streaming:
            yield self[var_name] if var_name is not None else self.text()
            return
        while (piece := self._pieces.get()) is not _END:
            yield piece
        self._wait()

    def __repr__(self) -> str:
        return f"RemoteState({self.name})"


def _cpus() -> int | None:
    import os

    return os.cpu_count()
