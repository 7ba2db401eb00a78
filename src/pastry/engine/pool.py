"""Preallocated device memory: KV pages, embedding slots and host swap pages.

The engine owns the memory; the control layer owns the bookkeeping (who holds which page).
K and V of each layer are one head-major tensor ``[kv_heads, num_pages * page_size, head_dim]``:
slot ``page * page_size + i`` holds token ``i`` of ``page``. Each slot also has a position
(for sliding-window attention) and an *attendable* bit (``MaskKv``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pastry.engine.config import EngineConfig, ModelConfig


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
    """K/V pages of every layer, plus per-slot positions and attendable bits."""

    def __init__(
        self,
        model: ModelConfig,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        slots = num_pages * page_size
        n = model.num_layers
        # One tensor behind every layer's K and V ([2 * layers, heads, slots, dim]: K of each
        # layer, then V), so that a swap gathers a page set across all of them at once.
        self.data = torch.zeros((2 * n, model.num_kv_heads, slots, model.head_dim), dtype=dtype,
                                device=device)  # fmt: skip
        self.k = [self.data[i] for i in range(n)]
        self.v = [self.data[n + i] for i in range(n)]
        self.attendable = torch.zeros(slots, dtype=torch.bool, device=device)
        self.positions = torch.zeros(slots, dtype=torch.int64, device=device)

    def slots_of(self, pages: torch.Tensor) -> torch.Tensor:
        """All slots of ``pages`` in order, ``[len(pages) * page_size]``."""
        ar = torch.arange(self.page_size, device=pages.device)
        return (pages.unsqueeze(1) * self.page_size + ar).reshape(-1)


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
