"""Samplers: how a Context picks the next token.

The built-in samplers run on the device (one ``sample`` call; only the token id comes
back). A sampler that needs the distribution overrides :meth:`Sampler.choose`, which gets
the top-k distribution from ``get_next_dist``.
"""

from __future__ import annotations

from dataclasses import dataclass

from pastry.api import Sampling


@dataclass(frozen=True)
class Sampler:
    """Temperature sampling with optional top-k / top-p / min-p filters (0 = greedy)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None

    on_device = True

    def choose(self, ids: list[int], probs: list[float]) -> int:
        """Pick a token from a top-k distribution (for samplers with ``on_device = False``)."""
        raise NotImplementedError

    def sampling(self, step: int) -> Sampling | None:
        """The :class:`~pastry.api.Sampling` record of generated token ``step`` (the seed
        advances by one per token); None for greedy without a seed (the fast path)."""
        if self.seed is None:
            if self.temperature == 0.0 and self.top_k == 0 and self.top_p == 1.0 and not self.min_p:
                return None
            return Sampling(self.temperature, self.top_k, self.top_p, self.min_p)
        return Sampling(self.temperature, self.top_k, self.top_p, self.min_p, self.seed + step)

    def params(self, step: int) -> dict:
        """:meth:`sampling`'s fields as keywords (``sample(q, e, **params)``)."""
        seed = None if self.seed is None else self.seed + step
        return dict(
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
            seed=seed,
        )


def Greedy() -> Sampler:
    return Sampler()


def TopK(k: int, temperature: float = 1.0, seed: int | None = None) -> Sampler:
    return Sampler(temperature=temperature, top_k=k, seed=seed)


def TopP(p: float, temperature: float = 1.0, seed: int | None = None) -> Sampler:
    return Sampler(temperature=temperature, top_p=p, seed=seed)


def MinP(p: float, temperature: float = 1.0, seed: int | None = None) -> Sampler:
    return Sampler(temperature=temperature, min_p=p, seed=seed)
