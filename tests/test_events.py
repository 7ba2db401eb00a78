"""Typed instance events: what a session's outbox carries and what the runner ends with."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from inferlet_util import load_engine, start
from pastry.api import ApiError
from pastry.control.events import Failed, Finished, Message, Terminated, event_data
from pastry.runtime.trusted import Program

TALKER = """
import pastry.sdk as px

async def main(args):
    px.send("a")
    px.send("b")
    if args == ["raise"]:
        raise KeyError("boom")
    if args == ["wait"]:
        await px.receive()
    return None if args == ["none"] else "done"
"""


def test_events_are_frozen_values_with_wire_names():
    events = [Message("hi"), Finished("r"), Finished(None), Failed("tb"), Terminated("why")]
    assert [e.kind for e in events] == ["message", "result", "result", "error", "terminated"]
    assert [event_data(e) for e in events] == ["hi", "r", None, "tb", "why"]
    assert Message("hi") == Message("hi") and Message("hi") != Finished("hi")
    with pytest.raises(dataclasses.FrozenInstanceError):
        events[0].text = "changed"
    with pytest.raises(TypeError, match="not an instance event"):
        event_data(("message", "hi"))


def test_an_instance_sends_messages_then_exactly_one_end(make_tiny):
    eng = load_engine(make_tiny("llama"))

    async def go():
        controller, rt, handle = await start(eng)
        prog = Program.from_source("talker", TALKER)
        insts = [rt.launch(prog, [a]) for a in ("ok", "none", "raise", "wait")]
        session = insts[0].session
        with pytest.raises(ApiError, match="send takes a string, got int"):
            session.send(7)
        waiting = insts[3]
        evs = waiting.events()
        first = [await anext(evs), await anext(evs)]
        rt.terminate(waiting.id, "stopped by the test")
        rest = [ev async for ev in evs]
        out = [[ev async for ev in i.events()] for i in insts[:3]]
        ends = [await i.wait() for i in insts]
        await controller.close()
        handle.close()
        return first + rest, out, ends

    waited, (ok, none, raised), ends = asyncio.run(go())
    talk = [Message("a"), Message("b")]
    assert ok == [*talk, Finished("done")]
    assert none == [*talk, Finished(None)]
    assert raised[:2] == talk and isinstance(raised[2], Failed) and len(raised) == 3
    assert "KeyError: 'boom'" in raised[2].error and "Traceback" in raised[2].error
    assert waited == [*talk, Terminated("stopped by the test")]
    assert ends == [ok[-1], none[-1], raised[-1], waited[-1]]
