"""Windowed attention (Longformer's local attention, Beltagy et al. 2020), with optional
attention sinks (StreamingLLM, Xiao et al. 2024): generation whose KV cache stays bounded
however long it runs.

The token at position ``i`` attends to the ``window`` most recent tokens (itself included)
and to the first ``sink`` tokens of the sequence::

    attends(i, j) = j <= i and (j < sink or j > i - window)

so the cache needs only the pages some later token can still attend: the pages holding the
sink tokens, and those holding a token of the current window. Page ``k`` of the sequence
holds positions ``k * P .. k * P + P - 1`` (``P``: page size); once all of its tokens have
fallen out of the window and none is a sink, the page is deallocated. The pages held stay
at most ``ceil(sink / P) + ceil((window + n - 2) / P) + 1`` for a forward of ``n`` tokens:
``n = 1`` while generating, ``n <= window`` while reading the prompt, which is forwarded in
chunks of ``window`` tokens.

A held page may still contain tokens outside the window (the oldest window page, the slots
after the sinks in the last sink page): every forward passes the mask above, one row per
input over its context and inputs. The output is therefore exactly that of a forward over
the full context with the same mask, which is what the tests check.

Positions: every token keeps its position in the sequence, because a cached key has its
rotary embedding applied and cannot be moved. StreamingLLM instead numbers positions within
the cache, so that they never exceed its size; here they grow with the sequence and must
stay below the model's maximum.

Args (one JSON object; ``prompt`` is text or a list of token ids)::

    {"prompt": "...", "window": 256, "sink": 0, "model": null (the first),
     "max_tokens": 64, "temperature": 0.0 (greedy), "seed": null, "stop_at_eos": true}

Result (JSON)::

    {"tokens": [generated ids, a final end-of-sequence token included], "text": "...",
     "max_pages_held": the most KV pages held at once}

``attention-sink`` is this program with ``"sink": 4`` by default.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable

import pastry.sdk as px
from pastry.sdk import Sampler
from pastry.sdk.args import options

DEFAULTS = {
    "prompt": None,
    "window": 256,
    "sink": 0,
    "model": None,
    "max_tokens": 64,
    "temperature": 0.0,
    "seed": None,
    "stop_at_eos": True,
}


async def main(args: list[str]) -> str:
    return json.dumps(await generate(options(args, DEFAULTS, prompt_keys=())))


class WindowedKv:
    """The KV pages of one sequence under windowed attention: only those still attendable."""

    def __init__(self, q: int, window: int, sink: int) -> None:
        self.q, self.window, self.sink = q, window, sink
        self.page_size = px.get_kv_page_size(q)
        self.pages: dict[int, int] = {}  # page number in the sequence -> handle, in order
        self.length = 0  # tokens forwarded
        self.max_held = 0

    def attends(self, i: int, j: int) -> bool:
        """May the token at position ``i`` attend to the one at position ``j``?"""
        return j <= i and (j < self.sink or j > i - self.window)

    def forward(self, tokens: list[int], embeds: list[int], out: int) -> list[Awaitable]:
        """Issue embed + forward of ``tokens`` at the next positions (the last one's output
        to embed slot ``out``), first dropping the pages no token from here on attends."""
        q, ps, start, n = self.q, self.page_size, self.length, len(tokens)
        # Page k is dropped once its last token, (k + 1) * ps - 1, is out of the window of
        # the token at ``start`` (and so of every later one), unless it holds a sink token.
        futs = []
        gone = [k for k in self.pages if (k + 1) * ps - 1 <= start - self.window]
        gone = [self.pages.pop(k) for k in gone if k * ps >= self.sink]
        if gone:
            futs.append(px.dealloc_kvpages(q, gone))
        new = range(-(-start // ps), -(-(start + n) // ps))  # pages first written now
        self.pages.update(zip(new, px.alloc_kvpages(q, len(new)), strict=True))
        self.max_held = max(self.max_held, len(self.pages))

        context = [k for k in self.pages if k * ps < start]
        keys = [j for k in context for j in range(k * ps, min((k + 1) * ps, start))]
        keys += range(start, start + n)
        mask = [[self.attends(i, j) for j in keys] for i in range(start, start + n)]
        last = start - context[-1] * ps if context else 0
        out_pages = [self.pages[k] for k in range(start // ps, -(-(start + n) // ps))]
        self.length += n
        futs.append(px.embed_txt(q, tokens, list(range(start, start + n)), embeds[:n]))
        futs.append(
            px.forward(
                q,
                [self.pages[k] for k in context],
                last,
                embeds[:n],
                out_pages,
                start % ps,
                [out],
                mask,
            )
        )
        return futs


async def generate(opts: dict) -> dict:
    """Read the prompt and generate under windowed attention (see the module docstring)."""
    window, sink, max_tokens = opts["window"], opts["sink"], opts["max_tokens"]
    if not (isinstance(window, int) and window >= 1 and isinstance(sink, int) and sink >= 0):
        raise ValueError(f"window must be >= 1 and sink >= 0, got {window} and {sink}")
    if not (isinstance(max_tokens, int) and max_tokens >= 1):
        raise ValueError(f"max_tokens must be a positive integer, got {max_tokens!r}")
    q = px.create_queue(opts["model"] or px.available_models()[0])
    prompt = prompt_tokens(q, opts["prompt"])
    kv = WindowedKv(q, window, sink)
    embeds = px.alloc_embeds(q, min(len(prompt), window) + 1)
    out = embeds[-1]
    last = (len(prompt) - 1) // window * window  # the prompt in chunks of window tokens
    for c in range(0, last, window):
        await asyncio.gather(*kv.forward(prompt[c : c + window], embeds, out))
    futs = kv.forward(prompt[last:], embeds, out)  # the last chunk, with the first sample
    sampler = Sampler(opts["temperature"], seed=opts["seed"])
    eos = set(px.get_eos_token_ids(q)) if opts["stop_at_eos"] else set()
    generated: list[int] = []
    while True:
        *_, tok = await asyncio.gather(*futs, px.sample(q, out, **sampler.params(len(generated))))
        generated.append(tok)
        if len(generated) == max_tokens or tok in eos:
            break
        futs = kv.forward([tok], embeds, out)
    text = px.detokenize(q, generated[:-1] if generated[-1] in eos else generated)
    return {"tokens": generated, "text": text, "max_pages_held": kv.max_held}


def prompt_tokens(q: int, value) -> list[int]:
    if isinstance(value, str) and value:
        return px.tokenize(q, value)
    if isinstance(value, list) and value and all(isinstance(t, int) for t in value):
        return list(value)
    raise ValueError(f'"prompt" must be non-empty text or a list of token ids, got {value!r}')
