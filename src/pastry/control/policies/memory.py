"""Admission by memory: programs come into device memory only while their KV fits.

Pastry's programs keep their KV between calls (an inferlet holds its pages through its
tool calls and think times), so device memory is held by *programs*, not only by running
calls as in vLLM. When the programs alive need more pages than the device has, giving
memory to whoever ranks best (PLAS: the newest programs first) swaps out programs that are
waiting in the middle of their work; they come back for their next step and push out
others in turn, so the device holds more programs than fit and spends its time copying
(thrashing). The classic answer (Denning's working sets) is load control: a program comes
into memory only while the working set of the programs already in — those with a command
pending or running — still fits, and the others wait without taking anyone's pages.

A program is **out** when none of its own KV pages are on the device: a new program whose
first pages were allocated short of device memory (they start on the host), or one whose
pages were swapped out. The :class:`~pastry.control.swap.KvSwapper` brings an out program
in only when the pages it holds (which include its next forward's: an inferlet allocates
them before it queues the forward, so "its context plus the next step's growth" is what it
holds) fit in

    free device pages  +  pages of idle programs that may give way

where an *idle* program has no command pending or running for at least
:attr:`MemoryAdmission.min_idle_s` (it is in a tool call, or waiting for its client) and
ranks after the out program (the swapper's other rules hold: not on the engine, back for at
least ``min_resident`` batches). Idle programs give way, the last-ranked first; a program
that is waiting for a batch is never pushed out to admit another. Out programs are
considered in the schedule policy's order (so the priority order is kept). With
:attr:`MemoryAdmission.head_of_line`, the first that does not fit stops the admission of
the out programs after it in that pass (as Autellix's Algorithm 1 line 37 and vLLM's
admission), so the memory that ending programs free is saved up for it; off by default:
on the simulator's ShareGPT at saturation it made FCFS 1.46x slower on average (a large
returning conversation first in line held back every small one behind it) against 1.13x
without it (``docs/scheduling.md``).

A program that is in and needs more pages (its next forward's pages were allocated short
of device memory) still takes them from programs that rank after it, waiting ones included
(the swapper's rules: idle programs first, only strictly better ranks, ``min_resident``).

The paper (digest §3.6-3.7) builds each batch in priority order while ``engine.can_fit(c)``
and stops at the first call that does not fit; calls left out are preempted and their KV
swapped. It does not say what "fits" counts for a program that holds KV between calls (in
vLLM a finished call's KV is released), nor what to do about programs in long interrupts
(its process table tracks the last completion "for detecting long external interrupts");
this object is Pastry's answer.
"""

from __future__ import annotations

from dataclasses import dataclass

from pastry.control.programs import Program


@dataclass(frozen=True)
class MemoryAdmission:
    """The admission rule (module docstring). ``min_idle_s``: how long a program in memory
    must have had no command pending or running before it gives way to an out program (0:
    as soon as it is idle; ``inf``: never, so out programs wait for free pages).
    ``head_of_line``: an out program that does not fit holds back the out programs after
    it in the policy's order for the rest of the scheduling pass."""

    min_idle_s: float = 0.0
    head_of_line: bool = False

    def __post_init__(self) -> None:
        if not (isinstance(self.min_idle_s, int | float) and self.min_idle_s >= 0):
            raise ValueError(f"min_idle_s must be seconds >= 0, got {self.min_idle_s!r}")

    def gives_way(self, program: Program, now: float) -> bool:
        """Whether ``program`` (in memory) may be swapped out to admit an out program:
        nothing pending or running for at least ``min_idle_s``."""
        if program.active:
            return False
        last = program.last_completion
        return now - (last if last is not None else program.started) >= self.min_idle_s

    def describe(self) -> str:
        hol = ", head-of-line" if self.head_of_line else ""
        return f"admission by memory (idle programs give way after {self.min_idle_s:g} s{hol})"
