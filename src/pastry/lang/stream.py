"""A prompt state's stream: what was appended to it, executed in order on a KV context.

The body of a program submits expressions (non-blocking); the stream runs them one after
another as an asyncio task on the inferlet's loop. Its text is the prompt; before a
``gen`` or ``select`` the text is tokenized whole and the context is brought to exactly
those tokens, keeping the K/V of the longest common prefix (the cache a program reuses:
its own earlier tokens, and the pages it shares with the state it was forked from). So a
program sees the same tokens as a server that re-tokenizes the full prompt on every
request (SGLang's runtime), and computes only what is new.

An ``image`` puts the model's image token in the text and the image in the state's
``images``: when the text is tokenized, each image token (in order, one per image) stands
for the image's embeddings, and the context holds the image there (``fill_image``). The
kept prefix never ends inside an image.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from pastry.lang import scoring
from pastry.lang.driver import Driver
from pastry.lang.expr import (
    Expr,
    Gen,
    Image,
    RoleBegin,
    RoleEnd,
    SamplingParams,
    Select,
    Text,
    flatten,
    names,
    typed_params,
)
from pastry.lang.generation import check, generate_n
from pastry.lang.template import prefix_and_suffix
from pastry.sdk.context import Context
from pastry.sdk.steps import truncate

log = logging.getLogger(__name__)


class Run(Protocol):
    """What a stream reads of its program's run (:class:`pastry.lang.run.Run`)."""

    model: str
    adapter: str | None
    defaults: SamplingParams
    driver: Driver
    on_text: Callable[[str], None] | None
    contexts: list[Context]

    def context(self) -> Context: ...


class ProgramError(RuntimeError):
    """A primitive of the program failed (the cause is chained); raised where its value is
    read, and by ``run`` for the program."""


@dataclass(eq=False)
class Fork:
    """Internal: fork the context into ``n`` children (the prefix is prefilled first)."""

    n: int
    out: list[Context | None] = field(default_factory=list)


@dataclass(eq=False)
class _Call:
    """Internal: run ``fn(stream)`` in order with the stream's other items."""

    fn: Callable[[Stream], Any]


