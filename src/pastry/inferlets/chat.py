"""Chat: messages in, the assistant's reply out — the program behind
``POST /v1/chat/completions``. It renders the model's chat template, then continues exactly
like ``text-completion`` (same options, streaming and result), with ``messages`` in place
of ``prompt``.

    pastry run chat -- "Tell me a story"
    pastry run chat -- '{"messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 64}'

Plain words are one user message, answered greedily and sent as raw text messages. A
caller that renders the conversation itself (the OpenAI endpoint does, with tools and
structured messages the API's ``apply_chat_template`` cannot carry) gives ``prompt``
(text or token ids) instead of ``messages``.
"""

from __future__ import annotations

import json

import pastry.sdk as px
from pastry.inferlets.text_completion import OPTIONS, complete, parse
from pastry.sdk import Context

CHAT_OPTIONS = {**OPTIONS, "prompt": None}
CHAT_OPTIONS.update(messages=[], max_tokens=256)  # messages: [{"role", "content"}]


async def main(args: list[str]) -> str | None:
    opts = parse(args, CHAT_OPTIONS)
    plain = opts is None
    if plain:
        user = {"role": "user", "content": " ".join(args)}
        opts = {**CHAT_OPTIONS, "messages": [user], "temperature": 0.0}
    ctx = Context(opts["model"])
    # a rendered template writes its own BOS (if the model has one): no special tokens
    if opts["prompt"] is not None:
        prompt = opts["prompt"]
        if isinstance(prompt, str):
            ctx.fill(prompt, add_special_tokens=False)
        else:
            ctx.fill_tokens(prompt)
    else:
        messages = [(m["role"], m["content"]) for m in opts["messages"]]
        ctx.fill(px.apply_chat_template(ctx.queue, messages), add_special_tokens=False)
    result = await complete(ctx, opts, plain)
    return None if plain else json.dumps(result)
