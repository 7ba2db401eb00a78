"""``Context``: a token sequence with its KV cache, the support library's main abstraction.

A context owns a command queue, KV pages and a few embedding slots. ``fill`` appends text
or tokens (lazily: they are forwarded with the next ``generate`` or ``flush``),
``generate`` runs the sample loop with a sampler and stop conditions, ``fork`` makes a
child that shares every *full* page by reference (the partial last page is copied), and
pages are allocated as the sequence grows and released when the context is.

Filled tokens go through the server's automatic prefix cache (``prefill``): whatever
prefix of the context another program (or an earlier request) already computed is shared
instead of computed again, and the context's own tokens — prompt and generated ones — are
kept for others when its pages are released. ``cached_tokens`` counts the tokens that came
from the cache.

A decode step (one pending token, a sampler on the device) is one fused ``step`` command
(embed, forward and sample in one submission); other steps issue their calls together and
await them once. Either way the inferlet wakes once per step, and the scheduler runs the
step's calls in one engine batch.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable, Sequence

from pastry.api import ApiError, Sampling
from pastry.sdk import images as imaging
from pastry.sdk.ahead import until_own_stop
from pastry.sdk.calls import await_step
from pastry.sdk.current import api
from pastry.sdk.pages import give_back, share
from pastry.sdk.sampling import Sampler
from pastry.sdk.stop import (
    EosTokens,
    LoopFields,
    MaxTokens,
    StopCondition,
    StopStrings,
    loop_fields,
)


class Context:
    def __init__(
        self,
        model: str | None = None,
        *,
        queue: int | None = None,
        engine: int | None = None,
        adapter: str | None = None,
    ) -> None:
        """``adapter``: a LoRA adapter of the model (``get_adapters``) applied to every
        forward of this context (its K/V is its own: the prefix cache neither supplies nor
        keeps it)."""
        self.api = a = api()
        self.model = model or a.available_models()[0]
        self.adapter = adapter
        self._own_queue = own_queue = queue is None
        if own_queue:
            queue = a.create_queue(self.model, *(() if engine is None else (engine,)))
        self.queue = queue
        if adapter is not None and adapter not in a.get_adapters(queue):
            loaded = ", ".join(a.get_adapters(queue)) or "none"
            if own_queue:  # not kept open for a context that never was
                a.close_queue(queue)
            raise ApiError(f"no adapter named '{adapter}' on {self.model} (loaded: {loaded})")
        # A context on a model with several engines is placed by the router before its
        # first forward, unless its queue or engine was given (see place).
        self._placed = not own_queue or engine is not None
        self.page_size = a.get_kv_page_size(self.queue)
        self.pages: list[int] = []
        self.kv_len = 0  # tokens whose K/V are in the pages
        self.tokens: list[int] = []  # every token of the context, forwarded or not
        self.pending: list[int] = []  # filled but not yet forwarded
        self._embeds: list[int] = []
        self._eos: list[int] | None = None
        self._last: asyncio.Future | None = None  # the latest flush still in flight
        self.released = False
        self.cached_tokens = 0  # filled tokens that came from the prefix cache
        # Images filled but not yet forwarded: position -> (encoded bytes, embeddings).
        self._images: dict[int, tuple[bytes, int]] = {}
        # Every image of the context: (first position, embeddings, SHA-256), in order; the
        # prefix cache matches an image by its digest.
        self.image_spans: list[tuple[int, int, bytes]] = []
        # Pages [0, frozen) may be shared through the prefix cache: never written in place,
        # but those of ``owned``, private copies made to be written (steps.own_page).
        self.frozen, self.owned = 0, set[int]()

    # ------------------------------------------------------------------ filling

    def fill(self, text: str, add_special_tokens: bool | None = None) -> None:
        """Append ``text``. ``add_special_tokens`` (default: whether the context is still
        empty) tokenizes it as the start of a sequence, with a BOS if the model wants one;
        pass False for text that carries its own, such as a rendered chat template."""
        if add_special_tokens is None:
            add_special_tokens = not self.tokens
        self.fill_tokens(self.api.tokenize(self.queue, text, add_special_tokens))

    def fill_tokens(self, tokens: Sequence[int]) -> None:
        self.check_live()
        self.tokens.extend(tokens)
        self.pending.extend(tokens)

    def fill_image(self, image: bytes) -> None:
        """Append an image (its encoded bytes: PNG, JPEG, WebP or GIF) on a model with the
        ``input_image`` trait: ``num_embs_needed`` positions whose embeddings
        ``embed_img`` writes when the context is next forwarded; ``tokens`` holds the
        model's image placeholder token (``get_image_token``) at each of them. Raises
        ``ApiError`` at once for bytes that are no such image, one over the image quotas,
        or a model without images. Fill text after it before ``flush`` or ``generate``
        (generation starts from a text token)."""
        self.check_live()
        a, q = self.api, self.queue
        n = a.num_embs_needed(q, image)
        image = bytes(image)
        self._images[len(self.tokens)] = (image, n)
        self.image_spans.append((len(self.tokens), n, hashlib.sha256(image).digest()))
        placeholder = [a.get_image_token(q)] * n
        self.tokens.extend(placeholder)
        self.pending.extend(placeholder)

    @property
    def has_image(self) -> bool:
        return bool(self.image_spans)

    def drop_images(self, length: int) -> None:
        """Forget the images at or after ``length`` (the context is being cut there:
        :func:`~pastry.sdk.steps.truncate`); ``ApiError`` for a cut through one."""
        self.image_spans = imaging.cut_images(self.image_spans, self._images, length)

    def fill_prompt(self, tokens: Sequence[int], images: Sequence[bytes] = ()) -> None:
        """Append ``tokens``, each image placeholder token among them (``get_image_token``:
        one per image, where a chat template or the client wrote it) replaced by the next
        of ``images`` (:meth:`fill_image`). ``ValueError`` unless there is one placeholder
        per image."""
        if not images:
            self.fill_tokens(tokens)
            return
        start = 0
        for i, image in zip(
            imaging.placeholders(self.api, self.queue, tokens, images), images, strict=True
        ):
            self.fill_tokens(tokens[start:i])
            self.fill_image(image)
            start = i + 1
        self.fill_tokens(tokens[start:])

    async def flush(self, keep_last: bool = True) -> None:
        """Forward the pending tokens into the KV cache.

        By default the last token stays pending: generation starts from its output, so a
        flushed context can still ``generate``. ``keep_last=False`` stores every token
        (e.g. before exporting the pages of a finished prompt).
        """
        self.check_live()
        if keep_last:
            self._check_tail("flush")
        await self.place()
        todo = self.pending[:-1] if keep_last else self.pending
        if todo:
            futs, _ = self.forward_tokens(todo, 0)
            self.pending = self.pending[len(todo) :]
            self._last = asyncio.gather(*futs)
        if self._last is not None:  # also when a concurrent flush (or fork) issued it
            await self._last

    # ------------------------------------------------------------------ generation

    async def generate(
        self, sampler: Sampler | None = None, stop: StopCondition | None = None
    ) -> str:
        """Generate until ``stop``; returns the generated text (stop strings trimmed, a final
        end-of-sequence token left out). The tokens stay in the context."""
        self.check_live()
        sampler = sampler or Sampler()
        stop = stop or (MaxTokens(256) | EosTokens(self.eos_ids))
        if not self.pending:
            raise ApiError("nothing to generate from: fill the context first")
        self._check_tail("generate")
        await self.place()
        a, q = self.api, self.queue
        out: list[int] = []
        # Room for the tokens to come, reserved with the prompt (the last is not stored).
        reserve = max(0, (stop.max_tokens or 1) - 1)
        # The decode steps run ahead in the control layer (``generate`` request): this
        # program wakes once, when they end, or per merged part to check a condition of
        # its own. Not for a sampler that picks the token itself, nor with an adapter.
        ahead = loop_fields(stop, True) if sampler.on_device and self.adapter is None else None
        while True:
            if ahead is not None and len(self.pending) == 1:
                await self._run_ahead(sampler, stop, ahead, out)
                break
            if not sampler.on_device:  # it picks from the distribution itself
                futs, (emb,) = self.forward_tokens(self.pending, 1, reserve)
                tok = sampler.choose(*await await_step(futs, a.get_next_dist(q, emb)))
            elif len(self.pending) == 1:  # the common decode step: one fused command
                tok = await self.decode_step(self.pending[0], sampler.sampling(len(out)))
            else:
                futs, (emb,) = self.forward_tokens(self.pending, 1, reserve)
                tok = await await_step(futs, a.sample(q, emb, sampler.sampling(len(out))))
            reserve = 0
            out.append(tok)
            self.tokens.append(tok)
            self.pending = [tok]
            tail = a.detokenize(q, out[-stop.tail_tokens :]) if stop.tail_tokens else ""
            if stop.should_stop(out, tail):
                break
        if out and out[-1] in self.eos_ids:
            out = out[:-1]
        return stop.trim(a.detokenize(q, out))

    async def _run_ahead(
        self, sampler: Sampler, stop: StopCondition, ahead: LoopFields, out: list[int]
    ) -> None:
        """The rest of ``generate`` as one loop in the control layer (see run_ahead)."""
        if loop_fields(stop) is None:  # a condition of the program's own
            await until_own_stop(self, sampler.sampling(len(out)), stop, ahead, out)
            return
        max_tokens, stop_ids, strings = ahead
        tail = out[-stop.tail_tokens :] if stop.tail_tokens else []
        tokens, _, _ = await self.run_ahead(
            max_tokens - len(out), sampler.sampling(len(out)), stop_ids, strings, recent=tail
        )
        out.extend(tokens)

    async def run_ahead(
        self,
        max_tokens: int,
        sampling: Sampling | None = None,
        stop_tokens: Sequence[int] = (),
        stop: Sequence[str] = (),
        min_tokens: int = 0,
        recent: Sequence[int] = (),
        every: int = 0,
        hear: Callable[[list[int], tuple[list, list, list]], bool] | None = None,
    ) -> tuple[list[int], str, tuple[list, list, list]]:
        """Generate from the one pending token with one ``generate`` request: the decode
        loop runs in the control layer and this program wakes once, when it ends (see
        :class:`pastry.api.Generate` for the stop rules, the per-token sampling and
        ``recent``). Every sampled token joins the context (the last one pending), as do
        the pages the loop allocated, also when it failed part-way (then ApiError is
        raised). Returns (the tokens, why it ended: ``length``, ``stop``, ``grammar`` or
        ``cancelled``, and with ``sampling.logprobs`` per token (logprob, top ids, top
        logprobs)).

        To hear the tokens as they come, pass ``every`` k >= 1 and ``hear``: it is called
        with the tokens (and their log-probabilities) sampled since its last call, at
        least k of them unless the loop ended, while the loop runs on; a true return ends
        the loop (finish ``cancelled``: the tokens sampled meanwhile are in the context
        and the result too)."""
        self.check_live()
        if len(self.pending) != 1:
            raise ApiError(f"run_ahead starts from one pending token, not {len(self.pending)}")
        if every and hear is None:
            raise ApiError("run_ahead with every needs hear, the function the tokens go to")
        e_in, e_out = self.embed_slots(2)
        answer = await self.api.generate(
            self.queue, self.pending[0], self.kv_len, e_in, e_out, list(self.pages),
            max_tokens, sampling, list(stop_tokens), list(stop), min_tokens, list(recent),
            every,
        )  # fmt: skip
        out: list[int] = []
        logprobs: tuple[list, list, list] = ([], [], [])
        while True:
            tokens, finish, error, lps = self._take(answer)
            out += tokens
            for whole, part in zip(logprobs, lps, strict=True):
                whole += part
            if error:
                raise ApiError(error)
            try:
                ended = hear(tokens, lps) if hear is not None and tokens else False
            except BaseException:
                if not finish:  # end the loop, the context kept whole, before raising
                    self._take(await self.api.generate_more(self.queue, True))
                raise
            if finish:
                return out, finish, logprobs
            answer = await self.api.generate_more(self.queue, bool(ended))

    def _take(self, answer: tuple) -> tuple[list[int], str, str, tuple[list, list, list]]:
        """A generation loop's answer into the context: (tokens, finish, error, logprobs)."""
        tokens, pages, finish, error, *lps = answer
        self.pages.extend(pages)
        self.kv_len += len(tokens)
        self.tokens.extend(tokens)
        if tokens:
            self.pending = [tokens[-1]]
        return tokens, finish, error, (lps[0], lps[1], lps[2])

    async def generate_until(
        self,
        max_tokens: int = 256,
        stop: Sequence[str] = (),
        sampler: Sampler | None = None,
    ) -> str:
        """Generate up to ``max_tokens``, stopping early at end-of-sequence or a stop string."""
        cond: StopCondition = MaxTokens(max_tokens) | EosTokens(self.eos_ids)
        if stop:
            cond = cond | StopStrings(stop)
        return await self.generate(sampler, cond)

    @property
    def eos_ids(self) -> list[int]:
        if self._eos is None:
            self._eos = self.api.get_eos_token_ids(self.queue)
        return self._eos

    @property
    def text(self) -> str:
        return self.api.detokenize(self.queue, self.tokens)

    # ------------------------------------------------------------------ forking and release

    async def fork(self) -> Context:
        """A child context on its own queue sharing this one's full KV pages by reference.

        Pending tokens but the last are flushed first so the shared prefix is in the cache;
        the last one stays pending in both.
        """
        await self.flush()
        child = Context(
            self.model, engine=self.api.get_queue_engine(self.queue), adapter=self.adapter
        )
        full = self.kv_len // self.page_size
        share(self.api, self.pages[:full])
        child.pages = list(self.pages[:full])
        child.frozen = min(self.frozen, full)
        rest = self.kv_len % self.page_size
        if rest:
            page = child.alloc_pages(1)[0]
            await self.api.copy_kvpage(child.queue, self.pages[full], page, 0, 0, rest)
        child.kv_len = self.kv_len
        child.tokens = list(self.tokens)
        child.pending = list(self.pending)
        child.image_spans = list(self.image_spans)
        return child

    async def release(self) -> None:
        """Give back pages (those no other context shares) and embedding slots."""
        if self.released:
            return
        self.released = True
        pages, embeds, self.pages, self._embeds = self.pages, self._embeds, [], []
        await give_back(self.api, self.queue, pages, embeds)
        if self._own_queue:
            self.api.close_queue(self.queue)

    async def __aenter__(self) -> Context:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.release()

    # ------------------------------------------------------------------ internals

    async def migrate(self, engine: int) -> None:
        """Move this context to engine ``engine`` of its model (microserving's context
        migration): its K/V are written into pages there, one-sided, and it goes on there
        exactly as if it had never moved. Its forks stay where they are."""
        self.check_live()
        await self.flush()
        self._placed = True
        a = self.api
        if engine == a.get_queue_engine(self.queue):
            return
        q = a.create_queue(self.model, engine)
        n, prompt = self.kv_len, list(self.tokens)
        pages: list[int] = []
        if n:
            kv, matched = await a.prep_recv(q, prompt, n)
            await a.remote_send(self.queue, prompt, kv, engine, matched, n, self.pages, n)
            pages = a.start_generate(q, prompt, n)
        old_q, old_pages, old_embeds = self.queue, self.pages, self._embeds
        self.queue, self.pages, self._embeds, self.owned = q, pages, [], set()
        await give_back(a, old_q, old_pages, old_embeds)
        if self._own_queue:
            a.close_queue(old_q)
        self._own_queue = True

    async def place(self, whole: bool = False) -> None:
        """Before the first forward of a fresh context on a model with several engines: ask
        the router where it runs (``route``); the K/V of the prompt's first ``begin``
        tokens may already be there (transferred by the router). ``flush`` and
        ``generate`` do it; code that forwards a context's tokens itself awaits it first.
        A no-op afterwards, and for a context whose queue or engine was given. ``whole``:
        the prompt is computed here whatever the router moved (its outputs are wanted)."""
        if self._placed:
            return
        self._placed = True
        if self.kv_len or self.pages or self.api.available_engines(self.model) == 1:
            return
        # The K/V of a context with an image is computed here: its placeholder tokens
        # name no K/V another engine could hold.
        whole = whole or self.has_image
        begin, pages = await self.api.route(self.queue, list(self.pending), whole)
        if begin:
            self.pages = list(pages)
            self.kv_len = begin
            self.pending = self.pending[begin:]

    def check_live(self) -> None:
        if self.released:
            raise ApiError("this context was released")

    def alloc_pages(self, n: int) -> list[int]:
        pages = self.api.alloc_kvpages(self.queue, n)
        self.pages.extend(pages)
        return pages

    def embed_slots(self, n: int) -> list[int]:
        if len(self._embeds) < n:
            self._embeds += self.api.alloc_embeds(self.queue, n - len(self._embeds))
        return self._embeds[:n]

    def forward_tokens(
        self, tokens: list[int], n_out: int, reserve: int = 0
    ) -> tuple[list, list[int]]:
        """Issue the calls that forward ``tokens`` (the pending ones, from ``kv_len``);
        returns (futures, the embedding slots of the outputs of the last ``n_out``). A
        prefill also reserves pages for ``reserve`` tokens after them."""
        a, q, ps = self.api, self.queue, self.page_size
        n = len(tokens)
        start = self.kv_len
        self.kv_len += n
        if n > n_out and self.adapter is None:  # maybe in the cache
            outs = self.embed_slots(n_out)  # the prefill brings its own input slots
            if start == len(self.pages) * ps:  # reusable: pages up to the end may be shared
                self.frozen = (start + n) // ps
            seq = self.tokens[: start + n]
            images = imaging.prefill_images(self.image_spans, self._images, start, start + n)
            new, fut = a.prefill(q, seq, start, self.pages, outs, reserve, *images)
            self.pages.extend(new)
            fut.add_done_callback(self._count_cached)
            return [fut], outs
        embeds = self.embed_slots(n + n_out)
        ins, outs = embeds[:n], embeds[n : n + n_out]
        ctx_pages, last, out_pages = self._grow(start, n)
        futs = self._embed(tokens, start, ins)
        futs.append(self._forward_call(ctx_pages, last, ins, out_pages, start % ps, outs))
        return futs, outs

    def _embed(self, tokens: list[int], start: int, ins: list[int]) -> list:
        """The embed calls of ``tokens`` at positions ``start..`` into ``ins``."""
        if not self._images:
            a, n = self.api, len(tokens)
            return [a.embed_txt(self.queue, list(tokens), list(range(start, start + n)), ins)]
        return imaging.embed_calls(self.api, self.queue, self._images, tokens, start, ins)

    def _check_tail(self, what: str) -> None:
        """Refuse to leave part of an image pending: the pending token a flush keeps (and
        generation starts from) must be text."""
        if imaging.in_image(self._images, len(self.tokens) - 1):
            raise ApiError(
                f"{what}: the context ends with an image; fill text after it (generation "
                "starts from a text token)"
            )

    def _forward_call(self, ctx_pages, last, ins, out_pages, offset, outs):
        if self.adapter is None:
            return self.api.forward(self.queue, ctx_pages, last, ins, out_pages, offset, outs)
        return self.api.forward_with_adapter(
            self.queue, self.adapter, ctx_pages, last, ins, out_pages, offset, outs
        )

    def decode_step(self, token: int, sampling: Sampling | None) -> asyncio.Future:
        """Forward the one pending ``token`` and sample the next with ``sampling``: one
        fused ``step`` command (embed, forward and sample)."""
        start = self.kv_len
        self.kv_len += 1
        e_in, e_out = self.embed_slots(2)
        ctx_pages, last, out_pages = self._grow(start, 1)
        if self.adapter is not None:  # the fused step has no adapter: its three calls
            a, q = self.api, self.queue
            offset = start % self.page_size
            earlier = [
                a.embed_txt(q, [token], [start], [e_in]),
                self._forward_call(ctx_pages, last, [e_in], out_pages, offset, [e_out]),
            ]
            return asyncio.ensure_future(await_step(earlier, a.sample(q, e_out, sampling)))
        return self.api.step(
            self.queue, [token], [start], [e_in], ctx_pages, last, out_pages,
            start % self.page_size, e_out, sampling,
        )  # fmt: skip

    def _grow(self, start: int, n: int) -> tuple[list[int], int, list[int]]:
        """Pages for ``n`` tokens from ``start`` (allocated as needed): (context pages, the
        last one's length, the pages the new tokens' K/V go to)."""
        ps = self.page_size
        need = -(-(start + n) // ps) - len(self.pages)
        if need > 0:
            self.alloc_pages(need)
        ctx_pages = self.pages[: -(-start // ps)]
        last = start - (len(ctx_pages) - 1) * ps if ctx_pages else 0
        return ctx_pages, last, self.pages[start // ps : -(-(start + n) // ps)]

    def _count_cached(self, fut: asyncio.Future) -> None:
        if not fut.cancelled() and fut.exception() is None:
            self.cached_tokens += fut.result()
