"""The host side of the inferlet API for one instance: :class:`Session`.

A session implements every function of :class:`pastry.api.InferletApi` with the instance's
own handle space: queues, KV pages, embeddings and subscriptions are small integers that
mean nothing outside that session. Calls that touch the model are queued on the model's
batch scheduler (:mod:`pastry.control.scheduler`) and translated to physical ids when they
are batched; the rest are answered here directly. Misuse (a foreign or freed handle, a
wrong queue, bad lengths) raises :class:`ApiError` in the calling inferlet only.

A session belongs to a user (``user``, :mod:`pastry.control.users`): its KV exports, store
keys and topics live in that user's namespace, and ``~OWNER/NAME`` reads another user's
where the owner granted it. Messages its client has not read count against the backlog
quota (``Quotas.backlog_bytes``): a sender over it is ended.

The :class:`~pastry.control.controller.Controller` creates and ends sessions.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import jinja2
import numpy as np

from pastry.api import ApiError
from pastry.control.constraints import MAX_CONSTRAINTS, HostConstraint
from pastry.control.events import Message
from pastry.control.outbox import Inbox, Outbox
from pastry.control.quotas import QuotaError
from pastry.control.resources import Kind, QuotaExceeded, ResourceError
from pastry.control.scheduler import Command, Queue, Stage
from pastry.control.steps import Embed, Step, claim
from pastry.control.tokenization import TokenizeTooLarge
from pastry.control.users import LOCAL, split_scoped
from pastry.engine.calls import (
    MAX_LOGPROBS,
    CopyKv,
    Dist,
    Forward,
    Logprobs,
    MaskKv,
    NextDist,
    Sample,
    Sampled,
    ids,
    mask_words,
)

if TYPE_CHECKING:
    from pastry.control.controller import Controller, Model

API_VERSION = "0.1.0"


def _token_ids(values, what: str, lo: int = 0, hi: int | None = None) -> np.ndarray:
    try:
        arr = ids(values)
    except (TypeError, ValueError, OverflowError):
        raise ApiError(f"{what} must be a list of token ids") from None
    top = hi if hi is not None else np.iinfo(np.int64).max
    bad = arr[(arr < lo) | (arr >= top)]
    if bad.size:
        raise ApiError(
            f"{what} has token id {int(bad[0])}, outside the vocabulary (0 to {top - 1})"
        )
    return arr


def _ints(values) -> list[int]:
    """``values`` as a list of Python ints that fit an int64 (what :func:`ids` makes of
    them, with its errors): the fused step keeps them as a list until its batch makes one
    array of every step's integers."""
    if type(values) is list:
        for v in values:
            if type(v) is not int or not -_I64 <= v < _I64:
                break
        else:
            return values.copy()
    return ids(values).tolist()


_I64 = 1 << 63


def _check_top(n, what: str) -> None:
    if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= MAX_LOGPROBS:
        raise ApiError(f"{what} must be an integer from 0 to {MAX_LOGPROBS}, got {n!r}")


def _sampled(r: Sampled | int) -> tuple[int, float, list[int], list[float]]:
    return r.token, r.logprob, r.top_ids.tolist(), r.top_logprobs.tolist()


def _prompt_logprobs(r: Logprobs) -> tuple[list[float], list[list[int]], list[list[float]]]:
    return r.logprobs.tolist(), r.top_ids.tolist(), r.top_logprobs.tolist()


_NEUTRAL = (1.0, 0.0, 0.0)  # repetition, frequency and presence penalties that do nothing


def _consume(fut: asyncio.Future) -> None:
    """Retrieve a fire-and-forget command's outcome (failures surface on later calls)."""
    if not fut.cancelled():
        fut.exception()


@dataclass
class _QueueRef:
    model: Model  # the engine the queue runs on (one of the model's engines)
    queue: Queue
    placed: bool = True  # False: the router may still move it (control/routing.py)


