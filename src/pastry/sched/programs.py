"""Program shapes shared by the simulator and the real-engine benchmark.

A :class:`ProgramSpec` is what a synthetic agentic program does, without its text: a
sequence of :class:`Stage` s, each a set of LLM calls that run in parallel (one thread
each; one call for a single-threaded program), followed by an interrupt (a tool call, a
human turn) before the next stage. A call appends ``prefill`` new input tokens to its
thread's context and generates ``decode`` tokens.

Threads: the program's *root* context lives from its first call to its end. In a stage,
call 0 runs on the root (extending it) and every other call on a fork of the root made
for the stage (sharing the root's context so far) and released after it; with
``fork=True`` every call runs on a fork and the root stays as it was (a tree search
whose calls branch from one node). The same spec runs on the simulator
(:mod:`pastry.sched.sim`) and, as an inferlet, on the real engine
(:mod:`pastry.sched.replay`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class CallSpec:
    prefill: int  # new input tokens (the context grows by these, then by the output)
    decode: int  # tokens generated (>= 1)

    def __post_init__(self) -> None:
        if self.prefill < 0 or self.decode < 1:
            raise ValueError(f"a call needs prefill >= 0 and decode >= 1, got {self}")


@dataclass(frozen=True)
class Stage:
    calls: tuple[CallSpec, ...]  # in parallel, call i on thread i
    interrupt_s: float = 0.0  # time outside the engine after the stage (tool, human)
    fork: bool = False  # every call on a fork of the root (else call 0 on the root)


@dataclass(frozen=True)
class ProgramSpec:
    """A program: its workload, when it arrives (seconds from the start) and its stages.
    ``shared_prefix`` tokens (a system prompt every program of the workload shares) come
    before the first call's prefill."""

    workload: str
    arrival: float
    stages: tuple[Stage, ...]
    shared_prefix: int = 0

    @property
    def decode_tokens(self) -> int:
        return sum(c.decode for s in self.stages for c in s.calls)

    @property
    def prefill_tokens(self) -> int:
        return self.shared_prefix + sum(c.prefill for s in self.stages for c in s.calls)

    @property
    def num_calls(self) -> int:
        return sum(len(s.calls) for s in self.stages)

    @property
    def max_threads(self) -> int:
        return max(len(s.calls) for s in self.stages)

    def to_json(self) -> str:
        return json.dumps(
            {
                "workload": self.workload,
                "shared_prefix": self.shared_prefix,
                "stages": [
                    {
                        "calls": [[c.prefill, c.decode] for c in s.calls],
                        "interrupt_s": s.interrupt_s,
                        "fork": s.fork,
                    }
                    for s in self.stages
                ],
            }
        )

    @classmethod
    def from_json(cls, text: str, arrival: float = 0.0) -> ProgramSpec:
        d = json.loads(text)
        stages = tuple(
            Stage(
                tuple(CallSpec(int(p), int(n)) for p, n in s["calls"]),
                float(s["interrupt_s"]),
                bool(s.get("fork", False)),
            )
            for s in d["stages"]
        )
        return cls(d["workload"], arrival, stages, int(d.get("shared_prefix", 0)))
