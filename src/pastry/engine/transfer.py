"""One-sided KV transfer between engines, layer by layer (microserving's ``remote_send``).

The receiving engine takes no part in a transfer: the control layer has allocated pages in
its pool (``prep_recv``) and the *sender* writes K/V straight into them, like an RDMA put.

- **On one host** every engine's KV pool lives in a shared-memory file
  (:class:`~pastry.engine.pool.KvLayout`, ``EngineConfig.kv_shm``); a sender maps its peer's
  file once and writes with ``index_copy_`` into the mapped tensors (``shm:PATH`` peers).
- **Across hosts** the receiver runs a :class:`KvReceiver`, a thread with its own ZeroMQ
  socket (CURVE-authenticated by the engine token) that applies the writes it is sent to
  the pool while the engine keeps running its batches; the sender streams each layer as a
  msgpack header plus the raw K and V rows (``tcp://HOST:PORT`` peers).

:class:`KvSender` runs the :class:`~pastry.wire.calls.SendKv` calls of a batch on a
*communication thread*, the analogue of a communication stream: the engine declares a
batch's sends before its forward (:meth:`KvSender.declare`, microserving's ``mark_send``),
the model calls :meth:`KvSender.on_layer` after each decoder layer (through the forward
context's per-layer hook) and layer ``l``'s rows are queued at once, so transfer overlaps
the compute of the layers after it; :meth:`KvSender.complete` sends what is left (all of
it when the batch has no forward, or the forward took a path without the hook), then the
positions and attendable bits, and returns when every write has landed.
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import msgpack
import numpy as np
import torch
import zmq

from pastry.engine.pool import KvLayout, KvPool
from pastry.wire.auth import secure_client, secure_server, start_authenticator
from pastry.wire.calls import SendKv

log = logging.getLogger(__name__)

COMMIT_TIMEOUT_S = 60.0
_WRITE, _COMMIT = 1, 2
_WIRE_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
_FROM_WIRE = {v: k for k, v in _WIRE_DTYPES.items()}
_INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


class TransferError(RuntimeError):
    """A KV transfer failed: the peer is unreachable, refused the write, or timed out."""


def page_slots(pages: np.ndarray, offset: int, length: int, page_size: int) -> np.ndarray:
    """Flat slot numbers of ``length`` tokens from ``offset`` over the concatenated pages."""
    idx = np.arange(offset, offset + length)
    return np.asarray(pages, dtype=np.int64)[idx // page_size] * page_size + idx % page_size


def head_rows(slots: np.ndarray, kv_heads: int, num_slots: int) -> torch.Tensor:
    """Rows of a ``[kv_heads * num_slots, head_dim]`` view of one layer's K (or V) that hold
    ``slots``, head-major: ``[kv_heads * len(slots)]``."""
    s = torch.from_numpy(np.ascontiguousarray(slots, dtype=np.int64))
    return (torch.arange(kv_heads).unsqueeze(1) * num_slots + s).reshape(-1)


# --------------------------------------------------------------------------- peers


class _ShmPeer:
    """A peer engine on this host: its pool file, mapped."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            self.inode = _inode(path)
            self.layout, (data, self.positions, self.attendable) = KvLayout.open(path)
        except (OSError, ValueError) as e:
            raise TransferError(f"cannot map the KV pool of peer shm:{path}: {e}") from e
        n = self.layout.num_layers
        self.k, self.v = data[:n], data[n:]

    def replaced(self) -> bool:
        """Whether the pool file is no longer the one mapped (the peer engine restarted and
        made a new pool: writes into the old mapping would reach nobody)."""
        try:
            return _inode(self.path) != self.inode
        except OSError:
            return True

    def write(self, layer: int, part: _Part, data: _LayerData) -> None:
        _apply(self.layout, self.k[layer], self.v[layer], part.dst_pages, part.dst_edge, data)

    def commit(self, dst_slots: np.ndarray, positions: torch.Tensor) -> None:
        s = torch.from_numpy(dst_slots)
        self.positions.index_copy_(0, s, positions)
        self.attendable.index_fill_(0, s, True)

    def check(self, dst_slots: np.ndarray, layout: KvLayout) -> None:
        _check_layout(self.layout, layout)
        if len(dst_slots) and (dst_slots.min() < 0 or dst_slots.max() >= self.layout.slots):
            raise TransferError(f"destination slots outside the peer's {self.layout.slots} slots")

    def close(self) -> None:
        pass


