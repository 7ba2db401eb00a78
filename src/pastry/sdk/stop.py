"""Stop conditions for generation; combine with ``|`` (stop when any holds)."""

from __future__ import annotations

from collections.abc import Sequence


class StopCondition:
    # How many trailing tokens' text ``should_stop`` needs (0: none, so generation never
    # decodes while it runs).
    tail_tokens: int = 0
    # The most tokens generation can run to (None: no bound); a prefill reserves KV pages
    # for them, so a program admitted under memory pressure can finish.
    max_tokens: int | None = None

    def should_stop(self, tokens: list[int], text: str) -> bool:
        """``tokens``: generated so far; ``text``: the text of the last ``tail_tokens``."""
        raise NotImplementedError

    def trim(self, text: str) -> str:
        """The text to return once stopped (e.g. without the stop string)."""
        return text

    def __or__(self, other: StopCondition) -> StopCondition:
        return AnyOf([self, other])


class AnyOf(StopCondition):
    def __init__(self, conds: Sequence[StopCondition]) -> None:
        self.conds = list(conds)
        self.tail_tokens = max(c.tail_tokens for c in self.conds)
        bounds = [c.max_tokens for c in self.conds if c.max_tokens is not None]
        self.max_tokens = min(bounds) if bounds else None

    def should_stop(self, tokens, text) -> bool:
        return any(c.should_stop(tokens, text) for c in self.conds)

    def trim(self, text: str) -> str:
        for c in self.conds:
            text = c.trim(text)
        return text


class MaxTokens(StopCondition):
    def __init__(self, n: int) -> None:
        if n <= 0:
            raise ValueError(f"max tokens must be positive, got {n}")
        self.n = self.max_tokens = n

    def should_stop(self, tokens, text) -> bool:
        return len(tokens) >= self.n


class EosTokens(StopCondition):
    def __init__(self, ids: Sequence[int]) -> None:
        self.ids = frozenset(ids)

    def should_stop(self, tokens, text) -> bool:
        return bool(tokens) and tokens[-1] in self.ids


class StopStrings(StopCondition):
    def __init__(self, strings: Sequence[str]) -> None:
        self.strings = [s for s in strings if s]
        # a string of L characters spans at most 4 L byte-level tokens (+1 for a boundary)
        self.tail_tokens = 4 * max((len(s) for s in self.strings), default=0) + 1

    def should_stop(self, tokens, text) -> bool:
        return any(s in text for s in self.strings)

    def trim(self, text: str) -> str:
        cut = min((text.find(s) for s in self.strings if s in text), default=-1)
        return text if cut < 0 else text[:cut]


# (max tokens, stop token ids, stop strings) of a stop condition the control layer checks
LoopFields = tuple[int, list[int], list[str]]
UNBOUNDED = (1 << 31) - 1  # max_tokens of a loop that only a stop token or string ends


def loop_fields(stop: StopCondition, partial: bool = False) -> LoopFields | None:
    """``stop`` as the ``generate`` request's stop fields, or None if it is not made of
    :class:`MaxTokens`, :class:`EosTokens` and :class:`StopStrings` alone (a condition of
    the program's own is checked by the program, per token). ``partial``: the fields of
    the parts it is made of anyway, the others bounding only by their ``max_tokens``."""
    conds, ids, strings, bound = [stop], set(), [], UNBOUNDED
    while conds:
        c = conds.pop()
        if type(c) is AnyOf:
            conds.extend(c.conds)
        elif type(c) is MaxTokens:
            bound = min(bound, c.n)
        elif type(c) is EosTokens:
            ids |= c.ids
        elif type(c) is StopStrings:
            strings += c.strings
        elif not partial:
            return None
        elif c.max_tokens is not None:
            bound = min(bound, c.max_tokens)
    return bound, sorted(ids), strings
