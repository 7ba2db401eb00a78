"""Typed messages between the control layer and the engine.

A *batch* is a list of calls, executed in order; consecutive calls of the same type run as
one batched handler invocation (one forward over all tokens of all ``Forward`` calls, one
``lm_head`` over all ``Sample`` rows, ...). The engine answers with one result per call, in
the same order: ``None`` for calls with no output (a :class:`Logprobs` for a ``Forward`` that
asks for prompt log-probabilities), a :class:`Dist` for :class:`NextDist`, an ``int`` token
id for :class:`Sample` (a :class:`Sampled` when it asks for log-probabilities), or a
:class:`CallError` when that call was rejected. A rejected call has no effect; the other
calls of the batch still run.

``NextDist`` and ``Sample`` rows of one batch share one ``lm_head``; each row may carry its
own logit processing (:mod:`pastry.engine.logits`): a packed token bitmask, a sparse logit
bias and repetition / frequency / presence penalties over a token history, applied in that
order before temperature and the top-k / top-p / min-p filters.

All ids are *physical* indices into the engine's pools: KV pages (``page_size`` token slots
each), embedding slots (one hidden vector each, with a position) and host pages (swap
space). The control layer translates an inferlet's virtual handles into these.

Integer arrays are ``np.int64`` (build them with :func:`ids`), masks are ``np.bool_``; the
engine validates dtypes and ranges of every call it receives.

Calls and results are values: nothing changes one after it is built. They are plain slotted
dataclasses, not frozen ones, because they are built on the per-step path (a decode step is
an ``EmbedTxt``, a ``Forward`` and a ``Sample``, built for every inferlet in every batch): a
frozen dataclass sets each field through ``object.__setattr__``, which made a ``Forward``
3x and a ``Sample`` 4x as costly to build (``benchmarks/translate_batch.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pastry.wire.images import ImageLayout


def ids(values) -> np.ndarray:
    """A 1-D int64 array from a list, range or array (no copy when already int64)."""
    if type(values) is list:  # the hot path (handle lists): one conversion, no reshape
        arr = np.array(values, dtype=np.int64)
        if arr.ndim == 1:
            return arr
    return np.ascontiguousarray(np.asarray(values, dtype=np.int64).reshape(-1))


_EMPTY = np.zeros(0, dtype=np.int64)
_EMPTY.flags.writeable = False
_EMPTY_F32 = np.zeros(0, dtype=np.float32)
_EMPTY_F32.flags.writeable = False

MAX_LOGPROBS = 20
"""The most top log-probabilities a call may ask for (OpenAI's limit)."""


def mask_words(vocab_size: int) -> int:
    """Length of a packed token bitmask over ``vocab_size`` rows: one int32 per 32 tokens."""
    return (vocab_size + 31) // 32


@dataclass(slots=True, eq=False)
class EmbedTxt:
    """Embed token ids into embedding slots: ``out_embeds[i] = E[tokens[i]]`` at ``positions[i]``."""

    tokens: np.ndarray
    positions: np.ndarray
    out_embeds: np.ndarray


@dataclass(slots=True, eq=False)
class EmbedImg:
    """Encode an image into embedding slots: ``image`` is its encoded bytes (``uint8``;
    PNG, JPEG, WebP or GIF, :mod:`pastry.wire.images`), ``out_embeds`` one slot per
    position the image takes (``EngineInfo.image_layout``: its span), which receive its
    embeddings at ``positions``."""

    image: np.ndarray
    positions: np.ndarray
    out_embeds: np.ndarray


@dataclass(slots=True, eq=False)
class Forward:
    """Run the model over ``n`` input embeddings on top of a paged KV context.

    Context: the tokens of ``ctx_pages`` in order, all ``page_size`` slots of each page but
    the last, of which only the first ``ctx_last_len`` count. A page left out of
    ``ctx_pages`` is simply not attended; slots marked by :class:`MaskKv` are not attended.

    Attention: without ``mask``, input token ``i`` attends to every context token and to
    input tokens ``0..i`` (causal). With ``mask`` (bool ``[n, ctx_len + n]``, True = may
    attend), exactly the marked tokens are attended (still minus masked KV slots).

    Outputs: the new K/V of input token ``i`` is written to slot ``out_offset + i`` of the
    concatenated ``out_pages`` (pass no pages to not store it, e.g. for scoring); the final
    (normed) hidden state of input token ``out_indices[j]`` goes to embed slot
    ``out_embeds[j]``, where ``NextDist`` / ``Sample`` can read it.

    ``positions`` are the RoPE positions of the inputs; ``None`` takes the positions stored
    with the input embedding slots by ``EmbedTxt``.

    ``adapter`` is the id of a LoRA adapter (from ``Engine.load_adapter``) applied to this
    call's tokens, or -1 for the base model; calls of one batch may name different adapters.

    Prompt log-probabilities: with ``logprob_targets`` (one token id per input, -1 for none),
    the result is a :class:`Logprobs`: for input ``i``, the log-probability (log-softmax of
    the model's logits at ``i``) of ``logprob_targets[i]`` and the ``logprob_top`` (at most
    :data:`MAX_LOGPROBS`) most likely tokens with theirs. Scoring a prompt passes each
    position the next prompt token.
    """

    in_embeds: np.ndarray
    ctx_pages: np.ndarray = field(default_factory=lambda: _EMPTY)
    ctx_last_len: int = 0
    out_pages: np.ndarray = field(default_factory=lambda: _EMPTY)
    out_offset: int = 0
    out_embeds: np.ndarray = field(default_factory=lambda: _EMPTY)
    out_indices: np.ndarray = field(default_factory=lambda: _EMPTY)
    positions: np.ndarray | None = None
    mask: np.ndarray | None = None
    adapter: int = -1
    logprob_targets: np.ndarray = field(default_factory=lambda: _EMPTY)
    logprob_top: int = 0

    @property
    def num_inputs(self) -> int:
        return len(self.in_embeds)


@dataclass(slots=True, eq=False, kw_only=True)
class Processing:
    """Logit processing of one output row, applied before temperature and the filters, in
    this order (vLLM's); the fields of :class:`NextDist` and :class:`Sample` (keyword-only).

    - ``mask``: allowed tokens, a packed bitmask of :func:`mask_words` int32 words (bit
      ``t % 32`` of word ``t // 32`` set = token ``t`` allowed; llguidance's
      ``compute_bitmask()`` layout); the others get logit -inf. At least one token must be
      allowed.
    - ``bias_ids`` / ``bias_values`` (float32): added to those tokens' logits.
    - penalties over a token history: ``penalty_tokens`` (typically the generated tokens)
      count for all three, ``penalty_prompt`` (typically the prompt) only for the
      repetition penalty. A token seen in either has its logit divided by
      ``repetition_penalty`` when positive, multiplied when negative (1 = off); then each
      logit loses ``frequency_penalty`` times the token's count in ``penalty_tokens`` and
      ``presence_penalty`` if it occurs there at all (0 = off).

    A new processing option is a field here, its check in ``engine/checks.py`` and its
    step in ``engine/logits.py``; the control layer fills it from the request's
    ``pastry.api.Sampling`` (``control/sampling.py``).
    """

    mask: np.ndarray | None = None
    bias_ids: np.ndarray = field(default_factory=lambda: _EMPTY)
    bias_values: np.ndarray = field(default_factory=lambda: _EMPTY_F32)
    penalty_tokens: np.ndarray = field(default_factory=lambda: _EMPTY)
    penalty_prompt: np.ndarray = field(default_factory=lambda: _EMPTY)
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0

    def processes(self) -> bool:
        """Whether any processing is asked (False: the logits are used as they are)."""
        return (
            self.mask is not None
            or len(self.bias_ids) > 0
            or self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )


@dataclass(slots=True, eq=False)
class NextDist(Processing):
    """Top-``k`` next-token distribution from the hidden state in embed slot ``embed``:
    the softmax of the processed logits (:class:`Processing`; tokens a mask forbids have
    probability 0)."""

    embed: int
    k: int = 256


@dataclass(slots=True, eq=False)
class Sample(Processing):
    """Sample one token on the device from the hidden state in embed slot ``embed``.

    ``temperature == 0`` is greedy. Filters apply in the order top-k, top-p, min-p (0 / 1.0
    / 0.0 disable them), after the logit processing of :class:`Processing`. With a
    ``seed`` the draw is a pure function of (seed, logits): the same in any batch, on any
    run; without one the engine draws a seed.

    ``logprobs``: -1 returns the token id alone; ``n`` in 0..:data:`MAX_LOGPROBS` returns a
    :class:`Sampled` with the token's log-probability and the ``n`` most likely tokens'.
    Log-probabilities are those of the model's raw distribution (log-softmax of the logits
    before any processing), as vLLM reports them by default.
    """

    embed: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    logprobs: int = -1


@dataclass(slots=True, eq=False)
class CopyKv:
    """Copy ``length`` token slots of K/V (and their mask bits) between pages."""

    src_page: int
    dst_page: int
    src_offset: int = 0
    dst_offset: int = 0
    length: int = 0


@dataclass(slots=True, eq=False)
class MaskKv:
    """Set the mask of a page: ``masked[i]`` True makes slot ``i`` not attendable."""

    page: int
    masked: np.ndarray


@dataclass(slots=True, eq=False)
class SwapOut:
    """Copy device pages to host pages (``pages[i] -> host_pages[i]``)."""

    pages: np.ndarray
    host_pages: np.ndarray


@dataclass(slots=True, eq=False)
class SwapIn:
    """Copy host pages back to device pages (``host_pages[i] -> pages[i]``)."""

    host_pages: np.ndarray
    pages: np.ndarray


@dataclass(slots=True, eq=False)
class SendKv:
    """Write K/V into another engine's pages, one-sided (microserving's ``remote_send``).

    ``length`` tokens from slot ``src_offset`` of the concatenated ``src_pages`` of this
    engine go to slot ``dst_offset`` of the concatenated ``dst_pages`` of the engine
    reachable at ``peer`` (one of its ``EngineInfo.kv_peers``: ``shm:PATH`` on this host,
    ``tcp://HOST:PORT`` across hosts); the peer's engine takes no part. In a batch with
    ``Forward`` calls, each layer's K/V are sent as soon as the forward has computed that
    layer (so slots written by the batch's forwards can be sent, overlapping transfer with
    compute); the call completes when every write has landed.
    """

    src_pages: np.ndarray
    dst_pages: np.ndarray
    length: int
    peer: str
    src_offset: int = 0
    dst_offset: int = 0


Call = (
    EmbedTxt | EmbedImg | Forward | NextDist | Sample | CopyKv | MaskKv | SwapOut | SwapIn | SendKv
)
CALL_TYPES: tuple[type, ...] = (
    EmbedTxt,
    EmbedImg,
    Forward,
    NextDist,
    Sample,
    CopyKv,
    MaskKv,
    SwapOut,
    SwapIn,
    SendKv,
)


@dataclass(slots=True, eq=False)
class Dist:
    """A top-k distribution: token ``ids`` by decreasing probability ``probs``."""

    ids: np.ndarray
    probs: np.ndarray


@dataclass(slots=True, eq=False)
class Sampled:
    """A sampled token with log-probabilities (:class:`Sample` with ``logprobs >= 0``):
    the token's, and the ``n`` most likely tokens' by decreasing log-probability."""

    token: int
    logprob: float
    top_ids: np.ndarray
    top_logprobs: np.ndarray


@dataclass(slots=True, eq=False)
class Logprobs:
    """Prompt log-probabilities of a :class:`Forward` (``logprob_targets``): per input,
    the target's log-probability (NaN where the target was -1), and the ``logprob_top``
    most likely tokens (``top_ids[i]``, int64) with theirs (``top_logprobs[i]``)."""

    logprobs: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray


@dataclass(frozen=True, slots=True)
class CallError:
    """Why one call of a batch was rejected. The call had no effect."""

    message: str


Result = None | int | Dist | Sampled | Logprobs | CallError


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What an engine reports on connect: the model, its pools and what it supports."""

    model_name: str
    arch: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    max_position: int
    dtype: str
    device: str
    page_size: int
    num_pages: int
    num_embeds: int
    num_host_pages: int
    max_batch_tokens: int
    traits: tuple[str, ...]
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    tokenizer_json: str
    chat_template: str | None
    special_tokens: dict[str, str] = field(default_factory=dict)
    adapters: tuple[str, ...] = ()  # LoRA adapter names, by id (Forward.adapter)
    kv_peers: tuple[str, ...] = ()  # where peers write this engine's KV (SendKv.peer)
    host: str = ""  # identifies the machine: engines of one host transfer KV through shm
    image_layout: ImageLayout | None = None  # how an image becomes positions; None: no images

    @property
    def image_token_id(self) -> int | None:
        """The placeholder a chat template writes for each image (``None``: no images)."""
        return self.image_layout.token if self.image_layout else None
