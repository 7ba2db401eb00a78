"""Admission order: which waiting prefills go first when not all fit (cache-aware scheduling).

A cache-aware prefill (:mod:`pastry.control.prefill`) waits at the head of its queue until
it is *admitted*: taken into a batch, its cached prefix shared and its fresh pages
allocated. When more prefills wait than one batch holds (``max_batch_tokens``) or than the
free and evictable KV pages allow, the order of admission decides which go now — and so
what the prefix cache still holds when the next ones are admitted. SGLang (§5.2) sorts
waiting requests by the length of their cached prefix (longest prefix match, LPM) so that
requests sharing what is cached run while it is cached, instead of thrashing it.

- :class:`AdmissionPolicy` — orders the queues waiting to admit a prefill (their head
  command carries an :class:`~pastry.control.prefill.Admission`: its tokens, arrival time
  and ``cached()``, the tokens the cache would supply now).
- :class:`LongestPrefixMatch` (``lpm``, the default), :class:`FirstComeFirstServed`
  (``fcfs``), :class:`RandomOrder` (``random``).
- :class:`CacheAwareSchedule` — a :class:`~pastry.control.policies.schedule.SchedulePolicy`
  that composes any other schedule policy (which decides how waiting prefills interleave
  with other work, e.g. running decodes or program-aware priorities) with an admission
  policy (which decides *which* prefill takes each place the inner policy gives to one),
  plus the starvation guard. Preemption ranks (:meth:`SchedulePolicy.rank`) and the
  process table binding are the inner policy's.

Starvation guard: an admission that has waited ``max_wait_batches`` dispatched batches is
*starved*. Starved admissions go before all others, oldest first, whatever the policy says;
and while a starved admission cannot get its KV pages, no other admission takes any (the
pages that running programs release are saved up for it). So no prefill is passed over for
more than ``max_wait_batches`` batches plus the time the starved ones before it take, and
the wait for memory is bounded by how long running programs hold their pages.
"""

from __future__ import annotations

import abc
import random
from collections.abc import Callable, Sequence
from typing import ClassVar

from pastry.control.policies.schedule import SchedulePolicy
from pastry.control.policies.views import AdmissionView, CommandView, QueueView
from pastry.control.programs import ProcessTable, Program


def _admission(q: QueueView) -> AdmissionView:
    return q.pending[0].admission


class AdmissionPolicy(abc.ABC):
    """The order in which waiting prefills are admitted.

    Contract: :meth:`order` is called on the scheduler's event loop with the queues whose
    head command is a prefill waiting for admission (``queue.pending[0].admission``, an
    :class:`~pastry.control.prefill.Admission`), in the order the inner schedule policy
    ranks them; it returns the same queues in the order to admit them. It may call
    ``admission.cached()`` (a walk of the prefix tree, cached until the tree changes) and
    read ``tokens``, ``kv_len`` and ``arrived``; it must not change queues or commands.
    """

    name: ClassVar[str]

    @abc.abstractmethod
    def order(self, waiting: Sequence[QueueView]) -> list[QueueView]: ...

    def describe(self) -> str:
        return self.name


class LongestPrefixMatch(AdmissionPolicy):
    """SGLang's LPM: the most tokens the cache would supply first; ties keep the inner
    policy's order."""

    name: ClassVar[str] = "lpm"

    def order(self, waiting: Sequence[QueueView]) -> list[QueueView]:
        return sorted(waiting, key=lambda q: -_admission(q).cached())

    def describe(self) -> str:
        return "lpm (longest cached prefix first)"


class FirstComeFirstServed(AdmissionPolicy):
    """The oldest prefill first (the inner policy's order among equals)."""

    name: ClassVar[str] = "fcfs"

    def order(self, waiting: Sequence[QueueView]) -> list[QueueView]:
        return sorted(waiting, key=lambda q: _admission(q).arrived)

    def describe(self) -> str:
        return "fcfs (oldest prefill first)"


class RandomOrder(AdmissionPolicy):
    """A random order, seeded (the paper's "Random" baseline)."""

    name: ClassVar[str] = "random"

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def order(self, waiting: Sequence[QueueView]) -> list[QueueView]:
        out = list(waiting)
        self._rng.shuffle(out)
        return out

    def describe(self) -> str:
        return "random order"


ADMISSION_POLICIES: dict[str, Callable[[], AdmissionPolicy]] = {
    p.name: p for p in (LongestPrefixMatch, FirstComeFirstServed, RandomOrder)
}


def admission_policy(name: str) -> AdmissionPolicy:
    """The admission policy called ``name`` (``lpm``, ``fcfs`` or ``random``)."""
    make = ADMISSION_POLICIES.get(name)
    if make is None:
        raise ValueError(
            f"unknown admission policy '{name}' (one of {', '.join(ADMISSION_POLICIES)})"
        )
    return make()


class CacheAwareSchedule(SchedulePolicy):
    """``inner`` orders all ready queues; among the places it gives to queues waiting to
    admit a prefill, ``admission`` decides which prefill takes which (starved ones first,
    see the module docstring). ``on_batch_done`` is passed on to ``inner``."""

    def __init__(
        self, inner: SchedulePolicy, admission: AdmissionPolicy, max_wait_batches: int = 64
    ) -> None:
        if not isinstance(max_wait_batches, int) or max_wait_batches < 1:
            raise ValueError(f"max_wait_batches must be an integer >= 1, got {max_wait_batches!r}")
        self.inner = inner
        self.admission = admission
        self.max_wait_batches = max_wait_batches
        self.batches = 0  # batches dispatched and done

    def bind(self, programs: ProcessTable) -> None:
        super().bind(programs)
        self.inner.bind(programs)

    def rank(self, program: Program) -> tuple[float, ...]:
        return self.inner.rank(program)

    def describe(self) -> str:
        return f"{self.inner.describe()}, admission {self.admission.describe()}"

    def order(self, ready: Sequence[QueueView]) -> list[QueueView]:
        ranked = self.inner.order(ready)
        places = [i for i, q in enumerate(ranked) if q.pending[0].admission is not None]
        if not places:
            return ranked
        waiting = [ranked[i] for i in places]
        starved = []
        for q in waiting:
            a = _admission(q)
            if a.seen is None:
                a.seen = self.batches
            if self.batches - a.seen >= self.max_wait_batches:
                a.starved = True
                starved.append(q)
        if len(waiting) > 1:
            rest = [q for q in waiting if not _admission(q).starved]
            starved.sort(key=lambda q: _admission(q).arrived)
            waiting = starved + self.admission.order(rest)
        out = list(ranked)
        for i, q in zip(places, waiting, strict=True):
            out[i] = q
        return out

    def on_batch_done(self, batch: Sequence[CommandView], elapsed_s: float) -> None:
        self.batches += 1
        self.inner.on_batch_done(batch, elapsed_s)


__all__ = [
    "ADMISSION_POLICIES",
    "AdmissionPolicy",
    "CacheAwareSchedule",
    "FirstComeFirstServed",
    "LongestPrefixMatch",
    "RandomOrder",
    "admission_policy",
]
