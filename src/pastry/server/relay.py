"""One HTTP response from inferlet instances: what the OpenAI and SGLang endpoints share.

A request runs as one instance per prompt. :func:`relay` launches them, pumps their events
into one queue tagged with the prompt's index, runs the endpoint's ``answer`` (a JSON body
or a stream) against that queue, and ends everything when either the answer is sent or the
client goes away: ``server.disown(owner)`` ends the instances still running. An error the
answer raised is raised again after the clean-up.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.types import Receive, Send

from pastry.control.events import Event
from pastry.runtime.trusted import Instance
from pastry.server.service import PastryServer

Events = asyncio.Queue[tuple[int, Event]]


async def relay(
    server: PastryServer,
    owner: object,
    args: list[str],
    launch: Callable[[str], Instance],
    answer: Callable[[Events], Awaitable[None]],
    receive: Receive,
) -> None:
    """Launch ``launch(arg)`` for each of ``args`` (owned by ``owner``) and run ``answer``
    on their events until it returns or the client disconnects."""
    events: Events = asyncio.Queue()
    tasks: list[asyncio.Task] = []
    try:
        for k, arg in enumerate(args):
            tasks.append(asyncio.create_task(_pump(k, launch(arg), events)))
        reply = asyncio.create_task(answer(events))
        gone = asyncio.create_task(_disconnected(receive))
        tasks += [reply, gone]
        await asyncio.wait([reply, gone], return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        server.disown(owner)  # ends the instances still running
    if reply.done() and not reply.cancelled():
        reply.result()  # raises what the answer raised


async def send_json(send: Send, status: int, body: Any) -> None:
    """A complete JSON response."""
    data = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


async def _pump(k: int, instance: Instance, events: Events) -> None:
    async for ev in instance.events():
        events.put_nowait((k, ev))


async def _disconnected(receive: Receive) -> None:
    """Returns when the client has gone (or, after the response, when the request is over)."""
    while (await receive())["type"] != "http.disconnect":
        pass