@dataclass(eq=False)
class Session:
    """The API as one inferlet instance sees it (see :class:`pastry.api.InferletApi`).

    ``inbox`` holds the client's messages for ``receive``; ``outbox`` the instance's
    :mod:`~pastry.control.events` for its client (messages, then the runner's end event).
    """

    controller: Controller
    instance: int
    args: list[str]
    inbox: Inbox = field(default_factory=Inbox)
    outbox: Outbox = field(default_factory=Outbox)
    _queues: dict[int, _QueueRef] = field(default_factory=dict)
    _subs: dict[int, object] = field(default_factory=dict)
    _ids: itertools.count = field(default_factory=itertools.count)
    closed: bool = False
    user: str = LOCAL
    _constraints: dict[int, HostConstraint] = field(default_factory=dict)
    max_constraints: int = MAX_CONSTRAINTS  # live grammar constraints (runners may lower it)

    # ------------------------------------------------------------------ runtime

    def get_arguments(self) -> list[str]:
        return list(self.args)

    def get_instance_id(self) -> int:
        return self.instance

    def get_version(self) -> str:
        return API_VERSION

    def send(self, message: str) -> None:
        if not isinstance(message, str):
            raise ApiError(f"send takes a string, got {type(message).__name__}")
        limit = self.controller.quotas.backlog_bytes
        if limit is not None and self.outbox.queued_bytes > limit:
            reason = (
                f"its client has not read {self.outbox.queued_bytes} bytes of its messages, "
                f"over the backlog quota of {limit} bytes (--max-backlog-bytes): a client must "
                "keep reading what its instances send"
            )
            self.controller.on_terminate(self.instance, reason)
            raise ApiError(f"this inferlet was ended: {reason}")
        self.outbox.put_nowait(Message(message))

    async def receive(self) -> str:
        return await self.inbox.get()

    def available_models(self) -> list[str]:
        return list(self.controller.models)

    def available_traits(self, model: str) -> list[str]:
        return self._model(model).traits

    def create_queue(self, model: str, engine: int = -1) -> int:
        m = self._model(model)
        if engine != -1:
            m = self.controller.routing.engine(model, engine)
        qid = next(self._ids)
        self._queues[qid] = _QueueRef(m, m.scheduler.create_queue(self.instance), engine != -1)
        return qid

    def synchronize(self, q: int) -> asyncio.Future:
        """Resolves when every command queued on ``q`` before this call has completed."""
        return self._submit(q, Command(Stage.CONTROL, prepare=lambda: None))

    def set_queue_priority(self, q: int, priority: int) -> None:
        self._queue(q).queue.priority = int(priority)

    def close_queue(self, q: int) -> None:
        ref = self._queue(q)
        ref.model.scheduler.close_queue(ref.queue, f"queue {q} was closed")
        del self._queues[q]
        self.controller.routing.queue_closed(self.instance, q)

    # ------------------------------------------------------------------ allocate

    def get_kv_page_size(self, q: int) -> int:
        return self._queue(q).model.info.page_size

    def alloc_kvpages(self, q: int, n: int) -> list[int]:
        """New pages, every slot not attendable until this inferlet writes it: a page may
        hold another inferlet's stale K/V, which must never be visible."""
        ref = self._queue(q)
        pages = self._alloc(q, "kv", n)
        if pages:
            hidden = np.ones(ref.model.info.page_size, dtype=np.bool_)
            for h in pages:  # translated when run: the page may move (swap) meanwhile

                def prepare(h=h):
                    return MaskKv(self._phys(ref, "kv", [h])[0], hidden)

                fut = self._submit(q, Command(Stage.KV, prepare=prepare))
                fut.add_done_callback(_consume)
        return pages

    def alloc_embeds(self, q: int, n: int) -> list[int]:
        return self._alloc(q, "embed", n)

    def dealloc_kvpages(self, q: int, pages: list[int]) -> asyncio.Future:
        return self._dealloc(q, "kv", pages)

    def dealloc_embeds(self, q: int, embeds: list[int]) -> asyncio.Future:
        return self._dealloc(q, "embed", embeds)

    def copy_kvpage(
        self, q: int, src: int, dst: int, src_offset: int, dst_offset: int, size: int
    ) -> asyncio.Future:
        ref = self._queue(q)

        def prepare():
            s, d = self._phys(ref, "kv", [src, dst])
            self._claim(ref, [d])
            return CopyKv(s, d, int(src_offset), int(dst_offset), int(size))

        return self._submit(q, Command(Stage.KV, prepare=prepare))

    def export_kvpages(
        self, q: int, pages: list[int], name: str, persistent: bool = False
    ) -> asyncio.Future:
        """Publish pages under ``name`` once the commands queued before have run."""
        ref = self._queue(q)
        res = ref.model.resources
        pages = list(pages)
        self._resource_call(lambda: res.translate(self.instance, "kv", pages))
        _, name = self._scoped(name, write=True)

        def prepare():
            res.export(self.instance, "kv", pages, name, persistent)

        return self._submit(q, Command(Stage.CONTROL, prepare=prepare))

    def import_kvpages(self, q: int, name: str) -> list[int]:
        ref = self._queue(q)
        owner, name = self._scoped(name, write=False)
        return self._resource_call(
            lambda: ref.model.resources.import_(self.instance, "kv", name, owner)
        )

    def unexport_kvpages(self, q: int, name: str) -> None:
        ref = self._queue(q)
        _, name = self._scoped(name, write=True)
        self._resource_call(lambda: ref.model.resources.unexport(self.instance, name))
        ref.model.scheduler.wake()  # prefills may wait for its pages

    def list_exported_kvpages(self, q: int) -> list[tuple[str, int]]:
        """This user's KV exports (another user's are imported by name, ``~OWNER/NAME``)."""
        res = self._queue(q).model.resources
        return [(name, n) for name, kind, n in res.list_exports(self.user) if kind == "kv"]

    # ------------------------------------------------------------------ forward

    def forward(
        self,
        q: int,
        in_kv: list[int],
        in_kv_last_len: int,
        in_embeds: list[int],
        out_kv: list[int],
        out_kv_offset: int,
        out_embeds: list[int],
        mask: list[list[bool]] | None = None,
        logprob_targets: list[int] | None = None,
        logprob_top: int = 0,
    ) -> asyncio.Future:
        """Run the model over ``in_embeds`` on top of the context in ``in_kv``.

        The new tokens' K/V go to ``out_kv`` from slot ``out_kv_offset`` on (no pages: not
        stored); ``out_embeds[j]`` receives the output of the ``len(out_embeds)`` last
        inputs. ``mask`` (one row per input over context + inputs, True = attend)
        replaces the default causal attention. With ``logprob_targets``, resolves to the
        prompt log-probabilities (see :meth:`pastry.api.InferletApi.forward`).
        """
        return self._forward(
            q, in_kv, in_kv_last_len, in_embeds, out_kv, out_kv_offset, out_embeds, mask, -1,
            logprob_targets, logprob_top,
        )  # fmt: skip

    def _forward(
        self, q, in_kv, in_kv_last_len, in_embeds, out_kv, out_kv_offset, out_embeds, mask, adapter,
        logprob_targets=None, logprob_top=0,
    ) -> asyncio.Future:  # fmt: skip
        ref = self._queue(q)
        # Snapshot the handle lists now: the command is prepared later, and the caller may
        # change its lists in the meantime (a context growing its pages, say).
        in_kv, in_embeds, out_kv, out_embeds = (
            list(in_kv), list(in_embeds), list(out_kv), list(out_embeds)
        )  # fmt: skip
        n = len(in_embeds)
        if n == 0:
            raise ApiError("forward needs at least one input embedding")
        m = len(out_embeds)
        if m > n:
            raise ApiError(f"{m} output embeddings for {n} inputs")
        mask_arr = None
        if mask is not None:
            mask_arr = np.asarray(mask, dtype=np.bool_)
            if mask_arr.ndim != 2 or mask_arr.shape[0] != n:
                raise ApiError(
                    f"mask must have one row per input ({n}), got shape {mask_arr.shape}"
                )
        targets = ids(())
        if logprob_targets is not None:
            targets = _token_ids(logprob_targets, "logprob_targets", -1, ref.model.info.vocab_size)
            if len(targets) != n:
                raise ApiError(
                    f"logprob_targets needs one token per input ({n}), got {len(targets)}"
                )
            _check_top(logprob_top, "logprob_top")
        elif logprob_top:
            raise ApiError("logprob_top needs logprob_targets")

        def prepare():
            out_pages = self._phys(ref, "kv", out_kv)
            self._claim(ref, out_pages)
            return Forward(
                in_embeds=ids(self._phys(ref, "embed", in_embeds)),
                ctx_pages=ids(self._phys(ref, "kv", in_kv)),
                ctx_last_len=int(in_kv_last_len) if len(in_kv) else 0,
                out_pages=ids(out_pages),
                out_offset=int(out_kv_offset),
                out_embeds=ids(self._phys(ref, "embed", out_embeds)),
                out_indices=ids(range(n - m, n)),
                mask=mask_arr,
                adapter=adapter,
                logprob_targets=targets,
                logprob_top=int(logprob_top) if len(targets) else 0,
            )

        cmd = Command(Stage.FORWARD, prepare=prepare, tokens=n)
        if len(targets):
            cmd.finish = _prompt_logprobs
        return self._submit(q, cmd)

    def forward_with_adapter(
        self,
        q: int,
        adapter: str,
        in_kv: list[int],
        in_kv_last_len: int,
        in_embeds: list[int],
        out_kv: list[int],
        out_kv_offset: int,
        out_embeds: list[int],
        mask: list[list[bool]] | None = None,
        logprob_targets: list[int] | None = None,
        logprob_top: int = 0,
    ) -> asyncio.Future:
        ref = self._queue(q)
        if adapter not in ref.model.adapters:
            names = ", ".join(ref.model.adapters) or "none"
            raise ApiError(f"no adapter named '{adapter}' on {ref.model.name} (loaded: {names})")
        return self._forward(
            q,
            in_kv,
            in_kv_last_len,
            in_embeds,
            out_kv,
            out_kv_offset,
            out_embeds,
            mask,
            ref.model.adapters[adapter],
            logprob_targets,
            logprob_top,
        )

    def get_adapters(self, q: int) -> list[str]:
        return list(self._queue(q).model.adapters)

    def mask_kvpage(self, q: int, page: int, mask: list[bool]) -> asyncio.Future:
        """``mask[i]`` True makes token ``i`` of ``page`` not attendable."""
        ref = self._queue(q)
        arr = np.asarray(mask, dtype=np.bool_)

        def prepare():
            phys = self._phys(ref, "kv", [page])
            self._claim(ref, phys)
            return MaskKv(phys[0], arr)

        return self._submit(q, Command(Stage.KV, prepare=prepare))

    def prefill(
        self,
        q: int,
        tokens: list[int],
        kv_len: int,
        pages: list[int],
        out_embeds: list[int],
        reserve: int = 0,
    ) -> tuple[list[int], asyncio.Future]:
        """Queued: the K/V of ``tokens`` (positions ``0..``) through the prefix cache; see
        :meth:`pastry.api.InferletApi.prefill` and :mod:`pastry.control.prefill`."""
        ref = self._queue(q)
        for name, value in (("kv_len", kv_len), ("reserve", reserve)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ApiError(f"{name} must be a non-negative integer, got {value!r}")
        try:
            return self._resource_call(
                lambda: ref.model.prefiller.submit(
                    self.instance, ref.queue, tokens, kv_len, pages, out_embeds, reserve
                )
            )
        except ApiError:
            raise
        except ValueError as e:
            raise ApiError(str(e)) from None

    # ------------------------------------------------------------------ input text, tokenize

    def embed_txt(
        self, q: int, tokens: list[int], positions: list[int], embeds: list[int]
    ) -> asyncio.Future:
        ref = self._queue(q)
        if not (len(tokens) == len(positions) == len(embeds)):
            raise ApiError(
                f"embed_txt needs as many positions and embeddings as tokens "
                f"({len(tokens)} tokens, {len(positions)} positions, {len(embeds)} embeds)"
            )
        embed = Embed(
            ref.model.resources, self.instance, _ints(tokens), _ints(positions), list(embeds)
        )
        return ref.model.scheduler.submit(ref.queue, Command(Stage.EMBED, batched=embed))

    def get_eos_token_ids(self, q: int) -> list[int]:
        return list(self._queue(q).model.info.eos_token_ids)

    def get_vocab_size(self, q: int) -> int:
        return self._queue(q).model.info.vocab_size

    def apply_chat_template(
        self, q: int, messages: list[tuple[str, str]], add_generation_prompt: bool = True
    ) -> str:
        tok = self._queue(q).model.tokenizer
        msgs = []
        for m in messages:
            if len(m) != 2 or not all(isinstance(x, str) for x in m):
                raise ApiError(f"messages must be (role, content) string pairs, got {m!r}")
            msgs.append({"role": m[0], "content": m[1]})
        try:
            return tok.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt)
        except (ValueError, jinja2.TemplateError) as e:
            raise ApiError(str(e)) from None

    def tokenize(self, q: int, text: str, add_special_tokens: bool = False) -> list[int]:
        ref = self._queue(q)
        if not isinstance(text, str):
            raise ApiError(f"tokenize takes a string, got {type(text).__name__}")
        try:
            return ref.model.tokens.encode(text, bool(add_special_tokens))
        except TokenizeTooLarge as e:
            raise ApiError(str(e)) from None

    async def tokenize_async(
        self, q: int, text: str, add_special_tokens: bool = False
    ) -> list[int]:
        """:meth:`tokenize` off the event loop (the model's tokenizing thread), for a runner
        that can suspend its inferlet meanwhile (the sandbox does for long texts)."""
        ref = self._queue(q)
        if not isinstance(text, str):
            raise ApiError(f"tokenize takes a string, got {type(text).__name__}")
        try:
            return await ref.model.tokens.encode_async(text, bool(add_special_tokens))
        except TokenizeTooLarge as e:
            raise ApiError(str(e)) from None

    def detokenize(self, q: int, tokens: list[int]) -> str:
        return self._queue(q).model.tokenizer.decode(list(tokens))

    def get_vocabs(self, q: int) -> list[bytes]:
        return self._queue(q).model.tokenizer.get_vocabs()

    # ------------------------------------------------------------------ output

    def get_next_dist(
        self,
        q: int,
        embed: int,
        k: int = 256,
        mask: bytes | None = None,
        logit_bias: list[tuple[int, float]] | None = None,
        penalty_tokens: list[int] | None = None,
        penalty_prompt: list[int] | None = None,
        repetition_penalty: float = 1.0,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
    ) -> asyncio.Future:
        """Top-``k`` next-token distribution at ``embed``: (token ids, probabilities)."""
        ref = self._queue(q)
        proc = self._processing(
            ref, mask, logit_bias, penalty_tokens, penalty_prompt,
            repetition_penalty, frequency_penalty, presence_penalty,
        )  # fmt: skip

        def prepare():
            return NextDist(self._phys(ref, "embed", [embed])[0], int(k), **proc)

        def finish(d: Dist):
            return d.ids.tolist(), d.probs.tolist()

        return self._submit(q, Command(Stage.OUTPUT, prepare=prepare, finish=finish))

    def sample(
        self,
        q: int,
        embed: int,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        min_p: float = 0.0,
        seed: int | None = None,
        mask: bytes | None = None,
        logit_bias: list[tuple[int, float]] | None = None,
        penalty_tokens: list[int] | None = None,
        penalty_prompt: list[int] | None = None,
        repetition_penalty: float = 1.0,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        logprobs: int | None = None,
        constraint: int | None = None,
    ) -> asyncio.Future:
        """Sample a token on the device (greedy at temperature 0), after the logit
        processing; with ``logprobs``, also log-probabilities; with ``constraint``, among
        the tokens its grammar allows, advancing it with the token (see the API)."""
        ref = self._queue(q)
        proc, grammar = self._sampling(
            ref, mask, logit_bias, penalty_tokens, penalty_prompt,
            repetition_penalty, frequency_penalty, presence_penalty, logprobs, constraint,
        )  # fmt: skip

        def prepare():
            return Sample(
                self._phys(ref, "embed", [embed])[0], temperature, top_k, top_p, min_p, seed,
                **proc,
            )  # fmt: skip

        return self._submit_sample(q, Command(Stage.OUTPUT, prepare=prepare), logprobs, grammar)

    def step(
        self,
        q: int,
        tokens: list[int],
        positions: list[int],
        in_embeds: list[int],
        in_kv: list[int],
        in_kv_last_len: int,
        out_kv: list[int],
        out_kv_offset: int,
        out_embed: int,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        min_p: float = 0.0,
        seed: int | None = None,
        mask: bytes | None = None,
        logit_bias: list[tuple[int, float]] | None = None,
        penalty_tokens: list[int] | None = None,
        penalty_prompt: list[int] | None = None,
        repetition_penalty: float = 1.0,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        logprobs: int | None = None,
        constraint: int | None = None,
    ) -> asyncio.Future:
        """``embed_txt``, ``forward`` (its last input's output to ``out_embed``) and
        ``sample`` from it as one fused command (see :meth:`pastry.api.InferletApi.step`):
        one submission, one translation of its handles, one future."""
        ref = self._queue(q)
        n = len(tokens)
        if n == 0:
            raise ApiError("step needs at least one token")
        if not n == len(positions) == len(in_embeds):
            raise ApiError(
                f"step needs as many positions and input embeddings as tokens ({n} tokens, "
                f"{len(positions)} positions, {len(in_embeds)} embeds)"
            )
        proc, grammar = self._sampling(
            ref, mask, logit_bias, penalty_tokens, penalty_prompt,
            repetition_penalty, frequency_penalty, presence_penalty, logprobs, constraint,
        )  # fmt: skip
        n_ctx = len(in_kv)
        step = Step(
            ref.model.resources, self.instance, _ints(tokens), _ints(positions),
            [*in_embeds, out_embed], [*in_kv, *out_kv],  # snapshots, translated when batched
            n_ctx, int(in_kv_last_len) if n_ctx else 0, int(out_kv_offset),
            (temperature, top_k, top_p, min_p, seed), proc,
        )  # fmt: skip
        cmd = Command(Stage.EMBED, tokens=n, last_stage=Stage.OUTPUT, batched=step)
        if logprobs is None and grammar is None:  # the common step: no wrapper
            return ref.model.scheduler.submit(ref.queue, cmd)
        return self._submit_sample(q, cmd, logprobs, grammar)

    def _sampling(
        self, ref: _QueueRef, mask, logit_bias, penalty_tokens, penalty_prompt, rep, freq, pres,
        logprobs, constraint,
    ) -> tuple[dict, HostConstraint | None]:  # fmt: skip
        """A sample's logit processing fields, checked, and its grammar (if constrained)."""
        plain = mask is None and not logit_bias and not penalty_tokens and not penalty_prompt
        plain = plain and logprobs is None and constraint is None and (rep, freq, pres) == _NEUTRAL
        if plain and type(rep) is float and type(freq) is float and type(pres) is float:
            return {}, None  # the common case, without the checks' cost
        proc = self._processing(
            ref, mask, logit_bias, penalty_tokens, penalty_prompt, rep, freq, pres
        )
        if logprobs is not None:
            _check_top(logprobs, "logprobs")
            proc["logprobs"] = int(logprobs)
        grammar = None
        if constraint is not None:
            grammar = self._constraint(constraint)
            if grammar.rows != ref.model.info.vocab_size:
                raise ApiError(f"constraint {constraint} was made for another model")
            if grammar.busy:
                raise ApiError(
                    f"constraint {constraint} is already used by a sample in flight; await "
                    "it first (the grammar advances with its token)"
                )
            words = grammar.mask()
            proc["mask"] = words & proc["mask"] if "mask" in proc else words
        return proc, grammar

    def _submit_sample(
        self, q: int, cmd: Command, logprobs: int | None, grammar: HostConstraint | None
    ) -> asyncio.Future:
        """Submit a command that ends in a sample: its value is the token (or, with
        ``logprobs``, the tuple), and a ``grammar`` advances with it."""
        if logprobs is not None:
            cmd.finish = _sampled
        if grammar is not None:
            inner = cmd.finish

            def finish(r):
                grammar.busy = False
                grammar.advance(r if isinstance(r, int) else r.token)
                return inner(r)

            def settled(_fut) -> None:
                grammar.busy = False

            cmd.finish = finish
            grammar.busy = True
            fut = self._submit(q, cmd)
            fut.add_done_callback(settled)
            return fut
        return self._submit(q, cmd)

    @staticmethod
    def _processing(
        ref: _QueueRef, mask, logit_bias, penalty_tokens, penalty_prompt, rep, freq, pres
    ) -> dict:
        """The engine call's logit processing fields (only those that are set), checked."""
        proc: dict = {}
        vocab = ref.model.info.vocab_size
        if mask is not None:
            if not isinstance(mask, bytes | bytearray | memoryview):
                raise ApiError(f"mask must be bytes (a packed bitmask), got {type(mask).__name__}")
            want = mask_words(vocab) * 4
            if len(mask) < want or len(mask) % 4:
                raise ApiError(
                    f"mask must be at least {want} bytes of whole 32-bit words (one bit per "
                    f"token of the {vocab} output rows), got {len(mask)}"
                )
            # llguidance may hand over a word more than the rows need: bits past them are moot
            words = np.frombuffer(bytes(mask[:want]), dtype="<i4")
            proc["mask"] = words.astype(np.int32, copy=False)
        if logit_bias:
            try:
                pairs = [(int(t), float(b)) for t, b in logit_bias]
            except (TypeError, ValueError):
                raise ApiError("logit_bias must be a list of (token id, bias) pairs") from None
            proc["bias_ids"] = _token_ids([t for t, _ in pairs], "logit_bias token", 0, vocab)
            proc["bias_values"] = np.array([b for _, b in pairs], dtype=np.float32)
        if penalty_tokens:
            proc["penalty_tokens"] = _token_ids(penalty_tokens, "penalty_tokens", 0, vocab)
        if penalty_prompt:
            proc["penalty_prompt"] = _token_ids(penalty_prompt, "penalty_prompt", 0, vocab)
        for name, value, off in (
            ("repetition_penalty", rep, 1.0),
            ("frequency_penalty", freq, 0.0),
            ("presence_penalty", pres, 0.0),
        ):
            if not isinstance(value, int | float) or isinstance(value, bool):
                raise ApiError(f"{name} must be a number, got {value!r}")
            if value != off:
                proc[name] = float(value)
        return proc

    # ------------------------------------------------------------------ grammar constraints

    def create_constraint(self, q: int, grammar: str) -> int:
        """A grammar constraint on the queue's model (see :mod:`pastry.control.constraints`)."""
        ref = self._queue(q)
        if len(self._constraints) >= self.max_constraints:
            raise QuotaError(
                f"this inferlet holds {len(self._constraints)} grammar constraints, the most it "
                "may at once: free those it is done with (free_constraint)"
            )
        info = ref.model.info
        try:
            c = HostConstraint(ref.model.tokenizer, info.vocab_size, info.eos_token_ids, grammar)
        except ImportError as e:
            raise ApiError(f"this server cannot constrain output: {e}") from None
        cid = next(self._ids)
        self._constraints[cid] = c
        return cid

    def constraint_state(self, c: int) -> tuple[bool, bool, list[int]]:
        return self._constraint(c).state()

    def constraint_consume(self, c: int, tokens: list[int]) -> None:
        grammar = self._constraint(c)
        if grammar.busy:
            raise ApiError(f"constraint {c} is used by a sample in flight; await it first")
        grammar.consume(list(tokens))

    def constraint_mask(self, c: int) -> bytes:
        return self._constraint(c).mask().astype("<i4").tobytes()

    def free_constraint(self, c: int) -> None:
        self._constraint(c)
        del self._constraints[c]

    def _constraint(self, c: int) -> HostConstraint:
        self._check_open()
        grammar = self._constraints.get(c)
        if grammar is None:
            raise ApiError(
                f"constraint {c} does not exist in this inferlet (create one with "
                "create_constraint; a freed one is gone)"
            )
        return grammar

    # ------------------------------------------------------------------ messaging, store, http

    def broadcast(self, topic: str, message: str) -> int:
        owner, topic = self._scoped(topic, write=True)
        return self.controller.bus.broadcast(str(self.instance), topic, message, owner)

    def subscribe(self, topic: str) -> int:
        owner, topic = self._scoped(topic, write=False)
        sub = self.controller.bus.subscribe(str(self.instance), topic, owner)
        sid = next(self._ids)
        self._subs[sid] = sub
        return sid

    async def next_message(self, sub: int) -> str:
        return await self._sub(sub).get()

    def unsubscribe(self, sub: int) -> None:
        self._sub(sub).close()
        del self._subs[sub]

    # Another user's namespace without a grant reads as empty and cannot be deleted from
    # (these calls have no error result in the WIT); store_set says why it is refused.

    def store_get(self, key: str) -> str | None:
        scoped = self._readable(key)
        return None if scoped is None else self.controller.store.get(scoped[1], scoped[0])

    def store_set(self, key: str, value: str) -> None:
        owner, key = self._scoped(key, write=True)
        self.controller.store.set(key, value, instance_id=str(self.instance), user=owner)

    def store_delete(self, key: str) -> bool:
        owner, rest = self._split(key)
        return owner == self.user and self.controller.store.delete(rest, owner)

    def store_exists(self, key: str) -> bool:
        scoped = self._readable(key)
        return scoped is not None and self.controller.store.exists(scoped[1], scoped[0])

    def store_list_keys(self, prefix: str = "") -> list[str]:
        """This user's keys starting with ``prefix``; for ``~OWNER/PREFIX``, the owner's
        (where granted) keys, named as the caller reads them (``~OWNER/KEY``)."""
        if not isinstance(prefix, str):
            raise ApiError(f"store_list_keys takes a string prefix, got {type(prefix).__name__}")
        owner, rest = split_scoped(prefix, prefix=True)
        if owner is None or owner == self.user:
            return self.controller.store.list_keys(rest, self.user)
        if not self.controller.grants.may_read(self.user, owner):
            return []
        return [f"~{owner}/{k}" for k in self.controller.store.list_keys(rest, owner)]

    async def http_get(self, url: str) -> tuple[int, str]:
        r = await self.controller.http.get(url)
        return r.status, r.text

    async def http_post(self, url: str, body: str) -> tuple[int, str]:
        r = await self.controller.http.post(url, body)
        return r.status, r.text

    # ------------------------------------------------------------------ several engines
    # (control/routing.py)

    def available_engines(self, model: str) -> int:
        return len(self.controller.routing.engines(model))

    def get_queue_engine(self, q: int) -> int:
        return self._queue(q).model.rank

    def get_engine_load(self, model: str) -> list[tuple[int, int, int]]:
        return self.controller.routing.load(model)

    def route(self, q: int, prompt: list[int], whole: bool = False) -> asyncio.Future:
        return self.controller.routing.route(self, q, prompt, whole)

    def prep_recv(self, q: int, prompt: list[int], end: int) -> asyncio.Future:
        return self.controller.routing.prep_recv(self, q, prompt, end)

    def remote_send(
        self,
        q: int,
        prompt: list[int],
        kv_addr_info: int,
        recv_rank: int,
        begin: int,
        end: int,
        src_pages: list[int] | None = None,
        src_len: int = 0,
    ) -> asyncio.Future:
        return self.controller.routing.remote_send(
            self, q, prompt, kv_addr_info, recv_rank, begin, end, src_pages or (), src_len
        )

    def start_generate(self, q: int, prompt: list[int], begin: int, request: int = -1) -> list[int]:
        return self.controller.routing.start_generate(self, q, prompt, begin, request)

    def next_request(self) -> asyncio.Future:
        return self.controller.routing.next_request(self)

    def reject_request(self, request: int, reason: str) -> None:
        self.controller.routing.reject_request(self, request, reason)

    # ------------------------------------------------------------------ host side only

    def deliver(self, message: str) -> None:
        """Put a client's message in the inbox for ``receive``; raises :class:`QuotaError`
        while the instance leaves more than the backlog quota unread. Not part of the
        inferlet API: the server calls it."""
        limit = self.controller.quotas.backlog_bytes
        if limit is not None and self.inbox.queued_bytes > limit:
            raise QuotaError(
                f"instance {self.instance} has not read {self.inbox.queued_bytes} bytes of "
                f"messages sent to it, over the backlog quota of {limit} bytes "
                "(--max-backlog-bytes): wait for it to receive them"
            )
        self.inbox.put_nowait(message)

    def set_limit(self, kind: Kind, max_held: int | None, source: str) -> None:
        """Cap the ``kind`` handles this instance may hold at once, on every model (see
        :meth:`~pastry.control.resources.ResourceManager.set_limit`); going over raises
        :class:`QuotaError` in the inferlet. Not part of the inferlet API: runners call it."""
        for m in self.controller.all_engines():
            m.resources.set_limit(self.instance, kind, max_held, source)

    # ------------------------------------------------------------------ helpers

    def _split(self, name: object) -> tuple[str, str]:
        """``(owner, name)``: ``~OWNER/NAME`` is in OWNER's namespace, the rest in ours."""
        if not isinstance(name, str):
            raise ApiError(f"expected a string name, got {type(name).__name__}")
        owner, rest = split_scoped(name)
        return (self.user if owner is None else owner), rest

    def _readable(self, name: object) -> tuple[str, str] | None:
        """:meth:`_split`, or None for another user's namespace that is not granted."""
        owner, rest = self._split(name)
        return (owner, rest) if self.controller.grants.may_read(self.user, owner) else None

    def _scoped(self, name: object, write: bool) -> tuple[str, str]:
        """``(owner, name)`` of an export name, store key or topic: this user's, or for
        ``~OWNER/NAME`` the owner's, which only reading may name and only with a grant."""
        owner, rest = self._split(name)
        if owner == self.user:
            return owner, rest
        if write:
            raise ApiError(
                f"{name[:80]!r} is in user {owner}'s namespace: another user's exports, store "
                "keys and topics can only be read (where granted), never written"
            )
        if not self.controller.grants.may_read(self.user, owner):
            raise ApiError(
                f"{name[:80]!r}: user {owner} has not granted user {self.user} access to its "
                f"namespace (the operator grants it with --grant {owner}:{self.user})"
            )
        return owner, rest

    def close(self) -> None:
        self.closed = True
        for ref in self._queues.values():
            ref.model.scheduler.close_queue(ref.queue, "the inferlet ended")
        self._queues.clear()
        for sub in self._subs.values():
            sub.close()
        self._subs.clear()
        self._constraints.clear()

    def _model(self, name: str) -> Model:
        try:
            return self.controller.models[name]
        except KeyError:
            raise ApiError(
                f"no model named '{name}' (available: {', '.join(self.controller.models)})"
            ) from None

    def _queue(self, q: int) -> _QueueRef:
        self._check_open()
        ref = self._queues.get(q)
        if ref is None:
            raise ApiError(
                f"queue {q} does not exist in this inferlet (create one with create_queue)"
            )
        return ref

    def _sub(self, sub: int):
        s = self._subs.get(sub)
        if s is None:
            raise ApiError(f"subscription {sub} does not exist in this inferlet")
        return s

    def _check_open(self) -> None:
        if self.closed:
            raise ApiError("this inferlet has ended")

    def _alloc(self, q: int, kind: str, n: int) -> list[int]:
        ref = self._queue(q)
        if not isinstance(n, int) or n < 0:
            raise ApiError(f"allocation size must be a non-negative integer, got {n!r}")
        return self._resource_call(lambda: ref.model.resources.alloc(self.instance, kind, n))

    def _dealloc(self, q: int, kind: str, handles: list[int]) -> asyncio.Future:
        ref = self._queue(q)
        handles = list(handles)
        res = ref.model.resources
        self._resource_call(lambda: res.check(self.instance, kind, handles))  # fail fast

        def prepare():
            res.free(self.instance, kind, handles)

        return self._submit(q, Command(Stage.CONTROL, prepare=prepare))

    def _claim(self, ref: _QueueRef, pages: list[int]) -> None:
        """This instance is about to write physical ``pages`` (see ``claim_writes``)."""
        res = ref.model.resources
        if res.cache is not None:  # no closure: every forward passes here
            claim(res, self.instance, pages)

    def _phys(self, ref: _QueueRef, kind: str, handles) -> list[int]:
        # The hot path (every handle of every command): no closure, no copy.
        try:
            return ref.model.resources.translate(self.instance, kind, handles)
        except ResourceError as e:
            raise ApiError(str(e)) from None

    @staticmethod
    def _resource_call(fn):
        try:
            return fn()
        except QuotaExceeded as e:
            raise QuotaError(str(e)) from None
        except ResourceError as e:
            raise ApiError(str(e)) from None

    def _submit(self, q: int, cmd: Command) -> asyncio.Future:
        """Queue ``cmd`` now; the returned future resolves when it has run."""
        ref = self._queue(q)
        return ref.model.scheduler.submit(ref.queue, cmd)
