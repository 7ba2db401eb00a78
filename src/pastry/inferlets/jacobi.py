"""Jacobi decoding (Santilli et al. 2023): greedy decoding as a parallel fixed-point iteration.

Greedy decoding solves ``y[i] = argmax p(. | prompt, y[:i])`` one unknown at a time. Jacobi
decoding solves ``block`` unknowns at once by fixed-point iteration. Start from any guess;
one forward over the last known token and the guesses for the first ``block - 1`` unknowns
(causal attention: output ``i`` sees exactly the guesses before it) gives every unknown's
greedy token *given the current guesses*, and these outputs are the next guesses. The
leading guesses that equal their outputs have reached the fixed point and are final, and
so is the output right after them (computed from final tokens only): they are committed
and the block slides on, the remaining outputs becoming the next iteration's guesses.
At least one token is committed per forward, so the result is exactly greedy decoding's,
in at most as many forwards, fewer when several guesses converge at once.

The K/V written for guesses that were not committed are dropped with ``truncate``: they sit
after the context's end, are never attended, and the next iteration overwrites them.

Args (one JSON object)::

    {"prompt": "text" or [ids]} or {"prompt_tokens": [ids]}, "model": null (the first),
    "max_tokens": 64, "block": 4 (tokens solved per iteration), "stop_at_eos": true

Result (JSON)::

    {"tokens": [generated ids], "text": "...", "forwards": forward calls (= iterations,
     prefill included), "committed": [tokens committed by each iteration]}
"""

from __future__ import annotations

import json

from pastry.sdk import Context
from pastry.sdk.args import options, prompt_tokens
from pastry.sdk.steps import greedy_after, truncate

DEFAULTS = {"model": None, "max_tokens": 64, "block": 4, "stop_at_eos": True}


async def main(args: list[str]) -> str:
    opts = options(args, DEFAULTS)
    max_tokens, block = opts["max_tokens"], opts["block"]
    if block < 1:
        raise ValueError(f"block must be at least 1, got {block}")
    async with Context(opts["model"]) as ctx:
        ctx.fill_tokens(prompt_tokens(ctx, opts))
        eos = set(ctx.eos_ids) if opts["stop_at_eos"] else set()
        out: list[int] = []
        committed: list[int] = []
        # guess[i]: the current guess for the (i + 1)-th unknown token; any start converges.
        guess = [ctx.tokens[-1]] * (block - 1)
        while len(out) < max_tokens and not eos.intersection(out):
            guess = guess[: max_tokens - len(out) - 1]  # one token more comes with them
            base = len(ctx.tokens)
            new = await greedy_after(ctx, guess)  # new[i]: greedy token given guess[:i]
            n_ok = 0
            while n_ok < len(guess) and guess[n_ok] == new[n_ok]:
                n_ok += 1
            await truncate(ctx, base + n_ok)  # keep the fixed point, drop the other guesses
            ctx.fill_tokens([new[n_ok]])
            out += new[: n_ok + 1]
            committed.append(n_ok + 1)
            # Next guesses: this iteration's outputs after the committed ones, padded.
            rest = new[n_ok + 1 :]
            guess = rest + [new[-1]] * (block - 1 - len(rest))
        out = _until_eos(out, eos)
        return json.dumps(
            {
                "tokens": out,
                "text": ctx.api.detokenize(ctx.queue, out),
                "forwards": len(committed),
                "committed": committed,
            }
        )


def _until_eos(tokens: list[int], eos: set[int]) -> list[int]:
    return next((tokens[:i] for i, t in enumerate(tokens) if t in eos), tokens)
