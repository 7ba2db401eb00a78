"""Simulated serving systems by name: :func:`system_named`.

``vllm`` (the paper's baseline, :mod:`pastry.sched.vllm`), ``srpt`` (clairvoyant shortest
remaining work, :mod:`pastry.sched.srpt`) or one of Pastry's scheduling policies (``fcfs``,
``mlfq``, ``plas``, ``atlas``: the real policy objects), for :func:`pastry.sched.sim.simulate`.
"""

from __future__ import annotations

from pastry.control.policies import schedule_policy
from pastry.sched.sim import System
from pastry.sched.srpt import Srpt
from pastry.sched.vllm import Vllm


def system_named(name: str) -> System:
    """A fresh system by name (policies keep per-scheduler state): ``vllm``, ``srpt`` or a
    scheduling policy's name."""
    if name == "vllm":
        return Vllm()
    if name == "srpt":
        return lambda sim: Srpt(sim.remaining_steps)
    return schedule_policy(name)
