"""LLM microserving's KV calls: prepare pages on one engine, fill them from another.

With the paper's semantics (Python slice indices, ``end=-1``; the routing that uses them is
:mod:`pastry.control.routing`):

- ``prep_recv(q, prompt, end)`` on the receiver (``q``'s engine): match ``prompt[:end]`` in
  its prefix cache (``matched_len``: the full pages of the longest cached prefix, in the
  caller's user's tree, shared read-only; never the last prompt token), allocate pages for
  the rest and return ``(kv_addr_info, matched_len)``. No compute. The pages are the
  caller's, recorded in a :class:`RecvBuffer` that ``kv_addr_info`` names.
- ``remote_send(q, prompt, kv_addr_info, recv_rank, begin, end)`` on the sender: compute
  the K/V of ``prompt[:end]`` there and write ``prompt[begin:end]`` straight into the
  receiver's pages, layer by layer as the forward computes them (:class:`Send` ops:
  ``SendKv`` calls, :mod:`pastry.engine.transfer`); resolves when every write has landed.
  What ``prep_recv`` matched is never sent again (``begin`` below ``matched_len`` starts
  there). The receiver's pages are held (:meth:`ResourceManager.hold
  <pastry.control.resources.ResourceManager.hold>`) until every write has ended.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pastry.api import ApiError
from pastry.control.commands import Op, Stage
from pastry.control.exports import Hold
from pastry.control.handlers.caller import resource_call
from pastry.control.model import Model
from pastry.control.session import Session
from pastry.wire.calls import SendKv, ids

PREFILL_CHUNK = 2048  # tokens per forward of a remote_send's prefill


@dataclass(eq=False)
class RecvBuffer:
    """Pages prepared by ``prep_recv`` (what ``kv_addr_info`` names): the caller's handles
    on engine ``rank`` for ``tokens`` (``prompt[:end]``); ``present`` holds the token ranges
    whose K/V are in them; ``sending`` counts the ``remote_send`` calls writing into them now,
    and ``landed`` says that one has ended with every write landed."""

    rank: int
    tokens: tuple[int, ...]
    matched: int
    pages: list[int]
    present: list[tuple[int, int]]
    queue: int = -1  # the prep_recv's queue (on engine ``rank``)
    sending: int = 0
    landed: bool = False
    dropped: bool = False  # discarded while a send wrote into it: freed when it ends

    def holds(self, begin: int) -> bool:
        """Whether the K/V of tokens ``[0, begin)`` are all present."""
        covered = 0
        for lo, hi in sorted(self.present):
            if lo > covered:
                break
            covered = max(covered, hi)
        return covered >= begin

    def serves(self, rank: int, tokens: tuple[int, ...], begin: int) -> bool:
        """Whether a request for ``tokens`` may start on engine ``rank`` from this
        buffer's K/V of ``tokens[:begin]``: it was prepared for a prefix of ``tokens``
        (not a longer prompt that shares ``begin`` tokens with it: that one's owner still
        needs it), holds them, no send writes into it, and the page where ``tokens[begin]``
        will be written is not one shared from the prefix cache (``matched``, read-only)."""
        n = len(self.tokens)
        return (self.rank == rank and not self.sending and not self.dropped and n >= begin
                and tokens[:n] == self.tokens and self.matched <= begin
                and self.holds(begin))  # fmt: skip


def slice_bounds(n: int, begin: int | None, end: int | None) -> tuple[int, int]:
    """``prompt[begin:end]`` as absolute ``(begin, end)`` of a length-``n`` prompt (Python
    slice semantics: negative counts from the end, out of range clamps)."""
    for name, v in (("begin", begin), ("end", end)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
            raise ApiError(f"{name} must be an integer (a Python slice index), got {v!r}")
    b, e, _ = slice(begin, end).indices(n)
    return b, max(b, e)


def tokens_of(prompt: Sequence[int]) -> tuple[int, ...]:
    try:
        return tuple(int(t) for t in prompt)
    except (TypeError, ValueError):
        raise ApiError("prompt must be a list of token ids") from None


class Transfers:
    """The ``prep_recv`` buffers of every instance, and the calls that fill them."""

    def __init__(self, engine_of: Callable[[str, int], Model]) -> None:
        self.engine_of = engine_of  # (model, rank) -> its engine (ApiError if none)
        self.buffers: dict[int, dict[int, RecvBuffer]] = defaultdict(dict)
        self._handles = itertools.count(1)  # never reused: a stale kv_addr_info stays stale

    def end_instance(self, instance: int) -> None:
        """Forget an ended instance's buffers (its pages went with its handles)."""
        self.buffers.pop(instance, None)

    def prep_recv(
        self, session: Session, q: int, prompt: Sequence[int], end: int
    ) -> asyncio.Future:
        ref = session.queue(q)
        tokens = tokens_of(prompt)
        _, end = slice_bounds(len(tokens), None, end)
        ps = ref.model.info.page_size
        shared = self._match(session, ref.model, tokens, end)
        matched = len(shared) * ps
        try:
            pages = shared + session.alloc_kvpages(q, -(-end // ps) - len(shared))  # masked
        except ApiError:
            ref.model.resources.free(session.instance, "kv", shared)
            raise
        buffers = self.buffers[session.instance]
        handle = next(self._handles)
        buffers[handle] = RecvBuffer(
            ref.model.rank, tokens[:end], matched, pages, [(0, matched)], queue=q
        )
        out = asyncio.get_running_loop().create_future()
        # Resolve once the masks of the fresh pages have run: a write that lands after
        # would otherwise be hidden again.
        _chain(session.synchronize(q), out, (handle, matched))
        return out

    def _match(self, session: Session, model: Model, tokens: tuple, end: int) -> list[int]:
        """New handles of ``session`` for the full pages of the longest prefix of
        ``tokens[:end]`` in ``model``'s prefix cache (the caller's user's tree; shared
        read-only, so ``remote_send`` never writes them). At least the last prompt token is
        left to send (``start_generate`` computes it)."""
        res, cache = model.resources, model.resources.cache
        if cache is None or not end:
            return []
        ps = model.info.page_size
        limit = min(end, len(tokens) - 1)
        m = cache.match(tokens, limit, namespace=res.user_of(session.instance))
        full = m.length // ps
        if not full:
            return []
        handles = resource_call(res.reserve, session.instance, "kv", full)
        res.bind_cached(session.instance, handles, m.pages[:full])
        return handles

    def remote_send(
        self,
        session: Session,
        q: int,
        prompt: Sequence[int],
        kv_addr_info: int,
        recv_rank: int,
        begin: int,
        end: int,
        src_pages: Sequence[int] = (),
        src_len: int = 0,
    ) -> asyncio.Future:
        sender = session.queue(q).model
        tokens = tokens_of(prompt)
        buf, begin, end = self._sent_range(session, kv_addr_info, recv_rank, tokens, begin, end)
        receiver = self.engine_of(sender.name, recv_rank)
        if receiver is sender:
            raise ApiError(
                f"remote_send from engine {recv_rank} to itself: its K/V are computed there by "
                "start_generate(prompt, begin)"
            )
        out = asyncio.get_running_loop().create_future()
        if begin == end:
            buf.landed = True
            out.set_result(None)
            return out
        plan = _SendPlan(session, q, sender, receiver, self.peer(sender, receiver), buf, tokens)
        futs, sends = plan.run(list(src_pages), int(src_len), begin, end)
        buf.sending += 1

        # The receiver's pages are held until every send has ended (landed, failed, or
        # dropped before it ran), even if the caller gives up earlier; no other request
        # takes the buffer meanwhile (``serves``), and one discarded meanwhile is freed then.
        def ended(_: asyncio.Future) -> None:
            receiver.resources.release(plan.hold, session.user)
            buf.sending -= 1
            if buf.dropped and not buf.sending:
                self.drop_buffer(session, buf.queue, buf)

        asyncio.gather(*sends, return_exceptions=True).add_done_callback(ended)

        def done(f: asyncio.Future) -> None:
            if f.cancelled():
                out.cancel()
            elif f.exception() is not None:
                out.set_exception(f.exception())
            else:
                buf.present.append((begin, end))
                buf.landed = True
                out.set_result(None)

        asyncio.gather(*futs, *sends).add_done_callback(done)
        return out

    def _sent_range(
        self, session: Session, kv_addr_info: int, recv_rank: int, tokens: tuple, begin, end
    ) -> tuple[RecvBuffer, int, int]:
        """The buffer ``kv_addr_info`` names and the absolute ``[begin, end)`` to send into
        it, checked against what ``prep_recv`` prepared."""
        buf = self.buffers[session.instance].get(kv_addr_info)
        if buf is None or buf.dropped:
            raise ApiError(f"kv_addr_info {kv_addr_info!r} is not a prep_recv of this inferlet")
        if recv_rank != buf.rank:
            raise ApiError(f"kv_addr_info {kv_addr_info} is on engine {buf.rank}, not {recv_rank}")
        begin, end = slice_bounds(len(tokens), begin, end)
        if end > len(buf.tokens) or tokens[:end] != buf.tokens[:end]:
            raise ApiError(
                f"prompt[:{end}] is not the prompt prep_recv prepared (its prompt[:{len(buf.tokens)}])"
            )
        # What prep_recv matched in the receiver's cache is there already (and shared: it
        # must not be written), so it is never sent again.
        return buf, min(max(begin, buf.matched), end), end

    def peer(self, sender: Model, receiver: Model) -> str:
        """The address through which ``sender`` writes into ``receiver``'s pool."""
        peers = receiver.info.kv_peers
        if sender.info.host and sender.info.host == receiver.info.host:
            for p in peers:
                if p.startswith("shm:"):
                    return p
        for p in peers:
            if p.startswith("tcp://"):
                return p
        raise ApiError(
            f"engine {receiver.rank} of '{receiver.name}' cannot receive K/V from engine "
            f"{sender.rank}: it has no shared-memory pool on that host and no --kv-recv "
            "endpoint (start it with `pastry engine --kv-recv tcp://HOST:PORT`)"
        )

    def buffer_for(self, session: Session, rank: int, tokens: tuple, begin: int) -> RecvBuffer:
        """The buffer a request for ``tokens`` starts from on engine ``rank`` with the K/V
        of ``tokens[:begin]`` (:meth:`RecvBuffer.serves`). Of several (concurrent requests
        of one prompt), one prepared for exactly ``tokens[:begin]`` whose send has landed
        comes first: a request that takes another's equivalent buffer leaves its own."""
        fits = [b for b in self.buffers[session.instance].values() if b.serves(rank, tokens, begin)]
        if not fits:
            raise ApiError(
                f"the K/V of prompt[:{begin}] is not on engine {rank}: prepare it with prep_recv "
                "there and remote_send from another engine first (or start at begin=0)"
            )
        return min(fits, key=lambda b: (len(b.tokens) != begin, not b.landed))

    def discard(self, session: Session, q: int, tokens: tuple[int, ...], begin: int) -> None:
        """Free the buffer a request for ``tokens`` from ``begin`` would have taken on
        ``q``'s engine (the request will not take it: it ended, or starts at 0). Only that
        one: concurrent requests of the same prompt keep theirs."""
        rank = session.queue(q).model.rank
        try:
            buf = self.buffer_for(session, rank, tokens, begin)
        except ApiError:
            return
        self.drop_buffer(session, q, buf)

    def drop_buffer(self, session: Session, q: int, buf: RecvBuffer) -> None:
        """Forget ``buf`` and free its pages (``q`` is a queue on its engine); one a send
        still writes into is freed when the send ends."""
        buffers = self.buffers[session.instance]
        if buf.sending:
            buf.dropped = True
            return
        for h, b in list(buffers.items()):
            if b is buf:
                del buffers[h]
        if buf.pages:
            session.dealloc_kvpages(q, buf.pages).add_done_callback(_consume)


@dataclass
class _SendPlan:
    """The calls of one ``remote_send``: the sender computes what it does not hold and
    writes ``tokens[begin:end]`` into the receiver's buffer ``buf``."""

    session: Session
    q: int
    sender: Model
    receiver: Model
    peer: str
    buf: RecvBuffer
    tokens: tuple[int, ...]
    hold: Hold | None = None

    def run(
        self, src_pages: list[int], src_len: int, begin: int, end: int
    ) -> tuple[list[asyncio.Future], list[asyncio.Future]]:
        """Queue the calls; returns (the prefill's and clean-up's futures, the sends')."""
        session, q, ps = self.session, self.q, self.sender.info.page_size
        # What the sender holds already (Fig. 8): pages of the caller's with the K/V of
        # prompt[:src_len] (the engines keep no context cache yet). Case 1: it holds more
        # than the receiver, and sends that part without compute; case 2: the rest,
        # prompt[held:end], is computed on top, and only prompt[begin:end] is sent.
        held = min(src_len, end) if src_pages else 0
        if src_pages and not 0 <= src_len <= len(src_pages) * ps:
            raise ApiError(f"src_len {src_len} does not fit {len(src_pages)} pages of {ps}")
        resource_call(self.sender.resources.translate, session.instance, "kv", src_pages)
        work = session.alloc_kvpages(q, -(-end // ps) - held // ps) if held < end else []
        # The page of every page index of prompt[:end] (a partial last held page is
        # copied into work[0], where its page index continues).
        view = src_pages[: held // ps] + work if work else src_pages[: -(-held // ps)]
        # Hold the receiver's pages until the writes have landed, whatever happens to
        # the buffer meanwhile.
        self.hold = self.receiver.resources.hold(session.instance, "kv", self.buf.pages)
        futs, sends = [], []
        if held % ps and held < end:  # the partial last held page continues in work[0]
            futs.append(session.copy_kvpage(q, src_pages[held // ps], work[0], 0, 0, held % ps))
        if held < end:
            self._prefill(view, held, begin, end, futs, sends)
        if begin < held:  # sent from what the sender holds, without compute
            sends.append(self._send(view, begin, held))
        if work:
            futs.append(session.dealloc_kvpages(q, work))
        return futs, sends

    def _prefill(self, view: list[int], held: int, begin: int, end: int, futs, sends) -> None:
        """Compute ``tokens[held:end]`` in chunks, sending each chunk's part of
        ``[begin, end)`` as its forward's layers are done."""
        session, q, ps, tokens = self.session, self.q, self.sender.info.page_size, self.tokens
        chunk = min(PREFILL_CHUNK, self.sender.info.max_batch_tokens)
        embeds = session.alloc_embeds(q, min(end - held, chunk))
        for start in range(held, end, chunk):
            stop = min(end, start + chunk)
            m = stop - start
            ctx = view[: -(-start // ps)]
            last = start - (len(ctx) - 1) * ps if ctx else 0
            futs.append(session.embed_txt(q, list(tokens[start:stop]), list(range(start, stop)),
                                          embeds[:m]))  # fmt: skip
            futs.append(session.forward(q, ctx, last, embeds[:m],
                                        view[start // ps : -(-stop // ps)], start % ps, []))  # fmt: skip
            lo = max(begin, start)
            if lo < stop:
                sends.append(self._send(view, lo, stop))
        futs.append(session.dealloc_embeds(q, embeds))

    def _send(self, view: list[int], lo: int, hi: int) -> asyncio.Future:
        ps = self.receiver.info.page_size
        ref = self.session.queue(self.q)
        src, dst = view[lo // ps : -(-hi // ps)], self.buf.pages[lo // ps : -(-hi // ps)]
        op = Send(self.session.instance, ref.model, src, self.receiver, dst, hi - lo, lo % ps,
                  self.peer)  # fmt: skip
        return self.session.submit(ref, Stage.OUTPUT, op)


class Send(Op):
    """One ``SendKv`` of a ``remote_send``: the sender's pages ``src`` into the receiver's
    ``dst`` (both the instance's handles, translated when batched)."""

    __slots__ = ("dst", "instance", "length", "offset", "peer", "receiver", "sender", "src")

    def __init__(self, instance, sender, src, receiver, dst, length, offset, peer) -> None:
        self.instance, self.sender, self.src, self.receiver, self.dst = (
            instance, sender, src, receiver, dst
        )  # fmt: skip
        self.length, self.offset, self.peer = length, offset, peer

    def prepare(self) -> SendKv:
        inst = self.instance
        return SendKv(
            src_pages=ids(self.sender.resources.translate(inst, "kv", self.src)),
            dst_pages=ids(self.receiver.resources.translate(inst, "kv", self.dst)),
            length=self.length,
            peer=self.peer,
            src_offset=self.offset,
            dst_offset=self.offset,
        )


def _chain(src: asyncio.Future, dst: asyncio.Future, value: object) -> None:
    def done(f: asyncio.Future) -> None:
        if dst.done():
            return
        if f.cancelled():
            dst.cancel()
        elif f.exception() is not None:
            dst.set_exception(f.exception())
        else:
            dst.set_result(value)

    src.add_done_callback(done)


def _consume(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()
