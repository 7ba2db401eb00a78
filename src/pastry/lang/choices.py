"""How ``select`` turns the scores of its choices into a decision (SGLang's three methods).

A method gets, for each choice, the log-probabilities of the tokens that score it (see
:mod:`pastry.lang.scoring` for which tokens those are) and, when it asks for them, the same
tokens' *unconditional* log-probabilities (scored without the prompt). Ties go to the
earliest choice. Methods are objects: a new method is a new subclass.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Decision:
    choice: int  # index into the choices
    meta_info: dict[str, Any] = field(default_factory=dict)


class ChoicesMethod:
    """Picks one choice from per-token log-probabilities (one list per choice)."""

    requires_unconditional_logprobs: bool = False

    def decide(
        self,
        logprobs: Sequence[Sequence[float]],
        unconditional: Sequence[Sequence[float]] | None = None,
    ) -> Decision:
        raise NotImplementedError

    def __repr__(self) -> str:
        return type(self).__name__


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else -math.inf


def _argmax(values: Sequence[float]) -> int:
    return max(range(len(values)), key=lambda i: (values[i], -i))


class TokenLengthNormalized(ChoicesMethod):
    """The highest mean token log-probability (SGLang's default)."""

    def decide(self, logprobs, unconditional=None) -> Decision:
        normalized = [_mean(lp) for lp in logprobs]
        return Decision(_argmax(normalized), {"normalized_prompt_logprobs": normalized})


class GreedyTokenSelection(ChoicesMethod):
    """Token by token, keep the choices with the highest log-probability at that position
    until one is left; a choice shorter than the others continues with its mean."""

    def decide(self, logprobs, unconditional=None) -> Decision:
        width = max(len(lp) for lp in logprobs)
        matrix = [list(lp) + [_mean(lp)] * (width - len(lp)) for lp in logprobs]
        left = list(range(len(matrix)))
        for j in range(width):
            best = max(matrix[i][j] for i in left)
            left = [i for i in left if matrix[i][j] == best]
            if len(left) == 1:
                break
        normalized = [_mean(lp) for lp in logprobs]
        return Decision(
            left[0], {"normalized_prompt_logprobs": normalized, "greedy_logprob_matrix": matrix}
        )


class UnconditionalLikelihoodNormalized(ChoicesMethod):
    """The highest mean of (log-probability given the prompt − log-probability without it);
    the first token, which has no unconditional probability, counts 0 for the latter."""

    requires_unconditional_logprobs = True

    def decide(self, logprobs, unconditional=None) -> Decision:
        if unconditional is None:
            raise ValueError(f"{self!r} needs the unconditional log-probabilities")
        scores = [
            _mean([c - u for c, u in zip(lp, un, strict=True)])
            for lp, un in zip(logprobs, unconditional, strict=True)
        ]
        normalized = [_mean(lp) for lp in logprobs]
        meta = {
            "normalized_prompt_logprobs": normalized,
            "normalized_unconditional_prompt_logprobs": scores,
        }
        return Decision(_argmax(scores), meta)


token_length_normalized = TokenLengthNormalized()
greedy_token_selection = GreedyTokenSelection()
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()
