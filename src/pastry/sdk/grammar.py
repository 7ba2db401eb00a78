"""Grammar-constrained decoding on a :class:`Context`, with llguidance.

A grammar (a JSON schema, a Lark grammar, or a regular expression) is compiled by
llguidance against the model's vocabulary, read through the API (``get_vocabs``,
``get_eos_token_ids``, ``get_vocab_size``). Every step, the grammar's matcher gives the set
of tokens that keep the output a prefix of some word of the grammar, as llguidance's packed
bitmask; ``sample`` applies it on the device (``mask``), so a constrained step costs one
``sample`` call like an unconstrained one and only the token id comes back. Greedy or
temperature sampling (reproducible for a seed); an end-of-sequence token is allowed exactly
when the output is complete. Ids past the tokenizer's vocabulary (a model's padded rows)
are never allowed. ``generate(..., device_mask=False)`` keeps the older path that pulls the
model's whole distribution back each step and picks on the host (for comparison:
``benchmarks/constrained.py``).

Tokens the grammar forces (e.g. ``{"name":`` of a JSON object with one required key) are
appended without sampling (fast-forward) and forwarded together with the next step.

    from pastry.sdk.grammar import Constraint, generate

    ctx = Context()
    ctx.fill("A person: ")
    out = await generate(ctx, Constraint(ctx, {"json_schema": schema}), max_tokens=64)
"""

from __future__ import annotations

import json
import math
import re
import weakref
from collections.abc import Mapping
from functools import lru_cache
from typing import Any, NamedTuple

import numpy as np

from pastry.sdk import api
from pastry.sdk.context import Context
from pastry.sdk.steps import next_dist, sample_next

# JSON output without optional whitespace unless the schema's "x-guidance" asks for it:
# a random or weak model otherwise tends to emit whitespace forever.
JSON_DEFAULTS = {"whitespace_flexible": False}
# Added tokens spelled like ``<|endoftext|>`` are matched as special tokens, not as text.
_SPECIAL = re.compile(rb"<\|[^|]*\|>")


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise ImportError(
            "grammar-constrained decoding needs llguidance: pip install 'llguidance>=1.9,<2'"
        ) from None
    return llguidance


def compile_grammar(spec: Mapping[str, Any] | str) -> str:
    """An llguidance grammar from ``{"json_schema": {...}}``, ``{"lark": "..."}`` or
    ``{"regex": "..."}`` (a string is a Lark grammar). Raises ``ValueError`` naming the
    problem for an unknown kind or an invalid grammar."""
    llg = _llguidance()
    if isinstance(spec, str):
        spec = {"lark": spec}
    kinds = ("json_schema", "lark", "regex")
    if not isinstance(spec, Mapping) or len(spec) != 1 or next(iter(spec)) not in kinds:
        raise ValueError(
            f"grammar must be one of {{'json_schema': {{...}}}}, {{'lark': '...'}}, "
            f"{{'regex': '...'}}; got {spec!r}"
        )
    ((kind, body),) = spec.items()
    if kind == "json_schema":
        if isinstance(body, str):
            body = json.loads(body)
        if not isinstance(body, dict):
            raise ValueError(f"json_schema must be a JSON object, got {body!r}")
        grammar = llg.LLMatcher.grammar_from_json_schema(body, defaults=JSON_DEFAULTS)
    elif not isinstance(body, str):
        raise ValueError(f"{kind} must be a string, got {body!r}")
    elif kind == "lark":
        grammar = llg.LLMatcher.grammar_from_lark(body)
    else:
        grammar = llg.LLMatcher.grammar_from_regex(body)
    error = llg.LLMatcher.validate_grammar(grammar)
    if error:
        raise ValueError(f"invalid {kind} grammar: {error}")
    return grammar


class _Vocab:
    """What llguidance's ``TokenizerWrapper`` reads: the bytes of every id, the special ids,
    and an encoder. llguidance encodes text (to fast-forward forced bytes) on the caller's
    thread, so the encoder tokenizes through the API of the inferlet instance that calls,
    and one cached tokenizer serves every instance."""

    def __init__(self, model: str, tokens: list[bytes], eos: list[int]) -> None:
        self.model = model
        self.tokens = tokens
        self.eos_token_id = eos[0]
        self.bos_token_id = None
        specials = (i for i, b in enumerate(tokens) if _SPECIAL.fullmatch(b))
        self.special_token_ids = sorted({*eos, *specials})

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):  # so that llguidance hands over str, never bytes
            raise TypeError("pass text as str")
        a = api()
        queues = _queues.setdefault(a, {})
        if self.model not in queues:
            queues[self.model] = a.create_queue(self.model)
        return a.tokenize(queues[self.model], text)


# A queue per instance and model for the encoder's tokenize calls.
_queues: weakref.WeakKeyDictionary[object, dict[str, int]] = weakref.WeakKeyDictionary()


