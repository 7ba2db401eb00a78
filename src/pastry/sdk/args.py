"""Argument handling shared by inferlets that take one JSON object (the built-ins)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from pastry.sdk.context import Context

PROMPT_KEYS = ("prompt", "prompt_tokens")


def options(
    args: list[str], defaults: Mapping[str, Any], *, prompt_keys: Sequence[str] = PROMPT_KEYS
) -> dict[str, Any]:
    """``args[0]`` parsed as a JSON object over ``defaults``, also accepting ``prompt_keys``
    (``prompt`` and ``prompt_tokens``, read by :func:`prompt_tokens`; pass ``()`` when the
    prompt is one of ``defaults`` or there is none); an unknown key is an error that lists
    the accepted ones."""
    given = json.loads(args[0]) if args else {}
    if not isinstance(given, dict):
        raise ValueError(f"args must be one JSON object, got {args[0]!r}")
    accepted = dict.fromkeys([*prompt_keys, *defaults])
    unknown = set(given) - set(accepted)
    if unknown:
        raise ValueError(f"unknown args {sorted(unknown)}; accepted: {', '.join(accepted)}")
    return {**defaults, **given}


def prompt_tokens(ctx: Context, opts: Mapping[str, Any]) -> list[int]:
    """The prompt as token ids: ``prompt_tokens``, or ``prompt`` as text (tokenized as the
    start of a sequence: with a BOS if the model wants one) or ids."""
    prompt = opts.get("prompt_tokens", opts.get("prompt"))
    if isinstance(prompt, str) and prompt:
        return ctx.api.tokenize(ctx.queue, prompt, True)
    if isinstance(prompt, list) and prompt:
        return [int(t) for t in prompt]
    raise ValueError('give a non-empty prompt as "prompt" (text or token ids) or "prompt_tokens"')
