"""The simulated machine: what an engine step costs and how much KV memory there is.

The defaults model the Autellix paper's single-engine setup (§6.2): LLaMA-3.1-8B in
bfloat16 on one A100-SXM4-80GB, host memory behind PCIe 4.0 x16. The numbers and where
they come from (``docs/scheduling.md``, "The simulated machine"):

- **KV bytes per token**: 2 (K and V) x 32 layers x 8 KV heads x 128 head dim x 2 bytes =
  128 KiB; a page (vLLM's block) of 16 tokens is 2 MiB.
- **Device KV capacity**: vLLM gives its engine ``gpu_memory_utilization`` = 0.9 of the
  80 GiB (72 GiB); the weights take 8.03e9 parameters x 2 bytes = 14.96 GiB; the
  activations of its profiling forward, CUDA graphs and the allocator's slack are taken
  as 3 GiB (an assumption; vLLM measures it at start-up). That leaves 54.0 GiB: 442,704
  tokens, **27,669 pages of 16** (vLLM logs about 27-28 thousand GPU blocks for this
  model on this card).
- **Host swap space**: the paper's ">1.2 TB" (§6.5.1): 572,204 pages.
- **Swap bandwidth**: PCIe 4.0 x16 carries 31.5 GB/s per direction; one bulk copy from
  pinned memory (Autellix's swap kernel, Pastry's ``SwapOut``/``SwapIn``) reaches about
  **25 GB/s**, so a page moves in 84 us. Swaps are synchronous (Autellix §4.2.3): their
  time adds to the step they precede.
- **Step time**: ``base_s + per_seq_s x sequences + per_token_s x input tokens +
  per_context_token_s x context tokens read``: 11 ms to stream the 16 GB of weights from
  HBM (2.0 TB/s, ~80% achieved), 0.02 ms per sequence, 0.06 ms per prefill token (~16
  thousand tokens/s, compute-bound), and attention reading each sequence's KV: 128 KiB
  per context token at ~1.6 TB/s, 82 ns per token (a full device, 442 thousand tokens,
  adds 36 ms to a step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GIB = 2**30

# LLaMA-3.1-8B (config.json): 32 layers, 8 KV heads of 128, 8.03e9 parameters.
LLAMA31_8B_LAYERS, LLAMA31_8B_KV_HEADS, LLAMA31_8B_HEAD_DIM = 32, 8, 128
LLAMA31_8B_PARAMS = 8.03e9
BF16 = 2
A100_BYTES = 80 * GIB
VLLM_GPU_MEMORY_UTILIZATION = 0.9
ACTIVATION_RESERVE = 3 * GIB  # profiling forward, CUDA graphs, allocator slack (assumed)
HOST_SWAP_BYTES = 1.2e12  # the paper's "> 1.2 TB" swap space
PCIE4_X16_BULK_B_S = 25e9  # one bulk pinned copy over PCIe 4.0 x16 (31.5 GB/s peak)
HBM_EFFECTIVE_B_S = 1.6e12  # A100-SXM4-80GB: 2.0 TB/s peak, ~80% achieved


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """K and V of one token over every layer."""
    return 2 * layers * kv_heads * head_dim * dtype_bytes


LLAMA31_8B_KV_BYTES = kv_bytes_per_token(
    LLAMA31_8B_LAYERS, LLAMA31_8B_KV_HEADS, LLAMA31_8B_HEAD_DIM, BF16
)


@dataclass(frozen=True)
class CostModel:
    """Seconds per engine step: ``base_s + per_seq_s x forwards + per_token_s x input
    tokens + per_context_token_s x context tokens the batch's attention reads``."""

    base_s: float = 1.0
    per_seq_s: float = 0.0
    per_token_s: float = 0.0
    per_context_token_s: float = 0.0

    def step(self, seqs: int, tokens: int, context: int = 0) -> float:
        return (
            self.base_s
            + self.per_seq_s * seqs
            + self.per_token_s * tokens
            + self.per_context_token_s * context
        )

    @classmethod
    def unit(cls) -> CostModel:
        """Every step takes 1 (the paper's toy example and its Fig. 18 simulation)."""
        return cls(1.0, 0.0, 0.0, 0.0)

    @classmethod
    def a100_llama8b(cls) -> CostModel:
        """LLaMA-3.1-8B on one A100-SXM4-80GB (see the module docstring)."""
        return cls(0.011, 2e-5, 6e-5, LLAMA31_8B_KV_BYTES / HBM_EFFECTIVE_B_S)


@dataclass(frozen=True)
class KvMemory:
    """KV memory of one engine: ``pages`` device pages of ``page_size`` tokens,
    ``host_pages`` of swap space, and what moving a page between them costs."""

    pages: int
    page_size: int = 16
    host_pages: int = 0
    page_bytes: int = 16 * LLAMA31_8B_KV_BYTES
    swap_bytes_per_s: float = PCIE4_X16_BULK_B_S

    def __post_init__(self) -> None:
        if self.pages < 1 or self.page_size < 1 or self.host_pages < 0:
            raise ValueError(f"KV memory needs pages >= 1, page_size >= 1, host_pages >= 0: {self}")

    @property
    def tokens(self) -> int:
        return self.pages * self.page_size

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def swap_s(self, pages: int) -> float:
        """Seconds to move ``pages`` pages across (one bulk copy)."""
        return pages * self.page_bytes / self.swap_bytes_per_s

    @classmethod
    def a100_llama8b(cls, page_size: int = 16) -> KvMemory:
        """LLaMA-3.1-8B on one A100-SXM4-80GB under vLLM's defaults (see the module
        docstring): 27,669 pages of 16 tokens, 1.2 TB of host swap space."""
        weights = LLAMA31_8B_PARAMS * BF16
        kv = VLLM_GPU_MEMORY_UTILIZATION * A100_BYTES - weights - ACTIVATION_RESERVE
        page_bytes = page_size * LLAMA31_8B_KV_BYTES
        return cls(
            pages=math.floor(kv / page_bytes),
            page_size=page_size,
            host_pages=math.floor(HOST_SWAP_BYTES / page_bytes),
            page_bytes=page_bytes,
        )
