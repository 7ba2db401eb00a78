"""The fused decode step: one command for embed -> forward -> sample (issue 16, point 2).

In the scheduler (one command, three engine calls, one resolution), through the API on the
trusted runner and in the sandbox (the same tokens as the three calls), and through the
SDK (``Context.generate`` steps with it).
"""

from __future__ import annotations

import asyncio
import json
from typing import ClassVar

import pytest

from commands import fn_command
from inferlet_util import load_engine, result, run_all, trusted_and_sandboxed
from pastry.control.commands import Command, CommandError, Op, Stage
from pastry.control.policies import KOnly
from pastry.control.scheduler import BatchScheduler
from pastry.wire.calls import CallError, EmbedTxt, Forward, Sample, ids
from test_scheduler import Recorder, cmd, fwd


def fused(embed_slot: int, out_slot: int, page: int) -> Command:
    calls = (
        EmbedTxt(ids([3]), ids([0]), ids([embed_slot])),
        Forward(
            in_embeds=ids([embed_slot]),
            out_pages=ids([page]),
            out_embeds=ids([out_slot]),
            out_indices=ids([0]),
        ),
        Sample(out_slot),
    )
    return fn_command(Stage.EMBED, lambda: calls, tokens=1, last_stage=Stage.OUTPUT)


def test_a_fused_command_runs_its_calls_in_one_batch_and_resolves_once():
    async def go():
        rec = Recorder()
        s = BatchScheduler(rec.execute, max_batch_tokens=100, page_size=4)
        a, b = s.create_queue(1), s.create_queue(2)
        fa = s.submit(a, fused(0, 1, 0))
        fa2 = s.submit(a, fused(2, 3, 1))  # the next step goes back down a stage
        fb = s.submit(b, cmd(Stage.EMBED, EmbedTxt(ids([1]), ids([0]), ids([5]))))
        fb2 = s.submit(b, cmd(Stage.FORWARD, fwd(ins=[5], out_pages=[2], outs=[6]), 1))
        fb3 = s.submit(b, cmd(Stage.OUTPUT, Sample(6)))
        s.start()
        values = await asyncio.gather(fa, fa2, fb, fb2, fb3)
        await s.stop()
        return rec.batches, values, s.stats

    batches, values, stats = asyncio.run(go())
    # one handler per call type: both queues' embeds, then forwards, then samples
    assert batches[0] == ["EmbedTxt", "EmbedTxt", "Forward", "Forward", "Sample", "Sample"]
    assert batches[1] == ["EmbedTxt", "Forward", "Sample"]
    assert values == [7, 7, None, None, 7]  # the fused ones resolve with the sample's token
    assert stats.forward_items == 3 and stats.commands == 5


def test_a_fused_command_counts_as_a_forward_against_the_caps():
    async def go():
        s = BatchScheduler(Recorder().execute, 100, 4, KOnly(k=1), max_batch=None)
        qs = [s.create_queue(i) for i in range(3)]
        for i, q in enumerate(qs):
            s.submit(q, fused(2 * i, 2 * i + 1, i))
        return [len(s.take_batch() or []) for _ in range(4)]

    assert asyncio.run(go()) == [1, 1, 1, 0]


def test_a_fused_command_fails_with_its_first_error():
    class Failing(Recorder):
        async def execute(self, batch):
            await super().execute(batch)
            return [CallError("bad embed") if isinstance(c, EmbedTxt) else 7 for c in batch]

    async def go():
        s = BatchScheduler(Failing().execute, max_batch_tokens=100, page_size=4)
        q = s.create_queue(1)
        fut = s.submit(q, fused(0, 1, 0))
        s.start()
        with pytest.raises(CommandError, match="bad embed"):
            await fut
        await s.stop()

    asyncio.run(go())


def test_a_fused_command_conflicting_with_an_earlier_one_waits():
    async def go():
        s = BatchScheduler(Recorder().execute, max_batch_tokens=100, page_size=4)
        q = s.create_queue(1)
        s.submit(q, cmd(Stage.EMBED, EmbedTxt(ids([1]), ids([0]), ids([0]))))
        s.submit(q, fused(0, 1, 0))  # writes embed slot 0 again: not in the same batch
        return len(s.take_batch()), len(s.take_batch())

    assert asyncio.run(go()) == (1, 1)


