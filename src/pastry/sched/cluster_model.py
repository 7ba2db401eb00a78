"""The modelled parts of the cluster simulator (:mod:`pastry.sched.cluster`): the links
between engines (:class:`Network`), the prompts as token-id pieces (:class:`Seg`) and each
engine's prefix cache (:class:`PrefixCache`)."""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

from pastry.sched.hardware import (
    A100_BYTES,
    ACTIVATION_RESERVE,
    BF16,
    LLAMA31_8B_KV_BYTES,
    LLAMA31_8B_LAYERS,
    LLAMA31_8B_PARAMS,
    VLLM_GPU_MEMORY_UTILIZATION,
)

MODEL = "llama-3.1-8b"  # the one model the simulated engines serve


def a100_kv_tokens(device_bytes: float = A100_BYTES) -> int:
    """KV tokens of LLaMA-3.1-8B on one A100 of ``device_bytes`` under vLLM's defaults
    (``pastry.sched.hardware``): 442,704 on the 80 GB card, 147,786 on the 40 GB one."""
    kv = VLLM_GPU_MEMORY_UTILIZATION * device_bytes - LLAMA31_8B_PARAMS * BF16 - ACTIVATION_RESERVE
    return math.floor(kv / LLAMA31_8B_KV_BYTES)


@dataclass(frozen=True)
class Network:
    """The links between engines. The default bandwidth is what LLM microserving measured
    for LLaMA-3.1-8B's K/V between two A100s (Table 3: 1000 to 5000 tokens, 4 KiB per token
    per layer, in 0.197 to 0.867 ms per layer: 20.8 to 23.6 GB/s)."""

    bandwidth_b_s: float = 23e9  # per sending engine
    latency_s: float = 20e-6
    layers: int = LLAMA31_8B_LAYERS
    kv_bytes_per_token: int = LLAMA31_8B_KV_BYTES

    def __post_init__(self) -> None:
        if not (self.bandwidth_b_s > 0 and self.latency_s >= 0 and self.layers >= 1):
            raise ValueError(f"a network needs bandwidth > 0, latency >= 0, layers >= 1: {self}")

    def transfer_s(self, tokens: int) -> float:
        """Seconds on the wire for the K/V of ``tokens`` tokens (latency excluded)."""
        return tokens * self.kv_bytes_per_token / self.bandwidth_b_s

    def pipelined_end(self, start: float, compute_s: float, tokens: int, link_free: float) -> float:
        """When a transfer of ``tokens`` tokens' K/V ends, sent layer by layer as a prefill
        that starts at ``start`` and lasts ``compute_s`` computes them, on a link free from
        ``link_free``: layer ``l``'s K/V are ready after ``l + 1`` layers' compute and go
        after layer ``l - 1``'s, so the last lands at the latest of the link's own time for
        all of them, the first layer's compute plus all of them, and the prefill plus one
        layer's (then the latency)."""
        wire = self.transfer_s(tokens)
        first = compute_s / self.layers
        return max(link_free + wire, start + first + wire,
                   start + compute_s + wire / self.layers) + self.latency_s  # fmt: skip


@dataclass(frozen=True, slots=True)
class Seg:
    """A piece of text: the token ids ``start .. start + length - 1``."""

    start: int
    length: int


Ctx = tuple[Seg, ...]


def ctx_tokens(ctx: Ctx) -> list[int]:
    out: list[int] = []
    for s in ctx:
        out.extend(range(s.start, s.start + s.length))
    return out


class _Node:
    __slots__ = ("children", "have", "parent", "seg", "used")

    def __init__(self, seg: Seg | None, parent: _Node | None) -> None:
        self.seg, self.parent = seg, parent
        self.children: dict[int, _Node] = {}
        self.have = 0  # tokens of seg held (a prefix of it)
        self.used = 0.0


class PrefixCache:
    """An engine's cached K/V: a tree of text pieces, ``capacity`` tokens, least recently
    used leaves evicted first."""

    def __init__(self, capacity: int, page_size: int, clock: Callable[[], float]) -> None:
        self.capacity, self.page_size, self.clock = capacity, page_size, clock
        self.root = _Node(None, None)
        self.tokens = 0
        self._leaves: list[tuple[float, int, _Node]] = []  # lazy: (used, tiebreak, node)
        self._seq = itertools.count()

    def match(self, ctx: Ctx, limit: int) -> int:
        """Tokens of the longest cached prefix of ``ctx[:limit]``, in whole pages (the
        pieces it passes count as used now)."""
        node, n, now = self.root, 0, self.clock()
        for s in ctx:
            child = node.children.get(s.start)
            if child is None:
                break
            child.used = now
            n += min(child.have, s.length)
            if child.have < s.length or n >= limit:
                break
            node = child
        n = min(n, limit)
        return n - n % self.page_size

    def insert(self, ctx: Ctx, n: int) -> None:
        """Hold the K/V of ``ctx[:n]``; then evict down to the capacity."""
        node, now = self.root, self.clock()
        for s in ctx:
            if n <= 0:
                break
            child = node.children.get(s.start)
            if child is None:
                child = node.children[s.start] = _Node(s, node)
            take = min(s.length, n)
            if take > child.have:
                self.tokens += take - child.have
                child.have = take
            child.used = now
            n -= s.length
            if child.have < s.length:
                break
            node = child
        if not node.children and node is not self.root:
            heapq.heappush(self._leaves, (node.used, next(self._seq), node))
        self._evict()

    def _evict(self) -> None:
        while self.tokens > self.capacity:
            if not self._leaves:  # every leaf's entry is stale: list them again
                self._leaves = [(x.used, next(self._seq), x) for x in self._all_leaves()]
                heapq.heapify(self._leaves)
            used, _, node = heapq.heappop(self._leaves)
            if node.children or node.parent is None or used != node.used:
                if not node.children and node.parent is not None:  # touched: requeue
                    heapq.heappush(self._leaves, (node.used, next(self._seq), node))
                continue
            parent = node.parent
            del parent.children[node.seg.start]
            node.parent = None
            self.tokens -= node.have
            if not parent.children and parent is not self.root:
                heapq.heappush(self._leaves, (parent.used, next(self._seq), parent))

    def _all_leaves(self):
        stack = [self.root]
        while stack:
            x = stack.pop()
            if x.children:
                stack.extend(x.children.values())
            elif x is not self.root:
                yield x
