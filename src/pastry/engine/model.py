"""The Llama-family decoder (llama, mistral, qwen2, qwen3) over paged KV cache.

Reads like the HF model, with two differences that serve the engine: q/k/v and gate/up are
fused into one projection each (fewer, larger matrix products), and the model consumes
*embeddings* with explicit positions and returns final normed hidden states, because the
inferlet API separates ``embed_txt``, ``forward`` and the output heads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pastry.engine.attention import layer_done, paged_attention
from pastry.engine.layers import Linear, RMSNorm, RotaryEmbedding, apply_rope
from pastry.engine.lora import DOWN, GATE_UP, OUT, QKV, add_lora
from pastry.engine.quant import (
    Codes,
    Int4Codes,
    Int4Weight,
    Int8Codes,
    cat_codes,
    pack,
    quantize,
)
from pastry.wire.config import CheckpointError, ModelConfig


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int = 0) -> None:
        super().__init__()
        self.layer_idx = layer_idx  # which LoRA deltas apply (see lora.add_lora)
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.scale = cfg.head_dim**-0.5
        self.qkv_proj = Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, cfg.attention_bias)
        self.o_proj = Linear(cfg.q_size, cfg.hidden_size)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        # Views into the engine's KV pool, [num_slots, kv_heads, head_dim]; set by the engine.
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        qkv = add_lora(self.qkv_proj(x), x, self.layer_idx, QKV)
        v = qkv[:, self.q_size + self.kv_size :].view(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is None:
            # q and k are adjacent columns: rotate both heads' sets in one pass
            qk = qkv[:, : self.q_size + self.kv_size].view(n, -1, self.head_dim)
            q, k = apply_rope(qk, cos, sin).split((self.num_heads, self.num_kv_heads), dim=1)
        else:
            q, k = qkv[:, : self.q_size + self.kv_size].split((self.q_size, self.kv_size), dim=-1)
            q = self.q_norm(q.reshape(n, self.num_heads, self.head_dim))
            k = self.k_norm(k.reshape(n, self.num_kv_heads, self.head_dim))
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = paged_attention(q, k, v, self.k_cache, self.v_cache, self.scale).reshape(n, self.q_size)
        return add_lora(self.o_proj(o), o, self.layer_idx, OUT)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int = 0) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.intermediate = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = add_lora(self.gate_up_proj(x), x, self.layer_idx, GATE_UP)
        gate, up = gate_up.split(self.intermediate, dim=-1)
        h = F.silu(gate) * up
        return add_lora(self.down_proj(h), h, self.layer_idx, DOWN)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, layer_idx)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """``forward(embeddings [N, H], positions [N]) -> normed hidden [N, H]``.

    Attention metadata (which tokens belong to which item and context) comes from the
    enclosing :func:`pastry.engine.attention.forward_context`.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Parameter(
            torch.empty(cfg.vocab_size, cfg.hidden_size), requires_grad=False
        )
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)
        self.rotary = RotaryEmbedding(cfg)
        # The dtype hidden states are carried in between the products (set_act_dtype)
        self.act_dtype = self.embed_tokens.dtype

    def set_act_dtype(self, dtype: torch.dtype) -> None:
        """Carry activations in ``dtype`` (float32 under bf16 weights on CPU): the residual
        stream, norms (their weights too), RoPE, attention scores and softmax, SiLU; each
        product rounds its input to the weight's dtype and accumulates in float32, as
        llama.cpp does. HF's bf16 model adds and normalises in bf16 instead, which is what
        lost the demo's first-token margin (issue 26). K/V stay in the pool's dtype."""
        self.act_dtype = dtype
        for m in self.modules():
            if isinstance(m, RMSNorm):
                m.weight.data = m.weight.data.to(dtype)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Embedding rows in the storage dtype (the embedding slots' dtype)."""
        return self.embed_tokens.index_select(0, tokens)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = x.to(self.act_dtype)
        cos, sin = self.rotary(positions, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin)
            layer_done(i)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits of normed hidden states."""
        return self.lm_head(hidden).float()

    @torch.no_grad()
    def load_hf_state_dict(self, weights: dict[str, torch.Tensor | Codes]) -> None:
        """Copy HF-named tensors in, fusing q/k/v and gate/up; tied heads share the embedding.

        A projection's weights may be quantization codes (:mod:`pastry.engine.quant`, e.g.
        straight from GGUF blocks) instead of tensors: the fused projection is then served
        quantized (:meth:`Linear.set_quantized`) and never expanded."""
        cfg = self.cfg
        load = _StateDict(weights, self.embed_tokens.dtype)
        embed = "model.embed_tokens.weight"
        load.put(self.embed_tokens, load.take(embed), embed)
        head = embed if cfg.tie_word_embeddings else "lm_head.weight"
        if cfg.tie_word_embeddings and isinstance(
            weights.get("lm_head.weight"), Int4Codes | Int8Codes
        ):
            head = "lm_head.weight"  # the tied embedding's codes, kept quantized for the head
        load.put_linear(self.lm_head, [head], head)
        load.put(self.norm.weight, load.take("model.norm.weight"), "model.norm.weight")
        for i, layer in enumerate(self.layers):
            load.layer(layer, f"model.layers.{i}.")

    def linears(self) -> list[Linear]:
        """Every projection: the decoder layers' in order, then the head."""
        return [m for m in self.layers.modules() if isinstance(m, Linear)] + [self.lm_head]

    @torch.no_grad()
    def quantize(self, mode: str) -> int:
        """Quantize the dense projections for the CPU kernels (``mode`` "int4" or "int8");
        returns how many. The head is quantized to int8 in both modes (as llama.cpp keeps
        its output matrix at higher precision); the embedding table stays dense.

        "int4-hybrid" is int4, and every int4 projection (these and those already loaded from
        a GGUF's blocks) also keeps a dense copy for batches of
        :data:`~pastry.engine.quant.INT4_DENSE_FROM_M` rows and more
        (:meth:`~pastry.engine.quant.Int4Weight.keep_dense`)."""
        if mode not in ("int4", "int8", "int4-hybrid"):
            raise ValueError(f"quantize mode must be int4, int4-hybrid or int8, got {mode!r}")
        dtype, base = self.embed_tokens.dtype, "int4" if mode == "int4-hybrid" else mode
        n = 0
        for lin in self.linears():
            if lin.weight is None:
                continue  # already quantized (or packed)
            codes = quantize(lin.weight, "int8" if lin is self.lm_head else base)
            lin.set_quantized(pack(codes, dtype))
            n += 1
        if mode == "int4-hybrid":
            for lin in self.linears():
                if isinstance(lin.quantized, Int4Weight):
                    lin.quantized.keep_dense()
        return n

    def prepack(self) -> int:
        """Prepack every linear for the CPU fast path where it applies; returns how many."""
        return sum(m.prepack() for m in self.modules() if isinstance(m, Linear))


