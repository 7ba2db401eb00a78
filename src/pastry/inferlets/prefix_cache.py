"""Prefix caching (as in vLLM, Kwon et al. 2023), controlled by the application: the KV
cache of a long shared prefix (a system prompt, few-shot examples, a document) is computed
once, exported, and imported by every later request that starts with it, which then
prefills only its own prompt.

The cache entry is a persistent export named ``prefix-cache/<hash>``, the SHA-256 of the
model name and the prefix's token ids, so equal prefixes find each other and a changed one
never reads stale pages. The first request for a prefix prefills it and exports its pages;
the others import them.

The partial last page: a prefix whose length is not a multiple of the page size ends in a
page with free slots, and each request writes its own tokens into the free slots of its
last page. A shared page must never be written, so an importer copies the prefix's slots of
that page into a private page (``copy_kvpage``, as ``Context.fork`` does) and shares only
the full pages. (The exporter goes on writing into its own last page after exporting it:
that changes only slots after the prefix, which importers never read.) Keeping only whole
pages in the cache instead would leave every request up to ``page_size - 1`` prefix tokens
to prefill; copying them is cheaper.

Two requests that miss at the same time both prefill the prefix; the first to export wins
and the other keeps its own pages. An entry lives until it is unexported:
``unexport_kvpages(q, result["cache"])`` from any inferlet.

Args (one JSON object; text or a list of token ids for ``prefix`` and ``prompt``)::

    {"prefix": "...", "prompt": "...", "model": null (the first), "max_tokens": 16,
     "temperature": 0.0 (greedy), "seed": null, "stop_at_eos": true}

Result (JSON)::

    {"tokens": [generated ids], "text": "...", "cache": "prefix-cache/...",
     "hit": true if the prefix was imported, "prefilled": tokens forwarded before the first
     generated token (the prompt, plus the prefix on a miss)}
"""

from __future__ import annotations

import contextlib
import hashlib
import json

import pastry.sdk as px
from pastry.sdk import ApiError, Context, EosTokens, MaxTokens, Sampler
from pastry.sdk.args import options

DEFAULTS = {
    "prefix": None,
    "prompt": None,
    "model": None,
    "max_tokens": 16,
    "temperature": 0.0,
    "seed": None,
    "stop_at_eos": True,
}


async def main(args: list[str]) -> str:
    opts = options(args, DEFAULTS, prompt_keys=())
    ctx = Context(opts["model"])
    prefix = _tokens(ctx, opts, "prefix")
    prompt = _tokens(ctx, opts, "prompt")
    name = "prefix-cache/" + hashlib.sha256(f"{ctx.model}\n{prefix}".encode()).hexdigest()
    hit = await _import_prefix(ctx, name, prefix)
    if not hit:
        ctx.fill_tokens(prefix)
        await ctx.flush(keep_last=False)
        with contextlib.suppress(ApiError):  # raised if another request exported it first
            await px.export_kvpages(ctx.queue, ctx.pages, name, True)
    ctx.fill_tokens(prompt)
    stop = MaxTokens(opts["max_tokens"])
    if opts["stop_at_eos"]:
        stop = stop | EosTokens(ctx.eos_ids)
    text = await ctx.generate(Sampler(opts["temperature"], seed=opts["seed"]), stop)
    return json.dumps(
        {
            "tokens": ctx.tokens[len(prefix) + len(prompt) :],
            "text": text,
            "cache": name,
            "hit": hit,
            "prefilled": len(prompt) + (0 if hit else len(prefix)),
        }
    )


async def _import_prefix(ctx: Context, name: str, prefix: list[int]) -> bool:
    """Continue ``ctx`` from the cached pages of ``prefix``; False if nothing is cached."""
    q, ps = ctx.queue, ctx.page_size
    if name not in dict(px.list_exported_kvpages(q)):
        return False
    pages = px.import_kvpages(q, name)
    full, rest = divmod(len(prefix), ps)
    if rest:  # the partial last page: our tokens will go into it, so use a private copy
        shared, pages[full] = pages[full], px.alloc_kvpages(q, 1)[0]
        await px.copy_kvpage(q, shared, pages[full], 0, 0, rest)
        await px.dealloc_kvpages(q, [shared])
    ctx.pages, ctx.kv_len, ctx.tokens = pages, len(prefix), list(prefix)
    return True


def _tokens(ctx: Context, opts: dict, key: str) -> list[int]:
    value = opts[key]
    if isinstance(value, str) and value:
        return ctx.api.tokenize(ctx.queue, value)
    if isinstance(value, list) and value and all(isinstance(t, int) for t in value):
        return list(value)
    raise ValueError(f'"{key}" must be non-empty text or a list of token ids, got {value!r}')
