"""The inferlet API: one language-neutral interface, implemented by the host.

Every function takes and returns only integers (handles are integers local to the calling
inferlet), floats, booleans, strings, bytes, lists and tuples of these, or ``None`` — so
the same surface can be bound into a Wasm guest (a WIT file later) or any other language.
Functions marked *queued* take a command queue ``q``, are executed in queue order by the
batch scheduler, and return an awaitable that resolves when the call has run; they are
submitted when called, so several queued calls can be issued before awaiting the last
(that is what lets embed, forward and sample of one step share one engine batch).

This module is the contract. ``pastry.control.session.Session`` implements it for
trusted inferlets; ``tests/test_api.py`` checks that every function here exists there with
the same parameters. The traits (groups of functions a model implements) are listed in
:data:`TRAITS`.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Protocol


class ApiError(ValueError):
    """An inferlet misused the API (a foreign or freed handle, a bad argument); raised in
    that inferlet only, with a message naming the bad value."""


TRAITS: dict[str, tuple[str, ...]] = {
    "allocate": (
        "get_kv_page_size",
        "alloc_kvpages",
        "dealloc_kvpages",
        "alloc_embeds",
        "dealloc_embeds",
        "copy_kvpage",
        "export_kvpages",
        "import_kvpages",
        "unexport_kvpages",
        "list_exported_kvpages",
    ),
    "forward": ("forward", "mask_kvpage"),
    "forward_with_adapter": ("forward_with_adapter", "get_adapters"),
    "input_text": ("embed_txt", "prefill"),
    "tokenize": (
        "tokenize",
        "detokenize",
        "get_vocabs",
        "get_eos_token_ids",
        "get_vocab_size",
        "apply_chat_template",
    ),
    "output_text": ("get_next_dist", "sample", "step"),
    "multi_engine": (
        "available_engines",
        "get_queue_engine",
        "get_engine_load",
        "route",
        "prep_recv",
        "remote_send",
        "start_generate",
        "next_request",
        "reject_request",
    ),
}


class InferletApi(Protocol):
    # ------------------------------------------------------------------ runtime
    def get_arguments(self) -> list[str]:
        """Arguments the client passed at launch."""

    def get_instance_id(self) -> int: ...

    def get_version(self) -> str:
        """Version of this API."""

    def send(self, message: str) -> None:
        """Send a message to the client that launched the inferlet."""

    async def receive(self) -> str:
        """The next message from the client."""

    def available_models(self) -> list[str]: ...

    def available_traits(self, model: str) -> list[str]: ...

    def create_queue(self, model: str, engine: int = -1) -> int:
        """A new command queue on ``model``; calls on different queues are independent.
        ``engine``: the rank of the engine it runs on (-1: the first, or where ``route``
        places it)."""

    def synchronize(self, q: int) -> Awaitable[None]:
        """Queued: resolves when every call queued on ``q`` before it has completed."""

    def set_queue_priority(self, q: int, priority: int) -> None:
        """Higher-priority queues are batched first (default 0)."""

    def close_queue(self, q: int) -> None:
        """Drop a queue (its pending calls fail); resources stay with the inferlet."""

    # ------------------------------------------------------------------ allocate
    def get_kv_page_size(self, q: int) -> int: ...

    def alloc_kvpages(self, q: int, n: int) -> list[int]:
        """``n`` new KV page handles (immediate)."""

    def dealloc_kvpages(self, q: int, pages: list[int]) -> Awaitable[None]:
        """Queued: free pages once the calls queued before have run."""

    def alloc_embeds(self, q: int, n: int) -> list[int]: ...

    def dealloc_embeds(self, q: int, embeds: list[int]) -> Awaitable[None]: ...

    def copy_kvpage(
        self, q: int, src: int, dst: int, src_offset: int, dst_offset: int, size: int
    ) -> Awaitable[None]:
        """Queued: copy ``size`` tokens of K/V (token level) from ``src`` to ``dst``."""

    def export_kvpages(
        self, q: int, pages: list[int], name: str, persistent: bool = False
    ) -> Awaitable[None]:
        """Queued: publish pages under ``name`` (shared by reference count) in this user's
        namespace; a persistent export outlives this inferlet until unexported (or reclaimed
        when memory is short). ``~OWNER/NAME`` names another user's export, which
        ``import_kvpages`` may read where the owner granted it (``docs/security.md``)."""

    def import_kvpages(self, q: int, name: str) -> list[int]:
        """New handles to the pages exported as ``name``."""

    def unexport_kvpages(self, q: int, name: str) -> None: ...

    def list_exported_kvpages(self, q: int) -> list[tuple[str, int]]:
        """(name, number of pages) of every export of this user."""

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        q: int,
        in_kv: list[int],
        in_kv_last_len: int,
        in_embeds: list[int],
        out_kv: list[int],
        out_kv_offset: int,
        out_embeds: list[int],
        mask: list[list[bool]] | None = None,
        logprob_targets: list[int] | None = None,
        logprob_top: int = 0,
    ) -> Awaitable[tuple[list[float], list[list[int]], list[list[float]]] | None]:
        """Queued: the model over ``in_embeds`` (positions stored with them by
        ``embed_txt``) on top of the context in ``in_kv`` (all tokens of every page, of the
        last only ``in_kv_last_len``). New K/V go to ``out_kv`` from slot
        ``out_kv_offset``; ``out_embeds`` receive the outputs of the last
        ``len(out_embeds)`` inputs. ``mask``: one row per input over context + inputs,
        True = attend (default: all context, causal among inputs). Leaving a page out of
        ``in_kv`` masks its tokens.

        Prompt log-probabilities: with ``logprob_targets`` (one token id per input, -1 for
        none; to score a prompt, each input's next token), resolves to ``(logprobs,
        top_ids, top_logprobs)``: per input the target's log-probability under the model
        (NaN for -1) and the ``logprob_top`` (at most 20) most likely tokens with theirs."""

    def forward_with_adapter(
        self,
        q: int,
        adapter: str,
        in_kv: list[int],
        in_kv_last_len: int,
        in_embeds: list[int],
        out_kv: list[int],
        out_kv_offset: int,
        out_embeds: list[int],
        mask: list[list[bool]] | None = None,
        logprob_targets: list[int] | None = None,
        logprob_top: int = 0,
    ) -> Awaitable[tuple[list[float], list[list[int]], list[list[float]]] | None]:
        """Queued: ``forward`` with the LoRA adapter named ``adapter`` applied."""

    def get_adapters(self, q: int) -> list[str]:
        """Names of the LoRA adapters loaded on the queue's model."""

    def mask_kvpage(self, q: int, page: int, mask: list[bool]) -> Awaitable[None]:
        """Queued: ``mask[i]`` True makes token ``i`` of ``page`` not attendable."""

    def prefill(
        self,
        q: int,
        tokens: list[int],
        kv_len: int,
        pages: list[int],
        out_embeds: list[int],
        reserve: int = 0,
    ) -> tuple[list[int], Awaitable[int]]:
        """Queued: the K/V of text through the automatic prefix cache (RadixAttention).

        ``tokens`` is the whole sequence, from position 0; ``pages`` (in order) hold the
        K/V of its first ``kv_len`` tokens. Returns, at once, new page handles for the page
        indices after ``pages``, enough for ``len(tokens) + reserve`` tokens (``reserve``:
        room for tokens to come, e.g. the generation budget, taken with the prompt so that
        a program admitted under memory pressure can finish), and an awaitable of how many
        of the new tokens came from the cache. When the call
        is admitted (it may wait for KV pages), the longest cached prefix of ``tokens``
        that starts at a page boundary of the context fills new pages (full pages shared
        by reference, the slots of a partial one copied) and the rest is embedded and
        forwarded; ``out_embeds`` receive the outputs of the last ``len(out_embeds)``
        tokens (always computed). The pages then hold what ``embed_txt`` + ``forward``
        would write. A page shared through the cache is read-only while another inferlet
        uses it: writing it (``forward`` into it, ``mask_kvpage``, ``copy_kvpage`` onto
        it) raises ``ApiError``; copy it into a page of your own first."""

    # ------------------------------------------------------------------ input text, tokenize
    def embed_txt(
        self, q: int, tokens: list[int], positions: list[int], embeds: list[int]
    ) -> Awaitable[None]:
        """Queued: embed ``tokens`` at ``positions`` into ``embeds``."""

    def tokenize(self, q: int, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``. ``add_special_tokens``: as the start of a sequence, with
        the special tokens the model's tokenizer adds there (a BOS for models that want one,
        e.g. Llama; none for SmolLM2 or Qwen). ``Context.fill`` sets it on an empty context."""

    def detokenize(self, q: int, tokens: list[int]) -> str: ...

    def get_vocabs(self, q: int) -> list[bytes]:
        """The bytes of every token id."""

    def get_eos_token_ids(self, q: int) -> list[int]: ...

    def get_vocab_size(self, q: int) -> int:
        """Rows of the model's output distribution (may exceed the tokenizer's vocabulary)."""

    def apply_chat_template(
        self, q: int, messages: list[tuple[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """Render (role, content) messages with the model's chat template."""

    # ------------------------------------------------------------------ output
    def get_next_dist(
        self,
        q: int,
        embed: int,
        k: int = 256,
        mask: bytes | None = None,
        logit_bias: list[tuple[int, float]] | None = None,
        penalty_tokens: list[int] | None = None,
        penalty_prompt: list[int] | None = None,
        repetition_penalty: float = 1.0,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
    ) -> Awaitable[tuple[list[int], list[float]]]:
        """Queued: the top-``k`` next-token distribution at ``embed`` (ids, probabilities),
        after the logit processing described at ``sample`` (forbidden tokens: probability
        0)."""

    def sample(
        self,
        q: int,
        embed: int,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        min_p: float = 0.0,
        seed: int | None = None,
        mask: bytes | None = None,
        logit_bias: list[tuple[int, float]] | None = None,
        penalty_tokens: list[int] | None = None,
        penalty_prompt: list[int] | None = None,
        repetition_penalty: float = 1.0,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        logprobs: int | None = None,
        constraint: int | None = None,
    ) -> Awaitable[int | tuple[int, float, list[int], list[float]]]:
        """Queued: sample a token on the device (greedy at temperature 0).

        Logit processing on the device, before temperature and the top-k / top-p / min-p
        filters, in this order: ``mask``, the allowed tokens as a packed bitmask (bit
        ``t % 32`` of little-endian 32-bit word ``t // 32``: what llguidance's
        ``compute_bitmask()`` returns; at least ``(vocab_size + 31) // 32`` words, bits past
        the vocabulary ignored); ``logit_bias``,
        ``(token, bias)`` pairs added to the logits; penalties over a token history (vLLM's
        semantics): a token in ``penalty_tokens`` (the generated ones) or ``penalty_prompt``
        has its logit divided by ``repetition_penalty`` if positive, multiplied if
        negative; then ``frequency_penalty`` times its count in ``penalty_tokens`` and
        ``presence_penalty`` once if it occurs there are subtracted.

        ``logprobs``: None resolves to the token id; ``n`` (0 to 20) to ``(token,
        logprob, top_ids, top_logprobs)``: the token's log-probability and the ``n`` most
        likely tokens' under the model's raw distribution (before any processing).

        ``constraint`` (a handle of ``create_constraint``): only the tokens its grammar
        allows next can be sampled (its mask, taken when ``sample`` is called, is combined
        with ``mask``), and the grammar advances with the sampled token when the call
        completes. One sample at a time per constraint: a second one while the first is in
        flight is an error."""

    def step(
        self,
        q: int,
        tokens: list[int],
        positions: list[int],
        in_embeds: list[int],
        in_kv: list[int],
        in_kv_last_len: int,
        out_kv: list[int],
        out_kv_offset: int,
        out_embed: int,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        min_p: float = 0.0,
        seed: int | None = None,
        mask: bytes | None = None,
        logit_bias: list[tuple[int, float]] | None = None,
        penalty_tokens: list[int] | None = None,
        penalty_prompt: list[int] | None = None,
        repetition_penalty: float = 1.0,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        logprobs: int | None = None,
        constraint: int | None = None,
    ) -> Awaitable[int | tuple[int, float, list[int], list[float]]]:
        """Queued: one decode step as one command, the same as the three calls
        ``embed_txt(q, tokens, positions, in_embeds)``, ``forward(q, in_kv, in_kv_last_len,
        in_embeds, out_kv, out_kv_offset, [out_embed])`` and ``sample(q, out_embed, ...)``
        (its parameters from ``temperature`` on) issued together: they run in one engine
        batch and the step resolves once, to ``sample``'s value. The first error among
        the three fails the step (as with the three calls, those before it took effect).
        Cheaper than the three calls (one submission, one translation, one wake-up);
        programs that want the parts (a custom mask, an adapter, several outputs, the
        distribution) use them."""

    # ------------------------------------------------------------------ grammar constraints
    def create_constraint(self, q: int, grammar: str) -> int:
        """A grammar constraint for one output on the queue's model, held by the host
        (immediate). ``grammar`` is JSON text: ``{"json_schema": {...}}``, ``{"regex":
        "..."}`` or ``{"lark": "..."}``. Pass the handle to ``sample``; free it when done:
        an instance may hold a limited number at once. JSON schemas give compact JSON (no
        optional whitespace) unless the schema's ``"x-guidance"`` asks otherwise."""

    def constraint_state(self, c: int) -> tuple[bool, bool, list[int]]:
        """(complete: the output so far is a word of the grammar; stopped: nothing but
        end-of-sequence may follow; the tokens the grammar forces next, possibly none)."""

    def constraint_consume(self, c: int, tokens: list[int]) -> None:
        """Advance the grammar with ``tokens`` appended without ``sample`` (forced ones,
        say); a token the grammar does not allow is an error."""

    def constraint_mask(self, c: int) -> bytes:
        """The tokens the grammar allows next as a packed bitmask (``sample``'s ``mask``
        format, one bit per output row)."""

    def free_constraint(self, c: int) -> None: ...

    # ------------------------------------------------------------------ messaging
    def broadcast(self, topic: str, message: str) -> int:
        """Deliver ``message`` to the subscribers of ``topic`` (this user's; another's is
        ``~OWNER/TOPIC``, which only ``subscribe`` may name); returns how many."""

    def subscribe(self, topic: str) -> int: ...

    async def next_message(self, sub: int) -> str: ...

    def unsubscribe(self, sub: int) -> None: ...

    # ------------------------------------------------------------------ key-value store
    # This user's keys; ``~OWNER/KEY`` reads another user's where granted (else it reads as
    # unset), and is never written.
    def store_get(self, key: str) -> str | None: ...

    def store_set(self, key: str, value: str) -> None: ...

    def store_delete(self, key: str) -> bool: ...

    def store_exists(self, key: str) -> bool: ...

    def store_list_keys(self, prefix: str = "") -> list[str]: ...

    # ------------------------------------------------------------------ http
    async def http_get(self, url: str) -> tuple[int, str]:
        """GET an allowlisted URL: (status, body text)."""

    async def http_post(self, url: str, body: str) -> tuple[int, str]: ...

    # ------------------------------------------------------------------ several engines
    # A model may be served by several engines (ranks 0..n-1). A queue runs on one engine
    # (``create_queue(model, engine)``; -1: placed by the router at the first ``route``);
    # pages and embeddings allocated through it live there. Microserving's calls move K/V
    # between engines (docs/multi-engine.md).

    def available_engines(self, model: str) -> int:
        """How many engines serve ``model``."""

    def get_queue_engine(self, q: int) -> int:
        """The rank of the engine queue ``q`` runs on."""

    def get_engine_load(self, model: str) -> list[tuple[int, int, int]]:
        """Per engine of ``model``: (alive 1/0, routed contexts running there, forward
        tokens queued)."""

    def route(
        self, q: int, prompt: list[int], whole: bool = False
    ) -> Awaitable[tuple[int, list[int]]]:
        """Queued: place the context of queue ``q`` (no call issued on it yet), which is about
        to prefill ``prompt``, through the active router. Resolves to ``(begin, pages)``
        once ``q`` runs on the chosen engine: ``pages`` (handles there, now this
        inferlet's) hold the K/V of ``prompt[:begin]``. ``whole``: the caller computes the
        whole prompt itself (it wants its outputs, e.g. prompt log-probabilities), so
        ``begin`` is 0 whatever the router moved. A queue created on a named engine, or
        on a model with one engine, resolves to ``(0, [])`` at once."""

    def prep_recv(self, q: int, prompt: list[int], end: int) -> Awaitable[tuple[int, int]]:
        """Queued, on the receiving engine: match ``prompt[:end]`` (Python slice index,
        ``-1``: all but the last token) in its context cache, allocate pages for the rest,
        and resolve to ``(kv_addr_info, matched_len)``. No compute."""

    def remote_send(
        self,
        q: int,
        prompt: list[int],
        kv_addr_info: int,
        recv_rank: int,
        begin: int,
        end: int,
        src_pages: list[int] | None = None,
        src_len: int = 0,
    ) -> Awaitable[None]:
        """Queued, on the sending engine: write the K/V of ``prompt[begin:end]`` into the
        pages ``kv_addr_info`` names on engine ``recv_rank``, one-sided. What the sender
        holds is sent as it is (``src_pages``: this inferlet's pages there with the K/V of
        ``prompt[:src_len]``); the rest of ``prompt[:end]`` is computed there and sent
        layer by layer as the forward computes it. Resolves when every write has landed."""

    def start_generate(self, q: int, prompt: list[int], begin: int, request: int = -1) -> list[int]:
        """Start generating on ``q``'s engine, where the K/V of ``prompt[:begin]`` is
        (received with prep_recv/remote_send; ``begin=0``: nothing needed), leaving at
        least the last token to prefill. A router hands ``request`` (from
        ``next_request``) over: its program prefills ``prompt[begin:]`` there and
        generates (returns ``[]``); with ``request=-1`` the caller starts there itself:
        returns the pages holding the K/V, now plain pages of its own."""

    def next_request(self) -> Awaitable[tuple[int, str, list[int], int]]:
        """Router only: the next context to place: ``(request, model, prompt, program)``,
        ``program`` being the process-table program of the requesting instance (the
        requests of one OpenAI session share one)."""

    def reject_request(self, request: int, reason: str) -> None:
        """Router only: fail ``request`` with ``reason``."""


API_FUNCTIONS: tuple[str, ...] = tuple(
    name
    for name in InferletApi.__dict__
    if not name.startswith("_") and callable(InferletApi.__dict__[name])
)
