"""A sequence starts the way the model's tokenizer says: ``tokenize(q, text, True)`` and
``Context.fill`` on an empty context add its BOS (Llama-style tokenizers) or nothing (Qwen,
SmolLM2), in trusted and sandboxed inferlets alike."""

from __future__ import annotations

import asyncio
import json

import pytest

from inferlet_util import load_engine, result, sandbox, start
from pastry.runtime.trusted import Program
from pastry.wire.tokenizer import Tokenizer

SOURCE = """
import json
import pastry.sdk as px
from pastry.sdk import Context

async def main(args):
    text = args[0]
    ctx, other = Context(), Context()
    plain, first = px.tokenize(ctx.queue, text), px.tokenize(ctx.queue, text, True)
    ctx.fill(text)  # empty: the start of a sequence
    ctx.fill(text)  # then plain text
    other.fill(text, add_special_tokens=False)  # e.g. a chat template that has its own BOS
    out = {"plain": plain, "first": first, "ctx": ctx.tokens, "other": other.tokens}
    await ctx.release()
    await other.release()
    return json.dumps(out)
"""


@pytest.fixture(scope="module")
def box():
    return sandbox()


@pytest.mark.parametrize("sandboxed", [False, True], ids=["trusted", "sandboxed"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_sequences_start_with_the_tokenizers_bos(make_tiny, arch, sandboxed, request):
    eng = load_engine(make_tiny(arch), num_pages=64)
    if sandboxed:
        from pastry.runtime.wasm import sandboxed_program

        program = sandboxed_program("bos", SOURCE, box=request.getfixturevalue("box"))
    else:
        program = Program.from_source("bos", SOURCE)
    text = "Hello there, world"

    async def go():
        controller, rt, handle = await start(eng)
        inst = rt.launch(program, [text])
        events = [ev async for ev in inst.events()]
        await controller.close()
        handle.close()
        return events

    out = json.loads(result(asyncio.run(go())))
    info = eng.info
    tok = Tokenizer.from_json(info.tokenizer_json, info.chat_template, info.special_tokens)
    plain = tok.encode(text)
    bos = [0] if arch == "llama" else []  # tiny llama: <|endoftext|> as BOS, as Llama 3
    assert tok.add_bos_token == (arch == "llama")
    assert out == {"plain": plain, "first": bos + plain, "ctx": bos + plain * 2, "other": plain}
