"""Batch preparation of steps and embeds (``Step.prepare_batch``, ``Embed.prepare_batch``)
directly over a resource manager: the calls of the good commands carry their physical ids,
and every kind of bad handle fails only its own command, with the error ``translate``
gives when the command is then prepared alone."""

from __future__ import annotations

import asyncio
import re

import pytest

from pastry.api import ApiError
from pastry.control.commands import Command, Stage
from pastry.control.resources import ResourceManager
from pastry.control.steps import Embed, Step


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def _manager() -> tuple[ResourceManager, dict[int, list[int]], dict[int, list[int]]]:
    m = ResourceManager(num_pages=300, num_embeds=40)
    kv, emb = {}, {}
    for inst in range(6):
        m.add_instance(inst)
    for inst in range(6):  # (interleaved: the instances' pages are not contiguous)
        kv[inst] = m.alloc(inst, "kv", 3 + 9 * inst)
        emb[inst] = m.alloc(inst, "embed", 3)
    return m, kv, emb


def _step(loop, m: ResourceManager, inst: int, kv: list, emb: list) -> Command:
    s = Step(m, inst, [5], [7], emb, kv, len(kv) - 1, 3, 2)  # greedy
    return Command(Stage.EMBED, s, tokens=1, last_stage=Stage.OUTPUT, future=loop.create_future())


def test_a_batch_of_steps_fails_only_the_steps_with_bad_handles(loop) -> None:
    m, kv, emb = _manager()
    m.free(0, "kv", [kv[0][0]])
    (res,) = m.reserve(1, "kv", 1)
    (eres,) = m.reserve(2, "embed", 1)
    m.free(3, "embed", [emb[3][2]])
    bad = {  # (instance, kv handles, embed handles, what translate says)
        "freed": (0, kv[0], emb[0][:2], f"kv page handle {kv[0][0]} was freed"),
        "reserved": (1, [*kv[1], res], emb[1][:2], f"kv page handle {res} is not filled yet"),
        "foreign": (2, [*kv[2][:2], 40], emb[2][:2], "kv page handle 40 is not owned"),
        "embed reserved": (2, kv[2][:2], [emb[2][0], eres], f"embed handle {eres} is not filled"),
        "negative": (3, [-1, *kv[3][:2]], emb[3][:2], "kv page handle -1 is not owned"),
        "embed freed": (3, kv[3][:2], [emb[3][2], emb[3][0]], f"embed handle {emb[3][2]} was freed"),
        "huge": (4, [2**70, *kv[4]], emb[4][:2], f"kv page handle {2**70} is not owned"),
    }  # fmt: skip
    cmds, expect = [], []
    for n, (i, k, e, msg) in enumerate(bad.values()):  # good steps between the bad ones
        good = n % 6
        cmds += [_step(loop, m, good, kv[good][1:], emb[good][:2]), _step(loop, m, i, k, e)]
        expect += [None, msg]
    failed = Step.prepare_batch(cmds)
    assert failed == [c for c, msg in zip(cmds, expect, strict=True) if msg is not None]
    for c, msg in zip(cmds, expect, strict=True):
        s = c.op
        if msg is not None:
            assert c.call is None and not c.future.done()
            with pytest.raises(ApiError, match=re.escape(msg)):
                s.prepare()  # what the scheduler does next: the error its caller sees
            continue
        embed, forward, sample = c.call
        phys_kv = m.translate(s.instance, "kv", s.kv)
        phys_e = m.translate(s.instance, "embed", s.embeds)
        assert forward.ctx_pages.tolist() == phys_kv[:-1]
        assert forward.out_pages.tolist() == phys_kv[-1:]
        assert embed.out_embeds.tolist() == forward.in_embeds.tolist() == phys_e[:1]
        assert forward.out_embeds.tolist() == phys_e[1:] and sample.embed == phys_e[1]
        assert embed.tokens.tolist() == [5] and embed.positions.tolist() == [7]
        assert forward.ctx_last_len == 3 and forward.out_offset == 2
    # an ended instance's step is left to prepare alone (and fails there)
    m.remove_instance(5)
    alone = _step(loop, m, 5, kv[5], emb[5][:2])
    assert Step.prepare_batch([alone, cmds[0]]) == [alone]
    with pytest.raises(ApiError, match="inferlet 5 is not registered"):
        alone.op.prepare()


def test_a_batch_of_embeds_fails_only_the_embeds_with_bad_handles(loop) -> None:
    m, _, emb = _manager()
    m.free(2, "embed", [emb[2][1]])
    slots = {inst: emb[inst][:2] for inst in range(6)}
    slots[4] = [emb[4][0], 99]
    cmds = [
        Command(
            Stage.EMBED, Embed(m, i, [3, 4], [0, 1], slots[i]), tokens=2,
            future=loop.create_future(),
        )
        for i in range(6)
    ]  # fmt: skip
    assert Embed.prepare_batch(cmds) == [cmds[2], cmds[4]]
    for i, c in enumerate(cmds):
        if i in (2, 4):
            assert c.call is None
            with pytest.raises(ApiError, match="was freed" if i == 2 else "99 is not owned"):
                c.op.prepare()
        else:
            assert c.call.out_embeds.tolist() == m.translate(i, "embed", slots[i])
            assert c.call.tokens.tolist() == [3, 4] and c.call.positions.tolist() == [0, 1]