class Stream:
    def __init__(
        self,
        run: Run,
        *,
        ctx: Context | None = None,
        text: str = "",
        messages: list[tuple[str, str]] | None = None,
        variables: dict[str, Any] | None = None,
        images: list[tuple[bytes, int]] | None = None,
        role: tuple[str | None, int | None] = (None, None),
        top: bool = False,
    ) -> None:
        self.run = run
        self.ctx = ctx
        self.text = text
        self.messages: list[tuple[str, str]] = list(messages or [])
        self.variables: dict[str, Any] = dict(variables or {})
        self.meta_info: dict[str, Any] = {}
        # the images of the text, in order: (encoded bytes, embeddings)
        self.images: list[tuple[bytes, int]] = list(images or [])
        self.cur_role, self.role_begin = role
        self.fork_start = len(text)
        self.top = top  # the program's own state: its text is what streaming sends
        self.pending: set[str] = set()  # variables submitted, not yet set
        self.submitted = 0  # body side
        self.done = 0  # loop side
        self.error: BaseException | None = None
        self._queue: deque = deque()
        self._task: asyncio.Task | None = None

    # ------------------------------------------------------------------ body side

    def submit(self, item: Expr | str | Fork | _Call) -> None:
        if isinstance(item, Expr | str):
            self.pending.update(names(item))
        self.submitted += 1
        self.run.driver.call(self._enqueue, item)

    def sync(self) -> None:
        self.run.driver.wait_until(lambda: self.done >= self.submitted or self.error is not None)
        self._raise()

    def get(self, name: str) -> Any:
        self.run.driver.wait_until(
            lambda: name in self.variables or self.error is not None or name not in self.pending
        )
        if name in self.variables:
            return self.variables[name]
        self._raise()
        known = ", ".join(sorted(self.variables)) or "none yet"
        raise KeyError(f"no variable {name!r} in this state (variables: {known})")

    def _raise(self) -> None:
        if self.error is not None:
            raise ProgramError(f"the program failed: {self.error}") from self.error

    def drained(self) -> bool:
        return self.done >= self.submitted or self.error is not None

    def idle(self) -> bool:
        """Drained, with nothing enqueued on the loop side either."""
        return self.drained() and not self._queue

    # ------------------------------------------------------------------ loop side

    def _enqueue(self, item) -> None:
        self._queue.append(item)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        while self._queue:
            item = self._queue.popleft()
            try:
                if self.error is None:
                    await self._execute(item)
            except Exception as e:
                log.debug("pastry.lang stream failed", exc_info=True)
                self.error = e
            finally:
                self.done += 1
                self.run.driver.notify()

    async def wait_drained(self) -> None:
        while self._task is not None and not self._task.done():
            await asyncio.shield(self._task)

    async def _execute(self, item) -> None:
        if isinstance(item, Fork):
            await self._fork(item)
            return
        if isinstance(item, _Call):
            item.fn(self)
            return
        for leaf in flatten(item):
            if isinstance(leaf, Text):
                self._append(leaf.value)
            elif isinstance(leaf, Gen):
                await self._gen(leaf)
            elif isinstance(leaf, Select):
                await self._select(leaf)
            elif isinstance(leaf, Image):
                await self._image(leaf)
            elif isinstance(leaf, RoleBegin):
                await self._role_begin(leaf.role)
            elif isinstance(leaf, RoleEnd):
                await self._role_end(leaf.role)
            else:
                raise TypeError(f"cannot execute {leaf!r}")

    def _append(self, text: str) -> None:
        self.text += text
        if self.top and self.run.on_text is not None and text:
            self.run.on_text(text)

    def _set(self, name: str | None, value: Any, meta: dict[str, Any]) -> None:
        if name is None:
            return
        self.variables[name] = value
        self.meta_info[name] = meta
        self.pending.discard(name)

    async def _context(self) -> Context:
        if self.ctx is None:
            self.ctx = self.run.context()
        return self.ctx

    def _tokenize(self, ctx: Context, text: str) -> list[int]:
        # the whole text from its start: with the model's BOS, as a server tokenizes a prompt
        return ctx.api.tokenize(ctx.queue, text, True)

    async def _image(self, image: Image) -> None:
        ctx = await self._context()
        a, q = ctx.api, ctx.queue
        n = a.num_embs_needed(q, image.data)  # refuses what is no image, or a text model
        self.images.append((image.data, n))
        self._append(a.detokenize(q, [a.get_image_token(q)]))

    def _expand(self, ctx: Context, tokens: list[int]) -> tuple[list[int], list[int]]:
        """``tokens`` with each image token made the image's embeddings' worth of them, and
        where each image starts."""
        if not self.images:
            return tokens, []
        mark = ctx.api.get_image_token(ctx.queue)
        found = tokens.count(mark)
        if found != len(self.images):
            raise ValueError(
                f"the text has {found} image tokens for the state's {len(self.images)} "
                "images: an image token in the text is an image's place, written by image()"
            )
        out: list[int] = []
        starts: list[int] = []
        for t in tokens:
            if t == mark:
                starts.append(len(out))
                out.extend([mark] * self.images[len(starts) - 1][1])
            else:
                out.append(t)
        return out, starts

    async def _synced(self) -> Context:
        """The context holding exactly the tokens of the text (the last one pending)."""
        ctx = await self._context()
        target, starts = self._expand(ctx, self._tokenize(ctx, self.text))
        if not target:
            raise ValueError("gen and select need a prompt: add text to the state first")
        keep = 0
        for a, b in zip(ctx.tokens, target, strict=False):
            if a != b:
                break
            keep += 1
        keep = min(keep, len(target) - 1)
        spans = [(at, self.images[i]) for i, at in enumerate(starts)]
        for at, (_, n) in spans:  # never keep part of an image
            if at < keep < at + n:
                keep = at
        if keep < len(ctx.tokens):
            await truncate(ctx, keep)
        done = keep
        for at, (data, n) in spans:
            if at >= keep:
                ctx.fill_tokens(target[done:at])
                ctx.fill_image(data)
                done = at + n
        ctx.fill_tokens(target[done:])
        return ctx

    async def _fork(self, item: Fork) -> None:
        if not self.text:
            item.out.extend([None] * item.n)
            return
        ctx = await self._synced()
        await ctx.flush()  # the shared prefix, once, before any branch runs
        for _ in range(item.n):
            child = await ctx.fork()
            self.run.contexts.append(child)
            item.out.append(child)

    async def _gen(self, gen: Gen) -> None:
        params = self.run.defaults.override(typed_params(gen))
        check(params)
        ctx = await self._synced()
        prompt, cached = len(ctx.tokens), ctx.kv_len
        stream = None
        if self.top and self.run.on_text is not None and params.n == 1:
            stream = [self.run.on_text]
        gens = await generate_n(ctx, params, stream)
        first = gens[0]
        self.text += first.text  # streamed already, piece by piece, when streaming
        if stream is None and self.top and self.run.on_text is not None and first.text:
            self.run.on_text(first.text)
        meta: dict[str, Any] = {
            "prompt_tokens": prompt,
            "completion_tokens": sum(len(g.tokens) for g in gens),
            "cached_tokens": cached,
            "finish_reason": first.finish_reason
            if params.n == 1
            else [g.finish_reason for g in gens],
        }
        if params.return_logprob:
            text_of = self._token_text(ctx, params.return_text_in_logprobs)
            meta["output_token_logprobs"] = [(lp, t, text_of(t)) for lp, t in first.logprobs or []]
            if params.top_logprobs_num:
                meta["output_top_logprobs"] = [
                    [(lp, t, text_of(t)) for lp, t in row] for row in first.top_logprobs or []
                ]
        value = first.text if params.n == 1 else [g.text for g in gens]
        self._set(gen.name, value, meta)

    def _token_text(self, ctx: Context, wanted: bool) -> Callable[[int], str | None]:
        if not wanted:
            return lambda t: None
        return lambda t: ctx.api.detokenize(ctx.queue, [t])

    async def _select(self, sel: Select) -> None:
        if sel.temperature > 1e-5:
            raise ValueError(
                f"select chooses greedily (temperature 0), got temperature={sel.temperature}"
            )
        ctx = await self._synced()
        prompt = list(ctx.tokens)
        continued = [self._expand(ctx, self._tokenize(ctx, self.text + c))[0] for c in sel.choices]
        scored = await scoring.choice_logprobs(ctx, prompt, continued)
        unconditional = None
        if sel.method.requires_unconditional_logprobs:
            runs = [scoring.unconditional_logprobs(ctx, [s.token for s in sc]) for sc in scored]
            unconditional = [[s.logprob for s in u] for u in await asyncio.gather(*runs)]
        decision = sel.method.decide([[s.logprob for s in sc] for sc in scored], unconditional)
        choice = sel.choices[decision.choice]
        self._append(choice)
        meta = {
            **decision.meta_info,
            "input_token_logprobs": [[(s.logprob, s.token, None) for s in sc] for sc in scored],
        }
        self._set(sel.name, choice, meta)

    async def _role_begin(self, role: str) -> None:
        if self.cur_role is not None:
            raise ValueError(f"role blocks do not nest: {role!r} inside {self.cur_role!r}")
        ctx = await self._context()

        def render(msgs: list[tuple[str, str]]) -> str:
            return ctx.api.apply_chat_template(ctx.queue, msgs, False)

        prefix, _ = prefix_and_suffix(render, self.messages, role)
        self.cur_role = role
        self._append(prefix)
        self.role_begin = len(self.text)

    async def _role_end(self, role: str) -> None:
        if self.cur_role != role:
            raise ValueError(f"{role!r} block ends, but the open block is {self.cur_role!r}")
        ctx = await self._context()

        def render(msgs: list[tuple[str, str]]) -> str:
            return ctx.api.apply_chat_template(ctx.queue, msgs, False)

        content = self.text[self.role_begin :].lstrip()
        _, suffix = prefix_and_suffix(render, self.messages, role)
        self._append(suffix)
        self.messages.append((role, content))
        self.cur_role = self.role_begin = None
