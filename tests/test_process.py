"""Engine handles: in-process, and an engine server process over ZeroMQ (IPC and TCP).

Most tests serve ``fake_engine.FakeEngine`` (no model, answers are functions of the calls);
one runs the real engine on a tiny checkpoint and compares with the in-process engine.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zmq

from fake_engine import FakeEngine
from pastry.engine.serve import handle_request
from pastry.wire.calls import (
    CallError,
    CopyKv,
    Dist,
    EmbedTxt,
    Forward,
    NextDist,
    Sample,
    ids,
)
from pastry.wire.codec import decode_results, encode_batch, encode_info
from pastry.wire.config import EngineConfig
from pastry.wire.handle import (
    EngineDied,
    EngineError,
    EngineStartError,
    EngineTimeout,
    InProcessEngine,
)
from pastry.wire.protocol import Op, Status
from pastry.wire.remote import RemoteEngine
from pastry.wire.spawn import spawn_engine

TESTS_DIR = str(Path(__file__).resolve().parent)
CONFIG = EngineConfig(page_size=32, num_pages=10, max_batch_tokens=512, seed=3)


def spawn_fake(tmp_path, endpoint=None, factory="fake_engine:make"):
    model = tmp_path / "fake-model"
    model.mkdir(exist_ok=True)
    return spawn_engine(
        model,
        CONFIG,
        endpoint,
        engine_factory=factory,
        env={"PYTHONPATH": TESTS_DIR},
        startup_timeout=60,
    )


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with spawn_fake(tmp_path_factory.mktemp("engine")) as proc:
        yield proc


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def samples(tag: int, n: int = 3) -> list:
    return [Sample(embed=tag, seed=i) for i in range(n)]


def expected(batch) -> list:
    return FakeEngine("x", CONFIG).execute(batch)


def assert_results_equal(xs, ys) -> None:
    assert len(xs) == len(ys)
    for x, y in zip(xs, ys, strict=True):
        assert type(x) is type(y)
        if isinstance(x, Dist):
            np.testing.assert_array_equal(x.ids, y.ids)
            np.testing.assert_array_equal(x.probs, y.probs)
        else:
            assert x == y


MIXED = [
    EmbedTxt(tokens=ids([1, 2]), positions=ids([0, 1]), out_embeds=ids([0, 1])),
    Forward(in_embeds=ids([0, 1]), out_embeds=ids([2]), out_indices=ids([1])),
    NextDist(embed=2, k=4),
    Sample(embed=2, seed=7),
    Sample(embed=2, temperature=-1.0),
]


# --- in-process -------------------------------------------------------------------------


def test_in_process_handle_runs_batches_in_order():
    engine = FakeEngine("m", CONFIG)
    with InProcessEngine(engine) as handle:
        assert handle.info.page_size == 32
        assert_results_equal(handle.execute_sync(MIXED), expected(MIXED))

        async def main():
            slow = [CopyKv(src_page=-1, dst_page=100), *samples(1)]
            return await asyncio.gather(
                handle.execute(slow), handle.execute(samples(2)), handle.execute(samples(3))
            )

        order = []
        real = engine.execute
        engine.execute = lambda batch: order.append(batch[-1].embed) or real(batch)
        out = run(main())
        assert order == [1, 2, 3]  # submission order, even behind a slow batch
        assert out == [[None, 1000, 1001, 1002], [2000, 2001, 2002], [3000, 3001, 3002]]
    with pytest.raises(EngineError, match="closed"):
        handle.execute_sync(MIXED)


def test_in_process_engine_exception_fails_only_that_batch():
    with InProcessEngine(FakeEngine("m", CONFIG)) as handle:
        out = handle.execute_sync([Sample(embed=1), NextDist(embed=1, k=0)])
        assert all(isinstance(r, CallError) and "fake engine bug" in r.message for r in out)
        assert handle.execute_sync(samples(4)) == [4000, 4001, 4002]


# --- server, over IPC -------------------------------------------------------------------


def test_remote_info_and_mixed_batch_match_in_process(server):
    async def main():
        async with await RemoteEngine.connect(server.endpoint, timeout=10) as engine:
            assert engine.info == FakeEngine("fake-model", CONFIG).info  # config passed on
            assert await engine.ping() < 1.0
            return await engine.execute(MIXED)

    out = run(main())
    assert_results_equal(out, expected(MIXED))
    assert isinstance(out[-1], CallError) and "temperature" in out[-1].message


def test_pipelined_requests_from_concurrent_coroutines_get_their_own_results(server):
    async def client(engine, tag: int, rounds: int):
        got = []
        for r in range(rounds):
            batch = [CopyKv(src_page=-1, dst_page=20)] if r == 0 and tag == 1 else []
            batch += [Sample(embed=tag, seed=r * 10 + i) for i in range(r % 4 + 1)]
            got.append((batch, await engine.execute(batch)))
        return got

    async def main():
        async with await RemoteEngine.connect(server.endpoint) as engine:
            pending = [engine.execute(samples(t)) for t in range(5, 9)]  # all in flight at once
            burst = await asyncio.gather(*pending)
            rounds = await asyncio.gather(client(engine, 1, 12), client(engine, 2, 12))
            return burst, rounds

    burst, rounds = run(main())
    assert burst == [expected(samples(t)) for t in range(5, 9)]
    for got in rounds:
        for batch, results in got:
            assert results == expected(batch)


def test_engine_exception_fails_the_batch_and_server_keeps_serving(server):
    async def main():
        async with await RemoteEngine.connect(server.endpoint) as engine:
            bad = await engine.execute([Sample(embed=1), NextDist(embed=1, k=0)])
            return bad, await engine.execute(samples(3))

    bad, good = run(main())
    assert all(
        isinstance(r, CallError) and "RuntimeError: fake engine bug" in r.message for r in bad
    )
    assert good == [3000, 3001, 3002]


def test_malformed_requests_get_error_replies_and_server_keeps_serving(server):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 10_000)
    sock.connect(server.endpoint)
    good_batch = encode_batch(samples(1))
    cases = [
        ([b"\xc1garbage"], None, "not valid msgpack"),
        ([msgpack.packb("execute")], None, "list of 2"),
        ([msgpack.packb([99, 5])], 5, "unknown op 99"),
        ([msgpack.packb(["execute", 6])], 6, "unknown op 'execute'"),
        ([msgpack.packb([Op.EXECUTE, 7]), b"junk"], 7, "header is not valid msgpack"),
        ([msgpack.packb([Op.EXECUTE, 8]), good_batch[0]], 8, None),  # a batch of plain values
        ([msgpack.packb([Op.EXECUTE, 9])], 9, "empty message"),
        ([msgpack.packb([Op.PING, 10]), b"extra"], 10, "PING takes no payload"),
    ]
    try:
        for frames, req_id, match in cases:
            sock.send_multipart(frames)
            status, got_id, message = msgpack.unpackb(sock.recv_multipart()[0])
            assert got_id == req_id
            if match is None:
                continue
            assert status == Status.ERROR and match in message, message
        sock.send_multipart([msgpack.packb([Op.EXECUTE, 11]), *good_batch])
        reply = sock.recv_multipart(copy=False)
        assert msgpack.unpackb(reply[0]) == [Status.OK, 11, None]
        assert decode_results(reply[1:]) == [1000, 1001, 1002]
    finally:
        sock.close()
        ctx.term()


def test_handle_request_directly():
    engine = FakeEngine("m", CONFIG)
    reply, stop = handle_request(engine, [msgpack.packb([Op.INFO, 1])])
    assert not stop and reply[1:] == encode_info(engine.info)
    reply, stop = handle_request(engine, [msgpack.packb([Op.SHUTDOWN, 2])])
    assert stop and msgpack.unpackb(reply[0]) == [Status.OK, 2, None]
    reply, stop = handle_request(engine, [])
    assert not stop and msgpack.unpackb(reply[0])[0] == Status.ERROR
    engine.execute = lambda batch: [object()] * len(batch)  # unencodable results (a bug)
    reply, _ = handle_request(engine, [msgpack.packb([Op.EXECUTE, 3]), *encode_batch(samples(1))])
    out = decode_results(reply[1:])
    assert len(out) == 3 and all("cannot send result" in r.message for r in out)


def test_sync_client(server):
    engine = RemoteEngine.connect_sync(server.endpoint, timeout=10)
    try:
        assert engine.info.model_name == "fake-model"
        assert_results_equal(engine.execute_sync(MIXED), expected(MIXED))
        with pytest.raises(EngineTimeout, match="did not answer EXECUTE"):
            engine.execute_sync([CopyKv(src_page=-1, dst_page=500)], timeout=0.05)
        assert engine.execute_sync(samples(2)) == [2000, 2001, 2002]  # late reply dropped
    finally:
        engine.close()


def test_execute_sync_inside_the_loop_is_refused(server):
    async def main():
        async with await RemoteEngine.connect(server.endpoint) as engine:
            with pytest.raises(EngineError, match="await execute"):
                engine.execute_sync(samples(1))

    run(main())


def test_connect_timeout_on_silent_endpoint(tmp_path):
    start = time.monotonic()
    with pytest.raises(EngineTimeout, match=r"did not answer INFO within 0\.3 s"):
        run(RemoteEngine.connect(f"ipc://{tmp_path}/nobody.sock", timeout=0.3))
    assert time.monotonic() - start < 5
    with pytest.raises(ValueError, match="endpoint must be"):
        run(RemoteEngine.connect("localhost:5555"))


# --- process lifecycle, TCP -------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tcp_endpoint_and_shutdown(tmp_path):
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    proc = spawn_fake(tmp_path, endpoint)
    try:
        assert proc.endpoint == endpoint

        async def main():
            engine = await RemoteEngine.connect(endpoint)
            out = await engine.execute(MIXED)
            await engine.shutdown()
            return out

        assert_results_equal(run(main()), expected(MIXED))
        assert proc.process.wait(10) == 0
    finally:
        proc.terminate()


def test_killed_server_fails_pending_and_later_requests(tmp_path):
    proc = spawn_fake(tmp_path)

    async def main():
        engine = await RemoteEngine.connect(proc.endpoint)
        slow = asyncio.ensure_future(engine.execute([CopyKv(src_page=-1, dst_page=20_000)]))
        await asyncio.sleep(0.2)
        os.kill(proc.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(EngineDied, match="lost the connection"):
            await slow
        elapsed = time.monotonic() - start
        with pytest.raises(EngineDied):
            await engine.execute(samples(1))
        await engine.aclose()
        return elapsed

    try:
        assert run(main()) < 5
    finally:
        assert proc.terminate() == -signal.SIGKILL
    assert not Path(proc.endpoint.removeprefix("ipc://")).parent.exists()  # temp dir removed


def test_spawn_failure_reports_the_child_stderr(tmp_path):
    with pytest.raises(EngineStartError, match=r"(?s)exited with code 1.*checkpoint is broken"):
        spawn_fake(tmp_path, factory="fake_engine:make_broken")


# --- the real engine --------------------------------------------------------------------


def test_real_engine_process_matches_in_process(make_tiny):
    from pastry.engine.engine import Engine

    tiny_checkpoint = make_tiny("llama")

    config = EngineConfig(dtype="float32", page_size=4, num_pages=32, num_embeds=64, seed=1)
    batch = [
        EmbedTxt(tokens=ids([5, 9, 2, 7, 3]), positions=ids(range(5)), out_embeds=ids(range(5))),
        Forward(
            in_embeds=ids(range(5)),
            out_pages=ids([0, 1]),
            out_embeds=ids([10, 11]),
            out_indices=ids([3, 4]),
        ),
        Sample(embed=11),
        Sample(embed=11, temperature=0.8, top_k=20, seed=42),
        NextDist(embed=10, k=8),
        Sample(embed=99_999),  # out of range: a CallError from the engine
    ]
    local = InProcessEngine(Engine.load(tiny_checkpoint, config))
    expected_out = local.execute_sync(batch)
    local.close()
    assert isinstance(expected_out[2], int) and isinstance(expected_out[-1], CallError)

    with spawn_engine(tiny_checkpoint, config, startup_timeout=120) as proc:

        async def main():
            async with await RemoteEngine.connect(proc.endpoint) as engine:
                assert engine.info == local.info
                return await engine.execute(batch)

        assert_results_equal(run(main()), expected_out)
