"""Batching policies: when the batch scheduler dispatches, and how big a batch may be.

A :class:`BatchPolicy` is a frozen configuration with one coroutine, :meth:`~BatchPolicy.wait`,
and three caps. The scheduler (:class:`~pastry.control.scheduler.BatchScheduler`) runs:

1. wait until a command is submitted or a batch completes;
2. if ``max_inflight`` batches are on the engine, prepare the next batch (take and translate
   what is ready) and go back to 1;
3. otherwise ``await policy.wait(state)``, then form and dispatch batches (each within
   ``max_queues`` and ``max_forwards``) until nothing is ready or ``max_inflight`` are out.

The four policies of the Pie paper (§6): :class:`Adaptive` (the default), :class:`Eager`,
:class:`KOnly` and :class:`TOnly`. :func:`batch_policy` builds one by its name (the CLI's
``--policy``). A new policy is a new subclass here or in a new file of this package.
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import time
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol


class SchedulerState(Protocol):
    """What a batching policy may read of the scheduler while it waits (read only)."""

    @property
    def submitted(self) -> int:
        """Commands submitted since the scheduler started (only ever grows)."""
        ...

    def ready_count(self) -> int:
        """Commands ready to go: those already taken into the batch being formed, plus
        one per queue that has a pending command."""
        ...


class BatchPolicy(abc.ABC):
    """When to dispatch and the caps of a batch (see the module docstring for the loop).

    Contract: :meth:`wait` is awaited on the scheduler's event loop each time the engine has
    room for another batch (fewer than ``max_inflight`` in flight) and something was
    submitted or completed; the batches are formed when it returns. It may sleep or yield
    to the event loop (that is how it lets commands accumulate) and read ``state``
    (:class:`SchedulerState`); it must not take, submit or dispatch commands, and it must
    return (a policy that never returns stops the scheduler). The caps are read once per
    batch: ``None`` means no limit besides the engine's ``max_batch_tokens``.
    """

    name: ClassVar[str]

    @property
    def max_queues(self) -> int | None:
        """Most queues that contribute commands to one batch."""
        return None

    @property
    def max_forwards(self) -> int | None:
        """Most forward calls in one batch."""
        return None

    max_inflight: int = 1  # batches on the engine at once (>1: pipelining, remote engines)

    @abc.abstractmethod
    async def wait(self, state: SchedulerState) -> None:
        """Return when the next batch should be formed."""

    @abc.abstractmethod
    def describe(self) -> str:
        """One line for logs and benchmark tables, e.g. ``k-only (k=64, ...)``."""

    def _check_inflight(self) -> None:
        if not isinstance(self.max_inflight, int) or self.max_inflight < 1:
            raise ValueError(
                f"{self.name}: max_inflight must be an integer >= 1 (batches on the engine "
                f"at once), got {self.max_inflight!r}"
            )


def _positive(policy: str, name: str, value: Any) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{policy}: {name} must be a positive number, got {value!r}")


@dataclass(frozen=True)
class Adaptive(BatchPolicy):
    """Work-conserving: dispatch as soon as the engine is idle, after letting the inferlets
    that the last results woke up queue their next calls.

    It yields event-loop turns until one passes without a new command (at least
    ``settle_ticks``, at most ``max_settle_ticks``): a batch sent earlier would leave late
    inferlets to the next one, and their Python work would then compete with the engine for
    the CPU (and, in process, the GIL) while it runs.
    """

    name: ClassVar[str] = "adaptive"
    settle_ticks: int = 3
    max_settle_ticks: int = 64
    max_inflight: int = 1

    def __post_init__(self) -> None:
        self._check_inflight()
        if not 0 <= self.settle_ticks <= self.max_settle_ticks:
            raise ValueError(
                f"adaptive: need 0 <= settle_ticks <= max_settle_ticks, got "
                f"{self.settle_ticks} and {self.max_settle_ticks}"
            )

    async def wait(self, state: SchedulerState) -> None:
        seen = state.submitted
        for tick in range(self.max_settle_ticks):
            await asyncio.sleep(0)
            if tick + 1 >= self.settle_ticks and state.submitted == seen:
                return
            seen = state.submitted

    def describe(self) -> str:
        return f"adaptive (when idle, {self.settle_ticks} settle ticks)"


@dataclass(frozen=True)
class Eager(BatchPolicy):
    """No horizontal batching: each queue's ready commands go out at once as their own
    batch (one queue per batch), without waiting."""

    name: ClassVar[str] = "eager"
    max_inflight: int = 1

    def __post_init__(self) -> None:
        self._check_inflight()

    @property
    def max_queues(self) -> int | None:
        return 1

    async def wait(self, state: SchedulerState) -> None:
        return None

    def describe(self) -> str:
        return "eager (every pending command at once)"


@dataclass(frozen=True)
class KOnly(BatchPolicy):
    """Batches of at most ``k`` forward calls, sent when ``k`` commands are ready or after
    ``t_ms`` (polling every millisecond at most)."""

    name: ClassVar[str] = "k-only"
    k: int = 64
    t_ms: float = 5.0
    max_inflight: int = 1

    def __post_init__(self) -> None:
        self._check_inflight()
        if not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"k-only: k must be an integer >= 1, got {self.k!r}")
        _positive("k-only", "t_ms", self.t_ms)

    @property
    def max_forwards(self) -> int | None:
        return self.k

    async def wait(self, state: SchedulerState) -> None:
        deadline = time.perf_counter() + self.t_ms / 1e3
        while state.ready_count() < self.k and time.perf_counter() < deadline:
            await asyncio.sleep(min(1e-3, self.t_ms / 1e3))

    def describe(self) -> str:
        return f"k-only (k={self.k}, give up after {self.t_ms:g} ms)"


@dataclass(frozen=True)
class TOnly(BatchPolicy):
    """A batch every ``t_ms``, whatever is ready."""

    name: ClassVar[str] = "t-only"
    t_ms: float = 5.0
    max_inflight: int = 1

    def __post_init__(self) -> None:
        self._check_inflight()
        _positive("t-only", "t_ms", self.t_ms)

    async def wait(self, state: SchedulerState) -> None:
        await asyncio.sleep(self.t_ms / 1e3)

    def describe(self) -> str:
        return f"t-only (every {self.t_ms:g} ms)"


BATCH_POLICIES: dict[str, type[BatchPolicy]] = {p.name: p for p in (Adaptive, Eager, KOnly, TOnly)}


def batch_policy(name: str, **params: Any) -> BatchPolicy:
    """The batching policy called ``name`` (``adaptive``, ``eager``, ``k-only``, ``t-only``)
    with ``params`` (its dataclass fields, e.g. ``k=32`` for ``k-only``)."""
    cls = BATCH_POLICIES.get(name)
    if cls is None:
        raise ValueError(f"unknown batching policy '{name}' (one of {', '.join(BATCH_POLICIES)})")
    fields = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(params) - set(fields))
    if unknown:
        raise ValueError(
            f"batching policy '{name}' takes no parameter {', '.join(map(repr, unknown))} "
            f"(it takes {', '.join(fields)})"
        )
    return cls(**params)