class Batched(Op):
    """A batched command's op: ``prepare_batch`` records each pass (the log is the
    class's), refuses the names in ``refuse`` and leaves ``odd`` ones to ``prepare``."""

    batched = True
    log: ClassVar[list[list[str]]] = []
    order: ClassVar[list[str]] = []  # every preparation, one by one or in a pass, in order

    def __init__(self, name: str, slot: int, refuse=False, odd=False) -> None:
        self.name, self.slot, self.refuse, self.odd = name, slot, refuse, odd

    def prepare(self):
        Batched.order.append(self.name)
        if self.odd:
            raise CommandError(f"{self.name} is odd")
        return fused(self.slot, self.slot + 1, self.slot).op.prepare()

    @staticmethod
    def prepare_batch(commands):
        Batched.log.append([c.op.name for c in commands])
        left = []
        for c in commands:
            b = c.op
            if b.odd:
                left.append(c)
                continue
            Batched.order.append(b.name)
            if b.refuse:
                c.future.set_exception(CommandError(f"{b.name} refused"))
                continue
            c.call = fused(b.slot, b.slot + 1, b.slot).op.prepare()
        return left


def batched(name: str, slot: int, **kw) -> Command:
    return Command(Stage.EMBED, Batched(name, slot, **kw), tokens=1, last_stage=Stage.OUTPUT)


def test_batched_commands_are_prepared_in_one_pass_per_batch_in_the_order_taken():
    Batched.log, Batched.order = [], []

    async def go():
        rec = Recorder()
        s = BatchScheduler(rec.execute, max_batch_tokens=100, page_size=4)
        qs = [s.create_queue(i) for i in range(6)]
        futs = [
            s.submit(qs[0], batched("a", 0)),
            s.submit(qs[1], batched("b", 10, refuse=True)),
            s.submit(qs[2], batched("c", 20, odd=True)),  # left to prepare: it raises
            s.submit(qs[3], batched("d", 30)),
        ]
        # a command prepared alone: the steps taken before it are prepared first
        mask = fn_command(Stage.KV, lambda: Batched.order.append("mask") or fwd())
        futs.append(s.submit(qs[4], mask))
        futs.append(s.submit(qs[4], batched("e", 40)))
        futs.append(s.submit(qs[5], batched("f", 50)))
        s.start()
        done = await asyncio.gather(*futs, return_exceptions=True)
        await s.stop()
        return done, s.stats, rec.batches

    done, stats, engine = asyncio.run(go())
    assert Batched.log == [["a", "b", "c", "d"], ["e", "f"]]
    assert Batched.order == ["a", "b", "d", "c", "mask", "e", "f"]
    assert done[0] == 7 and done[3] == 7 and done[5] == 7 and done[6] == 7
    assert "b refused" in str(done[1]) and "c is odd" in str(done[2])
    assert stats.forward_items == 5  # four steps and the lone forward
    assert engine == [["EmbedTxt"] * 4 + ["Forward"] * 5 + ["Sample"] * 4]


def test_a_closed_queue_takes_its_batched_commands_out_of_the_batch_being_formed():
    Batched.log, Batched.order = [], []

    async def go():
        s = BatchScheduler(Recorder().execute, max_batch_tokens=100, page_size=4)
        a, b, c = s.create_queue(1), s.create_queue(2), s.create_queue(3)
        s.submit(a, batched("a", 0))
        s.submit(b, batched("b", 10))
        s.form_batch()  # both prepared
        fc = s.submit(c, batched("c", 20))
        s.forming.take(c, float("inf"))  # taken, not prepared yet
        s.close_queue(c, "gone")  # (an instance ended while the batch was formed)
        batch = s.take_batch()
        with pytest.raises(CommandError, match="gone"):
            await fc
        return batch

    batch = asyncio.run(go())
    assert [c.op.name for c in batch] == ["a", "b"]
    assert Batched.log == [["a", "b"]]


# ---------------------------------------------------------------------------- the API

