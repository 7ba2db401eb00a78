"""Preallocated device memory: KV pages, embedding slots and host swap pages.

The engine owns the memory; the control layer owns the bookkeeping (who holds which page).
K and V of each layer are one head-major tensor ``[kv_heads, num_pages * page_size, head_dim]``:
slot ``page * page_size + i`` holds token ``i`` of ``page``. Each slot also has a position
(for sliding-window attention) and an *attendable* bit (``MaskKv``).
"""

from __future__ import annotations

import contextlib
import math
import os
import struct
from dataclasses import dataclass

import torch

from pastry.wire.config import EngineConfig, ModelConfig


def available_memory(device: torch.device) -> int:
    """Bytes free for new allocations on ``device``."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo")


@dataclass(frozen=True)
class PoolSizes:
    num_pages: int
    num_embeds: int
    num_host_pages: int

    @staticmethod
    def page_bytes(model: ModelConfig, page_size: int, dtype: torch.dtype) -> int:
        elem = torch.empty(0, dtype=dtype).element_size()
        return 2 * model.num_layers * page_size * model.kv_size * elem

    @classmethod
    def resolve(
        cls, model: ModelConfig, cfg: EngineConfig, dtype: torch.dtype, device: torch.device
    ) -> PoolSizes:
        """Sizes from the config; zeros are derived from the memory available now."""
        page = cls.page_bytes(model, cfg.page_size, dtype)
        num_pages = cfg.num_pages
        if num_pages == 0:
            budget = int(available_memory(device) * cfg.kv_memory_fraction)
            num_pages = max(1, min(cfg.max_kv_pages, budget // page))
        num_embeds = cfg.num_embeds or max(1024, num_pages * cfg.page_size // 4)
        num_host_pages = cfg.num_host_pages or num_pages
        return cls(num_pages, num_embeds, num_host_pages)


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
            self.data = torch.zeros((2 * n, model.num_kv_heads, slots, model.head_dim),
                                    dtype=dtype, device=device)  # fmt: skip
            self.attendable = torch.zeros(slots, dtype=torch.bool, device=device)
            self.positions = torch.zeros(slots, dtype=torch.int64, device=device)
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
            return torch.zeros(shape, dtype=dtype, pin_memory=pin)

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
        self.hidden = torch.zeros(num, hidden, dtype=dtype, device=device)
        self.positions = torch.zeros(num, dtype=torch.int64, device=device)
