"""Argument handling shared by inferlets that take one JSON object (the built-ins)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from pastry.sdk.context import Context

PROMPT_KEYS = ("prompt", "prompt_tokens")


def options(args: list[str], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """``args[0]`` parsed as a JSON object over ``defaults`` (plus the prompt keys); an
    unknown key is an error that lists the accepted ones."""
    given = json.loads(args[0]) if args else {}
    if not isinstance(given, dict):
        raise ValueError(f"args must be one JSON object, got {args[0]!r}")
    unknown = set(given) - set(defaults) - set(PROMPT_KEYS)
    if unknown:
        raise ValueError(
            f"unknown args {sorted(unknown)}; accepted: {', '.join(PROMPT_KEYS)}, "
            f"{', '.join(defaults)}"
        )
    return {**defaults, **given}


def prompt_tokens(ctx: Context, opts: Mapping[str, Any]) -> list[int]:
    """The prompt as token ids: ``prompt_tokens``, or ``prompt`` as text or ids."""
    prompt = opts.get("prompt_tokens", opts.get("prompt"))
    if isinstance(prompt, str) and prompt:
        return ctx.api.tokenize(ctx.queue, prompt)
    if isinstance(prompt, list) and prompt:
        return [int(t) for t in prompt]
    raise ValueError('give a non-empty prompt as "prompt" (text or token ids) or "prompt_tokens"')
