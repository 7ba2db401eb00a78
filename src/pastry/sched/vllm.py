"""The paper's vLLM baseline (vLLM v0.6.1, Autellix §6.2) as a simulated engine.

The paper's "vLLM" is v0.6.1 with its defaults: FCFS, continuous batching over
PagedAttention blocks, **no prefix caching** (the paper blames its results on "its lack of
prefix caching, which results in expensive recomputation of cumulative state"), and no
chunked prefill (that, prefix caching and multi-step scheduling make its "vLLM-opt").
This module models its scheduler (``vllm/core/scheduler.py``, ``_schedule_default``):

- **Requests.** Every LLM call is a request of its own. Its prompt is the call's whole
  input: the program's context so far (system prompt and every earlier turn, input and
  output) and the call's new tokens, all prefilled again, since nothing is cached across
  requests. The parallel calls of a stage (LATS's forks) are separate requests, each
  with its own copy of the context. A request's blocks are freed when it finishes.
- **Admission** (``_schedule_prefills``): the waiting queue is FCFS. Its head is admitted
  while fewer than ``max_batch`` requests run, its prompt fits the step's token budget (the
  first prompt of a step always does), and the block manager can allocate its prompt's
  blocks leaving the watermark (1% of the blocks) free; the first request that does not
  fit stops admission (head-of-line). A prompt larger than the device fails.
- **Steps.** A step that admitted any request runs their prefills only (each emits its
  first token); otherwise it runs one decode step over every running request. Without
  chunked prefill, arrivals therefore pause every running decode.
- **Preemption** (``_schedule_running``, v0.6.1's default mode for single sequences:
  recomputation): running requests are visited oldest first; one that needs a new block
  (its last block is full) when none is free preempts the *latest-arrived* running
  request (``running.pop()``), or itself when it is the last. A preempted request loses
  its blocks and goes back to the front of the waiting queue; when readmitted it
  prefills its prompt and everything it had generated.

It uses the simulator's ``max_batch``, ``max_batch_tokens``, cost model and memory
(``SimConfig``): the same device, batch size and step costs as Pastry's engine.
"""

from __future__ import annotations

import sys
from collections import deque
from dataclasses import dataclass
from typing import ClassVar

from pastry.sched.sim import Simulator
from pastry.sched.sim_model import SimProgram, SimThread

WATERMARK = 0.01  # vLLM's block-manager watermark: a fraction of the blocks kept free


@dataclass(frozen=True)
class Vllm:
    """The baseline system for :func:`pastry.sched.sim.simulate`."""

    name: ClassVar[str] = "vllm"
    watermark: float = WATERMARK

    def __post_init__(self) -> None:
        if not 0 <= self.watermark < 1:
            raise ValueError(
                f"the watermark is a fraction of the blocks in [0, 1), got {self.watermark!r}"
            )

    def engine(self, sim: Simulator) -> VllmEngine:
        return VllmEngine(sim, self)

    def describe(self) -> str:
        return "vllm (v0.6.1: fcfs, no prefix cache, recompute)"


@dataclass(eq=False, slots=True)
class Request:
    thread: SimThread
    prompt: int  # tokens to prefill at (re)admission
    left: int  # tokens still to generate
    queued: float  # since when it waits
    kv: int = 0  # tokens with KV on the device (0 while waiting)

    @property
    def total(self) -> int:
        """Tokens of the sequence: prefilled and generated (the last one without KV)."""
        return self.kv + 1 if self.kv else self.prompt


