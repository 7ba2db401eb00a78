"""Grammar-constrained decoding (EBNF decoding in the Pie paper's Table 2): the output is a
word of a JSON schema, a Lark (EBNF) grammar or a regular expression.

Each step the grammar (compiled by llguidance against the model's vocabulary) gives the set
of tokens that keep the output a prefix of a word of the grammar; the next token is the most
likely of them in the model's full next-token distribution, or one sampled among them at
``temperature``. Tokens the grammar forces are appended without a forward of their own
(``fast_forward``). Generation ends when the grammar admits nothing more, when the model
picks end-of-sequence where the grammar allows it (the output is complete), or at
``max_tokens``. See :mod:`pastry.sdk.grammar`.

JSON schemas compile to compact JSON (no optional whitespace) unless the schema's
``"x-guidance"`` sets ``"whitespace_flexible": true``.

Args (one JSON object)::

    {"prompt": "text" or [ids]} or {"prompt_tokens": [ids]}, "model": null (the first),
    "grammar": {"json_schema": {...}} | {"lark": "start: ..."} | {"regex": "..."},
    "max_tokens": 128, "temperature": 0.0 (greedy), "seed": null, "fast_forward": true,
    "device_mask": true (false: pick on the host from the pulled distribution)

Result (JSON)::

    {"text": "...", "tokens": [generated ids], "complete": true when the text is a word of
     the grammar, "finish_reason": "stop" | "length", "forward_calls": n}
"""

from __future__ import annotations

import json

from pastry.sdk import Context
from pastry.sdk.args import options, prompt_tokens
from pastry.sdk.grammar import Constraint, generate

DEFAULTS = {
    "model": None,
    "grammar": None,
    "max_tokens": 128,
    "temperature": 0.0,
    "seed": None,
    "fast_forward": True,
    "device_mask": True,
}


async def main(args: list[str]) -> str:
    opts = options(args, DEFAULTS)
    if opts["grammar"] is None:
        raise ValueError(
            'give "grammar": {"json_schema": {...}} | {"lark": "..."} | {"regex": "..."}'
        )
    async with Context(opts["model"]) as ctx:
        ctx.fill_tokens(prompt_tokens(ctx, opts))
        constraint = Constraint(ctx, opts["grammar"])
        out = await generate(
            ctx,
            constraint,
            max_tokens=int(opts["max_tokens"]),
            temperature=float(opts["temperature"]),
            seed=opts["seed"],
            fast_forward=bool(opts["fast_forward"]),
            device_mask=bool(opts["device_mask"]),
        )
        text = ctx.api.detokenize(ctx.queue, out.tokens)
    return json.dumps(
        {
            "text": text,
            "tokens": out.tokens,
            "complete": out.complete,
            "finish_reason": "stop" if out.complete else "length",
            "forward_calls": out.forwards,
        }
    )
