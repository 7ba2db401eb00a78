"""On-device sampling and top-k distributions.

Sampling uses the exponential-race (Gumbel-max) trick with noise that is a pure function of
(seed, token id): a row's draw depends only on its own logits and seed, never on which other
rows share the batch or on how the vocabulary was sorted. Greedy rows take a plain argmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_M32 = 0xFFFFFFFF


@dataclass(slots=True)
class SamplingParams:
    """Per-row parameters as device tensors of shape ``[B]``."""

    temperature: torch.Tensor  # float32; 0 = greedy
    top_k: torch.Tensor  # int64; 0 = off
    top_p: torch.Tensor  # float32; 1 = off
    min_p: torch.Tensor  # float32; 0 = off
    seed: torch.Tensor  # int64


def hash_uniform(seed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Uniform (0, 1) float32 noise from a 32-bit integer hash of (seed, id), elementwise.

    23 bits of the hash, so that ``k + 0.5`` is exact in float32 and the largest value
    stays below 1 (with 24 bits, ``2**24 - 0.5`` rounds to ``2**24``: u = 1, Gumbel noise
    +inf, and that token won the draw whatever its probability, or a masked one came out
    as NaN = -inf + inf: about 0.3% of sampled steps over a 49k vocabulary)."""
    s = (seed ^ (seed >> 32)) & _M32
    x = (s * 0x9E3779B1 + ids * 0x85EBCA77 + 0x165667B1) & _M32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    x = x ^ (x >> 16)
    return ((x >> 9).float() + 0.5) * (1.0 / (1 << 23))


def sample(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Token ids ``[B]`` from float32 logits ``[B, V]``."""
    out = logits.argmax(dim=-1)
    stochastic = p.temperature > 0
    if not bool(stochastic.any()):
        return out
    rows = stochastic.nonzero().squeeze(1)
    if len(rows) == len(out):
        out = _sample_rows(logits, p.temperature, p.top_k, p.top_p, p.min_p, p.seed)
    else:
        out[rows] = _sample_rows(
            logits[rows],
            p.temperature[rows],
            p.top_k[rows],
            p.top_p[rows],
            p.min_p[rows],
            p.seed[rows],
        )
    return out


def _sample_rows(logits, temperature, top_k, top_p, min_p, seed) -> torch.Tensor:
    logits = logits / temperature.unsqueeze(1)
    seed = seed.unsqueeze(1)
    vocab = logits.shape[1]
    if not bool(((top_k > 0) | (top_p < 1) | (min_p > 0)).any()):
        ids = torch.arange(vocab, device=logits.device).unsqueeze(0)
        return (logits + _gumbel(seed, ids)).argmax(dim=-1)
    # Filtered rows: work in sorted order (descending), drop the filtered tail, race the rest.
    sorted_logits, ids = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    rank = torch.arange(vocab, device=logits.device).unsqueeze(0)
    drop = (top_k.unsqueeze(1) > 0) & (rank >= top_k.unsqueeze(1))
    drop |= (probs.cumsum(dim=-1) - probs) > top_p.unsqueeze(1)  # keeps at least the top token
    drop |= probs < (min_p.unsqueeze(1) * probs[:, :1])
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    choice = (sorted_logits + _gumbel(seed, ids)).argmax(dim=-1, keepdim=True)
    return ids.gather(1, choice).squeeze(1)


def _gumbel(seed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return -torch.log(-torch.log(hash_uniform(seed, ids)))


def top_k_dist(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` most likely tokens of each row and their probabilities (float32)."""
    probs = logits.softmax(dim=-1)
    values, ids = probs.topk(min(k, probs.shape[-1]), dim=-1)
    return ids, values