@lru_cache(maxsize=8)
def _tokenizer(model: str, tokens: tuple[bytes, ...], eos: tuple[int, ...]):
    llg = _llguidance()
    wrapper = llg.TokenizerWrapper(_Vocab(model, list(tokens), list(eos)))
    return llg.LLTokenizer(wrapper, n_vocab=len(tokens), eos_token=list(eos))


def ll_tokenizer(ctx: Context):
    """llguidance's tokenizer for the context's model, over the model's output rows: the
    tokenizer's bytes for each id, ``b""`` (never allowed) for padded rows. Cached per
    model and vocabulary (building one for a large vocabulary takes about a second)."""
    a, q = ctx.api, ctx.queue
    rows = a.get_vocab_size(q)
    tokens = tuple(a.get_vocabs(q))[:rows]  # ids past the model's rows cannot come out
    eos = tuple(a.get_eos_token_ids(q))
    if not eos:
        raise ValueError(f"model {ctx.model!r} names no end-of-sequence token")
    return _tokenizer(ctx.model, tokens + (b"",) * (rows - len(tokens)), eos)


class Generated(NamedTuple):
    tokens: list[int]  # generated, without a final end-of-sequence token
    complete: bool  # the output is a word of the grammar
    forwards: int  # forward calls (fewer than tokens when forced tokens were fast-forwarded)


class Constraint:
    """One grammar's matcher for one output on ``ctx``'s model (build a new one per output).

    ``allowed()`` is the mask of tokens that may come next (over the model's output rows),
    ``forced()`` the tokens that must come next, ``consume(tokens)`` advances the grammar.
    """

    def __init__(self, ctx: Context, grammar: Mapping[str, Any] | str) -> None:
        llg = _llguidance()
        self.tokenizer = ll_tokenizer(ctx)
        self.n_vocab = self.tokenizer.vocab_size
        self.matcher = llg.LLMatcher(self.tokenizer, compile_grammar(grammar), log_level=0)
        self._check()

    @property
    def done(self) -> bool:
        """No token but end-of-sequence can follow (the output is complete or failed)."""
        return self.matcher.is_stopped()

    @property
    def complete(self) -> bool:
        """The output so far is a word of the grammar."""
        return self.matcher.is_accepting()

    def bitmask(self) -> bytes:
        """The tokens the grammar allows next as llguidance's packed bitmask (bit ``t % 32``
        of 32-bit word ``t // 32``), what ``sample``'s ``mask`` takes."""
        bits = self.matcher.compute_bitmask()
        self._check()
        return bytes(bits)

    def allowed(self) -> np.ndarray:
        """Boolean mask over the model's output rows of the tokens the grammar allows next
        (end-of-sequence tokens exactly when the output is complete)."""
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        self._check()
        return np.unpackbits(bits, bitorder="little")[: self.n_vocab].astype(bool)

    def forced(self) -> list[int]:
        """Tokens the grammar forces next (possibly none)."""
        return self.matcher.compute_ff_tokens()

    def consume(self, tokens: list[int]) -> None:
        self.matcher.consume_tokens(tokens)
        self._check()

    def _check(self) -> None:
        if self.matcher.is_error():
            raise ValueError(f"grammar error: {self.matcher.get_error()}")


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
    rng = np.random.default_rng(seed)
    eos = set(ctx.eos_ids)
    out: list[int] = []
    forwards = 0
    while len(out) < max_tokens and not constraint.done:
        forced = constraint.forced()[: max_tokens - len(out)] if fast_forward else []
        if forced:
            constraint.consume(forced)
            ctx.fill_tokens(forced)
            out += forced
            continue
        if device_mask:
            step_seed = None if seed is None else _step_seed(seed, forwards)
            tok = await sample_masked(ctx, constraint.bitmask(), temperature, step_seed)
        else:
            allowed = constraint.allowed()
            ids, probs = await next_dist(ctx, constraint.n_vocab)
            tok = _pick(ids, probs, allowed, temperature, rng)
        forwards += 1
        constraint.consume([tok])
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


def _pick(ids: list[int], probs: list[float], allowed: np.ndarray, temperature: float, rng) -> int:
    """The most likely allowed token, or one sampled at ``temperature`` among the allowed."""
    ids_a = np.asarray(ids)
    ok = allowed[ids_a]
    if not ok.any():
        raise RuntimeError("the grammar allows no token of the distribution")
    ids_a, p = ids_a[ok], np.asarray(probs, dtype=np.float64)[ok]
    if temperature == 0:
        return int(ids_a[0])  # ids come by decreasing probability
    with np.errstate(divide="ignore"):
        logits = np.log(p) / temperature
    top = logits.max()
    if not math.isfinite(top):  # every allowed token underflowed to probability 0
        return int(ids_a[0])
    w = np.exp(logits - top)
    return int(rng.choice(ids_a, p=w / w.sum()))
