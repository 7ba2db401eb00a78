"""Watermarked generation and its detector (Kirchenbauer et al. 2023, "soft" watermark).

At each step, a key and the previous token pseudo-randomly split the vocabulary into a
*green* fraction ``gamma`` and a red rest; ``delta`` is added to the logits of green tokens
(their probability is multiplied by ``e ** delta`` and renormalised) and the token is
sampled in the inferlet from the ``top_k`` distribution of ``get_next_dist`` (seeded, so a
run is reproducible). The text reads the same to a person, but has far more green tokens
than the ``gamma`` fraction expected by chance.

Detection needs only the key and the tokens, not the model: count the green tokens ``G``
among the ``T`` scored ones (each token given the one before it) and compute the z-score
``(G - gamma T) / sqrt(T gamma (1 - gamma))``. Text written without the key has ``z`` of
about N(0, 1); a watermarked text of 64 tokens with ``gamma = 0.25, delta = 2`` has ``z``
near 8 when the model's distribution has high entropy (less when it is peaked: a token
the model is sure of is sampled whatever its colour).

Green lists come from a hash of (key, previous token, token), so testing a token is O(1)
and needs no vocabulary size.

Args (one JSON object), to generate::

    {"prompt": "text" or [ids]} or {"prompt_tokens": [ids]}, "model": null (the first),
    "max_tokens": 64, "gamma": 0.25, "delta": 2.0, "key": 15485863, "seed": 0,
    "temperature": 1.0, "top_k": 256, "stop_at_eos": true

or to detect (no model call)::

    {"detect": [token ids], "gamma": 0.25, "key": 15485863}

Result (JSON): generating, ``{"tokens": [generated ids], "text": "...", "z": z-score of
the generated tokens}``; detecting, ``{"z": z, "green": G, "scored": T}``.
"""

from __future__ import annotations

import json
import math
import random
from itertools import pairwise

from pastry.sdk import Context
from pastry.sdk.args import options, prompt_tokens
from pastry.sdk.steps import next_dist

DEFAULTS = {
    "model": None,
    "max_tokens": 64,
    "gamma": 0.25,
    "delta": 2.0,
    "key": 15485863,
    "seed": 0,
    "temperature": 1.0,
    "top_k": 256,
    "stop_at_eos": True,
    "detect": None,
}

_M64 = (1 << 64) - 1


def _mix(x: int) -> int:
    """SplitMix64's finaliser: a well-mixed 64-bit hash of a 64-bit integer."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def green_test(key: int, prev: int, gamma: float):
    """A function telling whether a token is green after ``prev`` (P = ``gamma`` each)."""
    seed = _mix((key & _M64) ^ _mix(prev))
    bound = int(gamma * 2**64)
    return lambda token: _mix(seed ^ token) < bound


def detect(tokens: list[int], key: int, gamma: float) -> dict:
    """Score each token after the first given the one before it: green count and z-score."""
    scored = len(tokens) - 1
    if scored < 1:
        raise ValueError("detection needs at least two tokens")
    green = sum(green_test(key, prev, gamma)(tok) for prev, tok in pairwise(tokens))
    z = (green - gamma * scored) / math.sqrt(scored * gamma * (1 - gamma))
    return {"z": z, "green": green, "scored": scored}


def choose(ids: list[int], probs: list[float], prev: int, opts: dict, rng: random.Random) -> int:
    """Sample from ``p ** (1 / temperature)``, green tokens weighted by ``e ** delta``."""
    is_green = green_test(opts["key"], prev, opts["gamma"])
    boost = math.exp(opts["delta"])
    weights = [
        p ** (1 / opts["temperature"]) * (boost if is_green(t) else 1.0)
        for t, p in zip(ids, probs, strict=True)
    ]
    return rng.choices(ids, weights)[0]


async def main(args: list[str]) -> str:
    opts = options(args, DEFAULTS)
    if not 0 < opts["gamma"] < 1:
        raise ValueError(f"gamma must be in (0, 1), got {opts['gamma']}")
    if opts["detect"] is not None:
        return json.dumps(detect([int(t) for t in opts["detect"]], opts["key"], opts["gamma"]))
    if opts["temperature"] <= 0:
        raise ValueError(f"temperature must be > 0, got {opts['temperature']}")
    rng = random.Random(opts["seed"])
    async with Context(opts["model"]) as ctx:
        ctx.fill_tokens(prompt_tokens(ctx, opts))
        eos = set(ctx.eos_ids) if opts["stop_at_eos"] else set()
        out: list[int] = []
        while len(out) < opts["max_tokens"]:
            ids, probs = await next_dist(ctx, opts["top_k"])
            tok = choose(ids, probs, ctx.tokens[-1], opts, rng)
            if tok in eos:
                break
            ctx.fill_tokens([tok])
            out.append(tok)
        result = {"tokens": out, "text": ctx.api.detokenize(ctx.queue, out)}
        if len(out) >= 2:
            result["z"] = detect(out, opts["key"], opts["gamma"])["z"]
        return json.dumps(result)
