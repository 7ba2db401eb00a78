"""The engine's boundary: every call checked against the model and the pools, once.

The engine serves any controller (in process, or over ZeroMQ from another process or
host), so it trusts no call: :class:`CallChecker` checks each one (ids in range, shapes,
dtypes, finite numbers, the KV layout rule of :mod:`pastry.wire.kv_layout`) and turns the
good ones into what their handler runs on — a :class:`ForwardPlan` of slots and arrays for
a forward, slot ranges for a copy. A bad call raises :class:`Invalid`, which the engine
turns into that call's ``CallError``; the rest of its batch runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from pastry.engine.logits import mask_allows_any
from pastry.wire.calls import (
    MAX_LOGPROBS,
    Call,
    CallError,
    CopyKv,
    EmbedImg,
    EmbedTxt,
    Forward,
    MaskKv,
    NextDist,
    Processing,
    Result,
    Sample,
    mask_words,
)
from pastry.wire.config import ModelConfig
from pastry.wire.images import ImageLayout
from pastry.wire.kv_layout import kv_write_error

_INF = float("inf")


class Invalid(Exception):
    """A call is malformed or names memory that does not exist."""


class ForwardPlan(NamedTuple):
    """A checked ``Forward``: what its batch runs on (slots are ``page * page_size + i``)."""

    ins: np.ndarray  # input embed slots
    ctx_slots: np.ndarray  # the context's KV slots, in order
    out_slots: np.ndarray | None  # where the new tokens' K/V go (None: not stored)
    out_embeds: np.ndarray  # embed slots receiving outputs
    out_indices: np.ndarray  # which inputs' outputs
    positions: np.ndarray | None  # None: those stored with the input embeds
    mask: np.ndarray | None  # bool [n, ctx + n], or None: causal
    adapter: int  # LoRA adapter id, -1 for the base model
    targets: np.ndarray | None  # prompt log-probability targets (None: none)


def accept(
    run: Sequence[tuple[int, Call]], results: list[Result], check: Callable[[Call], object]
) -> list[tuple[int, Call, object]]:
    """``(index, call, plan)`` for each call ``check`` accepts; a refused call's result
    becomes a ``CallError`` naming its type and the reason."""
    ok = []
    for i, call in run:
        try:
            ok.append((i, call, check(call)))
        except Invalid as e:
            results[i] = CallError(f"{type(call).__name__}: {e}")
        except (TypeError, ValueError, AttributeError, IndexError) as e:
            results[i] = CallError(f"{type(call).__name__}: malformed call ({e})")
    return ok


def _is_int(value: object) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def _finite(value: object) -> bool:
    return isinstance(value, int | float) and abs(value) < _INF


class CallChecker:
    """Checks calls against one engine's model and pools (sizes fixed at start-up; the
    ``adapters`` list is the engine's own, by id, ``None`` where one was unloaded)."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        page_size: int,
        num_pages: int,
        num_host_pages: int,
        num_embeds: int,
        max_batch_tokens: int,
        adapters: list,
        image_layout: ImageLayout | None = None,
        max_image_bytes: int = 0,
    ) -> None:
        self.cfg, self.page_size, self.num_pages = cfg, page_size, num_pages
        self.num_host_pages, self.num_embeds = num_host_pages, num_embeds
        self.max_batch_tokens, self.adapters = max_batch_tokens, adapters
        self.image_layout, self.max_image_bytes = image_layout, max_image_bytes

    # ------------------------------------------------------------------ values

    def ids(self, arr, limit: int, what: str, fix: str = "") -> np.ndarray:
        """``arr`` as int64 ids in ``[0, limit)``; ``fix`` says what the limit is."""
        arr = np.asarray(arr)
        if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
            raise Invalid(f"{what} must be a 1-D integer array")
        if arr.size <= 16:  # most calls name a few ids: numpy's reductions cost more here
            values = arr.tolist()
            lo, hi = (min(values), max(values)) if values else (0, 0)
        else:
            lo, hi = arr.min(), arr.max()
        if arr.size and (lo < 0 or hi >= limit):
            bad = arr[(arr < 0) | (arr >= limit)][0]
            raise Invalid(f"{what} {int(bad)} is out of range [0, {limit}){fix}")
        return arr.astype(np.int64, copy=False)

    def scalar(self, value, lo: int, hi: int, what: str) -> int:
        """An integer in ``[lo, hi)``."""
        if not _is_int(value):
            raise Invalid(f"{what} must be an integer, got {value!r}")
        if not lo <= value < hi:
            raise Invalid(f"{what} {value} is out of range [{lo}, {hi})")
        return int(value)

    def pages(self, arr, what: str) -> np.ndarray:
        return self.ids(arr, self.num_pages, what)

    def embed_slots(self, arr, what: str) -> np.ndarray:
        return self.ids(arr, self.num_embeds, what)

    def positions(self, arr, n: int) -> np.ndarray:
        pos = self.ids(arr, self.cfg.max_position, "position", " (the model's max_position)")
        if len(pos) != n:
            raise Invalid(f"{n} inputs but {len(pos)} positions")
        return pos

    def tokens(self, arr, what: str = "token id") -> np.ndarray:
        return self.ids(arr, self.cfg.vocab_size, what, " (vocab size)")

    # ------------------------------------------------------------------ calls

    def embed_txt(self, c: EmbedTxt) -> None:
        tokens = self.tokens(c.tokens)
        out = self.embed_slots(c.out_embeds, "out embed")
        if len(out) != len(tokens):
            raise Invalid(f"{len(tokens)} tokens but {len(out)} out embeds")
        self.positions(c.positions, len(tokens))

    def embed_img(self, c: EmbedImg) -> None:
        """Shapes only: the engine decodes the image (a bad one, or one whose span is not
        as long as the slots, fails that call alone)."""
        layout = self.image_layout
        if layout is None:
            raise Invalid("this model takes no images (it has no image encoder)")
        image = np.asarray(c.image)
        if image.ndim != 1 or image.dtype != np.uint8 or not image.size:
            raise Invalid("image must be a non-empty 1-D uint8 array (the encoded bytes)")
        if image.size > self.max_image_bytes:
            raise Invalid(f"the image is {image.size} bytes, over {self.max_image_bytes}")
        out = self.embed_slots(c.out_embeds, "out embed")
        if layout.fixed and len(out) != layout.frame:
            raise Invalid(f"an image takes {layout.frame} embeds on this model, got {len(out)}")
        self.positions(c.positions, len(out))

    def forward(self, c: Forward) -> ForwardPlan:
        """A forward as the slots and arrays it runs on."""
        ins = self.embed_slots(c.in_embeds, "input embed")
        n = len(ins)
        if n == 0:
            raise Invalid("no inputs")
        if n > self.max_batch_tokens:
            raise Invalid(
                f"{n} inputs exceed the engine's max_batch_tokens ({self.max_batch_tokens}); "
                "split the forward"
            )
        ctx, out = self.pages(c.ctx_pages, "context page"), self.pages(c.out_pages, "output page")
        error = kv_write_error(
            self.page_size, ctx.tolist(), c.ctx_last_len, out.tolist(), c.out_offset, n
        )
        if error is not None:
            raise Invalid(error)
        ctx_len = (len(ctx) - 1) * self.page_size + int(c.ctx_last_len) if len(ctx) else 0
        ctx_slots = self._slots(ctx, 0, ctx_len)
        out_slots = self._slots(out, int(c.out_offset), n) if len(out) else None
        out_embeds = self.embed_slots(c.out_embeds, "output embed")
        out_idx = self.ids(c.out_indices, n, "output index", " (number of inputs)")
        if len(out_idx) != len(out_embeds):
            raise Invalid(f"{len(out_embeds)} output embeds but {len(out_idx)} output indices")
        positions = None if c.positions is None else self.positions(c.positions, n)
        return ForwardPlan(ins, ctx_slots, out_slots, out_embeds, out_idx, positions,
                           self._mask(c.mask, n, len(ctx_slots)), self._adapter(c.adapter),
                           self._logprob_targets(c, n))  # fmt: skip

    def _slots(self, pages: np.ndarray, first: int, n: int) -> np.ndarray:
        """The ``n`` slots of ``pages`` from offset ``first`` of the first page on."""
        ps = self.page_size
        return (pages[:, None] * ps + np.arange(ps)).reshape(-1)[first : first + n]

    @staticmethod
    def _mask(mask, n: int, ctx: int) -> np.ndarray | None:
        if mask is None:
            return None
        mask = np.asarray(mask)
        if mask.dtype != np.bool_ or mask.shape != (n, ctx + n):
            raise Invalid(
                f"mask must be bool of shape {(n, ctx + n)}, got {mask.dtype} {mask.shape}"
            )
        if not mask.any(axis=1).all():
            raise Invalid("every input token must attend to at least one token (mask row is empty)")
        return mask

    def _adapter(self, value) -> int:
        adapter = self.scalar(value, -(1 << 62), 1 << 62, "adapter")
        loaded = self.adapters
        if not -1 <= adapter < len(loaded) or (adapter >= 0 and loaded[adapter] is None):
            raise Invalid(f"adapter {adapter} is not loaded ({self.adapter_ids()})")
        return adapter

    def adapter_ids(self) -> str:
        """The valid adapter ids, in words (for errors)."""
        ids = [i for i, a in enumerate(self.adapters) if a is not None]
        spans = f"0..{len(ids) - 1}" if ids == list(range(len(ids))) else ", ".join(map(str, ids))
        loaded = f"{spans} for the {len(ids)} loaded adapters" if ids else "no adapter is loaded"
        return f"valid ids: -1 for the base model, {loaded}"

    def _logprob_targets(self, c: Forward, n: int) -> np.ndarray | None:
        """The prompt log-probability targets (None: none asked)."""
        if not len(c.logprob_targets):
            if c.logprob_top:
                raise Invalid("logprob_top needs logprob_targets")
            return None
        targets = np.asarray(c.logprob_targets)
        vocab = self.cfg.vocab_size
        if targets.ndim != 1 or targets.dtype.kind not in "iu":
            raise Invalid("logprob_targets must be a 1-D integer array")
        if targets.min() < -1 or targets.max() >= vocab:
            raise Invalid(f"logprob_targets must be token ids below {vocab} or -1 (none)")
        if len(targets) != n:
            raise Invalid(f"{n} inputs but {len(targets)} logprob targets")
        self.scalar(c.logprob_top, 0, MAX_LOGPROBS + 1, "logprob_top")
        return targets.astype(np.int64, copy=False)

    def output(self, c: NextDist | Sample) -> None:
        """A next-token distribution or sample: its slot, parameters and processing."""
        self.scalar(c.embed, 0, self.num_embeds, "embed")
        if isinstance(c, NextDist):
            self.scalar(c.k, 1, self.cfg.vocab_size + 1, "k")
        else:
            if not (_finite(c.temperature) and c.temperature >= 0):
                raise Invalid(f"temperature must be a finite number >= 0, got {c.temperature!r}")
            self.scalar(c.top_k, 0, 1 << 31, "top_k")
            if not (isinstance(c.top_p, int | float) and 0 < c.top_p <= 1):
                raise Invalid(f"top_p must be in (0, 1], got {c.top_p!r}")
            if not (isinstance(c.min_p, int | float) and 0 <= c.min_p <= 1):
                raise Invalid(f"min_p must be in [0, 1], got {c.min_p!r}")
            if c.seed is not None:
                self.scalar(c.seed, -(1 << 63), 1 << 63, "seed")
            self.scalar(c.logprobs, -1, MAX_LOGPROBS + 1, "logprobs")
        if c.processes():
            self._processing(c)

    def _processing(self, c: Processing) -> None:
        vocab = self.cfg.vocab_size
        if c.mask is not None:
            mask = np.asarray(c.mask)
            want = mask_words(vocab)
            if mask.dtype != np.int32 or mask.shape != (want,):
                raise Invalid(
                    f"mask must be int32 of shape ({want},) (a packed bitmask over {vocab} "
                    f"tokens), got {mask.dtype} {mask.shape}"
                )
            if not mask_allows_any(mask, vocab):
                raise Invalid("mask allows no token")
        bias_ids = self.tokens(c.bias_ids, "bias token id")
        values = np.asarray(c.bias_values)
        if values.shape != bias_ids.shape or values.dtype != np.float32:
            raise Invalid(
                f"bias_values must be float32, one per bias id ({len(bias_ids)}), got "
                f"{values.dtype} {values.shape}"
            )
        if np.isnan(values).any() or (values == _INF).any():
            raise Invalid("bias_values must not be NaN or +inf")
        self.tokens(c.penalty_tokens, "penalty token id")
        self.tokens(c.penalty_prompt, "penalty prompt token id")
        rep = c.repetition_penalty
        if not (_finite(rep) and rep > 0):
            raise Invalid(f"repetition_penalty must be a finite number > 0, got {rep!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not _finite(v := getattr(c, name)):
                raise Invalid(f"{name} must be a finite number, got {v!r}")

    def copy_kv(self, c: CopyKv) -> tuple[np.ndarray, np.ndarray]:
        """The source and destination slots."""
        ps = self.page_size
        src = self.scalar(c.src_page, 0, self.num_pages, "src_page")
        dst = self.scalar(c.dst_page, 0, self.num_pages, "dst_page")
        so = self.scalar(c.src_offset, 0, ps, "src_offset")
        do = self.scalar(c.dst_offset, 0, ps, "dst_offset")
        n = self.scalar(c.length, 0, ps + 1, "length")
        if so + n > ps or do + n > ps:
            raise Invalid(f"copy of {n} tokens from offset {so} to {do} crosses a page end ({ps})")
        return np.arange(src * ps + so, src * ps + so + n), np.arange(
            dst * ps + do, dst * ps + do + n
        )

    def mask_kv(self, c: MaskKv) -> tuple[int, np.ndarray]:
        page = self.scalar(c.page, 0, self.num_pages, "page")
        masked = np.asarray(c.masked)
        if masked.dtype != np.bool_ or masked.shape != (self.page_size,):
            raise Invalid(
                f"masked must be bool of shape ({self.page_size},), got {masked.dtype} {masked.shape}"
            )
        return page, masked

    def swap(self, c) -> tuple[np.ndarray, np.ndarray]:
        """A ``SwapOut`` or ``SwapIn``: (device pages, host pages)."""
        pages = self.pages(c.pages, "page")
        host = self.ids(c.host_pages, self.num_host_pages, "host page")
        if len(pages) != len(host):
            raise Invalid(f"{len(pages)} pages but {len(host)} host pages")
        return pages, host


def decode_apart(ok: list[tuple[int, Call, ForwardPlan]]) -> tuple[list, list]:
    """(the other forwards, the one-token forwards that store their K/V: decode steps) of
    a batch's checked forwards, for the decode steps to run apart (by the compiled step),
    after the others so that they see what those write. Not apart (all in the first list)
    when one of the others reads a slot a decode step writes: it must see that too."""
    decode = [
        item for item in ok
        if len(item[2].ins) == 1 and item[2].out_slots is not None
        and item[2].mask is None and item[2].adapter < 0
    ]  # fmt: skip
    if not decode or len(decode) == len(ok):
        return ok, []
    chosen = {i for i, _, _ in decode}
    longer = [item for item in ok if item[0] not in chosen]
    written = np.concatenate([plan.out_slots for _, _, plan in decode])
    read = np.concatenate([plan.ctx_slots for _, _, plan in longer])
    if np.isin(read, written).any():
        return ok, []
    return longer, decode
