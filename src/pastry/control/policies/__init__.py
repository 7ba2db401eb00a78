"""Scheduler policies as objects: batching (:mod:`.batching`: when to dispatch, batch
caps), scheduling (:mod:`.schedule`: which queues go first, who is preempted; FCFS
there, MLFQ in :mod:`.mlfq`, PLAS in :mod:`.plas`, ATLAS in :mod:`.atlas`), admission
(:mod:`.admission`: which waiting prefills go first; cache-aware), admission by memory
(:mod:`.memory`: which programs may hold KV on the device) and eviction across
users (:mod:`.eviction`: who ends when memory runs out). A new policy is a new class, not a
new branch in the scheduler."""

from pastry.control.policies.admission import (
    ADMISSION_POLICIES,
    AdmissionPolicy,
    CacheAwareSchedule,
    FirstComeFirstServed,
    LongestPrefixMatch,
    RandomOrder,
    admission_policy,
)
from pastry.control.policies.atlas import Atlas
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
from pastry.control.policies.eviction import FairShare
from pastry.control.policies.memory import MemoryAdmission
from pastry.control.policies.mlfq import Levels, Mlfq, MultilevelQueues
from pastry.control.policies.names import DEFAULT_SCHEDULE, SCHEDULES, schedule_policy
from pastry.control.policies.plas import Plas
from pastry.control.policies.schedule import Fcfs, SchedulePolicy

__all__ = [
    "ADMISSION_POLICIES",
    "BATCH_POLICIES",
    "DEFAULT_SCHEDULE",
    "SCHEDULES",
    "Adaptive",
    "AdmissionPolicy",
    "Atlas",
    "BatchPolicy",
    "CacheAwareSchedule",
    "Eager",
    "FairShare",
    "Fcfs",
    "FirstComeFirstServed",
    "KOnly",
    "Levels",
    "LongestPrefixMatch",
    "MemoryAdmission",
    "Mlfq",
    "MultilevelQueues",
    "Plas",
    "RandomOrder",
    "SchedulePolicy",
    "SchedulerState",
    "TOnly",
    "admission_policy",
    "batch_policy",
    "schedule_policy",
]
