"""Hierarchical attention (after Tang et al. 2022): read a long document through its
structure instead of as one flat sequence.

The document is a list of sections, each a header and paragraphs. While the document is
read, a paragraph's tokens attend only within their own paragraph and to the headers read
so far; a header's tokens attend only to the headers (its own and earlier ones). The
headers thus form the document's outline, which every token sees, while paragraphs stay
local to themselves. For token ``i`` and an earlier (or the same) token ``j``::

    attends(i, j) = j is a header token or j is in i's paragraph

The prompt after the document (e.g. a question) and the generated tokens attend to
everything before them, as usual. The document is forwarded once with this mask (the
``mask`` argument of ``forward``, one row per token); its pages then become the start of an
ordinary :class:`Context`, which reads the prompt and generates. Positions are the usual
ones: the document's tokens in reading order, then the prompt.

Args (one JSON object; every header, paragraph and the prompt is text or a list of token
ids; a header may be empty)::

    {"sections": [{"header": "...", "paragraphs": ["...", ...]}, ...], "prompt": "...",
     "model": null (the first), "max_tokens": 16, "temperature": 0.0 (greedy),
     "seed": null, "stop_at_eos": true}

Result (JSON)::

    {"tokens": [generated ids, a final end-of-sequence token included], "text": "...",
     "document_tokens": number of tokens in the document}
"""

from __future__ import annotations

import asyncio
import json

import pastry.sdk as px
from pastry.sdk import Context, EosTokens, MaxTokens, Sampler
from pastry.sdk.args import options

DEFAULTS = {
    "sections": None,
    "prompt": None,
    "model": None,
    "max_tokens": 16,
    "temperature": 0.0,
    "seed": None,
    "stop_at_eos": True,
}

HEADER = -1  # the group of header tokens; paragraphs are groups 0, 1, 2, ...


async def main(args: list[str]) -> str:
    opts = options(args, DEFAULTS, prompt_keys=())
    ctx = Context(opts["model"])
    q = ctx.queue
    doc, groups = _document(ctx, opts["sections"])
    prompt = _tokens(ctx, opts["prompt"], "prompt")
    n = len(doc)
    pages = px.alloc_kvpages(q, -(-n // ctx.page_size))
    embeds = px.alloc_embeds(q, n)
    await asyncio.gather(
        px.embed_txt(q, doc, list(range(n)), embeds),
        px.forward(q, [], 0, embeds, pages, 0, [], hierarchical_mask(groups)),
        px.dealloc_embeds(q, embeds),
    )
    # The document's pages start the context; the prompt and the answer attend to all of it.
    ctx.pages, ctx.kv_len, ctx.tokens = pages, n, list(doc)
    ctx.fill_tokens(prompt)
    start = len(ctx.tokens)
    stop = MaxTokens(opts["max_tokens"])
    if opts["stop_at_eos"]:
        stop = stop | EosTokens(ctx.eos_ids)
    text = await ctx.generate(Sampler(opts["temperature"], seed=opts["seed"]), stop)
    return json.dumps({"tokens": ctx.tokens[start:], "text": text, "document_tokens": n})


def hierarchical_mask(groups: list[int]) -> list[list[bool]]:
    """The attention mask of a document whose token ``i`` is in group ``groups[i]`` (a
    paragraph number, or ``HEADER``): row ``i`` says which tokens ``i`` attends to."""
    return [
        [j <= i and (groups[j] == HEADER or groups[j] == g) for j in range(len(groups))]
        for i, g in enumerate(groups)
    ]


def _document(ctx: Context, sections) -> tuple[list[int], list[int]]:
    """The document's tokens in reading order and the group of each."""
    if not isinstance(sections, list) or not sections:
        raise ValueError(f'"sections" must be a non-empty list of sections, got {sections!r}')
    doc: list[int] = []
    groups: list[int] = []
    paragraph = 0
    for s in sections:
        if not isinstance(s, dict) or set(s) - {"header", "paragraphs"}:
            raise ValueError(f'a section is {{"header": ..., "paragraphs": [...]}}, got {s!r}')
        header = _tokens(ctx, s["header"], "header") if s.get("header") else []
        doc += header
        groups += [HEADER] * len(header)
        for p in s.get("paragraphs", []):
            tokens = _tokens(ctx, p, "paragraph")
            doc += tokens
            groups += [paragraph] * len(tokens)
            paragraph += 1
    if not doc:
        raise ValueError("the document is empty")
    return doc, groups


def _tokens(ctx: Context, value, what: str) -> list[int]:
    if isinstance(value, str) and value:
        return ctx.api.tokenize(ctx.queue, value)
    if isinstance(value, list) and value and all(isinstance(t, int) for t in value):
        return list(value)
    raise ValueError(f"a {what} must be non-empty text or a list of token ids, got {value!r}")
