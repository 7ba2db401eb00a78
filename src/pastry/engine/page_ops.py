"""KV page operations on the engine's pools: copy slots, mask slots, swap pages to host.

:class:`PageOps` runs each kind for a whole batch run at once, over the slots and pages
the engine's checks produced (:mod:`pastry.engine.checks`). The pools are those of
:mod:`pastry.engine.pool`: K/V of every layer in one backing tensor, per-slot attendable
bits and positions, and host pages for swap.
"""

from __future__ import annotations

import numpy as np
import torch

from pastry.engine.pool import HostPool, KvPool


def cat_ids(arrays: list[np.ndarray]) -> np.ndarray:
    """One int64 array of ``arrays`` in order (a copy)."""
    if len(arrays) == 1:
        return np.array(arrays[0], dtype=np.int64)
    if not arrays:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate(arrays).astype(np.int64, copy=False)


class PageOps:
    """Copy, mask and swap over one engine's KV pool and host pool."""

    def __init__(self, kv: KvPool, host: HostPool, device: torch.device) -> None:
        self.kv, self.host, self.device = kv, host, device
        self.page_size = kv.page_size
        self._staging: tuple[torch.Tensor, torch.Tensor] | None = None

    def copy(self, src: list[np.ndarray], dst: list[np.ndarray]) -> None:
        """Each ``src`` slot's K, V, attendable bit and position onto its ``dst`` slot."""
        src_t = torch.from_numpy(cat_ids(src)).to(self.device)
        dst_t = torch.from_numpy(cat_ids(dst)).to(self.device)
        for t in (*self.kv.k, *self.kv.v):
            t[:, dst_t] = t[:, src_t]
        for t in (self.kv.attendable, self.kv.positions):
            t[dst_t] = t[src_t]

    def mask(self, page: int, masked: np.ndarray) -> None:
        """Slot ``i`` of ``page`` stops being attendable where ``masked[i]`` (and becomes
        attendable again where not)."""
        ps = self.page_size
        self.kv.attendable[page * ps : (page + 1) * ps] = torch.from_numpy(~masked).to(self.device)

    def swap(self, pages: list[np.ndarray], host_pages: list[np.ndarray], to_host: bool) -> None:
        """Device ``pages[i]`` to (``to_host``) or from host page ``host_pages[i]``.

        Every page of the run at once: one gather of the pages from all layers' K and V
        (a page-granular ``index_select`` on the pool's backing tensor) into a staging
        buffer, one bulk copy across (none on CPU), one scatter into the destination pool;
        the same for the slots' attendable bits and positions. The staging buffers are
        kept (pinned on CUDA): fresh ones cost a page fault per 4 KiB on every swap."""
        dev = self.device
        pages_t = torch.from_numpy(cat_ids(pages)).to(dev)
        host = torch.from_numpy(cat_ids(host_pages))
        kv, hk, ps = self.kv, self.host, self.page_size
        rows = kv.data.shape[0] * kv.data.shape[1]
        d_kv = kv.data.view(rows, kv.num_pages, -1)  # [layers x heads, page, page's K or V]
        h_kv = hk.data.view(rows, hk.num_pages, -1)
        d_buf, h_buf = self._buffers(rows, len(host), d_kv.shape[2])
        small = ((kv.attendable, hk.attendable), (kv.positions, hk.positions))
        if to_host:
            torch.index_select(d_kv, 1, pages_t, out=d_buf)
            if h_buf is not d_buf:
                h_buf.copy_(d_buf)
            h_kv.index_copy_(1, host, h_buf)
            for d, h in small:
                h.view(-1, ps).index_copy_(0, host, d.view(-1, ps).index_select(0, pages_t).cpu())
        else:
            torch.index_select(h_kv, 1, host, out=h_buf)
            if h_buf is not d_buf:
                d_buf.copy_(h_buf, non_blocking=True)
            d_kv.index_copy_(1, pages_t, d_buf)
            for d, h in small:
                d.view(-1, ps).index_copy_(0, pages_t, h.view(-1, ps).index_select(0, host).to(dev))
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def _buffers(self, rows: int, n: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Contiguous ``[rows, n, width]`` staging views on the device and in host memory
        (the same tensor on CPU), grown as needed and kept."""
        need = rows * n * width
        have = self._staging
        if have is None or have[0].numel() < need:
            dtype = self.kv.data.dtype
            d = torch.empty(need, dtype=dtype, device=self.device)
            h = d if self.device.type == "cpu" else torch.empty(need, dtype=dtype, pin_memory=True)
            have = self._staging = (d, h)
        return tuple(t[:need].view(rows, n, width) for t in have)  # type: ignore[return-value]
