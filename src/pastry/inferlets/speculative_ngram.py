"""Speculative decoding with n-gram prompt lookup (Saxena 2023; vLLM's ``ngram`` proposer).

Greedy decoding, several tokens per forward when the text repeats itself. Each step:

1. **Draft.** Take the last ``n`` tokens of the context (``n`` from ``max_ngram`` down to
   ``min_ngram``), find their latest earlier occurrence in the context, and propose the
   (up to ``num_draft``) tokens that followed it. No occurrence: no draft.
2. **Verify.** One forward over the pending token and the draft, reading the greedy token
   after each of them. Draft token ``i`` is accepted while it equals the model's greedy
   choice at its position; the model's choice at the first mismatch (or after the last
   draft token) comes for free. So each forward yields 1 to ``len(draft) + 1`` tokens, and
   the output is exactly greedy decoding's.
3. **Roll back** the rejected draft tokens: ``truncate`` drops them from the context. Their
   K/V were written to the slots after the accepted tokens, but a forward attends to the
   context only up to its length, and the next forward overwrites those slots; so they
   never influence a later token.

Args (one JSON object)::

    {"prompt": "text" or [ids]} or {"prompt_tokens": [ids]}, "model": null (the first),
    "max_tokens": 64, "num_draft": 5, "max_ngram": 3, "min_ngram": 1, "stop_at_eos": true

Result (JSON)::

    {"tokens": [generated ids], "text": "...", "forwards": forward calls made
     (prefill included), "drafted": draft tokens proposed, "accepted": of them accepted}
"""

from __future__ import annotations

import json

from pastry.sdk import Context
from pastry.sdk.args import options, prompt_tokens
from pastry.sdk.steps import greedy_after, truncate

DEFAULTS = {
    "model": None,
    "max_tokens": 64,
    "num_draft": 5,
    "max_ngram": 3,
    "min_ngram": 1,
    "stop_at_eos": True,
}


def lookup(tokens: list[int], max_ngram: int, min_ngram: int, num_draft: int) -> list[int]:
    """The tokens that followed the latest earlier occurrence of the longest matching
    suffix n-gram (``max_ngram`` >= n >= ``min_ngram``); [] when none occurs."""
    for n in range(min(max_ngram, len(tokens) - 1), min_ngram - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + num_draft]
    return []


async def main(args: list[str]) -> str:
    opts = options(args, DEFAULTS)
    max_tokens = opts["max_tokens"]
    if not 1 <= opts["min_ngram"] <= opts["max_ngram"] or opts["num_draft"] < 0:
        raise ValueError(f"need 1 <= min_ngram <= max_ngram and num_draft >= 0, got {opts}")
    async with Context(opts["model"]) as ctx:
        ctx.fill_tokens(prompt_tokens(ctx, opts))
        eos = set(ctx.eos_ids) if opts["stop_at_eos"] else set()
        out: list[int] = []
        forwards = drafted = accepted = 0
        while len(out) < max_tokens and not eos.intersection(out):
            room = max_tokens - len(out) - 1  # a forward yields one token beyond its draft
            n_draft = min(opts["num_draft"], room)
            draft = lookup(ctx.tokens, opts["max_ngram"], opts["min_ngram"], n_draft)
            base = len(ctx.tokens)
            greedy = await greedy_after(ctx, draft)  # greedy[i]: the model's token after input i
            n_ok = 0
            while n_ok < len(draft) and draft[n_ok] == greedy[n_ok]:
                n_ok += 1
            await truncate(ctx, base + n_ok)  # drop the rejected draft tokens
            ctx.fill_tokens([greedy[n_ok]])
            out += greedy[: n_ok + 1]
            forwards += 1
            drafted += len(draft)
            accepted += n_ok
        out = _until_eos(out, eos)
        return json.dumps(
            {
                "tokens": out,
                "text": ctx.api.detokenize(ctx.queue, out),
                "forwards": forwards,
                "drafted": drafted,
                "accepted": accepted,
            }
        )


def _until_eos(tokens: list[int], eos: set[int]) -> list[int]:
    return next((tokens[:i] for i, t in enumerate(tokens) if t in eos), tokens)
