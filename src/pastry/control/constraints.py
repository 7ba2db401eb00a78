"""Grammar constraints held by the host: llguidance matchers behind per-instance handles.

An inferlet creates a constraint from a grammar spec (``create_constraint``); the host
compiles it with llguidance against the model's vocabulary and keeps the matcher. A
``sample(..., constraint=c)`` call takes the matcher's token mask at submission (applied on
the device like any ``mask``) and, when the token comes back, advances the matcher with
it: a constrained step costs the inferlet one ``sample`` call, as an unconstrained one
does, and the inferlet itself needs no llguidance (a sandboxed one has none). The
inferlet queries the state between steps (complete, stopped, tokens the grammar forces,
for fast-forwarding) and may advance it itself (``constraint_consume``).

Host memory is bounded per instance: at most ``max_constraints`` live handles (a
:class:`~pastry.control.session.Session` field; the sandbox sets it from its limits), a
grammar spec of at most :data:`MAX_GRAMMAR_BYTES`, and llguidance's parser limits
(:func:`parser_limits`: lexer states, grammar size, per-step work) on every matcher.

Compiling is the expensive part (a 5000-property JSON schema: ~1 s to compile, ~1 s more
to build its matcher; a model's llguidance tokenizer: ~0.8 s), and ``create_constraint``
runs on the event loop. So compiled grammars and fresh matchers are cached, process-wide
and bounded (:data:`COMPILED_CACHE_BYTES`, :data:`MATCHER_CACHE_SIZE`): an endpoint that
takes a grammar in a request calls :func:`prepare` in its worker thread, and the
inferlet that serves the request gets a copy of the matcher made there
(``LLMatcher.deep_copy``, microseconds). All of it is thread-safe.
"""

from __future__ import annotations

import json
import re
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from pastry.api import ApiError
from pastry.wire.calls import mask_words
from pastry.wire.tokenizer import Tokenizer

MAX_CONSTRAINTS = 64
"""Live constraint handles one instance may hold, unless its runner sets another limit."""
MAX_GRAMMAR_BYTES = 1 << 20
"""The largest grammar spec (its JSON text) ``create_constraint`` takes."""
# Added tokens spelled like ``<|endoftext|>`` are matched as special tokens, not as text.
_SPECIAL = re.compile(rb"<\|[^|]*\|>")
# JSON output without optional whitespace unless the schema's "x-guidance" asks for it:
# a random or weak model otherwise tends to emit whitespace forever.
JSON_DEFAULTS = {"whitespace_flexible": False}
KINDS = ("json_schema", "lark", "regex")


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise ImportError(
            "grammar-constrained decoding needs llguidance: pip install 'llguidance>=1.9,<2'"
        ) from None
    return llguidance


COMPILED_CACHE_BYTES = 32 << 20
"""Characters of compiled grammars (and of their specs) kept for reuse, least recently
used first out."""
MATCHER_CACHE_SIZE = 32
"""Fresh matchers kept per model vocabulary for copying, least recently used first out."""

_lock = threading.Lock()  # the caches below; builds run outside it, once per key
_compiled: OrderedDict[str, tuple[str | None, str | None, int]] = OrderedDict()
_compiled_chars = 0
_building: dict[Any, threading.Event] = {}


def compile_grammar(spec: Mapping[str, Any] | str) -> str:
    """An llguidance grammar from ``{"json_schema": {...}}``, ``{"lark": "..."}`` or
    ``{"regex": "..."}`` (a string is a Lark grammar). Raises ``ValueError`` naming the
    problem for an unknown kind, an invalid grammar, or one over the size limits (its spec
    over :data:`MAX_GRAMMAR_BYTES` as JSON text, refused before compiling; llguidance's
    :func:`parser_limits`). Cached (failures too): the same spec is compiled once."""
    global _compiled_chars
    try:
        key = json.dumps(spec, ensure_ascii=False)
    except (TypeError, ValueError):
        return _compile(spec)  # not JSON data: _compile says what is wrong with it
    if len(key) > MAX_GRAMMAR_BYTES and len(key.encode()) > MAX_GRAMMAR_BYTES:
        raise ValueError(
            f"the grammar spec has {len(key.encode())} bytes; the limit is {MAX_GRAMMAR_BYTES}"
        )

    def lookup():
        found = _compiled.get(key)
        if found is not None:
            _compiled.move_to_end(key)
        return found

    hit = _once(("compile", key), lookup)
    if hit is None:
        try:
            try:
                grammar, error = _compile(spec), None
            except ValueError as e:
                grammar, error = None, str(e)
            size = len(key) + len(grammar or error or "")
            with _lock:
                _compiled[key] = hit = (grammar, error, size)
                _compiled_chars += size
                while _compiled_chars > COMPILED_CACHE_BYTES and len(_compiled) > 1:
                    _compiled_chars -= _compiled.popitem(last=False)[1][2]
        finally:
            _done(("compile", key))
    grammar, error, _ = hit
    if error is not None:
        raise ValueError(error)
    assert grammar is not None
    return grammar


