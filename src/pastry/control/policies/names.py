"""Schedule policies by name (``pastry serve --schedule``): :func:`schedule_policy`."""

from __future__ import annotations

from typing import Any

from pastry.control.policies.atlas import Atlas
from pastry.control.policies.mlfq import Mlfq
from pastry.control.policies.plas import Plas
from pastry.control.policies.schedule import Fcfs, SchedulePolicy

POLICIES: dict[str, type[SchedulePolicy]] = {p.name: p for p in (Fcfs, Mlfq, Plas, Atlas)}
SCHEDULES: tuple[str, ...] = tuple(POLICIES)
# The best measured (benchmarks/RESULTS.md, "Scheduling"): on the simulator's mixed
# workload in steady state, at saturation, PLAS had the lowest average and P99 latency
# (ATLAS favours wide programs, which costs the others); the two are the same policy on
# single-threaded programs. ATLAS is the choice for a server of mostly parallel programs
# (it minds their critical path); FCFS for many short, alike tool-using programs at
# KV-memory saturation (RESULTS.md, simulator, bfcl: with admission by memory PLAS no
# longer thrashes there, but least-attained-service loses to FCFS on alike programs).
DEFAULT_SCHEDULE = "plas"


def schedule_policy(name: str, **params: Any) -> SchedulePolicy:
    """A new schedule policy called ``name`` (``fcfs``, ``mlfq``, ``plas``, ``atlas``) with
    ``params`` (its constructor's keyword arguments)."""
    cls = POLICIES.get(name)
    if cls is None:
        raise ValueError(f"unknown schedule policy '{name}' (one of {', '.join(SCHEDULES)})")
    try:
        return cls(**params)
    except TypeError as e:
        raise ValueError(f"schedule policy '{name}': {e}") from None
