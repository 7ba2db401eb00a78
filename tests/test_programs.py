"""The process table (control/programs.py): lifecycle, calls, charging, sessions; and the
batch scheduler feeding it."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import pytest

from commands import fn_command
from pastry.control.commands import Stage
from pastry.control.programs import ProcessTable, session_key
from pastry.control.scheduler import BatchScheduler
from pastry.wire.calls import Forward, Sample, ids


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def table() -> tuple[ProcessTable, Clock]:
    clock = Clock()
    return ProcessTable(clock=clock, session_ttl_s=10.0), clock


def test_a_call_is_a_busy_period_charged_per_batch():
    pt, _clock = table()
    p = pt.start(1)
    t = pt.open_thread(1, "m")
    pt.arrive(t, 0.0)  # a call begins
    pt.arrive(t, 0.5)
    assert t.call is not None and t.call.arrival == 0.0 and t.pending == 2
    pt.dispatched([(t, 2)], 1.0)  # waited 1 s
    pt.completed([(t, 2, True)], 0.25, 1.25)
    assert (t.call.waited, t.call.model_time, t.served, t.waited) == (1.0, 0.25, 0.25, 1.0)
    pt.arrive(t, 1.25)  # next step queued before the next batch: same call
    pt.dispatched([(t, 1)], 2.0)
    pt.completed([(t, 1, False)], 0.5, 2.5)  # no forward in it: not charged
    assert t.call.model_time == 0.25 and t.call.waited == 1.75
    assert p.service == 0 and p.calls == 0
    other = pt.open_thread(2, "m")
    pt.arrive(other, 3.0)
    pt.dispatched([(other, 1)], 3.0)  # t had nothing to offer: its call ends
    assert t.call is None and t.calls == 1
    assert (p.service, p.critical_path, p.wait, p.calls) == (0.25, 0.25, 1.75, 1)
    assert p.last_completion == 2.5 and p.last_arrival == 0.0
    pt.check_integrity()


def test_plas_sums_and_atlas_takes_the_longest_path_over_parallel_threads():
    pt, _clock = table()
    p = pt.start(1)
    a, b = pt.open_thread(1), pt.open_thread(1)
    for t in (a, b):
        pt.arrive(t, 0.0)
    pt.dispatched([(a, 1), (b, 1)], 0.0)
    pt.completed([(a, 1, True), (b, 1, True)], 2.0, 2.0)
    pt.arrive(a, 2.0)
    pt.dispatched([(a, 1)], 2.0)
    pt.completed([(a, 1, True)], 1.0, 3.0)
    pt.end_call(a, 3.0)
    pt.end_call(b, 3.0)
    assert (p.service, p.critical_path, p.calls) == (5.0, 3.0, 2)
    # the next call of either thread starts from path 3: a call of 1 s makes it 4
    pt.arrive(b, 4.0)
    assert (b.call.base_service, b.call.base_path) == (5.0, 3.0)
    pt.dispatched([(b, 1)], 4.0)
    pt.completed([(b, 1, True)], 1.0, 5.0)
    pt.end_call(b)
    assert (p.service, p.critical_path) == (6.0, 4.0)
    pt.check_integrity()


def test_waiting_counts_only_while_pending_and_nothing_in_flight():
    pt, _ = table()
    t = pt.open_thread(1)
    pt.arrive(t, 0.0)
    pt.dispatched([(t, 1)], 1.0)
    pt.arrive(t, 1.5)  # queued while its first command runs: not waiting yet
    assert t.ready_since is None
    pt.completed([(t, 1, True)], 1.0, 2.0)
    assert t.ready_since == 2.0 and t.current_wait(3.0) == 2.0  # 1 s + 1 s ongoing
    pt.dropped(t)  # rejected: nothing pending any more, the thread is idle
    assert t.ready_since is None and t.pending == 0
    pt.check_integrity()


def test_programs_live_from_start_to_end_and_sessions_wait_for_their_next_request():
    pt, clock = table()
    pt.start(1)
    s = pt.join(2, session_key("chat-7", None))
    assert s.key == "session:chat-7" and pt.program_of(2) is s
    pt.join(3, "session:chat-7")
    assert pt.program_of(3) is s and s.instances == {2, 3}
    pt.end(1)
    assert pt.program_of(1) is None and [p.key for p in pt.programs()] == ["session:chat-7"]
    pt.end(2)
    pt.end(3)
    assert pt.programs() == [s] and s.idle_since == 0.0  # kept for the next request
    clock.t = 5.0
    assert pt.start(4, "session:chat-7") is s  # same entry: its service carries over
    pt.end(4)
    clock.t = 16.0
    pt.start(5)  # expiry is checked on start
    assert [p.key for p in pt.programs()] == ["inferlet:5"]
    with pytest.raises(ValueError, match="already in the process table"):
        pt.start(5)
    pt.check_integrity()


def test_join_refuses_an_instance_that_already_runs():
    pt, _ = table()
    pt.start(1)
    pt.open_thread(1)
    with pytest.raises(ValueError, match="join before it starts"):
        pt.join(1, "session:x")


def test_session_key_precedence():
    assert session_key("abc", "u") == "session:abc"
    assert session_key(" ", "u") == "user:u"
    assert session_key(None, 7) is None  # a request of its own


def test_the_batch_scheduler_reports_to_the_table():
    async def go():
        s = BatchScheduler(_results, max_batch_tokens=100, page_size=4, engine="m")
        q1, q2 = s.create_queue(1), s.create_queue(2)
        assert q1.thread.engine == "m" and q1.thread.program.key == "inferlet:1"
        f = [
            s.submit(q1, fn_command(Stage.FORWARD, lambda: _fwd(), tokens=1)),
            s.submit(q1, fn_command(Stage.OUTPUT, lambda: Sample(0))),
            s.submit(q2, fn_command(Stage.OUTPUT, lambda: Sample(1))),
        ]
        s.start()
        await asyncio.gather(*f)
        await asyncio.sleep(0)
        t1, t2 = q1.thread, q2.thread
        assert t1.served > 0 and t2.served == 0  # only forwards are charged
        assert t1.call is not None and t1.pending == t1.inflight == 0
        s.submit(q2, fn_command(Stage.OUTPUT, lambda: Sample(1)))
        await asyncio.sleep(0.01)
        assert t1.call is None and t1.program.service == t1.served  # ended at that dispatch
        s.close_queue(q1)
        assert t1 not in t1.program.threads
        s.programs.check_integrity()
        await s.stop()

    asyncio.run(go())


def _fwd() -> Forward:
    return Forward(in_embeds=ids([0]))


async def _results(batch):
    await asyncio.sleep(0.001)
    return [0 if isinstance(c, Sample) else None for c in batch]


def test_max_batch_caps_forwards_and_is_validated():
    async def go():
        s = BatchScheduler(_results, max_batch_tokens=100, page_size=4, max_batch=2)
        qs = [s.create_queue(i) for i in range(3)]
        for q in qs:
            s.submit(q, fn_command(Stage.FORWARD, _fwd, tokens=1))
        first = s.take_batch()
        return [c.queue.instance for c in first]

    assert asyncio.run(go()) == [0, 1]
    with pytest.raises(ValueError, match="max_batch must be an integer >= 1"):
        BatchScheduler(_results, 100, 4, max_batch=0)


def test_api_requests_join_their_client_s_session(make_tiny, tmp_path):
    """OpenAI clients: an X-Session-Id header (else the user field) names the program, whose
    entry outlives each request; a request without either is a program of its own."""
    import openai

    from server_util import call, running_server

    with running_server(make_tiny("llama"), tmp_path, schedule="atlas", max_batch=4) as (
        url,
        server,
    ):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
        model = server.models[0]

        def ask(**kw):
            client.completions.create(model=model, prompt="Hi", max_tokens=3, **kw)

        ask(extra_headers={"X-Session-Id": "conv-1"}, user="alice")
        ask(extra_headers={"X-Session-Id": "conv-1"})
        ask(user="alice")
        ask()
        native = urllib.request.Request(  # SGLang's native /generate joins the same way
            f"{url}/generate",
            json.dumps({"text": "Hi", "sampling_params": {"max_new_tokens": 2}}).encode(),
            {"Content-Type": "application/json", "X-Session-Id": "conv-1"},
        )
        with urllib.request.urlopen(native, timeout=60) as r:
            assert r.status == 200

        def entries():
            server.controller.programs.check_integrity()
            return {p.key: (p.calls, p.service > 0) for p in server.controller.programs.programs()}

        got = call(server, entries)
        assert got == {"session:conv-1": (3, True), "user:alice": (1, True)}
        assert call(server, lambda: server.controller.models[model].scheduler.max_batch) == 4


def test_a_session_id_never_joins_two_users_programs(make_tiny, tmp_path):
    """With several users (issue 17) a session is keyed by its user too: bob naming alice's
    X-Session-Id gets a program of his own, on the OpenAI and the SGLang-native API."""
    import openai

    from pastry.control.users import Account, User
    from server_util import call, running_server

    users = (Account(User("alice"), "tok-alice"), Account(User("bob"), "tok-bob"))
    with running_server(make_tiny("llama"), tmp_path, users=users) as (url, server):
        model = server.models[0]
        for token in ("tok-alice", "tok-bob", "tok-alice"):
            client = openai.OpenAI(base_url=f"{url}/v1", api_key=token)
            client.completions.create(
                model=model, prompt="Hi", max_tokens=2, extra_headers={"X-Session-Id": "conv-1"}
            )
        native = urllib.request.Request(
            f"{url}/generate",
            json.dumps({"text": "Hi", "sampling_params": {"max_new_tokens": 2}}).encode(),
            {"Content-Type": "application/json", "X-Session-Id": "conv-1",
             "Authorization": "Bearer tok-bob"},
        )  # fmt: skip
        with urllib.request.urlopen(native, timeout=60) as r:
            assert r.status == 200

        def entries():
            server.controller.programs.check_integrity()
            return {p.key: p.calls for p in server.controller.programs.programs()}

        assert call(server, entries) == {"alice/session:conv-1": 2, "bob/session:conv-1": 2}
