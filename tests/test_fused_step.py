"""The fused decode step: one command for embed -> forward -> sample (issue 16, point 2).

In the scheduler (one command, three engine calls, one resolution), through the API on the
trusted runner and in the sandbox (the same tokens as the three calls), and through the
SDK (``Context.generate`` steps with it).
"""

from __future__ import annotations

import asyncio
import json

import pytest

from inferlet_util import load_engine, result, run_all, start
from pastry.control.policies import KOnly
from pastry.control.scheduler import BatchScheduler, Command, CommandError, Stage
from pastry.engine.calls import CallError, EmbedTxt, Forward, Sample, ids
from pastry.runtime.trusted import Program
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
    return Command(Stage.EMBED, prepare=lambda: calls, tokens=1, last_stage=Stage.OUTPUT)


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


# ---------------------------------------------------------------------------- the API

STEP = """
import json
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
    pytest.importorskip("wasmtime")
    pytest.importorskip("componentize_py")
    from pastry.runtime import build_pyrt
    from pastry.runtime.wasm import WasmSandbox, sandboxed_program

    try:
        build_pyrt.build()
    except build_pyrt.BuildError as e:
        pytest.skip(f"cannot build the Python runtime component: {e}")
    box = WasmSandbox(pool_size=1)
    try:

        async def collect(inst):
            return [ev async for ev in inst.events()]

        async def go():
            controller, rt, handle = await start(eng)
            insts = [
                rt.launch(Program.from_source("t", STEP), [PROMPT]),
                rt.launch(sandboxed_program("s", STEP, box=box), [PROMPT]),
            ]
            events = await asyncio.gather(*(collect(i) for i in insts))
            await controller.close()
            handle.close()
            return events

        events = asyncio.run(go())
    finally:
        box.close()
    trusted, boxed = (json.loads(result(e)) for e in events)
    check(boxed)
    assert boxed["fused"] == trusted["fused"]
    assert boxed["constrained"] == trusted["constrained"]


GENERATE = """
from pastry.sdk import Context, MaxTokens, Sampler
from pastry.sdk.context import _step
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
        futs, (emb,) = ref._forward(ref.pending, 1)
        tok = await _step(futs, px.sample(ref.queue, emb))
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