STEP = """
import json
from typing import ClassVar
import pastry.sdk as px
from pastry.api import ApiError

async def main(args):
    model = px.available_models()[0]
    out = {}
    q = px.create_queue(model)
    ps = px.get_kv_page_size(q)
    prompt = [int(t) for t in args[0].split(",")]
    n = len(prompt)

    async def run(fused, steps, **sampling):
        # prefill the prompt but its last token, then decode `steps` tokens
        pages = px.alloc_kvpages(q, -(-(n + steps) // ps))
        emb = px.alloc_embeds(q, n + 1)
        await px.embed_txt(q, prompt[:-1], list(range(n - 1)), emb[: n - 1])
        await px.forward(q, [], 0, emb[: n - 1], pages, 0, [])
        tok, values = prompt[-1], []
        for i in range(steps):
            start = n - 1 + i
            ctx = pages[: -(-start // ps)]
            last = start - (len(ctx) - 1) * ps
            outp = pages[start // ps : start // ps + 1]
            if fused:
                v = await px.step(q, [tok], [start], [emb[0]], ctx, last, outp, start % ps,
                                  emb[1], **sampling)
            else:
                px.embed_txt(q, [tok], [start], [emb[0]])
                px.forward(q, ctx, last, [emb[0]], outp, start % ps, [emb[1]])
                v = await px.sample(q, emb[1], **sampling)
            values.append(v)
            tok = v if isinstance(v, int) else v[0]
        await px.dealloc_kvpages(q, pages)
        await px.dealloc_embeds(q, emb)
        return values

    out["fused"] = await run(True, 6)
    out["calls"] = await run(False, 6)
    bias = {"logit_bias": [(11, 50.0)], "logprobs": 2}
    out["fused_proc"] = await run(True, 2, **bias)
    out["calls_proc"] = await run(False, 2, **bias)
    seeded = {"temperature": 1.0, "top_k": 20, "seed": 5}
    out["fused_seeded"] = await run(True, 3, **seeded)
    out["calls_seeded"] = await run(False, 3, **seeded)
    c = px.create_constraint(q, json.dumps({"regex": "[0-9]{3}"}))
    out["constrained"] = await run(True, 1, constraint=c)
    out["constrained_text"] = px.detokenize(q, out["constrained"])
    px.free_constraint(c)
    emb = px.alloc_embeds(q, 2)
    try:
        px.step(q, [1, 2], [0], [emb[0]], [], 0, [], 0, emb[1])
    except ApiError as e:
        out["bad_lengths"] = str(e)
    try:
        await px.step(q, [1], [0], [emb[0]], [], 0, [], 0, 999)
    except ApiError as e:
        out["foreign"] = str(e)
    out["after"] = await px.step(q, [1], [0], [emb[0]], [], 0, [], 0, emb[1])
    await px.dealloc_embeds(q, emb)
    return json.dumps(out)
"""


@pytest.fixture(scope="module")
def eng(make_tiny):
    return load_engine(make_tiny("llama"), num_pages=256)


def check(out: dict) -> None:
    assert out["fused"] == out["calls"] and len(out["fused"]) == 6
    # logprobs: (token, logprob, top ids, top logprobs); the bias forces token 11
    assert [v[0] for v in out["fused_proc"]] == [11, 11]
    assert [v[0] for v in out["fused_proc"]] == [v[0] for v in out["calls_proc"]]
    for a, b in zip(out["fused_proc"], out["calls_proc"], strict=True):
        assert a[2] == b[2] and abs(a[1] - b[1]) < 1e-4
    assert out["fused_seeded"] == out["calls_seeded"]
    assert "step needs as many positions and input embeddings as tokens" in out["bad_lengths"]
    assert "999" in out["foreign"]
    assert isinstance(out["after"], int)
    assert out["constrained_text"].isdigit()  # the grammar's mask applied


PROMPT = "5,17,42,8,99,3,250,31,7"


def test_step_gives_the_tokens_of_the_three_calls(eng):
    events, controller = asyncio.run(run_all(eng, [(STEP, [PROMPT])]))
    out = json.loads(result(events[0]))
    check(out)
    res = next(iter(controller.models.values())).resources
    res.check_integrity()
    assert res.referenced("embed") == 0


