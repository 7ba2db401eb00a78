"""Modular caching in the style of Prompt Cache (Gim et al. 2024): a prompt is composed of
named modules (a system prompt, documents, examples) whose KV caches are computed once each
and reused in any prompt that includes them, at any combination, plus the user's prompt.

A *schema* lists the modules in order and fixes each one's positions: module ``k`` starts
at the total length of the modules before it, and the user's prompt at the end of the
schema. A request uses some of the modules (all by default). Each module is read on its
own, at its positions: its tokens attend only within the module (causally), never to
another module, so its KV does not depend on the other modules and can be cached. The
prompt and the generated tokens attend to every module used and to each other. Modules
left out leave a gap in the positions, as in Prompt Cache.

Each module's KV is a persistent export named ``modular-cache/<hash>``, the SHA-256 of the
model name, the module's start position and its token ids. A request imports the modules
that are cached, prefills and exports the others, and concatenates their pages in schema
order as the context of its prompt. A module rarely fills its last page; the free slots are
masked with ``mask_kvpage`` when the module is exported, so the mask travels with the
shared page and every importer can use the pages as they are. Nothing is ever written to a
module's pages: the prompt and the generated tokens go to pages of their own.

Args (one JSON object; module contents and the prompt are text or lists of token ids)::

    {"modules": [{"name": "system", "content": "..."}, {"name": "doc-a", "content": ...}],
     "use": ["system", "doc-a"] (default: all, in schema order), "prompt": "...",
     "model": null (the first), "max_tokens": 16, "temperature": 0.0 (greedy),
     "seed": null, "stop_at_eos": true}

Result (JSON)::

    {"tokens": [generated ids, a final end-of-sequence token included], "text": "...",
     "reused": [modules imported], "prefilled": [modules prefilled here],
     "prefilled_tokens": tokens forwarded before the first generated token}
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json

import pastry.sdk as px
from pastry.sdk import ApiError, Sampler
from pastry.sdk.args import options

DEFAULTS = {
    "modules": None,
    "use": None,
    "prompt": None,
    "model": None,
    "max_tokens": 16,
    "temperature": 0.0,
    "seed": None,
    "stop_at_eos": True,
}


async def main(args: list[str]) -> str:
    opts = _options(args)
    model = opts["model"] or px.available_models()[0]
    q = px.create_queue(model)
    schema, end = _schema(q, opts["modules"])
    use = opts["use"] if opts["use"] is not None else list(schema)
    unknown = [name for name in use if name not in schema]
    if unknown:
        raise ValueError(f"unknown modules {unknown}; the schema has {list(schema)}")
    prompt = _tokens(q, opts["prompt"], "prompt")
    cached = dict(px.list_exported_kvpages(q))
    context: list[int] = []
    reused, prefilled = [], []
    for name in sorted(set(use), key=list(schema).index):
        tokens, start = schema[name]
        key = "modular-cache/" + hashlib.sha256(f"{model}\n{start}\n{tokens}".encode()).hexdigest()
        if key in cached:
            context += px.import_kvpages(q, key)
            reused.append(name)
        else:
            context += await _prefill_module(q, tokens, start, key)
            prefilled.append(name)
    generated = await _generate(q, context, prompt, end, opts)
    eos = set(px.get_eos_token_ids(q)) if opts["stop_at_eos"] else set()
    return json.dumps(
        {
            "tokens": generated,
            "text": px.detokenize(q, generated[:-1] if generated[-1] in eos else generated),
            "reused": reused,
            "prefilled": prefilled,
            "prefilled_tokens": len(prompt) + sum(len(schema[m][0]) for m in prefilled),
        }
    )


async def _prefill_module(q: int, tokens: list[int], start: int, key: str) -> list[int]:
    """Forward a module on its own at positions ``start...``, mask the free slots of its
    last page, and export its pages as ``key``."""
    ps, n = px.get_kv_page_size(q), len(tokens)
    pages = px.alloc_kvpages(q, -(-n // ps))
    embeds = px.alloc_embeds(q, n)
    futs = [
        px.embed_txt(q, tokens, list(range(start, start + n)), embeds),
        px.forward(q, [], 0, embeds, pages, 0, []),
        px.dealloc_embeds(q, embeds),
    ]
    if n % ps:
        futs.append(px.mask_kvpage(q, pages[-1], [i >= n % ps for i in range(ps)]))
    await asyncio.gather(*futs)
    with contextlib.suppress(ApiError):  # raised if another request exported it first
        await px.export_kvpages(q, pages, key, True)
    return pages


async def _generate(
    q: int, context: list[int], prompt: list[int], start: int, opts: dict
) -> list[int]:
    """Forward ``prompt`` at positions ``start...`` on top of ``context`` (pages of which
    every unmasked slot is attended), then sample up to ``max_tokens`` tokens."""
    ps, n, max_tokens = px.get_kv_page_size(q), len(prompt), opts["max_tokens"]
    own = px.alloc_kvpages(q, -(-(n + max_tokens - 1) // ps))  # prompt + generated tokens
    embeds = px.alloc_embeds(q, n + 1)
    out = embeds[n]
    futs = [
        px.embed_txt(q, prompt, list(range(start, start + n)), embeds[:n]),
        px.forward(q, context, ps if context else 0, embeds[:n], own, 0, [out]),
    ]
    sampler = Sampler(opts["temperature"], seed=opts["seed"])
    eos = set(px.get_eos_token_ids(q)) if opts["stop_at_eos"] else set()
    generated: list[int] = []
    length = n  # tokens in our own pages
    while True:
        *_, tok = await asyncio.gather(*futs, px.sample(q, out, **sampler.params(len(generated))))
        generated.append(tok)
        if len(generated) == max_tokens or tok in eos:
            return generated
        used = own[: -(-length // ps)]
        futs = [
            px.embed_txt(q, [tok], [start + length], embeds[:1]),
            px.forward(
                q,
                context + used,
                length - (len(used) - 1) * ps,
                embeds[:1],
                own[length // ps :],
                length % ps,
                [out],
            ),
        ]
        length += 1


def _schema(q: int, modules) -> tuple[dict[str, tuple[list[int], int]], int]:
    """name -> (tokens, start position) of every module, and the end of the schema."""
    if not isinstance(modules, list) or not modules:
        raise ValueError(f'"modules" must be a non-empty list, got {modules!r}')
    schema: dict[str, tuple[list[int], int]] = {}
    pos = 0
    for m in modules:
        if not isinstance(m, dict) or set(m) != {"name", "content"}:
            raise ValueError(f'a module is {{"name": ..., "content": ...}}, got {m!r}')
        if m["name"] in schema:
            raise ValueError(f"module name {m['name']!r} appears twice in the schema")
        tokens = _tokens(q, m["content"], f"module {m['name']!r}")
        schema[m["name"]] = (tokens, pos)
        pos += len(tokens)
    return schema, pos


def _options(args: list[str]) -> dict:
    opts = options(args, DEFAULTS, prompt_keys=())
    if not (isinstance(opts["max_tokens"], int) and opts["max_tokens"] >= 1):
        raise ValueError(f"max_tokens must be a positive integer, got {opts['max_tokens']!r}")
    return opts


def _tokens(q: int, value, what: str) -> list[int]:
    if isinstance(value, str) and value:
        return px.tokenize(q, value)
    if isinstance(value, list) and value and all(isinstance(t, int) for t in value):
        return list(value)
    raise ValueError(f"{what} must be non-empty text or a list of token ids, got {value!r}")
