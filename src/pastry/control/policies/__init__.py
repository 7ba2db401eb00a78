"""Scheduler policies as objects: batching (:mod:`.batching`: when to dispatch, batch
caps) and scheduling (:mod:`.schedule`: which queues go first). A new policy is a new
class, not a new branch in the scheduler."""

from pastry.control.policies.batching import (
    BATCH_POLICIES,
    Adaptive,
    BatchPolicy,
    Eager,
    KOnly,
    SchedulerState,
    TOnly,
    batch_policy,
)
from pastry.control.policies.schedule import Fcfs, SchedulePolicy

__all__ = [
    "BATCH_POLICIES",
    "Adaptive",
    "BatchPolicy",
    "Eager",
    "Fcfs",
    "KOnly",
    "SchedulePolicy",
    "SchedulerState",
    "TOnly",
    "batch_policy",
]
