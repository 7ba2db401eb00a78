"""Preemption keeps KV: inferlets swapped out to host memory and back, end to end on the
tiny engine (control/swap.py, control/resources.py, the engine's SwapOut / SwapIn)."""

from __future__ import annotations

import asyncio
import json

import pytest

from inferlet_util import load_engine, start
from pastry.control.events import Finished, Message
from pastry.control.policies import Fcfs, Plas
from pastry.runtime.trusted import Program

# Generates `first` tokens, optionally pauses (tells the client, waits for a message: the
# instance is idle and may give its memory away), then generates `second` more.
PAUSING = """
import json
import pastry.sdk as px
from pastry.sdk import Context, MaxTokens, Sampler

async def main(args):
    prompt, first, pause, second = args
    ctx = Context()
    ctx.fill_tokens([int(t) for t in prompt.split(",")])
    await ctx.generate(Sampler(), MaxTokens(int(first)))
    if pause == "pause":
        px.send("paused")
        await px.receive()
    await ctx.generate(Sampler(), MaxTokens(int(second)))
    await ctx.release()
    return json.dumps(ctx.tokens)
"""

# Takes `pages` KV pages (most of the device) and fills them, then releases everything.
HOG = """
import pastry.sdk as px
from pastry.sdk import Context, MaxTokens, Sampler

async def main(args):
    ctx = Context()
    ctx.fill_tokens([int(t) % 50 + 3 for t in range(int(args[0]))])
    await ctx.generate(Sampler(), MaxTokens(2))
    await ctx.release()
    return "done"
"""

PROMPT = ",".join(str(t) for t in (5, 17, 33, 8, 41, 12, 9, 27, 30, 6))


def model_of(controller):
    return next(iter(controller.models.values()))


async def _alone(engine, args):
    controller, rt, handle = await start(engine)
    inst = rt.launch(Program.from_source("a", PAUSING), args)
    end = await inst.wait()
    await controller.close()
    handle.close()
    assert isinstance(end, Finished), end
    return json.loads(end.result)


def test_preempted_mid_generation_resumes_with_the_same_tokens(make_tiny):
    """A pauses mid-generation; B needs more pages than are free, so A's pages go to host
    memory; A resumes after B ended: its pages come back and it generates exactly the
    tokens it generates uninterrupted."""
    ckpt = make_tiny("llama")
    pools = dict(num_pages=8, num_host_pages=16, page_size=4)
    want = asyncio.run(_alone(load_engine(ckpt, **pools), [PROMPT, "6", "go", "10"]))

    async def go():
        controller, rt, handle = await start(load_engine(ckpt, **pools))
        m = model_of(controller)
        res, swapper = m.resources, m.swapper
        a = rt.launch(Program.from_source("a", PAUSING), [PROMPT, "6", "pause", "10"])
        events = a.events()
        assert await anext(events) == Message("paused")
        held = res.held(a.id, "kv")
        assert held == 4 and res.handles_on_host(a.id) == 0  # 16 tokens, all on the device
        b = rt.launch(Program.from_source("b", HOG), ["22"])  # 24 tokens: 6 pages, 4 free
        assert isinstance(await b.wait(), Finished), b.end
        res.check_integrity()
        seen_on_host = res.handles_on_host(a.id)  # A stays swapped out until it runs again
        a.send("resume")
        end = await a.wait()
        stats = swapper.stats
        res.check_integrity()
        controller.programs.check_integrity()
        await controller.close()
        handle.close()
        return end, seen_on_host, stats, res

    end, seen_on_host, stats, res = asyncio.run(go())
    assert isinstance(end, Finished), end
    assert json.loads(end.result) == want
    assert seen_on_host >= 2  # A really was (partly) in host memory while B ran
    assert stats.pages_out >= 2 and stats.pages_in == stats.pages_out and stats.forced == 0
    assert res.referenced("kv") == 0 and res.host_usage()[1] == 0


CHAT = """
import json
from pastry.sdk import Context, MaxTokens, Sampler

async def main(args):
    ctx = Context()
    ctx.fill_tokens([int(t) for t in args[0].split(",")])
    for _ in range(int(args[1])):
        await ctx.generate(Sampler(), MaxTokens(int(args[2])))
        ctx.fill_tokens([7, 11])
    await ctx.release()
    return json.dumps(ctx.tokens)
"""


@pytest.mark.parametrize("policy", [Fcfs, Plas])
def test_programs_that_do_not_fit_together_all_finish_by_swapping(make_tiny, policy):
    """Six programs, each needing about half the device's pages, with one batch slot:
    they take turns through swapping, none is terminated, and each produces the tokens
    it produces alone."""
    ckpt = make_tiny("llama")
    pools = dict(num_pages=12, num_host_pages=64, page_size=4)
    prompts = [",".join(str((7 * i + j) % 60 + 3) for j in range(6 + i)) for i in range(6)]
    args = [[p, "2", "5"] for p in prompts]

    async def run(n_pages, max_batch, schedule):
        controller, rt, handle = await start(
            load_engine(ckpt, **{**pools, "num_pages": n_pages}),
            schedule=schedule,
            max_batch=max_batch,
        )
        insts = [rt.launch(Program.from_source("c", CHAT), a) for a in args]
        ends = [await i.wait() for i in insts]
        m = model_of(controller)
        m.resources.check_integrity()
        controller.programs.check_integrity()
        stats = m.swapper.stats
        await controller.close()
        handle.close()
        return ends, stats

    alone = []
    for a in args:
        ends, _ = asyncio.run(_solo(ckpt, pools, a))
        alone.append(ends)
    ends, stats = asyncio.run(run(12, 1, policy))
    assert all(isinstance(e, Finished) for e in ends), ends
    assert [json.loads(e.result) for e in ends] == alone
    assert stats.pages_out > 0 and stats.pages_in > 0


async def _solo(ckpt, pools, args):
    controller, rt, handle = await start(load_engine(ckpt, **{**pools, "num_pages": 64}))
    end = await rt.launch(Program.from_source("c", CHAT), args).wait()
    await controller.close()
    handle.close()
    assert isinstance(end, Finished), end
    return json.loads(end.result), None