class VllmEngine:
    """vLLM v0.6.1's scheduler over a simulated device (see the module docstring)."""

    def __init__(self, sim: Simulator, system: Vllm) -> None:
        cfg = sim.config
        self.sim = sim
        self.system = system
        self.cost = cfg.cost
        self.max_batch = cfg.max_batch
        self.max_tokens = cfg.max_batch_tokens if cfg.max_batch_tokens is not None else sys.maxsize
        mem = cfg.memory
        self.page_size = mem.page_size if mem is not None else 16
        self.blocks = mem.pages if mem is not None else sys.maxsize
        self.free = self.blocks
        self.watermark = int(system.watermark * self.blocks) if mem is not None else 0
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        self.preemptions = 0
        self.recomputed = 0  # tokens prefilled again after a preemption
        self.prefill_tokens = 0
        self.prefill_steps = 0
        self.decode_steps = 0
        self._seqs = 0

    def describe(self) -> str:
        return self.system.describe()

    def finish(self) -> dict:
        return {
            "preemptions": self.preemptions,
            "recomputed_tokens": self.recomputed,
            "prefill_tokens": self.prefill_tokens,
            "prefill_steps": self.prefill_steps,
            "decode_steps": self.decode_steps,
            "mean_batch": round(self._seqs / max(1, self.decode_steps), 2),
        }

    # ------------------------------------------------------------------ the simulator's calls

    def start_program(self, p: SimProgram) -> None:
        pass

    def open_thread(self, th: SimThread, parent: SimThread | None) -> None:
        pass

    def start_call(self, th: SimThread, tokens: int, decode: int) -> None:
        self.waiting.append(Request(th, th.context + tokens, decode, self.sim.now))

    def close_thread(self, th: SimThread) -> None:
        pass  # its request finished (the driver closes threads between calls)

    def end_program(self, p: SimProgram) -> None:
        gone = [r for r in self.running if r.thread.program is p]
        for r in gone:
            self.running.remove(r)
            self.free += self._blocks(r.kv)
        self.waiting = deque(r for r in self.waiting if r.thread.program is not p)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ a step

    def step(self) -> tuple[float, list[SimThread], list[tuple[SimProgram, str]]]:
        now = self.sim.now
        failed: list[tuple[SimProgram, str]] = []
        admitted = self._admit(now, failed)
        if admitted:
            tokens = sum(r.prompt for r in admitted)
            self.prefill_steps += 1
            self.prefill_tokens += tokens
            dt = self.cost.step(len(admitted), tokens, tokens)
            for r in admitted:
                r.kv = r.prompt
            return dt, self._emit(admitted), failed
        batch = self._schedule_running()
        if not batch:
            return 0.0, [], failed
        self.decode_steps += 1
        self._seqs += len(batch)
        dt = self.cost.step(len(batch), len(batch), sum(r.kv + 1 for r in batch))
        for r in batch:
            r.kv += 1
        return dt, self._emit(batch), failed

    def _admit(self, now: float, failed: list[tuple[SimProgram, str]]) -> list[Request]:
        admitted: list[Request] = []
        tokens = 0
        while self.waiting and len(self.running) < self.max_batch:
            r = self.waiting[0]
            need = self._blocks(r.prompt)
            if need > self.blocks - self.watermark:  # AllocStatus.NEVER
                self.waiting.popleft()
                failed.append(
                    (r.thread.program, f"a prompt of {r.prompt} tokens exceeds the device")
                )
                continue
            if self.free - need < self.watermark:  # AllocStatus.LATER: head-of-line
                break
            if admitted and tokens + r.prompt > self.max_tokens:
                break
            self.waiting.popleft()
            self.free -= need
            tokens += r.prompt
            r.thread.waited += now - r.queued
            admitted.append(r)
            self.running.append(r)
        return admitted

    def _schedule_running(self) -> list[Request]:
        """One decode step's requests, oldest first, preempting the latest-arrived when a
        request needs a block and none is free."""
        queue = deque(self.running)
        batch: list[Request] = []
        while queue:
            r = queue.popleft()
            need = self._blocks(r.kv + 1) - self._blocks(r.kv)
            while need > self.free:
                victim = queue.pop() if queue else r
                self._preempt(victim)
                if victim is r:
                    break
            else:
                self.free -= need
                batch.append(r)
        return batch

    def _preempt(self, r: Request) -> None:
        """Recomputation: the blocks go, the request waits at the front with everything it
        has as its prompt."""
        self.preemptions += 1
        self.free += self._blocks(r.kv)
        self.running.remove(r)
        r.prompt = r.total
        self.recomputed += r.prompt
        r.kv = 0
        r.queued = self.sim.now
        self.waiting.appendleft(r)

    def _emit(self, batch: list[Request]) -> list[SimThread]:
        """Each request generated a token; those done leave with their blocks."""
        done = []
        for r in batch:
            r.left -= 1
            if r.left == 0:
                self.running.remove(r)
                self.free += self._blocks(r.kv)
                done.append(r.thread)
        return done

    def _blocks(self, tokens: int) -> int:
        return -(-tokens // self.page_size)
