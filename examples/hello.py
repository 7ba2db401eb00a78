"""A tiny inferlet: greets, then continues a prompt with the model.

pastry run examples/hello.py -- world
"""

import pastry.sdk as px
from pastry.sdk import Context


async def main(args: list[str]) -> str:
    name = " ".join(args) or "world"
    px.send(f"Hello, {name}!\n")  # a message, streamed to the client as it is sent
    ctx = Context()
    ctx.fill(f"Hello, {name}.")
    return await ctx.generate_until(max_tokens=12)  # the result, sent last
