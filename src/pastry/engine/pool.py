"""Preallocated device memory: KV pages, embedding slots and host swap pages.

The engine owns the memory; the control layer owns the bookkeeping (who holds which page).
K and V of each layer are one head-major tensor ``[kv_heads, num_pages * page_size, head_dim]``:
slot ``page * page_size + i`` holds token ``i`` of ``page``. Each slot also has a position
(for sliding-window attention) and an *attendable* bit (``MaskKv``).
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import struct
from dataclasses import dataclass

import torch

from pastry.wire.config import DEFAULT_KV_BUDGET, EngineConfig, ModelConfig


def _meminfo(key: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(f"{key}:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"cannot read {key} from /proc/meminfo")


def available_memory(device: torch.device) -> int:
    """Bytes free for new allocations on ``device``."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    return _meminfo("MemAvailable")


def default_kv_budget(cfg: EngineConfig, device: torch.device) -> int:
    """Bytes a derived KV pool may take: on CUDA ``kv_memory_fraction`` of free device
    memory; on the CPU, which the weights, the server and everything else on the host share,
    :data:`DEFAULT_KV_BUDGET` but at most a quarter of the host's memory and half of what
    is free now (a 16 GB laptop keeps three quarters of its memory)."""
    if device.type == "cuda":
        return int(available_memory(device) * cfg.kv_memory_fraction)
    return min(DEFAULT_KV_BUDGET, _meminfo("MemTotal") // 4, available_memory(device) // 2)


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled tensor whose CPU memory is committed only as it is written.

    ``torch.zeros`` writes every byte, so a pool sized for many long sequences was resident
    in full at start-up (14.9 GB for SmolLM2-135M's old default). An anonymous mapping is
    zero pages until touched: RSS grows with the KV actually used."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    elem = torch.empty(0, dtype=dtype).element_size()
    nbytes = math.prod(shape) * elem
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # the tensor holds a reference to the mapping; unmapped when the last view goes
    return torch.frombuffer(buf, dtype=dtype).view(shape)


@dataclass(frozen=True)
class PoolSizes:
    num_pages: int
    num_embeds: int
    num_host_pages: int
    page_bytes: int  # one KV page across every layer, K and V
    derived: str  # how num_pages was chosen, for the log

    @staticmethod
    def bytes_per_page(model: ModelConfig, page_size: int, dtype: torch.dtype) -> int:
        elem = torch.empty(0, dtype=dtype).element_size()
        return 2 * model.num_layers * page_size * model.kv_size * elem

    @classmethod
    def resolve(
        cls, model: ModelConfig, cfg: EngineConfig, dtype: torch.dtype, device: torch.device
    ) -> PoolSizes:
        """Sizes from the config; zeros are derived.

        KV pages: ``num_pages`` if set; else ``kv_memory`` bytes' worth if set; else enough
        for ``kv_sequences`` sequences of the model's full context, within the default
        budget (:func:`default_kv_budget`). Host (swap) pages: on the CPU a quarter of the
        pool (swap space there is the same memory), on CUDA as many as the pool."""
        page = cls.bytes_per_page(model, cfg.page_size, dtype)
        num_pages = cfg.num_pages
        if num_pages:
            derived = "--num-pages"
        elif cfg.kv_memory:
            num_pages = cfg.kv_memory // page
            if num_pages == 0:
                raise ValueError(
                    f"kv_memory {cfg.kv_memory} bytes holds no KV page of {page} bytes "
                    f"({model.num_layers} layers x {cfg.page_size} tokens)"
                )
            derived = f"--kv-memory {_gib(cfg.kv_memory)}"
        else:
            per_seq = -(-model.max_position // cfg.page_size)
            budget = default_kv_budget(cfg, device)
            num_pages = max(1, min(cfg.max_kv_pages, cfg.kv_sequences * per_seq, budget // page))
            derived = (
                f"{cfg.kv_sequences} sequences x {model.max_position} tokens within "
                f"{_gib(budget)}; --kv-memory or --num-pages to change"
            )
        num_embeds = cfg.num_embeds or max(1024, num_pages * cfg.page_size // 4)
        host_default = num_pages if device.type == "cuda" else max(1, num_pages // 4)
        num_host_pages = cfg.num_host_pages or host_default
        return cls(num_pages, num_embeds, num_host_pages, page, derived)

    def describe(self, page_size: int) -> str:
        """One log line: the pool's pages, bytes, tokens and how they were chosen."""
        return (
            f"KV pool {self.num_pages} pages x {page_size} tokens "
            f"({_gib(self.num_pages * self.page_bytes)}, {self.num_pages * page_size} tokens; "
            f"{self.derived}), swap {self.num_host_pages} pages "
            f"({_gib(self.num_host_pages * self.page_bytes)}); committed as used"
        )


def _gib(nbytes: int) -> str:
    return f"{nbytes / (1 << 30):.2f} GiB"


class KvPool:
    """K/V pages of every layer, plus per-slot positions and attendable bits.

    With ``shm_path`` (CPU only) the whole pool lives in one shared-memory file
    (:class:`KvLayout`), which a peer engine on the same host maps to write K/V straight
    into this engine's pages (one-sided transfer, :mod:`pastry.engine.transfer`). The file
    is removed by :meth:`close` (and by the spawner after a crash).
    """

    def __init__(
        self,
        model: ModelConfig,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device,
        shm_path: str = "",
    ) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self.shm_path = shm_path
        slots = num_pages * page_size
        n = model.num_layers
        self.layout = KvLayout(n, model.num_kv_heads, slots, model.head_dim, dtype)
        if shm_path:
            if device.type != "cpu":
                raise ValueError(f"a shared-memory KV pool must be on the CPU, not {device}")
            self.data, self.positions, self.attendable = self.layout.create(shm_path)
        else:
            # One tensor behind every layer's K and V ([2 * layers, heads, slots, dim]: K of
            # each layer, then V), so that a swap gathers a page set across all at once.
            self.data = zeros((2 * n, model.num_kv_heads, slots, model.head_dim), dtype, device)
            self.attendable = zeros((slots,), torch.bool, device)
            self.positions = zeros((slots,), torch.int64, device)
        self.k = [self.data[i] for i in range(n)]
        self.v = [self.data[n + i] for i in range(n)]

    def slots_of(self, pages: torch.Tensor) -> torch.Tensor:
        """All slots of ``pages`` in order, ``[len(pages) * page_size]``."""
        ar = torch.arange(self.page_size, device=pages.device)
        return (pages.unsqueeze(1) * self.page_size + ar).reshape(-1)

    def close(self) -> None:
        """Remove the shared-memory file (the mapping stays valid until the process ends)."""
        if self.shm_path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.shm_path)


_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_MAGIC = b"PASTRYKV"
_HEADER = struct.Struct("<8sIIIIQI")  # magic, version, layers, kv heads, head dim, slots, dtype
_HEADER_BYTES = 4096
_ALIGN = 64


@dataclass(frozen=True)
class KvLayout:
    """The byte layout of a KV pool in a shared-memory file: a header naming the shape, then
    K and V as one tensor ``[2 * layers, kv_heads, slots, head_dim]`` (K of each layer, then
    V: :class:`KvPool`'s layout), then positions (int64) and attendable bits (bool) per
    slot, each 64-byte aligned."""

    num_layers: int
    kv_heads: int
    slots: int
    head_dim: int
    dtype: torch.dtype

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (2 * self.num_layers, self.kv_heads, self.slots, self.head_dim)

    def _offsets(self) -> tuple[int, int, int, int]:
        kv = _align(2 * self.num_layers * self.kv_heads * self.slots * self.head_dim
                    * self.dtype.itemsize)  # fmt: skip
        pos = _HEADER_BYTES + kv
        att = pos + _align(self.slots * 8)
        return _HEADER_BYTES, pos, att, att + _align(self.slots)

    @property
    def nbytes(self) -> int:
        return self._offsets()[3]

    def create(self, path: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Create the file at ``path`` (zeroed, mode 0600); views of (K/V, positions,
        attendable)."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, self.nbytes)
            header = _HEADER.pack(
                _MAGIC, 2, self.num_layers, self.kv_heads, self.head_dim, self.slots,
                _DTYPE_CODES[self.dtype],
            )  # fmt: skip
            os.pwrite(fd, header, 0)
        finally:
            os.close(fd)
        return self._views(path)

    @classmethod
    def open(cls, path: str) -> tuple[KvLayout, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Map the pool file another engine created: its layout and tensor views."""
        with open(path, "rb") as f:
            magic, version, layers, heads, dim, slots, code = _HEADER.unpack(f.read(_HEADER.size))
        if magic != _MAGIC or version != 2:
            raise ValueError(f"{path} is not a Pastry KV pool file (version 2)")
        dtype = {v: k for k, v in _DTYPE_CODES.items()}[code]
        layout = cls(layers, heads, slots, dim, dtype)
        return layout, layout._views(path)

    def _views(self, path: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        buf = torch.from_file(path, shared=True, size=self.nbytes, dtype=torch.uint8)
        kv, pos, att, _ = self._offsets()

        def at(off: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
            return buf[off : off + nbytes].view(dtype)

        data = at(kv, math.prod(self.shape) * self.dtype.itemsize, self.dtype).view(self.shape)
        return data, at(pos, self.slots * 8, torch.int64), at(att, self.slots, torch.bool)


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class HostPool:
    """Swap space for KV pages in host memory (pinned when the device is CUDA)."""

    def __init__(self, kv: KvPool, num_pages: int) -> None:
        self.num_pages = num_pages
        pin = kv.k[0].device.type == "cuda"
        slots = num_pages * kv.page_size

        def alloc(dtype: torch.dtype, shape) -> torch.Tensor:
            if pin:
                return torch.zeros(shape, dtype=dtype, pin_memory=True)
            return zeros(shape, dtype, torch.device("cpu"))

        # The device pool's layout ([2 * layers, heads, slots, dim]), in host memory.
        self.data = alloc(kv.data.dtype, (kv.data.shape[0], kv.data.shape[1], slots,
                                          kv.data.shape[3]))  # fmt: skip
        self.k = list(self.data[: len(kv.k)])
        self.v = list(self.data[len(kv.k) :])
        self.attendable = alloc(torch.bool, (slots,))
        self.positions = alloc(torch.int64, (slots,))


class EmbedPool:
    """Embedding slots: one hidden vector and its position each."""

    def __init__(self, num: int, hidden: int, dtype: torch.dtype, device: torch.device) -> None:
        self.num = num
        self.hidden = zeros((num, hidden), dtype, device)
        self.positions = zeros((num,), torch.int64, device)
