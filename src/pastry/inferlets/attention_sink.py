"""Attention sinks (StreamingLLM, Xiao et al. 2024): generate for as long as you like with a
KV cache of bounded size, keeping the first tokens of the sequence in attention.

Models attend heavily to the first few tokens whatever they are (the "sinks"); a plain
sliding window that drops them degrades as soon as they leave it. StreamingLLM keeps the
``sink`` first tokens plus a window of the most recent ones::

    attends(i, j) = j <= i and (j < sink or j > i - window)

This is ``windowed-attention`` with 4 sink tokens by default; see
:mod:`pastry.inferlets.windowed_attention` for how pages are dropped and masked, and how
positions differ from StreamingLLM's. Args and result are the same::

    {"prompt": "...", "window": 256, "sink": 4, "model": null, "max_tokens": 64,
     "temperature": 0.0, "seed": null, "stop_at_eos": true}
    -> {"tokens": [...], "text": "...", "max_pages_held": n}
"""

from __future__ import annotations

import json

from pastry.inferlets.windowed_attention import DEFAULTS, generate
from pastry.sdk.args import options


async def main(args: list[str]) -> str:
    return json.dumps(await generate(options(args, {**DEFAULTS, "sink": 4}, prompt_keys=())))
