"""A fused continuous-batching generate loop straight over the engine, with no inferlets.

This is the reference the rest of Pastry is measured against: the cost of programmability
is (inferlet time per token) / (this loop's time per token) on the same engine. It is also
what "an ordinary LLM server" does: every step forms one batch of all running sequences'
decode tokens plus chunks of waiting prompts (chunked prefill within a token budget).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from pastry.wire.calls import Call, CallError, EmbedTxt, EngineInfo, Forward, Result, Sample, ids


@dataclass
class Request:
    prompt: list[int]
    max_new_tokens: int
    temperature: float = 0.0
    seed: int | None = None
    stop_ids: tuple[int, ...] = ()
    output: list[int] = field(default_factory=list)


@dataclass
class _Running:
    req: Request
    pages: list[int] = field(default_factory=list)
    length: int = 0  # tokens whose KV is stored
    prefilled: int = 0  # prompt tokens consumed so far


class FreeList:
    def __init__(self, n: int) -> None:
        self.free = list(range(n - 1, -1, -1))

    def take(self, k: int) -> list[int]:
        if k > len(self.free):
            raise MemoryError(f"need {k} pages, {len(self.free)} free")
        return [self.free.pop() for _ in range(k)]

    def give(self, items: Sequence[int]) -> None:
        self.free.extend(reversed(items))


class FusedGenerator:
    """Runs many requests to completion with continuous batching.

    ``execute`` is a synchronous batch executor (``Engine.execute`` or a remote handle's
    ``execute_sync``). ``prefill_budget`` caps prompt tokens per step.
    """

    def __init__(
        self,
        execute: Callable[[Sequence[Call]], list[Result]],
        info: EngineInfo,
        prefill_budget: int = 512,
        max_running: int = 256,
    ) -> None:
        self.execute = execute
        self.info = info
        self.ps = info.page_size
        self.prefill_budget = prefill_budget
        self.max_running = max_running
        self.pages = FreeList(info.num_pages)
        # Embed slots live for one step only (embed -> forward -> sample in one batch), so
        # every step reuses the same range: inputs first, then one output per sequence.
        need = prefill_budget + 2 * max_running
        if info.num_embeds < need:
            raise ValueError(f"engine has {info.num_embeds} embed slots, the loop needs {need}")
        self.steps = 0
        self.batch_sizes: list[int] = []

    def run(self, requests: Sequence[Request]) -> list[Request]:
        waiting = deque(requests)
        running: list[_Running] = []
        while waiting or running:
            while waiting and len(running) < self.max_running:
                running.append(_Running(waiting.popleft()))
            self.step(running)
            for r in [r for r in running if self._done(r)]:
                running.remove(r)
                self.pages.give(r.pages)
        return list(requests)

    def _done(self, r: _Running) -> bool:
        out = r.req.output
        return len(out) >= r.req.max_new_tokens or (bool(out) and out[-1] in r.req.stop_ids)

    def step(self, running: list[_Running]) -> None:
        embeds, forwards, samples, sampled = [], [], [], []
        budget = self.prefill_budget
        next_in, next_out = 0, self.prefill_budget + self.max_running
        for r in running:
            if r.prefilled < len(r.req.prompt):
                n = min(budget, len(r.req.prompt) - r.prefilled)
                if n == 0:
                    continue
                budget -= n
                tokens = r.req.prompt[r.prefilled : r.prefilled + n]
                r.prefilled += n
                last = r.prefilled == len(r.req.prompt)
            else:
                tokens, last = [r.req.output[-1]], True
            out_slot = next_out if last else None
            e, f = self._append(r, tokens, next_in, out_slot)
            next_in += len(tokens)
            embeds.append(e)
            forwards.append(f)
            if last:
                next_out += 1
                seed = None if r.req.seed is None else r.req.seed + len(r.req.output)
                samples.append(Sample(out_slot, r.req.temperature, seed=seed))
                sampled.append(r)
        results = self.execute([*embeds, *forwards, *samples])
        for res in results:
            if isinstance(res, CallError):
                raise RuntimeError(f"engine rejected a call: {res.message}")
        for r, tok in zip(sampled, results[len(embeds) + len(forwards) :], strict=True):
            r.req.output.append(tok)
        self.steps += 1
        self.batch_sizes.append(len(forwards))

    def _append(self, r: _Running, tokens: list[int], base: int, out_slot: int | None):
        n, ps = len(tokens), self.ps
        offset = r.length % ps
        room = (ps - offset) % ps if r.pages else 0
        new = self.pages.take(max(0, -(-(n - room) // ps)))
        out_pages = ([r.pages[-1]] if room else []) + new
        positions = ids(range(r.length, r.length + n))
        in_slots = ids(range(base, base + n))
        fwd = Forward(
            in_embeds=in_slots,
            ctx_pages=ids(r.pages),
            ctx_last_len=r.length - (len(r.pages) - 1) * ps if r.pages else 0,
            out_pages=ids(out_pages),
            out_offset=offset if room else 0,
            out_embeds=ids([] if out_slot is None else [out_slot]),
            out_indices=ids([] if out_slot is None else [n - 1]),
            positions=positions,
        )
        r.pages += new
        r.length += n
        return EmbedTxt(np.asarray(tokens, dtype=np.int64), positions, in_slots), fwd
