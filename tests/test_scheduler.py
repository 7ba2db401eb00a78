"""The batch scheduler in isolation, against a recording fake engine."""

from __future__ import annotations

import asyncio

from commands import fn_command
from pastry.control.commands import Stage
from pastry.control.policies import Eager
from pastry.control.scheduler import BatchScheduler
from pastry.wire.calls import EmbedTxt, Forward, Sample, ids


class Recorder:
    def __init__(self):
        self.batches = []

    async def execute(self, batch):
        self.batches.append([type(c).__name__ for c in batch])
        await asyncio.sleep(0)
        return [7 if isinstance(c, Sample) else None for c in batch]


def fwd(n=1, out_pages=(), ctx=(), last=0, ins=None, outs=()):
    return Forward(
        in_embeds=ids(ins if ins is not None else range(n)),
        ctx_pages=ids(ctx),
        ctx_last_len=last,
        out_pages=ids(out_pages),
        out_embeds=ids(outs),
        out_indices=ids(range(len(outs))),
    )


def cmd(stage, call, tokens=0):
    return fn_command(stage, lambda: call, tokens=tokens)


def run(fn):
    return asyncio.run(fn())


def test_vertical_and_horizontal_batching_in_stage_order():
    async def go():
        rec = Recorder()
        s = BatchScheduler(rec.execute, max_batch_tokens=100, page_size=4)
        a, b = s.create_queue(1), s.create_queue(2)
        futs = [
            s.submit(a, cmd(Stage.EMBED, EmbedTxt(ids([1]), ids([0]), ids([0])))),
            s.submit(a, cmd(Stage.FORWARD, fwd(ins=[0], out_pages=[0], outs=[1]), 1)),
            s.submit(a, cmd(Stage.OUTPUT, Sample(1))),
            s.submit(a, cmd(Stage.EMBED, EmbedTxt(ids([2]), ids([1]), ids([0])))),  # next step
            s.submit(b, cmd(Stage.EMBED, EmbedTxt(ids([1]), ids([0]), ids([5])))),
            s.submit(b, cmd(Stage.FORWARD, fwd(ins=[5], out_pages=[1]), 1)),
        ]
        first = s.take_batch()
        return first, futs, s

    first, _futs, s = run(go)
    # queue a: embed, forward, sample (its second embed goes back down a stage: next batch);
    # queue b: embed, forward
    assert [type(c.call).__name__ for c in first] == [
        "EmbedTxt",
        "Forward",
        "Sample",
        "EmbedTxt",
        "Forward",
    ]
    assert len(s.queues[0].pending) == 1 and len(s.queues[1].pending) == 0


def test_conflicting_forwards_split_and_extending_ones_join():
    async def go():
        s = BatchScheduler(Recorder().execute, max_batch_tokens=100, page_size=4)
        q = s.create_queue(1)
        # B extends A's KV (reads what A writes): may share the batch
        s.submit(q, cmd(Stage.FORWARD, fwd(n=4, out_pages=[0]), 4))
        s.submit(q, cmd(Stage.FORWARD, fwd(ins=[4], ctx=[0], last=4, out_pages=[1]), 1))
        # C rewrites page 0, which A and B use: must wait
        s.submit(q, cmd(Stage.FORWARD, fwd(ins=[5], out_pages=[0]), 1))
        b1 = s.take_batch()
        b2 = s.take_batch()
        return len(b1), len(b2)

    assert run(go) == (2, 1)


def test_priority_first_and_token_limit():
    async def go():
        s = BatchScheduler(Recorder().execute, max_batch_tokens=10, page_size=4)
        low, high = s.create_queue(1), s.create_queue(2, priority=5)
        s.submit(low, cmd(Stage.FORWARD, fwd(n=6, out_pages=[0, 1]), 6))
        s.submit(high, cmd(Stage.FORWARD, fwd(n=6, out_pages=[2, 3]), 6))
        first = s.take_batch()
        second = s.take_batch()
        return [c.tokens for c in first], first[0].call.out_pages.tolist(), len(second)

    tokens, pages, n2 = run(go)
    assert tokens == [6] and pages == [2, 3] and n2 == 1  # high priority first; 12 > 10 tokens


def test_oversized_command_still_runs_alone():
    async def go():
        s = BatchScheduler(Recorder().execute, max_batch_tokens=4, page_size=4)
        q = s.create_queue(1)
        s.submit(q, cmd(Stage.FORWARD, fwd(n=9, out_pages=[0, 1, 2]), 9))
        return len(s.take_batch())

    assert run(go) == 1