def _once(key: Any, lookup):
    """``lookup()`` under the lock, or None when the caller must build the value: the first
    caller for ``key`` builds (and calls :func:`_done`), later ones wait for it."""
    while True:
        with _lock:
            hit = lookup()
            if hit is not None:
                return hit
            event = _building.get(key)
            if event is None:
                _building[key] = threading.Event()
                return None
        event.wait()


def _done(key: Any) -> None:
    with _lock:
        event = _building.pop(key, None)
    if event is not None:
        event.set()


def _compile(spec: Mapping[str, Any] | str) -> str:
    llg = _llguidance()
    if isinstance(spec, str):
        spec = {"lark": spec}
    if not isinstance(spec, Mapping) or len(spec) != 1 or next(iter(spec)) not in KINDS:
        raise ValueError(
            f"grammar must be one of {{'json_schema': {{...}}}}, {{'lark': '...'}}, "
            f"{{'regex': '...'}}; got {spec!r:.200}"
        )
    ((kind, body),) = spec.items()
    if kind == "json_schema":
        if isinstance(body, str):
            try:
                body = json.loads(body)
            except ValueError as e:
                raise ValueError(f"json_schema is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise ValueError(f"json_schema must be a JSON object, got {body!r:.200}")
        grammar = llg.LLMatcher.grammar_from_json_schema(body, defaults=JSON_DEFAULTS)
    elif not isinstance(body, str):
        raise ValueError(f"{kind} must be a string, got {body!r:.200}")
    elif kind == "lark":
        grammar = llg.LLMatcher.grammar_from_lark(body)
    else:
        grammar = llg.LLMatcher.grammar_from_regex(body)
    error = llg.LLMatcher.validate_grammar(grammar, limits=parser_limits())
    if error:
        raise ValueError(f"invalid {kind} grammar: {error}")
    return grammar


def parser_limits():
    """llguidance's limits for host matchers: its defaults, but at most 20 000 lexer states
    (about 1-2 kB each; the default 250 000 would let one grammar take ~500 MB)."""
    return _llguidance().LLParserLimits(max_lexer_states=20_000, max_grammar_size=200_000)


@dataclass
class MaskStats:
    """Process-wide counters of the host's mask computations (for benchmarks)."""

    masks: int = 0
    ns: int = 0


STATS = MaskStats()


class _Vocab:
    """What llguidance's ``TokenizerWrapper`` reads from a model's tokenizer."""

    def __init__(self, tokenizer: Tokenizer, tokens: list[bytes], eos: list[int]) -> None:
        self._encode = tokenizer.encode
        self.tokens = tokens
        self.eos_token_id = eos[0]
        self.bos_token_id = None
        specials = (i for i, b in enumerate(tokens) if _SPECIAL.fullmatch(b))
        self.special_token_ids = sorted({*eos, *specials})

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):  # so that llguidance hands over str, never bytes
            raise TypeError("pass text as str")
        return self._encode(text)


class _Vocabulary:
    """A model vocabulary's llguidance tokenizer and the fresh matchers made over it."""

    def __init__(self, lltok) -> None:
        self.lltok = lltok
        self.matchers: OrderedDict[str, Any] = OrderedDict()  # grammar -> fresh LLMatcher


_tokenizers: weakref.WeakKeyDictionary[Tokenizer, dict] = weakref.WeakKeyDictionary()


def _vocabulary(tokenizer: Tokenizer, rows: int, eos: tuple[int, ...]) -> _Vocabulary:
    llguidance = _llguidance()
    if not eos:
        raise ApiError("the model names no end-of-sequence token: grammars need one")
    key = (rows, tuple(eos))
    build = ("vocab", id(tokenizer), key)
    hit = _once(build, lambda: _tokenizers.get(tokenizer, {}).get(key))
    if hit is None:
        try:
            tokens = tokenizer.get_vocabs()[:rows]
            tokens += [b""] * (rows - len(tokens))
            wrapper = llguidance.TokenizerWrapper(_Vocab(tokenizer, tokens, list(eos)))
            hit = _Vocabulary(llguidance.LLTokenizer(wrapper, n_vocab=rows, eos_token=list(eos)))
            with _lock:
                _tokenizers.setdefault(tokenizer, {})[key] = hit
        finally:
            _done(build)
    return hit


def ll_tokenizer(tokenizer: Tokenizer, rows: int, eos: tuple[int, ...]):
    """llguidance's tokenizer over a model's ``rows`` output rows: the tokenizer's bytes
    for each id, ``b""`` (never allowed) for padded rows. Built once per tokenizer, rows
    and end tokens (about a second for a large vocabulary)."""
    return _vocabulary(tokenizer, rows, eos).lltok


