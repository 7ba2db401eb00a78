"""Logit processing and log-probabilities on the device, for a batch of output rows.

Each row of an output batch (a ``NextDist`` or ``Sample`` call) may carry its
:class:`~pastry.wire.calls.Processing`: a token bitmask, a sparse logit bias and
repetition / frequency / presence penalties over a token history. :class:`LogitsProcessor`
gathers them once per batch into a few device tensors and applies them in place, in vLLM's
order: mask, bias, penalties. Rows without processing are untouched and cost nothing; rows
of different kinds share the batch's one ``lm_head`` and one pass of each step.

:func:`top_logprobs` and :func:`token_logprobs` read log-probabilities from raw logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pastry.wire.calls import Processing

_LUTS: dict[tuple[torch.device, bool], torch.Tensor] = {}


def _lut(device: torch.device, additive: bool) -> torch.Tensor:
    """Byte value -> its 8 bits, least significant first: as bool, or as logit addends
    (0 for a set bit, -inf for a clear one)."""
    lut = _LUTS.get((device, additive))
    if lut is None:
        byte = torch.arange(256, dtype=torch.int32, device=device)
        bits = ((byte[:, None] >> torch.arange(8, device=device)) & 1).bool()
        lut = torch.where(bits, 0.0, float("-inf")) if additive else bits.to(torch.uint8)
        _LUTS[(device, additive)] = lut
    return lut


def _expand(words: torch.Tensor, vocab: int, additive: bool) -> torch.Tensor:
    as_bytes = words.contiguous().view(torch.uint8).int()  # [R, 4 W], little-endian
    # an embedding lookup is the fastest byte -> 8 values expansion on CPU (measured:
    # ~10x a bool masked_fill over the same logits)
    out = torch.nn.functional.embedding(as_bytes, _lut(words.device, additive))
    return out.reshape(words.shape[0], -1)[:, :vocab]


def unpack_mask(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """Bool ``[R, vocab]`` from packed int32 bitmask words ``[R, W]`` (bit ``t % 32`` of
    word ``t // 32`` is token ``t``; little-endian bytes, as llguidance writes them)."""
    return _expand(words, vocab, additive=False).bool()


def mask_addend(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """float32 ``[R, vocab]``: 0 for the allowed tokens of packed bitmask ``words``, -inf
    for the others (add it to the logits)."""
    return _expand(words, vocab, additive=True)


def mask_allows_any(mask: np.ndarray, vocab: int) -> bool:
    """Whether a packed bitmask allows at least one token below ``vocab``."""
    full, rest = divmod(vocab, 32)
    words = np.asarray(mask).view(np.uint32)
    if words[:full].any():
        return True
    return bool(rest) and bool(int(words[full]) & ((1 << rest) - 1))


@dataclass
class LogitsProcessor:
    """The processing of one output batch as device tensors (build with :meth:`build`)."""

    mask_rows: torch.Tensor | None = None  # [Rm] rows with a mask
    mask_words: torch.Tensor | None = None  # [Rm, W] int32
    bias_rows: torch.Tensor | None = None  # [nb] flattened (row, id, value)
    bias_ids: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None
    pen_rows: torch.Tensor | None = None  # [Rp] rows with penalties
    pen_counts: torch.Tensor | None = None  # [Rp, V] float32 occurrences in penalty_tokens
    pen_seen: torch.Tensor | None = None  # [Rp, V] bool: in penalty_tokens or penalty_prompt
    repetition: torch.Tensor | None = None  # [Rp, 1]
    frequency: torch.Tensor | None = None  # [Rp, 1]
    presence: torch.Tensor | None = None  # [Rp, 1]

    @classmethod
    def build(
        cls, calls: Sequence[Processing], vocab: int, device: torch.device
    ) -> LogitsProcessor | None:
        """The processing of ``calls`` (row ``r`` = ``calls[r]``); None when no row has any."""
        p = cls()
        masked = [r for r, c in enumerate(calls) if c.mask is not None]
        if masked:
            p.mask_rows = torch.tensor(masked, device=device)
            words = np.stack([calls[r].mask for r in masked]).astype(np.int32, copy=False)
            p.mask_words = torch.from_numpy(words).to(device)
        biased = [r for r, c in enumerate(calls) if len(c.bias_ids)]
        if biased:
            lengths = [len(calls[r].bias_ids) for r in biased]
            p.bias_rows = torch.tensor(np.repeat(biased, lengths), device=device)
            p.bias_ids = torch.from_numpy(np.concatenate([calls[r].bias_ids for r in biased])).to(
                device
            )
            values = np.concatenate([calls[r].bias_values for r in biased]).astype(np.float32)
            p.bias_values = torch.from_numpy(values).to(device)
        penalized = [
            r
            for r, c in enumerate(calls)
            if c.repetition_penalty != 1.0
            or c.frequency_penalty != 0.0
            or c.presence_penalty != 0.0
        ]
        if penalized:
            p._build_penalties(calls, penalized, vocab, device)
        if p.mask_rows is None and p.bias_rows is None and p.pen_rows is None:
            return None
        return p

    def _build_penalties(self, calls, rows: list[int], vocab: int, device) -> None:
        n = len(rows)
        out = [np.asarray(calls[r].penalty_tokens, dtype=np.int64) for r in rows]
        prompt = [np.asarray(calls[r].penalty_prompt, dtype=np.int64) for r in rows]
        counts = torch.zeros(n, vocab, device=device)
        seen = torch.zeros(n, vocab, dtype=torch.bool, device=device)
        if sum(map(len, out)):
            ids = torch.from_numpy(np.concatenate(out)).to(device)
            at = torch.from_numpy(np.repeat(np.arange(n), list(map(len, out)))).to(device)
            counts.index_put_((at, ids), torch.ones_like(ids, dtype=torch.float32), accumulate=True)
        if sum(map(len, prompt)):
            ids = torch.from_numpy(np.concatenate(prompt)).to(device)
            at = torch.from_numpy(np.repeat(np.arange(n), list(map(len, prompt)))).to(device)
            seen[at, ids] = True
        seen |= counts > 0

        def column(name: str) -> torch.Tensor:
            values = [float(getattr(calls[r], name)) for r in rows]
            return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)

        self.pen_rows = torch.tensor(rows, device=device)
        self.pen_counts, self.pen_seen = counts, seen
        self.repetition = column("repetition_penalty")
        self.frequency = column("frequency_penalty")
        self.presence = column("presence_penalty")

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Process float32 ``logits [R, V]`` in place (and return them)."""
        vocab = logits.shape[1]
        if self.mask_rows is not None:
            addend = mask_addend(self.mask_words, vocab)
            if len(self.mask_rows) == len(logits):
                logits.add_(addend)
            else:
                logits.index_add_(0, self.mask_rows, addend)
        if self.bias_rows is not None:
            logits.index_put_((self.bias_rows, self.bias_ids), self.bias_values, accumulate=True)
        if self.pen_rows is not None:
            rows = logits.index_select(0, self.pen_rows)
            rep = self.repetition
            scaled = torch.where(rows > 0, rows / rep, rows * rep)
            rows = torch.where(self.pen_seen, scaled, rows)
            rows -= self.frequency * self.pen_counts + self.presence * (self.pen_counts > 0)
            logits.index_copy_(0, self.pen_rows, rows)
        return logits


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """float32 log-probabilities of float32 logits ``[R, V]``."""
    return torch.log_softmax(logits, dim=-1)


def top_logprobs(logp: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``n`` most likely tokens of each row of log-probabilities and theirs."""
    values, ids = logp.topk(n, dim=-1) if n else (logp[:, :0], logp[:, :0].long())
    return ids, values


def token_logprobs(logp: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``logp[r, tokens[r]]`` for every row."""
    return logp.gather(1, tokens.long().unsqueeze(1)).squeeze(1)
