"""Run-ahead generation: a whole decode loop as one request (:class:`pastry.api.Generate`).

A program that generates with ``step`` wakes once per token: its coroutine resumes, it
checks its stop conditions, grows its pages and queues the next step (a sandboxed one
crosses the WebAssembly boundary several times for that). A :class:`GenerateLoop` does
the same work in the control layer, on the completion of each step: it appends the
sampled token, checks the stop conditions host-side (stop tokens, stop strings over the
decoded tail, the grammar, the length), allocates a page when the sequence crosses into
a new one, and queues the next :class:`~pastry.control.steps.Step` at once, so that the
sequence is in the next batch the scheduler forms. The program wakes once, when the loop
ends.

The steps are the ops a program's own ``step`` calls would queue, with the same sampling
records (the seed advanced by one per token, the generated tokens appended to the
penalty history), so the tokens are the same as the per-step loop's.

A program that wants to hear the tokens as they come (to stream them, or to check a
condition of its own) asks for them every ``k`` tokens (``every``): the first answer
comes after ``k`` tokens and ``generate_more`` takes the next ones, while the loop goes on
without waiting for the program. Whatever was sampled since the last answer comes in
one answer, so a program that reads slower than the loop samples wakes once per read,
not once per token.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from dataclasses import replace

from pastry.api import ApiError, Sampling
from pastry.control.commands import Stage
from pastry.control.handlers.caller import Caller, QueueRef
from pastry.control.sampling import SampleSpec, sample_spec
from pastry.control.steps import SampledStep, Step

LENGTH, STOP, GRAMMAR, ERROR, CANCELLED = "length", "stop", "grammar", "error", "cancelled"


class GenerateLoop:
    """One :class:`pastry.api.Generate` request in flight (checked by its handler), on
    ``ref.loop`` until its last answer is taken.

    ``alloc_page()`` allocates one KV page handle for the instance (as ``alloc_kvpages``
    does); ``future`` is the waiting request's (``generate``, then ``generate_more``), None
    while no request waits."""

    __slots__ = (
        "alloc_page",
        "caller",
        "embeds",
        "error",
        "every",
        "finish",
        "first",
        "future",
        "history",
        "kv",
        "logprobs",
        "max_tokens",
        "min_tokens",
        "new_pages",
        "position",
        "read",
        "recent",
        "ref",
        "sampling",
        "spec",
        "static",
        "stop",
        "stop_tokens",
        "stopping",
        "tail_tokens",
        "tokens",
    )

    def __init__(
        self,
        caller: Caller,
        ref: QueueRef,
        *,
        token: int,
        position: int,
        embeds: tuple[int, int],
        kv: list[int],
        max_tokens: int,
        sampling: Sampling | None,
        spec: SampleSpec | None,
        stop_tokens: frozenset[int],
        stop: list[str],
        min_tokens: int,
        recent: list[int],
        alloc_page: Callable[[], int],
        every: int = 0,
    ) -> None:
        self.caller, self.ref = caller, ref
        self.first, self.position, self.embeds = token, position, list(embeds)
        self.kv, self.new_pages = kv, []
        self.max_tokens, self.min_tokens = max_tokens, min_tokens
        self.sampling, self.spec = sampling, spec
        self.stop_tokens, self.stop = stop_tokens, stop
        # a string of L characters spans at most 4 L byte-level tokens (+1 for a boundary)
        self.tail_tokens = 4 * max(map(len, stop), default=0) + 1 if stop else 0
        self.recent = recent
        self.alloc_page = alloc_page
        self.tokens: list[int] = []
        self.logprobs: tuple[list, list, list] = ([], [], [])
        self.every = every
        self.read = (0, 0)  # tokens and new pages already answered
        self.finish = self.error = ""  # why the loop ended ("": it runs)
        self.stopping = False  # asked to stop: end after the step in flight
        s = sampling
        # Whether every step samples with the first step's record: no seed to advance, no
        # penalty history to grow, no grammar mask to take again, no ban to lift.
        penalizes = s is not None and (
            s.repetition_penalty != 1.0 or s.frequency_penalty != 0.0 or s.presence_penalty != 0.0
        )
        self.history = list(s.penalty_tokens) if penalizes else None
        self.static = not (min_tokens and stop_tokens) and (
            s is None or (s.seed is None and not penalizes and s.constraint is None)
        )
        self.future: asyncio.Future | None = asyncio.get_running_loop().create_future()

    # ------------------------------------------------------------------ the requests

    def start(self) -> asyncio.Future:
        """Queue the first step (its errors are the request's); the first answer's future."""
        fut = self.future
        assert fut is not None
        grammar = self.spec.grammar if self.spec is not None else None
        if grammar is not None and grammar.matcher.is_stopped():
            self._end(GRAMMAR)
        else:
            self._submit()
            self.ref.loop = self
        return fut

    def more(self, stop: bool) -> asyncio.Future:
        """A ``generate_more`` request: the next answer's future (``stop``: end the loop
        once the step in flight completes)."""
        if self.future is not None and not self.future.done():
            raise ApiError("a generate or generate_more call on this queue still waits")
        fut = self.future = asyncio.get_running_loop().create_future()
        if stop and not self.finish:  # a running loop always has its next step in flight
            self.stopping = True
        self._answer()
        return fut

    # ------------------------------------------------------------------ the loop

    def _submit(self) -> None:
        """Queue the decode step of the newest token (raises what refuses it)."""
        n = len(self.tokens)
        token = self.tokens[-1] if n else self.first
        p = self.position + n
        info = self.ref.model.info
        if p >= info.max_position:
            raise ApiError(f"position {p} is outside the model's 0 to {info.max_position - 1}")
        ps = info.page_size
        if p // ps >= len(self.kv):
            page = self.alloc_page()
            self.kv.append(page)
            self.new_pages.append(page)
        n_ctx = -(-p // ps)
        last = p - (n_ctx - 1) * ps if n_ctx else 0
        spec = self.spec if self.static else self._spec_at(n)
        sampled = spec is not None and (spec.logprobs or spec.grammar is not None)
        cls = SampledStep if sampled else Step
        op = cls(
            self.ref.model.resources, self.caller.instance, [token], [p], self.embeds,
            [*self.kv[:n_ctx], self.kv[p // ps]], n_ctx, last, p % ps, spec,
        )  # fmt: skip
        fut = self.caller.submit(self.ref, Stage.EMBED, op, tokens=1, last_stage=Stage.OUTPUT)
        if spec is not None and spec.grammar is not None:
            spec.grammar.busy = True  # one sample at a time (SampledStep.finish frees it)
        fut.add_done_callback(self._stepped)

    def _spec_at(self, n: int) -> SampleSpec | None:
        """The sampling of generated token ``n``: the seed advanced, the history grown, the
        grammar's mask taken now, the stop tokens banned before ``min_tokens``."""
        s = self.sampling or Sampling()
        changes: dict = {}
        if s.seed is not None:
            changes["seed"] = s.seed + n
        if self.history is not None:
            changes["penalty_tokens"] = self.history
        grammar = self.spec.grammar if self.spec is not None else None
        complete = grammar is not None and grammar.matcher.is_accepting()
        if n < self.min_tokens and self.stop_tokens and not complete:
            ban = [(t, -math.inf) for t in sorted(self.stop_tokens)]
            changes["logit_bias"] = [*s.logit_bias, *ban]
        record = replace(s, **changes) if changes else s
        info = self.ref.model.info
        return sample_spec(record, info.vocab_size, self.caller.constraints)

    def _stepped(self, fut: asyncio.Future) -> None:
        """A step completed: take its token, stop or queue the next one."""
        spec = self.spec
        if spec is not None and spec.grammar is not None:
            spec.grammar.busy = False
        if self.future is not None and self.future.cancelled():  # the program gave up on it
            if not fut.cancelled():
                fut.exception()
            self._abandon()
            return
        if fut.cancelled() or fut.exception() is not None:
            e = ApiError("the step was cancelled") if fut.cancelled() else fut.exception()
            if not self.tokens and self.future is not None:  # the request fails as a step
                self.future.set_exception(e)
                self._abandon()
            else:
                self._end(ERROR, str(e))
            return
        r = fut.result()
        if type(r) is tuple:
            token, lp, ids, lps = r
            self.logprobs[0].append(lp)
            self.logprobs[1].append(ids)
            self.logprobs[2].append(lps)
        else:
            token = r
        self.tokens.append(token)
        if self.history is not None:
            self.history = [*self.history, token]
        reason = self._stopped(token)
        if reason is not None:
            self._end(reason)
            return
        if self.stopping:
            self._end(CANCELLED)
            return
        try:
            self._submit()
        except Exception as e:  # out of pages, over a quota, the queue closed, ...
            self._end(ERROR, str(e))
            return
        self._answer()

    def _stopped(self, token: int) -> str | None:
        if token in self.stop_tokens:
            return STOP
        if self.stop and len(self.tokens) >= self.min_tokens:
            tail = [*self.recent, *self.tokens][-self.tail_tokens :]
            text = self.ref.model.tokenizer.decode(tail)
            if any(s in text for s in self.stop):
                return STOP
        if len(self.tokens) >= self.max_tokens:
            return LENGTH
        grammar = self.spec.grammar if self.spec is not None else None
        if grammar is not None and grammar.matcher.is_stopped():
            return GRAMMAR
        return None

    def _end(self, finish: str, error: str = "") -> None:
        self.finish, self.error = finish, error
        self._answer()

    def _answer(self) -> None:
        """Resolve the waiting request with what it has not seen, if it is due: the loop
        ended, or ``every`` tokens are new."""
        fut = self.future
        n, pages = self.read
        if fut is None or fut.done():
            return
        if not self.finish and not (self.every and len(self.tokens) - n >= self.every):
            return
        self.read = (len(self.tokens), len(self.new_pages))
        lps, ids, tops = (x[n:] for x in self.logprobs)
        fut.set_result(
            (self.tokens[n:], self.new_pages[pages:], self.finish, self.error, lps, ids, tops)
        )
        self.future = None
        if self.finish:
            self._abandon()

    def _abandon(self) -> None:
        """The loop is over for its queue: a new one may start there."""
        self.finish = self.finish or CANCELLED
        if self.ref.loop is self:
            self.ref.loop = None
