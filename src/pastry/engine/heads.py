"""The output heads: next-token distributions, samples and log-probabilities.

The ``NextDist`` and ``Sample`` rows of a batch share one ``lm_head`` and one pass of
logit processing (:mod:`pastry.engine.logits`); then the distributions take the top ``k``
of the processed logits, the samples draw on the device (:mod:`pastry.engine.sampling`),
and log-probabilities come from the raw logits. A prompt's log-probabilities (``Forward``
with ``logprob_targets``) are read here too, in chunks of rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from pastry.engine.logits import LogitsProcessor, log_softmax, token_logprobs, top_logprobs
from pastry.engine.model import LlamaModel
from pastry.engine.sampling import SamplingParams, sample, top_k_dist
from pastry.wire.calls import Dist, Logprobs, NextDist, Result, Sample, Sampled

# Rows of prompt log-probabilities computed at once (bounds the [rows, vocab] logits).
LOGPROB_CHUNK = 256


class OutputHeads:
    """The model's output rows turned into results; ``seed`` seeds the draws of samples
    that name no seed of their own (one random stream per engine)."""

    def __init__(self, model: LlamaModel, device: torch.device, seed: int | None) -> None:
        self.model, self.device = model, device
        self._rng = np.random.default_rng(seed)

    def outputs(self, calls: Sequence[NextDist | Sample], hidden: torch.Tensor) -> list[Result]:
        """One result per call, from ``hidden`` (row ``r`` = ``calls[r]``'s hidden state):
        one lm_head, one pass of logit processing, then the distributions, the samples and
        their log-probabilities."""
        results: list[Result] = [None] * len(calls)
        logits = self.model.logits(hidden)
        want_lp = [r for r, c in enumerate(calls) if isinstance(c, Sample) and c.logprobs >= 0]
        logp = log_softmax(logits[want_lp]) if want_lp else None  # raw: before processing
        processor = LogitsProcessor.build(calls, logits.shape[1], self.device)
        if processor is not None:
            processor.apply(logits)
        dists = [r for r, c in enumerate(calls) if isinstance(c, NextDist)]
        if dists:
            self._dists(
                calls, dists, logits if len(dists) == len(calls) else logits[dists], results
            )
        samples = [r for r, c in enumerate(calls) if isinstance(c, Sample)]
        if samples:
            rows = logits if len(samples) == len(calls) else logits[samples]
            tokens = self._sample([calls[r] for r in samples], rows)
            self._finish_samples(calls, samples, want_lp, logp, tokens, results)
        return results

    @staticmethod
    def _dists(calls, dists: list[int], rows: torch.Tensor, results: list[Result]) -> None:
        ids, probs = top_k_dist(rows, max(calls[r].k for r in dists))
        ids, probs = ids.cpu().numpy(), probs.cpu().numpy()
        for j, r in enumerate(dists):
            k = calls[r].k
            results[r] = Dist(ids=ids[j, :k].copy(), probs=probs[j, :k].copy())

    def _sample(self, sc: list[Sample], rows: torch.Tensor) -> torch.Tensor:
        if all(c.temperature == 0 for c in sc):
            # all greedy: the argmax, without building the sampling parameters (the seeds
            # are still drawn, so that later unseeded samples see the same random stream)
            for c in sc:
                if c.seed is None:
                    self._draw_seed()
            return rows.argmax(dim=-1)
        dev = self.device
        params = SamplingParams(
            temperature=torch.tensor([float(c.temperature) for c in sc], device=dev),
            top_k=torch.tensor([c.top_k for c in sc], dtype=torch.int64, device=dev),
            top_p=torch.tensor([float(c.top_p) for c in sc], device=dev),
            min_p=torch.tensor([float(c.min_p) for c in sc], device=dev),
            seed=torch.tensor(
                [self._draw_seed() if c.seed is None else c.seed for c in sc],
                dtype=torch.int64,
                device=dev,
            ),
        )
        return sample(rows, params)

    @staticmethod
    def _finish_samples(calls, samples, want_lp, logp, tokens_t, results) -> None:
        """The sampled rows' results: the token, or with its log-probabilities when asked."""
        tokens = tokens_t.tolist()
        for r, t in zip(samples, tokens, strict=True):
            results[r] = t
        if logp is None:
            return
        at = {r: j for j, r in enumerate(samples)}
        chosen = token_logprobs(logp, tokens_t[[at[r] for r in want_lp]]).tolist()
        top_ids, top_lps = top_logprobs(logp, max(calls[r].logprobs for r in want_lp))
        top_ids, top_lps = top_ids.cpu().numpy(), top_lps.cpu().numpy()
        for j, r in enumerate(want_lp):
            n = calls[r].logprobs
            results[r] = Sampled(
                tokens[at[r]], chosen[j], top_ids[j, :n].copy(), top_lps[j, :n].copy()
            )

    def _draw_seed(self) -> int:
        return int(self._rng.integers(0, 1 << 62))

    def prompt_logprobs(self, hidden, first: int, targets: np.ndarray, top: int) -> Logprobs:
        """Log-probabilities of ``targets`` at rows ``first ...`` of ``hidden``, in chunks."""
        n = len(targets)
        lp = np.full(n, np.nan, dtype=np.float32)
        ids = np.zeros((n, top), dtype=np.int64)
        lps = np.zeros((n, top), dtype=np.float32)
        for s in range(0, n, LOGPROB_CHUNK):
            e = min(n, s + LOGPROB_CHUNK)
            logp = log_softmax(self.model.logits(hidden[first + s : first + e]))
            t = torch.from_numpy(np.maximum(targets[s:e], 0)).to(self.device)
            got = token_logprobs(logp, t).cpu().numpy()
            lp[s:e] = np.where(targets[s:e] >= 0, got, np.nan)
            if top:
                ti, tv = top_logprobs(logp, top)
                ids[s:e], lps[s:e] = ti.cpu().numpy(), tv.cpu().numpy()
        return Logprobs(lp, ids, lps)
