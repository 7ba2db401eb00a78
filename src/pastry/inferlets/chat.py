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

A conversation can be kept as KV between turns (what ``POST /v1/responses`` does with
``store``): ``"kv_export": NAME`` exports the pages of the whole conversation (prompt and
reply, every token forwarded) as the persistent export ``NAME`` and adds ``"kv": {"name",
"tokens"}`` to the result; ``"kv_import": {"name", "tokens"}`` continues from such an
export, whose KV is that of the first ``tokens`` prompt ids, instead of computing them
again (they count as ``cached_tokens``). An export that is gone (dropped when memory was
short, ``docs/security.md``) is computed again.
"""

from __future__ import annotations

import base64
import json

import pastry.sdk as px
from pastry.inferlets.text_completion import OPTIONS, complete, parse
from pastry.sdk import Context

CHAT_OPTIONS = {**OPTIONS, "prompt": None, "kv_import": None, "kv_export": None}
CHAT_OPTIONS.update(messages=[], max_tokens=256)  # messages: [{"role", "content"}]
CHAT_OPTIONS["images"] = []  # base64 encoded images, one per placeholder in prompt


async def main(args: list[str]) -> str | None:
    opts = parse(args, CHAT_OPTIONS)
    plain = opts is None
    if plain:
        user = {"role": "user", "content": " ".join(args)}
        opts = {**CHAT_OPTIONS, "messages": [user], "temperature": 0.0}
    if opts["images"] and (opts["prompt"] is None or opts["kv_import"] is not None):
        raise ValueError("'images' go with a 'prompt' (token ids or text), without 'kv_import'")
    ctx = Context(opts["model"], adapter=opts["adapter"])
    # a rendered template writes its own BOS (if the model has one): no special tokens
    if opts["kv_import"] is not None:
        prompt = list(opts["prompt"])
        imported = await _continue(ctx, opts["kv_import"], prompt)
        ctx.fill_tokens(prompt[imported:])
    elif opts["prompt"] is not None:
        prompt = opts["prompt"]
        if isinstance(prompt, str):
            prompt = px.tokenize(ctx.queue, prompt, False)
        ctx.fill_prompt(prompt, [base64.b64decode(i, validate=True) for i in opts["images"]])
    else:
        messages = [(m["role"], m["content"]) for m in opts["messages"]]
        ctx.fill(px.apply_chat_template(ctx.queue, messages), add_special_tokens=False)
    result = await complete(ctx, opts, plain)
    if opts["kv_export"] is not None:
        await ctx.flush(keep_last=False)  # the last token's K/V too
        await px.export_kvpages(ctx.queue, ctx.pages, opts["kv_export"], True)
        result["kv"] = {"name": opts["kv_export"], "tokens": ctx.kv_len}
    return None if plain else json.dumps(result)


async def _continue(ctx: Context, kv: dict, prompt: list[int]) -> int:
    """Adopt the export ``kv["name"]`` (the K/V of ``prompt[:kv["tokens"]]``) as the start
    of ``ctx``; the number of tokens it holds (0 if it is gone)."""
    q, ps, n = ctx.queue, ctx.page_size, int(kv["tokens"])
    if not 0 < n < len(prompt) or kv["name"] not in dict(px.list_exported_kvpages(q)):
        return 0
    pages = px.import_kvpages(q, kv["name"])
    full, rest = divmod(n, ps)
    if len(pages) != full + bool(rest):
        await px.dealloc_kvpages(q, pages)
        return 0
    if rest:  # the partial last page: ours to write into, so a private copy
        shared, pages[full] = pages[full], px.alloc_kvpages(q, 1)[0]
        await px.copy_kvpage(q, shared, pages[full], 0, 0, rest)
        await px.dealloc_kvpages(q, [shared])
    ctx.pages, ctx.kv_len, ctx.tokens = pages, n, prompt[:n]
    ctx.frozen = full  # shared with the export (and its other importers): never written
    ctx.cached_tokens += n
    return n
