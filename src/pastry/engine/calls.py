"""Typed messages between the control layer and the engine.

A *batch* is a list of calls, executed in order; consecutive calls of the same type run as
one batched handler invocation (one forward over all tokens of all ``Forward`` calls, one
``lm_head`` over all ``Sample`` rows, ...). The engine answers with one result per call, in
the same order: ``None`` for calls with no output, a :class:`Dist` for :class:`NextDist`, an
``int`` token id for :class:`Sample`, or a :class:`CallError` when that call was rejected.
A rejected call has no effect; the other calls of the batch still run.

All ids are *physical* indices into the engine's pools: KV pages (``page_size`` token slots
each), embedding slots (one hidden vector each, with a position) and host pages (swap
space). The control layer translates an inferlet's virtual handles into these.

Integer arrays are ``np.int64`` (build them with :func:`ids`), masks are ``np.bool_``; the
engine validates dtypes and ranges of every call it receives.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


def ids(values) -> np.ndarray:
    """A 1-D int64 array from a list, range or array (no copy when already int64)."""
    return np.ascontiguousarray(np.asarray(values, dtype=np.int64).reshape(-1))


_EMPTY = np.zeros(0, dtype=np.int64)
_EMPTY.flags.writeable = False


@dataclass(frozen=True, slots=True, eq=False)
class EmbedTxt:
    """Embed token ids into embedding slots: ``out_embeds[i] = E[tokens[i]]`` at ``positions[i]``."""

    tokens: np.ndarray
    positions: np.ndarray
    out_embeds: np.ndarray


@dataclass(frozen=True, slots=True, eq=False)
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

    @property
    def num_inputs(self) -> int:
        return len(self.in_embeds)


@dataclass(frozen=True, slots=True, eq=False)
class NextDist:
    """Top-``k`` next-token distribution from the hidden state in embed slot ``embed``."""

    embed: int
    k: int = 256


@dataclass(frozen=True, slots=True, eq=False)
class Sample:
    """Sample one token on the device from the hidden state in embed slot ``embed``.

    ``temperature == 0`` is greedy. Filters apply in the order top-k, top-p, min-p (0 / 1.0
    / 0.0 disable them). With a ``seed`` the draw is a pure function of (seed, logits):
    the same in any batch, on any run; without one the engine draws a seed.
    """

    embed: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None


@dataclass(frozen=True, slots=True, eq=False)
class CopyKv:
    """Copy ``length`` token slots of K/V (and their mask bits) between pages."""

    src_page: int
    dst_page: int
    src_offset: int = 0
    dst_offset: int = 0
    length: int = 0


@dataclass(frozen=True, slots=True, eq=False)
class MaskKv:
    """Set the mask of a page: ``masked[i]`` True makes slot ``i`` not attendable."""

    page: int
    masked: np.ndarray


@dataclass(frozen=True, slots=True, eq=False)
class SwapOut:
    """Copy device pages to host pages (``pages[i] -> host_pages[i]``)."""

    pages: np.ndarray
    host_pages: np.ndarray


@dataclass(frozen=True, slots=True, eq=False)
class SwapIn:
    """Copy host pages back to device pages (``host_pages[i] -> pages[i]``)."""

    host_pages: np.ndarray
    pages: np.ndarray


Call = EmbedTxt | Forward | NextDist | Sample | CopyKv | MaskKv | SwapOut | SwapIn
CALL_TYPES: tuple[type, ...] = (
    EmbedTxt,
    Forward,
    NextDist,
    Sample,
    CopyKv,
    MaskKv,
    SwapOut,
    SwapIn,
)


@dataclass(frozen=True, slots=True, eq=False)
class Dist:
    """A top-k distribution: token ``ids`` by decreasing probability ``probs``."""

    ids: np.ndarray
    probs: np.ndarray


@dataclass(frozen=True, slots=True)
class CallError:
    """Why one call of a batch was rejected. The call had no effect."""

    message: str


Result = None | int | Dist | CallError


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