def test_step_in_the_sandbox_matches_the_trusted_runner(eng):
    events = trusted_and_sandboxed(eng, STEP, [PROMPT])
    trusted, boxed = (json.loads(result(e)) for e in events)
    check(boxed)
    assert boxed["fused"] == trusted["fused"]
    assert boxed["constrained"] == trusted["constrained"]


GENERATE = """
from pastry.sdk import Context, MaxTokens, Sampler
from pastry.sdk.calls import await_step
import pastry.sdk as px

async def main(args):
    ctx = Context()
    ctx.fill_tokens([int(t) for t in args[0].split(",")])
    text = await ctx.generate(Sampler(), MaxTokens(8))
    generated = ctx.tokens[-8:]
    # the same with the three calls per step
    ref = Context()
    ref.fill_tokens([int(t) for t in args[0].split(",")])
    await ref.generate(Sampler(), MaxTokens(1))
    for _ in range(7):
        futs, (emb,) = ref.forward_tokens(ref.pending, 1)
        tok = await await_step(futs, px.sample(ref.queue, emb))
        ref.tokens.append(tok)
        ref.pending = [tok]
    return ",".join(map(str, generated)) + "|" + ",".join(map(str, ref.tokens[-8:]))
"""


def test_context_generate_steps_fused_with_the_same_tokens(eng):
    events, controller = asyncio.run(run_all(eng, [(GENERATE, [PROMPT])] * 3))
    for ev in events:
        fused_tokens, calls_tokens = result(ev).split("|")
        assert fused_tokens == calls_tokens
    sched = next(iter(controller.models.values())).scheduler
    # 3 x (7 fused steps + 7 x 3 calls + the prefills' commands): fewer commands than calls
    assert sched.stats.commands < sched.stats.calls


STEPS_TOGETHER = """
import pastry.sdk as px
from pastry.api import ApiError

async def main(args):
    q = px.create_queue(px.available_models()[0])
    emb = px.alloc_embeds(q, 2)
    page = px.alloc_kvpages(q, 1)
    await px.synchronize(q)
    out = 999 if args[0] == "bad" else emb[1]
    toks = []
    for i in range(4):
        try:
            toks.append(str(await px.step(q, [5 + i], [i], [emb[0]], page if i else [], i,
                                          page, i, out)))
        except ApiError as e:
            return "error: " + str(e)
    return ",".join(toks)
"""


def test_steps_of_many_inferlets_batch_together_and_a_bad_one_fails_alone(eng):
    launches = [(STEPS_TOGETHER, ["bad" if i == 3 else "good"]) for i in range(8)]
    events, controller = asyncio.run(run_all(eng, launches))
    outs = [result(e) for e in events]
    assert outs[3].startswith("error: ") and "999" in outs[3]
    good = [o for i, o in enumerate(outs) if i != 3]
    assert all(len(o.split(",")) == 4 for o in good) and len(set(good)) == 1
    model = next(iter(controller.models.values()))
    assert model.scheduler.stats.forward_items / model.scheduler.stats.forward_batches > 2
    model.resources.check_integrity()


EMBEDS_TOGETHER = """
import pastry.sdk as px
from pastry.api import ApiError

async def main(args):
    q = px.create_queue(px.available_models()[0])
    emb = px.alloc_embeds(q, 3)
    slots = [999, emb[1]] if args[0] == "bad" else emb[1:]
    try:
        for i in range(3):
            await px.embed_txt(q, [5 + i, 6], [i, i + 1], slots)
    except ApiError as e:
        return "error: " + str(e)
    return await px.sample(q, emb[2]) >= 0 and "ok"
"""


def test_embeds_of_many_inferlets_batch_together_and_a_bad_one_fails_alone(eng):
    launches = [(EMBEDS_TOGETHER, ["bad" if i == 5 else "good"]) for i in range(8)]
    events, controller = asyncio.run(run_all(eng, launches))
    outs = [result(e) for e in events]
    assert outs[5].startswith("error: ") and "999" in outs[5]
    assert all(o == "ok" for i, o in enumerate(outs) if i != 5)
    model = next(iter(controller.models.values()))
    assert model.scheduler.stats.calls / model.scheduler.stats.batches > 2
    model.resources.check_integrity()