def _inode(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino


class _TcpPeer:
    """A peer engine across hosts, through its :class:`KvReceiver` (used from one thread)."""

    def __init__(self, ctx: zmq.Context, endpoint: str, token: str | None) -> None:
        self.endpoint = endpoint
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        secure_client(self.sock, token)
        self.sock.connect(endpoint)

    def write(self, layer: int, part: _Part, data: _LayerData) -> None:
        header = msgpack.packb([_WRITE, layer, _WIRE_DTYPES[data.kp.dtype], part.page_size])
        frames = [header, part.dst_pages.numpy(), part.dst_edge, *map(_raw, data)]
        self.sock.send_multipart(frames, copy=False)

    def commit(self, dst_slots: np.ndarray, positions: torch.Tensor) -> None:
        self.sock.send_multipart([msgpack.packb([_COMMIT]), dst_slots, positions.numpy()])
        if not self.sock.poll(int(COMMIT_TIMEOUT_S * 1000)):
            raise TransferError(
                f"peer {self.endpoint} did not confirm a KV transfer within {COMMIT_TIMEOUT_S:g} s"
            )
        status, message = msgpack.unpackb(self.sock.recv())
        if status != 0:
            raise TransferError(f"peer {self.endpoint} refused a KV transfer: {message}")

    def check(self, dst_slots: np.ndarray, layout: KvLayout) -> None:
        pass  # the receiver checks, and reports at commit

    def close(self) -> None:
        self.sock.close(linger=0)


def _raw(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(_INT_VIEW[t.dtype]).numpy()


@dataclass(frozen=True)
class _Part:
    """Where one send's rows go: whole pages (page-granular copies: a page of one head is
    ``page_size * head_dim`` contiguous values) when source and destination are aligned,
    and single slots for the rest (the partial pages at the ends)."""

    page_size: int
    src_pages: torch.Tensor  # whole pages, source side
    dst_pages: torch.Tensor
    src_edge: torch.Tensor  # head rows (see head_rows) of the remaining source slots
    dst_edge: np.ndarray  # the remaining destination slots

    @classmethod
    def of(cls, src: np.ndarray, dst: np.ndarray, src_off: int, dst_off: int, n: int,
           ps: int, kv_heads: int, src_slots: int) -> _Part:  # fmt: skip
        idx = np.arange(n)
        full = np.zeros(n, dtype=bool)
        if src_off == dst_off:  # token i sits at the same offset of its page on both sides
            pos = idx + src_off
            first = -(-src_off // ps) * ps  # the first page boundary inside the range
            full = (pos >= first) & (pos < (src_off + n) // ps * ps)
        whole = np.unique((idx[full] + src_off) // ps)
        s_slots = src[(idx + src_off) // ps] * ps + (idx + src_off) % ps
        d_slots = dst[(idx + dst_off) // ps] * ps + (idx + dst_off) % ps
        return cls(
            ps,
            torch.from_numpy(np.ascontiguousarray(src[whole], dtype=np.int64)),
            torch.from_numpy(np.ascontiguousarray(dst[whole], dtype=np.int64)),
            head_rows(s_slots[~full], kv_heads, src_slots),
            np.ascontiguousarray(d_slots[~full], dtype=np.int64),
        )


class _LayerData(tuple):
    """One layer's K and V: whole pages ``[H, F, ps * D]`` and edge rows ``[H * E, D]``."""

    kp = property(lambda self: self[0])


def _gather(k: torch.Tensor, v: torch.Tensor, part: _Part, ps: int) -> _LayerData:
    h, slots, d = k.shape
    pages = [t.view(h, slots // ps, ps * d).index_select(1, part.src_pages) for t in (k, v)]
    edges = [t.view(-1, d).index_select(0, part.src_edge) for t in (k, v)]
    return _LayerData((pages[0], pages[1], edges[0], edges[1]))


def _apply(
    lay: KvLayout, k: torch.Tensor, v: torch.Tensor, dst_pages: torch.Tensor,
    dst_edge: np.ndarray, data: tuple,
) -> None:  # fmt: skip
    """Write one layer's K/V (pages, then edge slots) into ``k`` and ``v``."""
    kp, vp, ks, vs = data
    h, d = lay.kv_heads, lay.head_dim
    if len(dst_pages):
        ps_d = kp.numel() // (h * len(dst_pages))  # page_size * head_dim
        for cache, block in ((k, kp), (v, vp)):
            cache.view(h, -1, ps_d).index_copy_(1, dst_pages, block.view(h, -1, ps_d))
    if len(dst_edge):
        rows = head_rows(dst_edge, h, lay.slots)
        for cache, block in ((k, ks), (v, vs)):
            cache.view(-1, d).index_copy_(0, rows, block.view(-1, d))


def _check_layout(peer: KvLayout, mine: KvLayout) -> None:
    if (peer.num_layers, peer.kv_heads, peer.head_dim, peer.dtype) != (
        mine.num_layers, mine.kv_heads, mine.head_dim, mine.dtype,
    ):  # fmt: skip
        raise TransferError(
            f"the peer's KV pool has another shape ({peer.num_layers} layers x {peer.kv_heads} "
            f"heads x {peer.head_dim}, {peer.dtype}) than this engine's ({mine.num_layers} x "
            f"{mine.kv_heads} x {mine.head_dim}, {mine.dtype}): engines must serve one model "
            "in one dtype"
        )


# --------------------------------------------------------------------------- sender


@dataclass(eq=False)
class _Plan:
    """One declared SendKv: where its rows come from and go, and the writes queued so far."""

    call: SendKv
    peer: _ShmPeer | _TcpPeer
    part: _Part
    src_slots: np.ndarray
    dst_slots: np.ndarray
    sent_layers: int = 0
    jobs: list[Future] = field(default_factory=list)


class KvSender:
    """Runs an engine's :class:`SendKv` calls on one communication thread (see the module
    docstring). Used from the engine's thread; the peers are touched only by the
    communication thread."""

    def __init__(self, kv: KvPool, token: str | None = None) -> None:
        self.kv = kv
        self.token = token
        self._plans: dict[int, _Plan | str] = {}  # id(call) -> plan, or why it was refused
        self._active: list[_Plan] = []
        self._peers: dict[str, _ShmPeer | _TcpPeer] = {}
        self._ctx: zmq.Context | None = None
        self._comm = ThreadPoolExecutor(1, thread_name_prefix="pastry-kv-send")

    # ---------------------------------------------------------------- the batch protocol

    def declare(self, sends: list[SendKv]) -> None:
        """Plan the sends of the batch about to run (before its forward)."""
        self._plans.clear()
        self._active = []
        for call in sends:
            try:
                plan = self._plan(call)
            except (TransferError, ValueError, TypeError, IndexError) as e:
                self._plans[id(call)] = str(e)
                continue
            self._plans[id(call)] = plan
            self._active.append(plan)

    def on_layer(self, layer: int) -> None:
        """The forward has stored layer ``layer``'s K/V: queue that layer of every send."""
        for plan in self._active:
            self._queue_layers(plan, layer + 1)

    def complete(self, call: SendKv) -> str | None:
        """Finish ``call``: queue its remaining layers and the commit, wait until every
        write has landed; ``None``, or why it failed."""
        plan = self._plans.pop(id(call), None)
        if plan is None:
            plan = self._plans[id(call)] = "not declared"  # a bug in the engine's batch loop
        if isinstance(plan, str):
            return plan
        self._active = [p for p in self._active if p is not plan]
        self._queue_layers(plan, self.kv.layout.num_layers)
        plan.jobs.append(self._comm.submit(self._commit, plan))
        errors = [str(e) for j in plan.jobs if (e := j.exception()) is not None]
        return errors[0] if errors else None

    def close(self) -> None:
        self._comm.shutdown(wait=True)
        for peer in self._peers.values():
            peer.close()
        if self._ctx is not None:
            self._ctx.term()

    # ---------------------------------------------------------------- internals

    def _plan(self, call: SendKv) -> _Plan:
        ps, lay = self.kv.page_size, self.kv.layout
        n = int(call.length)
        src_pages = np.asarray(call.src_pages, dtype=np.int64)
        dst_pages = np.asarray(call.dst_pages, dtype=np.int64)
        if n <= 0:
            raise ValueError(f"length must be positive, got {n}")
        for what, pages, off in (
            ("src", src_pages, call.src_offset),
            ("dst", dst_pages, call.dst_offset),
        ):
            if not 0 <= off < ps or len(pages) * ps - off < n:
                raise ValueError(
                    f"{what}: {len(pages)} pages from offset {off} do not hold {n} tokens"
                )
        if src_pages.min() < 0 or src_pages.max() >= self.kv.num_pages:
            raise ValueError(f"source pages out of range [0, {self.kv.num_pages})")
        src_slots = page_slots(src_pages, call.src_offset, n, ps)
        dst_slots = page_slots(dst_pages, call.dst_offset, n, ps)
        peer = self._comm.submit(self._peer, call.peer).result()
        peer.check(dst_slots, lay)
        part = _Part.of(src_pages, dst_pages, int(call.src_offset), int(call.dst_offset), n, ps,
                        lay.kv_heads, lay.slots)  # fmt: skip
        return _Plan(call, peer, part, src_slots, dst_slots)

    def _peer(self, address: str) -> _ShmPeer | _TcpPeer:
        peer = self._peers.get(address)
        if isinstance(peer, _ShmPeer) and peer.replaced():  # the peer restarted: map anew
            peer = None
        if peer is None:
            if address.startswith("shm:"):
                peer = _ShmPeer(address[4:])
            elif address.startswith("tcp://"):
                if self._ctx is None:
                    self._ctx = zmq.Context()
                peer = _TcpPeer(self._ctx, address, self.token)
            else:
                raise TransferError(
                    f"unknown peer address {address!r} (shm:PATH or tcp://HOST:PORT)"
                )
            self._peers[address] = peer
        return peer

    def _queue_layers(self, plan: _Plan, upto: int) -> None:
        while plan.sent_layers < upto:
            layer = plan.sent_layers
            # The layer's rows are final now (the rest of the forward does not touch them):
            # gather and write them on the communication thread.
            plan.jobs.append(self._comm.submit(self._send_layer, plan, layer))
            plan.sent_layers += 1

    def _send_layer(self, plan: _Plan, layer: int) -> None:
        data = _gather(self.kv.k[layer], self.kv.v[layer], plan.part, self.kv.page_size)
        plan.peer.write(layer, plan.part, data)

    def _commit(self, plan: _Plan) -> None:
        positions = self.kv.positions.index_select(0, torch.from_numpy(plan.src_slots))
        plan.peer.commit(plan.dst_slots, positions)


# --------------------------------------------------------------------------- receiver


class KvReceiver:
    """Applies KV writes from peers on other hosts to this engine's pool (a thread).

    Binds ``endpoint`` (``tcp://HOST:PORT``; port 0 picks one: see :attr:`endpoint`),
    CURVE-authenticated by ``token``. A peer's writes are applied as they arrive; its
    commit is answered once everything before it has landed.
    """

    def __init__(self, kv: KvPool, endpoint: str, token: str | None = None) -> None:
        self.kv = kv
        self._ctx = zmq.Context()
        self._auth = start_authenticator(self._ctx, token)
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        secure_server(self._sock, token)
        if endpoint.endswith(":0"):
            port = self._sock.bind_to_random_port(endpoint[: endpoint.rindex(":")])
            endpoint = f"{endpoint[: endpoint.rindex(':')]}:{port}"
        else:
            self._sock.bind(endpoint)
        self.endpoint = endpoint
        self._stop = threading.Event()
        self._errors: dict[bytes, str] = {}
        self._thread = threading.Thread(target=self._run, name="pastry-kv-recv", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(100):
                continue
            ident, header, *frames = self._sock.recv_multipart()
            try:
                op, *rest = msgpack.unpackb(header)
                if op == _WRITE:
                    self._write(rest, frames)
                    continue
                error = self._errors.pop(ident, None)
                if error is None:
                    self._commit(frames)
            except Exception as e:  # a malformed or bad write: refuse it at the commit
                log.warning("refused a KV write from a peer: %s", e)
                if op == _WRITE:
                    self._errors.setdefault(ident, f"{type(e).__name__}: {e}")
                    continue
                error = f"{type(e).__name__}: {e}"
            self._sock.send_multipart([ident, msgpack.packb([0 if error is None else 1, error])])

    def _slots(self, frame: bytes) -> torch.Tensor:
        slots = np.frombuffer(frame, dtype=np.int64)
        if len(slots) and (slots.min() < 0 or slots.max() >= self.kv.layout.slots):
            raise ValueError(f"destination slots outside this engine's {self.kv.layout.slots}")
        return torch.from_numpy(slots.copy())

    def _write(self, rest: list, frames: list[bytes]) -> None:
        layer, dtype, ps = rest
        lay = self.kv.layout
        if not 0 <= layer < lay.num_layers or _FROM_WIRE.get(dtype) != lay.dtype:
            raise ValueError(f"layer {layer} / dtype {dtype} does not match this engine's pool")
        if ps != self.kv.page_size:
            raise ValueError(f"page size {ps} is not this engine's ({self.kv.page_size})")
        pages = torch.from_numpy(np.frombuffer(frames[0], dtype=np.int64).copy())
        if len(pages) and (pages.min() < 0 or pages.max() >= self.kv.num_pages):
            raise ValueError(f"destination pages outside this engine's {self.kv.num_pages}")
        edge = self._slots(frames[1]).numpy()
        data = [torch.frombuffer(bytearray(raw), dtype=_INT_VIEW[lay.dtype]).view(lay.dtype)
                if len(raw) else torch.empty(0, dtype=lay.dtype) for raw in frames[2:6]]  # fmt: skip
        _apply(lay, self.kv.k[layer], self.kv.v[layer], pages, edge, data)

    def _commit(self, frames: list[bytes]) -> None:
        slots = self._slots(frames[0])
        positions = torch.from_numpy(np.frombuffer(frames[1], dtype=np.int64).copy())
        self.kv.positions.index_copy_(0, slots, positions)
        self.kv.attendable.index_fill_(0, slots, True)


def host_id() -> str:
    """This machine's identity (hostname and boot id): engines with the same one can map
    each other's shared-memory KV pools. ``$PASTRY_HOST_ID`` overrides it (containers that
    share a hostname but not ``/dev/shm``)."""
    import socket

    if os.environ.get("PASTRY_HOST_ID"):
        return os.environ["PASTRY_HOST_ID"]
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"
