"""The sampler's noise and what it may pick: never a token the logit processing removed."""

from __future__ import annotations

import torch

from pastry.engine.sampling import SamplingParams, sample, unit_interval

VOCAB = 49152  # SmolLM2's: the size at which the old 24-bit noise failed ~0.3% of rows


def test_noise_is_strictly_inside_the_unit_interval():
    extremes = torch.tensor([0, 0x1FF, 0xFFFFFE00, 0xFFFFFFFF], dtype=torch.int64)
    u = unit_interval(extremes)
    assert u.dtype == torch.float32
    assert bool((u > 0).all()) and bool((u < 1).all())
    assert u[-1].item() == 1 - 2**-24  # exact in float32: the largest value
    g = -torch.log(-torch.log(u))
    assert bool(torch.isfinite(g).all())


def _params(n: int, seeds: torch.Tensor, **kw) -> SamplingParams:
    return SamplingParams(
        temperature=torch.full((n,), kw.get("temperature", 1.0)),
        top_k=torch.full((n,), kw.get("top_k", 0), dtype=torch.int64),
        top_p=torch.full((n,), kw.get("top_p", 1.0)),
        min_p=torch.full((n,), kw.get("min_p", 0.0)),
        seed=seeds,
    )


def test_masked_tokens_are_never_sampled():
    """Rows where only 10 tokens are allowed (the rest -inf, as a grammar's mask leaves
    them): 3000 seeded draws, plain and through the top-k/top-p path, all allowed. With
    noise that could reach 1.0, about 9 of the 3000 would have picked a forbidden token."""
    allowed = torch.arange(32, 42)
    rows, batches = 250, 12
    for kw in ({}, {"top_k": 5}, {"top_p": 0.9}):
        for b in range(batches):
            logits = torch.full((rows, VOCAB), float("-inf"))
            logits[:, allowed] = torch.randn(
                rows, len(allowed), generator=torch.Generator().manual_seed(b)
            )
            seeds = torch.arange(b * rows, (b + 1) * rows, dtype=torch.int64) * 7919 + 11
            got = sample(logits, _params(rows, seeds, **kw))
            assert bool(torch.isin(got, allowed).all()), (kw, got[~torch.isin(got, allowed)])
