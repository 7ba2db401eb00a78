"""Grammar-constrained decoding on a :class:`Context`; the grammar lives on the host.

A grammar (a JSON schema, a Lark grammar, or a regular expression) is compiled by the host
with llguidance against the model's vocabulary (``create_constraint``); a
:class:`Constraint` is the handle. Each step ``sample(..., constraint=handle)`` samples
among the tokens the grammar allows (its mask applied on the device) and advances the
grammar with the sampled token, so a constrained step costs one ``sample`` call like an
unconstrained one and only the token id comes back. It works the same in trusted and
sandboxed inferlets: the inferlet itself needs no llguidance. Greedy or temperature
sampling (reproducible for a seed); an end-of-sequence token is allowed exactly when the
output is complete. Ids past the tokenizer's vocabulary (a model's padded rows) are never
allowed. ``generate(..., device_mask=False)`` keeps the older path that pulls the model's
whole distribution back each step and picks on the inferlet's side (for comparison:
``benchmarks/constrained.py``).

Tokens the grammar forces (e.g. ``{"name":`` of a JSON object with one required key) are
appended without sampling (fast-forward) and forwarded together with the next step.

    from pastry.sdk.grammar import Constraint, generate

    ctx = Context()
    ctx.fill("A person: ")
    with Constraint(ctx, {"json_schema": schema}) as c:
        out = await generate(ctx, c, max_tokens=64)
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Mapping
from typing import Any, NamedTuple

from pastry.api import ApiError
from pastry.sdk.context import Context
from pastry.sdk.steps import next_dist, sample_next


def grammar_text(grammar: Mapping[str, Any] | str) -> str:
    """The JSON text ``create_constraint`` takes: ``{"json_schema": ...}``, ``{"regex":
    ...}`` or ``{"lark": ...}`` (a string is a Lark grammar)."""
    if isinstance(grammar, str):
        grammar = {"lark": grammar}
    if not isinstance(grammar, Mapping):
        raise ValueError(
            "grammar must be one of {'json_schema': {...}}, {'lark': '...'}, {'regex': '...'}; "
            f"got {grammar!r:.200}"
        )
    return json.dumps(dict(grammar))


class Generated(NamedTuple):
    tokens: list[int]  # generated, without a final end-of-sequence token
    complete: bool  # the output is a word of the grammar
    forwards: int  # forward calls (fewer than tokens when forced tokens were fast-forwarded)


class Constraint:
    """One grammar for one output on ``ctx``'s model (make a new one per output), held by
    the host. ``handle`` goes to ``sample(..., constraint=)``; ``forced()`` are the tokens
    that must come next, ``consume(tokens)`` advances the grammar past tokens appended
    without sampling; ``free()`` (or ``with``) gives the handle back: an instance may hold
    only a limited number at once."""

    def __init__(self, ctx: Context, grammar: Mapping[str, Any] | str) -> None:
        self.api, self.queue = ctx.api, ctx.queue
        self.handle: int | None = self.api.create_constraint(ctx.queue, grammar_text(grammar))
        self.n_vocab = self.api.get_vocab_size(ctx.queue)
        self._state: tuple[bool, bool, list[int]] | None = None

    def state(self) -> tuple[bool, bool, list[int]]:
        """(complete, done, forced tokens), asked of the host once per grammar position."""
        if self._state is None:
            self._state = self.api.constraint_state(self._live())
        return self._state

    @property
    def done(self) -> bool:
        """No token but end-of-sequence can follow (the output is complete or failed)."""
        return self.state()[1]

    @property
    def complete(self) -> bool:
        """The output so far is a word of the grammar."""
        return self.state()[0]

    def forced(self) -> list[int]:
        """Tokens the grammar forces next (possibly none)."""
        return list(self.state()[2])

    def bitmask(self) -> bytes:
        """The tokens the grammar allows next as a packed bitmask (bit ``t % 32`` of 32-bit
        word ``t // 32``), what ``sample``'s ``mask`` takes."""
        return self.api.constraint_mask(self._live())

    def allowed(self) -> list[bool]:
        """Over the model's output rows, whether the grammar allows each token next
        (end-of-sequence tokens exactly when the output is complete)."""
        bits = self.bitmask()
        return [bool(bits[t >> 3] >> (t & 7) & 1) for t in range(self.n_vocab)]

    def consume(self, tokens: list[int]) -> None:
        """Advance past ``tokens`` appended without a constrained ``sample``."""
        self._state = None
        self.api.constraint_consume(self._live(), list(tokens))

    def sampled(self) -> None:
        """A ``sample`` with this constraint completed: the host advanced the grammar."""
        self._state = None

    def free(self) -> None:
        if self.handle is not None:
            handle, self.handle = self.handle, None
            self.api.free_constraint(handle)

    def __enter__(self) -> Constraint:
        return self

    def __exit__(self, *exc) -> None:
        self.free()

    def _live(self) -> int:
        if self.handle is None:
            raise ApiError("this constraint was freed")
        return self.handle


async def generate(
    ctx: Context,
    constraint: Constraint,
    max_tokens: int = 256,
    temperature: float = 0.0,
    seed: int | None = None,
    fast_forward: bool = True,
    device_mask: bool = True,
) -> Generated:
    """Generate on ``ctx`` (which must have a pending token, e.g. a filled prompt) until the
    grammar ends or ``max_tokens``; the tokens stay in the context (a final end-of-sequence
    token is not added). Greedy at ``temperature`` 0, else sampled from the model's
    distribution at that temperature restricted to the allowed tokens, reproducibly for a
    given ``seed``. With ``fast_forward``, forced tokens are appended without a forward
    each. ``device_mask`` False pulls the whole distribution each step instead of masking
    on the device (slower; same greedy tokens)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
    if not (temperature >= 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature}")
    rng = random.Random(seed)
    eos = set(ctx.eos_ids)
    out: list[int] = []
    forwards = 0
    while len(out) < max_tokens:
        _, done, forced = constraint.state()
        if done:
            break
        forced = forced[: max_tokens - len(out)] if fast_forward else []
        if forced:
            constraint.consume(forced)
            ctx.fill_tokens(forced)
            out += forced
            continue
        if device_mask:
            step_seed = None if seed is None else _step_seed(seed, forwards)
            tok = await sample_next(
                ctx, temperature=temperature, seed=step_seed, constraint=constraint.handle
            )
            constraint.sampled()
        else:
            mask = constraint.bitmask()
            ids, probs = await next_dist(ctx, constraint.n_vocab)
            tok = _pick(ids, probs, mask, temperature, rng)
            constraint.consume([tok])
        forwards += 1
        if tok in eos:
            break
        ctx.fill_tokens([tok])
        out.append(tok)
    return Generated(out, constraint.complete, forwards)


async def sample_masked(
    ctx: Context, mask: bytes, temperature: float = 0.0, seed: int | None = None, **kw
) -> int:
    """Forward the pending tokens and sample the next one among those ``mask`` allows, on
    the device (one ``sample`` call; ``kw``: its other parameters, e.g. ``logit_bias``).
    Afterwards nothing is pending: append the token with ``ctx.fill_tokens``."""
    return await sample_next(ctx, temperature=temperature, seed=seed, mask=mask, **kw)


def _step_seed(seed: int, step: int) -> int:
    """A well-spread per-step seed, so that seeds s and s + 1 share no draws."""
    return (seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9) % (1 << 62)


def _pick(ids: list[int], probs: list[float], mask: bytes, temperature: float, rng) -> int:
    """The most likely allowed token, or one sampled at ``temperature`` among the allowed."""
    ok = [(t, p) for t, p in zip(ids, probs, strict=True) if mask[t >> 3] >> (t & 7) & 1]
    if not ok:
        raise RuntimeError("the grammar allows no token of the distribution")
    if temperature == 0:
        return ok[0][0]  # ids come by decreasing probability
    logits = [math.log(p) / temperature if p > 0 else -math.inf for _, p in ok]
    top = max(logits)
    if not math.isfinite(top):  # every allowed token underflowed to probability 0
        return ok[0][0]
    weights = [math.exp(x - top) for x in logits]
    return rng.choices([t for t, _ in ok], weights)[0]