def test_rejected_prepare_fails_only_that_command():
    async def go():
        rec = Recorder()
        s = BatchScheduler(rec.execute, max_batch_tokens=100, page_size=4, batching=Eager())
        s.start()
        q = s.create_queue(1)

        def bad():
            raise ValueError("handle 3 was freed")

        f_bad = s.submit(q, fn_command(Stage.OUTPUT, bad))
        f_ok = s.submit(q, cmd(Stage.OUTPUT, Sample(0)))
        res = await asyncio.gather(f_bad, f_ok, return_exceptions=True)
        await s.stop()
        return res

    bad, ok = run(go)
    assert "handle 3 was freed" in str(bad) and ok == 7


def test_control_commands_resolve_after_earlier_commands():
    async def go():
        rec = Recorder()
        s = BatchScheduler(rec.execute, max_batch_tokens=100, page_size=4)
        s.start()
        q = s.create_queue(1)
        order = []
        f1 = s.submit(q, cmd(Stage.OUTPUT, Sample(0)))
        f1.add_done_callback(lambda f: order.append("sample"))
        f2 = s.submit(q, fn_command(Stage.CONTROL, lambda: None))
        f2.add_done_callback(lambda f: order.append("sync"))
        await f2
        await s.stop()
        return order

    assert run(go) == ["sample", "sync"]


def test_closed_queue_fails_pending_commands():
    async def go():
        s = BatchScheduler(Recorder().execute, max_batch_tokens=100, page_size=4)
        q = s.create_queue(1)
        f = s.submit(q, cmd(Stage.OUTPUT, Sample(0)))
        s.close_queue(q, "the inferlet ended")
        try:
            await f
        except Exception as e:
            return str(e)

    assert run(go) == "the inferlet ended"


def test_batch_prepared_while_the_engine_runs():
    """Commands arriving while a batch executes are taken and translated right away; the
    next batch goes out when the engine is free, with everything ready by then."""

    async def go():
        release = asyncio.Event()
        sizes = []

        async def slow_execute(batch):
            sizes.append(len(batch))
            if len(sizes) == 1:
                await release.wait()
            return [None] * len(batch)

        s = BatchScheduler(slow_execute, max_batch_tokens=100, page_size=4)
        s.start()
        qs = [s.create_queue(i) for i in range(4)]
        prepared = []

        def cmd_for(i):
            call = Sample(i)

            def prepare():
                prepared.append(i)
                return call

            return fn_command(Stage.OUTPUT, prepare)

        first = s.submit(qs[0], cmd_for(0))
        for _ in range(5):
            await asyncio.sleep(0)
        assert sizes == [1]  # batch 1 is running
        later = [s.submit(q, cmd_for(i)) for i, q in enumerate(qs[1:], 1)]
        for _ in range(5):
            await asyncio.sleep(0)
        assert prepared == [0, 1, 2, 3]  # translated while batch 1 runs
        release.set()
        await asyncio.gather(first, *later)
        await s.stop()
        return sizes

    assert run(go) == [1, 3]


def test_a_failing_dispatch_hook_fails_only_its_batch():
    """A bug in ``on_dispatch`` (the prefix cache's bookkeeping) must not end the
    scheduler task: that batch's callers get the error, later batches run."""

    async def go():
        s = BatchScheduler(Recorder().execute, max_batch_tokens=100, page_size=4, batching=Eager())
        calls = []

        def hook(cmds):
            calls.append(len(cmds))
            if len(calls) == 1:
                raise RuntimeError("provenance bug")

        s.on_dispatch = hook
        s.start()
        q = s.create_queue(1)
        first = await asyncio.gather(
            s.submit(q, cmd(Stage.OUTPUT, Sample(0))), return_exceptions=True
        )
        second = await asyncio.wait_for(s.submit(q, cmd(Stage.OUTPUT, Sample(0))), 5)
        await s.stop()
        return first[0], second

    first, second = run(go)
    assert isinstance(first, Exception) and "provenance bug" in str(first)
    assert second == 7


def test_the_completion_hook_sees_every_call_with_its_result_before_they_resolve():
    """``on_complete`` gets each (command, engine call) pair with its result while the
    futures are still pending; a failing hook is logged and the callers still get theirs."""

    async def go(fail: bool):
        s = BatchScheduler(Recorder().execute, max_batch_tokens=100, page_size=4)
        q = s.create_queue(1)
        seen = []

        def hook(calls, results):
            pairs = zip(calls, results, strict=True)
            seen.append([(type(call).__name__, r, c.future.done()) for (c, call), r in pairs])
            if fail:
                raise RuntimeError("a bug in the hook")

        s.on_complete = hook
        futs = [
            s.submit(q, cmd(Stage.EMBED, EmbedTxt(ids([1]), ids([0]), ids([0])))),
            s.submit(q, cmd(Stage.OUTPUT, Sample(0))),
        ]
        s.start()
        values = await asyncio.gather(*futs)
        await s.stop()
        return seen, values

    for fail in (False, True):
        seen, values = run(lambda fail=fail: go(fail))
        assert seen == [[("EmbedTxt", None, False), ("Sample", 7, False)]]
        assert values == [None, 7]