def new_matcher(
    tokenizer: Tokenizer, rows: int, eos: tuple[int, ...], spec: Mapping[str, Any] | str
):
    """A fresh llguidance matcher for grammar ``spec`` over the model's vocabulary: a copy
    of a cached one when this grammar was seen (:func:`prepare`), else compiled here.
    ``ValueError`` for a bad grammar."""
    return _fresh(tokenizer, rows, eos, spec).deep_copy()


def prepare(
    tokenizer: Tokenizer, rows: int, eos: tuple[int, ...], spec: Mapping[str, Any] | str
) -> None:
    """Compile ``spec`` and make its matcher over the model's vocabulary, for a later
    ``create_constraint`` to copy: call it from a worker thread where a request hands the
    server a grammar, so that the event loop never compiles one. ``ValueError`` for a bad
    grammar (the request's 400); ``ApiError`` when the model cannot take grammars."""
    _fresh(tokenizer, rows, eos, spec)


def _fresh(tokenizer: Tokenizer, rows: int, eos: tuple[int, ...], spec: Mapping[str, Any] | str):
    grammar = compile_grammar(spec)
    vocab = _vocabulary(tokenizer, rows, eos)

    def lookup():
        m = vocab.matchers.get(grammar)
        if m is not None:
            vocab.matchers.move_to_end(grammar)
        return m

    build = ("matcher", id(vocab), grammar)
    matcher = _once(build, lookup)
    if matcher is None:
        try:
            matcher = _llguidance().LLMatcher(
                vocab.lltok, grammar, log_level=0, limits=parser_limits()
            )
            if matcher.is_error():
                raise ValueError(f"invalid grammar: {matcher.get_error()}")
            with _lock:
                vocab.matchers[grammar] = matcher
                while len(vocab.matchers) > MATCHER_CACHE_SIZE:
                    vocab.matchers.popitem(last=False)
        finally:
            _done(build)
    return matcher


def parse_spec(grammar: str) -> dict:
    """The grammar spec of ``create_constraint``: JSON text of ``{"json_schema": ...}``,
    ``{"regex": "..."}`` or ``{"lark": "..."}``."""
    if not isinstance(grammar, str):
        raise ApiError(f"a grammar spec is JSON text, got {type(grammar).__name__}")
    if len(grammar.encode()) > MAX_GRAMMAR_BYTES:
        raise ApiError(
            f"the grammar spec has {len(grammar.encode())} bytes; the limit is {MAX_GRAMMAR_BYTES}"
        )
    try:
        spec = json.loads(grammar)
    except ValueError as e:
        raise ApiError(
            f'a grammar spec is JSON text like {{"regex": "[0-9]+"}}; this is not JSON ({e})'
        ) from None
    return spec


class HostConstraint:
    """One grammar's matcher for one output of one instance (see the module docstring)."""

    def __init__(self, tokenizer: Tokenizer, rows: int, eos: tuple[int, ...], grammar: str):
        spec = parse_spec(grammar)
        try:
            self.matcher = new_matcher(tokenizer, rows, eos, spec)
        except ValueError as e:
            raise ApiError(str(e)) from None
        self.rows = rows
        self.words = mask_words(rows)
        self.busy = False  # a sample with this constraint is in flight
        self._check()

    def state(self) -> tuple[bool, bool, list[int]]:
        """(the output so far is a word of the grammar, nothing but end-of-sequence can
        follow, the tokens the grammar forces next)."""
        self._check()
        forced = [] if self.matcher.is_stopped() else self.matcher.compute_ff_tokens()
        self._check()
        return self.matcher.is_accepting(), self.matcher.is_stopped(), forced

    def mask(self) -> np.ndarray:
        """The tokens allowed next as int32 bitmask words (bit ``t % 32`` of word
        ``t // 32``), what ``Sample.mask`` takes."""
        self._check()
        t0 = time.perf_counter_ns()
        bits = self.matcher.compute_bitmask()
        STATS.ns += time.perf_counter_ns() - t0
        STATS.masks += 1
        self._check()
        return np.frombuffer(bits, dtype="<i4")[: self.words].astype(np.int32)

    def consume(self, tokens: list[int]) -> None:
        self._check()
        for t in tokens:
            if not isinstance(t, int) or not 0 <= t < self.rows:
                raise ApiError(f"token {t!r} is not a token id (0 to {self.rows - 1})")
        self.matcher.consume_tokens(tokens)
        self._check()

    def advance(self, token: int) -> None:
        """Consume a sampled token; never raises (a failure is the matcher's error state,
        reported by the next use)."""
        self.matcher.consume_tokens([token])

    def _check(self) -> None:
        if self.matcher.is_error():
            raise ApiError(f"grammar error: {self.matcher.get_error()}")