class _StateDict:
    """HF-named tensors (or quantization codes) copied into a :class:`LlamaModel`'s
    parameters, with errors that name the tensor."""

    def __init__(self, weights: dict[str, torch.Tensor | Codes], dtype: torch.dtype) -> None:
        self.weights = weights
        self.dtype = dtype  # the model's: quantized projections are packed for it

    def take(self, name: str) -> torch.Tensor | Codes:
        if name not in self.weights:
            raise CheckpointError(f"checkpoint has no tensor '{name}'")
        return self.weights[name]

    def put(self, dst: torch.Tensor, src: torch.Tensor | Codes, name: str) -> None:
        if isinstance(src, Int4Codes | Int8Codes):
            raise CheckpointError(f"tensor '{name}' is quantized; only projections may be")
        if tuple(dst.shape) != tuple(src.shape):
            raise CheckpointError(
                f"tensor '{name}' has shape {tuple(src.shape)}, expected {tuple(dst.shape)}"
            )
        dst.copy_(src)

    def put_linear(self, dst: Linear, names: list[str], label: str) -> None:
        parts = [self.take(n) for n in names]
        if not any(isinstance(p, Int4Codes | Int8Codes) for p in parts):
            self.put(dst.weight, parts[0] if len(parts) == 1 else torch.cat(parts), label)
            return
        for n, p in zip(names, parts, strict=True):
            if p.shape[1] != dst.in_features:
                raise CheckpointError(
                    f"tensor '{n}' has shape {tuple(p.shape)}, expected [*, {dst.in_features}]"
                )
        if sum(p.shape[0] for p in parts) != dst.out_features:
            raise CheckpointError(
                f"tensors {label} have {sum(p.shape[0] for p in parts)} rows, expected "
                f"{dst.out_features}"
            )
        codes = [
            p if isinstance(p, Int4Codes | Int8Codes) else Int8Codes.from_dense(p) for p in parts
        ]
        dst.set_quantized(pack(cat_codes(codes), self.dtype))

    def layer(self, layer: DecoderLayer, p: str) -> None:
        """Decoder layer ``layer``'s tensors, named with the prefix ``p``."""
        attn, mlp = layer.self_attn, layer.mlp
        qkv = [f"{p}self_attn.{x}_proj.weight" for x in "qkv"]
        self.put_linear(attn.qkv_proj, qkv, f"{p}self_attn.q/k/v_proj.weight")
        if attn.qkv_proj.bias is not None:
            bias = [self.take(f"{p}self_attn.{x}_proj.bias") for x in "qkv"]
            self.put(attn.qkv_proj.bias, torch.cat(bias), f"{p}self_attn.q/k/v_proj.bias")
        self.put_linear(attn.o_proj, [f"{p}self_attn.o_proj.weight"], f"{p}self_attn.o_proj")
        if attn.q_norm is not None:
            self.put(attn.q_norm.weight, self.take(f"{p}self_attn.q_norm.weight"), f"{p}q_norm")
            self.put(attn.k_norm.weight, self.take(f"{p}self_attn.k_norm.weight"), f"{p}k_norm")
        gate_up = [f"{p}mlp.gate_proj.weight", f"{p}mlp.up_proj.weight"]
        self.put_linear(mlp.gate_up_proj, gate_up, f"{p}mlp.gate/up_proj.weight")
        self.put_linear(mlp.down_proj, [f"{p}mlp.down_proj.weight"], f"{p}mlp.down_proj")
        self.put(
            layer.input_layernorm.weight, self.take(f"{p}input_layernorm.weight"), f"{p}in_norm"
        )
        self.put(
            layer.post_attention_layernorm.weight,
            self.take(f"{p}post_attention_layernorm.weight"),
            f"{p}post_norm",
        )
