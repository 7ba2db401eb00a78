"""The decode step as one compiled graph (``torch.compile``, inductor's C++ backend) on CPU.

A *decode batch* — every item one new token that stores its K/V, no adapter — is what
serving runs most. Eager PyTorch spends as long on such a step's ~1,800 small operators
(RMSNorm alone is a dozen) as on its matrix products; compiled, each layer becomes a few
fused C++ loops between the projections:

- RMSNorm, RoPE, residual adds and SiLU·mul are fused elementwise/reduction kernels;
- paged attention gathers each item's K/V rows from the pool (fused with the widening to
  float32), then masked scores, softmax and the weighted sum in float32;
- the projections stay the model's own :class:`~pastry.engine.layers.Linear` modules
  (oneDNN-packed bf16, int8 or int4 weights), called through one opaque custom op,
  ``pastry::linear(x, layer, site)``, that resolves them in the model being run. The graph
  never holds weights, so one compiled graph serves every engine of the same architecture.

The batch size, the padded context length and the pool's slot count are symbolic: one graph
serves batch 1 (size 1 is specialised) and one every larger batch, at every context length,
for any pool size. Both are compiled when
the engine starts (:meth:`CompiledDecode.warm_up`, tens of seconds on 2 cores); inductor
caches the generated code under ``$PASTRY_HOME/inductor`` (content-keyed), so a restart
compiles in a few seconds. Any other batch (prefill chunks, mixed prefill/decode batches,
adapters, items that do not store their K/V) runs the eager model, which computes the same
function.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pastry.engine import native, torch_raw
from pastry.engine.attention import AttnMetadata
from pastry.engine.layers import Linear, native_projections
from pastry.engine.model import LlamaModel
from pastry.paths import pastry_home

log = logging.getLogger(__name__)

# Inductor's code cache (content-keyed, safe to share), unless the user chose one.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(pastry_home() / "inductor"))

# Sites of a layer's projections, the order of DecoderLayer's Linear modules.
QKV, OUT, GATE_UP, DOWN = range(4)


class _Local(threading.local):
    # the projections of the model being run, per thread (engines of one process each
    # forward on their own worker thread)
    forwards: list[Callable[[torch.Tensor], torch.Tensor]] | None = None


_local = _Local()


@contextmanager
def _running(
    forwards: list[Callable[[torch.Tensor], torch.Tensor]], projections: torch.ScriptObject | None
) -> Iterator[None]:
    """The projections ``pastry::linear`` resolves on this thread: ``projections`` for the
    native kernel, ``forwards`` for the Python one."""
    _local.forwards = forwards
    if projections is not None:
        projections.use()
    try:
        yield
    finally:
        _local.forwards = None
        if projections is not None:
            projections.release()


# pastry::linear(x, index, out_features): projection ``index`` (4 per layer, in layer order:
# q/k/v, o, gate/up, down) of the model being run. An opaque operator to the compiler, defined
# with the low-level library API. Its CPU kernel is C++ (engine/native.py: the graph's C++
# wrapper then calls it without entering Python, 120 calls a step) or, where the native
# library cannot be built, the Python function below (_kernel() chooses, once).
_lib = torch.library.Library("pastry", "DEF")
_lib.define("linear(Tensor x, int index, int out_features) -> Tensor")


def _linear(x: torch.Tensor, index: int, out_features: int) -> torch.Tensor:
    forwards = _local.forwards
    assert forwards is not None, "pastry::linear called outside CompiledDecode"
    return forwards[index](x)


def _linear_fake(x: torch.Tensor, index: int, out_features: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)


torch.library.register_fake("pastry::linear", _linear_fake, lib=_lib)
_kernels: list[str] = []  # which kernel pastry::linear has: "native" or "python"


def _kernel() -> str:
    """Give ``pastry::linear`` its CPU kernel, once per process: the native one if the
    library loads (it registers itself), else :func:`_linear`."""
    if not _kernels:
        if native.load():
            _kernels.append("native")
        else:
            _lib.impl("linear", _linear, "CPU")
            _kernels.append("python")
    return _kernels[0]


def _projection(lin: Linear) -> Callable[[torch.Tensor], torch.Tensor]:
    """What the Python kernel of ``pastry::linear`` calls for ``lin``: for a oneDNN-packed
    weight without bias and without the native kernel, the packed product itself (one
    Python frame and no per-call checks instead of ``Linear.forward``'s); otherwise the
    bound ``forward`` (which skips ``nn.Module.__call__``'s hook handling). Taken when the
    engine starts: the model's weights do not change afterwards."""
    if lin.packed is not None and lin.bias is None and not native.ready:
        op, w = torch_raw.onednn_linear_op(), lin.packed
        return lambda x: op(x, w, None, "none", [], "")
    return lin.forward


@dataclass(frozen=True)
class Spec:
    """What the graph is specialised on: the architecture's static numbers (and the dtype)."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    eps: float
    qk_norm: bool
    # attention by the native kernel (engine/native.py) instead of gathers and bmm calls
    native_attention: bool = False
    # the projections' dtype; activations may be wider (LlamaModel.set_act_dtype): each
    # projection's input is rounded to it and its output widened back, fused by inductor
    weight_dtype: torch.dtype = torch.float32


def _lin(spec: Spec, x: torch.Tensor, index: int, out_features: int) -> torch.Tensor:
    y = torch.ops.pastry.linear(x.to(spec.weight_dtype), index, out_features)
    return y.to(x.dtype)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm: normalise in float32, cast back, then scale."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * y.to(x.dtype)


def _rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = t.shape[-1] // 2
    return t * cos + torch.cat((-t[..., half:], t[..., :half]), dim=-1) * sin


def decode_layer(
    spec: Spec,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    pool: torch.Tensor,
    store: tuple[torch.Tensor, torch.Tensor],
    kv: tuple[torch.Tensor, torch.Tensor],
    mask: torch.Tensor,
    norms: list[torch.Tensor],
    layer: int,
    kv_rows: torch.Tensor,
) -> torch.Tensor:
    """Decoder layer ``layer`` of a decode step (see :func:`decode_step`); ``store`` and
    ``kv`` as (head, slot) index pairs into the pool, ``kv_rows`` as flat head-major rows."""
    b, hq, d, inter = x.shape[0], spec.num_heads, spec.head_dim, spec.intermediate_size
    q, k, v = _qkv(spec, x, cos, sin, norms, layer)
    # Written with index_put_ on the pool itself (not a view of it), which inductor does in
    # place; a view's index_copy_ made it copy the whole pool every step.
    n = spec.num_layers
    k_at, v_at = torch.full_like(store[0], layer), torch.full_like(store[0], n + layer)
    pool.index_put_((k_at, *store), k.transpose(0, 1).to(pool.dtype))
    pool.index_put_((v_at, *store), v.transpose(0, 1).to(pool.dtype))
    if spec.native_attention:
        # one opaque kernel per layer: it reads the K/V rows in place (no gathered copies)
        # and computes the masked float32 softmax and both products (engine/native.py)
        o = torch.ops.pastry_native.decode_attention(
            q.to(pool.dtype), pool, layer, n + layer, kv_rows, mask, d**-0.5
        ).to(x.dtype)
        o = o.reshape(b, hq * d)
    else:
        o = _pool_attention(spec, q, pool, kv, mask, layer).to(x.dtype)
    x = x + _lin(spec, o, 4 * layer + OUT, spec.hidden_size)
    h = _lin(spec, _rms(x, norms[1], spec.eps), 4 * layer + GATE_UP, 2 * inter)
    h = F.silu(h[:, :inter]) * h[:, inter:]
    return x + _lin(spec, h, 4 * layer + DOWN, spec.hidden_size)


def _qkv(
    spec: Spec,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    norms: list[torch.Tensor],
    layer: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Layer ``layer``'s rotated queries ``[B, Hq, D]`` and keys and values ``[B, Hkv, D]``
    of the normed ``x`` (with the model's q/k norms where it has them)."""
    b, hq, hkv, d = x.shape[0], spec.num_heads, spec.num_kv_heads, spec.head_dim
    qkv = _lin(spec, _rms(x, norms[0], spec.eps), 4 * layer + QKV, (hq + 2 * hkv) * d)
    q = qkv[:, : hq * d].view(b, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(b, hkv, d)
    v = qkv[:, (hq + hkv) * d :].view(b, hkv, d)
    if spec.qk_norm:
        q, k = _rms(q, norms[2], spec.eps), _rms(k, norms[3], spec.eps)
    return _rope(q, cos, sin), _rope(k, cos, sin), v


def _pool_attention(
    spec: Spec,
    q: torch.Tensor,
    pool: torch.Tensor,
    kv: tuple[torch.Tensor, torch.Tensor],
    mask: torch.Tensor,
    layer: int,
) -> torch.Tensor:
    """Attention of ``q [B, Hq, D]`` over the pool's rows ``kv`` of layer ``layer`` under
    ``mask [B, L]``, in float32: ``[B, Hq * D]``."""
    b, hq, hkv, d = q.shape[0], spec.num_heads, spec.num_kv_heads, spec.head_dim
    n = spec.num_layers
    k_at, v_at = torch.full_like(kv[0], layer), torch.full_like(kv[0], n + layer)
    # Each query head against its KV head's rows of the pool ([Hkv, B, L, D], gathered and
    # widened in one fused pass), in float32: [Hkv, B, rep, L] scores. Batched matrix
    # products, not a fused multiply-sum, which would recompute the scores for every output
    # element (10x slower from batch 8).
    rep = hq // hkv
    qg = q.view(b, hkv, rep, d).transpose(0, 1).float()
    if rep == 1:
        # Inductor lowers a CPU bmm with one row (M == 1) to that multiply-sum, fusing the
        # softmax into the reduction over the context: without grouped-query attention
        # (one query row per KV head) the step ran 2.4x slower than the eager model at
        # batch 32. Two identical rows keep both products real bmm calls.
        qg = qg.expand(hkv, b, 2, d)
    scores = torch.matmul(qg, pool[k_at, *kv].float().transpose(-1, -2)) / (d**0.5)
    scores = scores.masked_fill(~mask.view(1, b, 1, -1), torch.finfo(torch.float32).min)
    o = torch.matmul(scores.softmax(-1), pool[v_at, *kv].float())  # [Hkv, B, rep, D]
    return o[:, :, :rep].transpose(0, 1).reshape(b, hq * d)


def decode_step(
    spec: Spec,
    x: torch.Tensor,
    positions: torch.Tensor,
    store: torch.Tensor,
    kv: torch.Tensor,
    mask: torch.Tensor,
    pool: torch.Tensor,
    norms: list[torch.Tensor],
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
) -> torch.Tensor:
    """One decode step of ``B`` items, the function the graph is compiled from.

    ``x [B, H]`` embeddings at ``positions [B]``; ``pool`` the KV pool,
    ``[2 * layers, Hkv, slots, D]`` (K of each layer, then V: ``KvPool.data``);
    ``store [Hkv, B]`` the rows of the new K/V in one layer's K (or V) viewed as
    ``[Hkv * slots, D]`` (head-major, see ``attention.head_index``);
    ``kv [Hkv, B, L]`` the rows each item attends to (its context, padding, then its own new
    token); ``mask [B, L]`` which of them it may attend. ``norms``: per layer the input and
    post-attention (then q and k) norm weights, and last the final norm. The projections are
    ``pastry::linear`` calls (:func:`_linear`). Every item's new K/V are stored
    before any item reads the pool, as in the eager model. Returns the final normed hidden
    states ``[B, H]``."""
    cos = cos_table[positions].to(x.dtype).unsqueeze(1)  # [B, 1, D]
    sin = sin_table[positions].to(x.dtype).unsqueeze(1)
    per_layer = 4 if spec.qk_norm else 2
    slots = pool.shape[2]
    store_at = (store // slots, store % slots)  # (head, slot) of the flat head-major rows
    kv_at = (kv // slots, kv % slots)
    for i in range(spec.num_layers):
        w = norms[i * per_layer : (i + 1) * per_layer]
        x = decode_layer(spec, x, cos, sin, pool, store_at, kv_at, mask, w, i, kv)
    return _rms(x, norms[-1], spec.eps)


def decode_step_one(*args) -> torch.Tensor:
    """:func:`decode_step` for a batch of one: its own code object, so that dynamo keeps its
    graphs apart from the batched ones (they are compiled with other options)."""
    return decode_step(*args)


_compiled_steps: dict[bool, Callable[..., torch.Tensor]] = {}


def _compiled(one: bool) -> Callable[..., torch.Tensor]:
    """The compiled step for a batch of one (``one``) or of more.

    A batch of one gets inductor's C++ wrapper: the graph's ~300 kernel launches, buffer
    allocations and checks then run in C++ instead of a generated Python function (measured
    ~0.35 ms of a ~10 ms SmolLM2-135M step on 2 cores; benchmarks/RESULTS.md). Larger
    batches keep the Python wrapper, whose overhead is small next to their products, and
    which compiles faster."""
    step = _compiled_steps.get(one)
    if step is None:
        # One graph per (architecture, dtype, batch 1 or more): a process with
        # several engines (tests, benchmarks) needs more than dynamo's default of 8.
        torch_raw.raise_recompile_limit(64)
        if one:
            step = torch.compile(decode_step_one, fullgraph=True, options={"cpp_wrapper": True})
        else:
            step = torch.compile(decode_step, fullgraph=True)
        _compiled_steps[one] = step
    return step


class CompiledDecode:
    """Runs decode batches of one engine's model through the compiled graph.

    Contract: :meth:`accepts` says whether a forward's attention metadata is a decode batch
    the graph computes; only then may :meth:`__call__` run it, inside the same
    ``forward_context`` the eager model would run in, with the same result up to float
    rounding (bfloat16 differs from eager in the last bits; float32 agrees to ~1e-6).
    """

    def __init__(self, model: LlamaModel, pool: torch.Tensor):
        """``pool``: the engine's KV pool tensor, ``[2 * layers, kv_heads, slots, head_dim]``
        (``KvPool.data``)."""
        cfg = model.cfg
        self.kernel = _kernel()  # pastry::linear's: native or python
        self.spec = Spec(
            num_layers=cfg.num_layers,
            num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            eps=cfg.rms_norm_eps,
            qk_norm=cfg.qk_norm,
            native_attention=pool.device.type == "cpu" and native.attention(cfg.head_dim),
            weight_dtype=model.embed_tokens.dtype,
        )
        self.model = model
        assert pool.shape == (2 * cfg.num_layers, cfg.num_kv_heads, pool.shape[2], cfg.head_dim)
        self.pool = pool
        # pool sizes differ between starts (derived from free memory): keep the slot count
        # symbolic so that the cached graph serves any pool
        torch_raw.mark_dynamic(pool, 2)
        linears = [
            lin
            for m in model.layers
            for lin in (
                m.self_attn.qkv_proj,
                m.self_attn.o_proj,
                m.mlp.gate_up_proj,
                m.mlp.down_proj,
            )
        ]
        # the projections as pastry::linear's kernel reads them
        self.native = native_projections(linears) if self.kernel == "native" else None
        self.forwards = [_projection(lin) for lin in linears]
        norms = []
        for layer in model.layers:
            norms += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
            if cfg.qk_norm:
                norms += [layer.self_attn.q_norm.weight, layer.self_attn.k_norm.weight]
        self.norms = [*norms, model.norm.weight]
        self.steps = 0  # decode steps run compiled (tests and benchmarks read it)
        self.error: str | None = None  # why compiling failed, if it did
        self._ready = threading.Event()  # the warm-up compiled every graph
        self._warming: threading.Thread | None = None

    @property
    def enabled(self) -> bool:
        """False once compiling failed (the engine then runs every step eagerly)."""
        return self.error is None

    @property
    def ready(self) -> bool:
        """The warm-up has compiled every graph (until then decode steps run eagerly)."""
        return self._ready.is_set() and self.error is None

    def accepts(self, meta: AttnMetadata) -> bool:
        """A single group of one-token items, in batch order, all storing their K/V, once
        the warm-up is done."""
        if not self.ready:
            return False
        if len(meta.groups) != 1 or meta.store_slots is None or meta.store_rows is not None:
            return False
        g = meta.groups[0]
        return g.n == 1 and g.rows is None and g.kv_slots is not None and g.mask is not None

    def __call__(
        self, x: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata
    ) -> torch.Tensor:
        """The decode step of an accepted batch (inside its ``forward_context``)."""
        g = meta.groups[0]
        x = x.to(self.model.act_dtype)  # the embedding slots' dtype to the activations'
        try:
            out = self._run(x, positions, meta.store_slots, g.kv_slots, g.mask.view(g.size, -1))
        except torch_raw.compile_error() as e:
            # A batch the warm-up did not cover failed to compile (nothing ran): serve it,
            # and every later one, eagerly.
            self._disable(e)
            return self.model(x, positions)
        if meta.on_layer is not None:  # every layer's K/V are stored now
            for i in range(self.spec.num_layers):
                meta.on_layer(i)
        self.steps += 1
        return out

    def _disable(self, e: Exception) -> None:
        self.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        log.warning("compiling the decode step failed (%s); decode steps run eagerly", self.error)

    def _run(self, x, positions, store, kv, mask, pool: torch.Tensor | None = None):
        # Only the batch and context dims are symbolic; a batch of 1 gets its own graph.
        if x.shape[0] > 1:
            for t, dim in ((x, 0), (positions, 0), (store, 1), (kv, 1), (mask, 0)):
                torch_raw.mark_dynamic(t, dim)
        torch_raw.mark_dynamic(kv, 2)
        torch_raw.mark_dynamic(mask, 1)
        with _running(self.forwards, self.native):
            return _compiled(x.shape[0] == 1)(
                self.spec,
                x,
                positions,
                store,
                kv,
                mask,
                self.pool if pool is None else pool,
                self.norms,
                self.model.rotary.cos,
                self.model.rotary.sin,
            )

    def warm_up(self, batch_sizes: tuple[int, ...] = (1, 2)) -> bool:
        """Compile the graphs for ``batch_sizes`` now (1 and 2 cover every batch), logging
        the progress; False (and eager decoding from then on) if compiling fails, e.g.
        without a C++ compiler. Runs on a scratch pool of 64 slots (the slot count is
        symbolic, so the graphs are those of the engine's pool): the engine's KV is never
        touched, and the engine may serve meanwhile (:meth:`warm_up_in_background`)."""
        dev, dtype = self.pool.device, self.pool.dtype
        hkv, slots = self.spec.num_kv_heads, 64
        scratch = torch.zeros((*self.pool.shape[:2], slots, self.pool.shape[3]),
                              dtype=dtype, device=dev)  # fmt: skip
        torch_raw.mark_dynamic(scratch, 2)
        act = self.model.act_dtype
        for b in batch_sizes:
            label = "1" if b == 1 else "2 and more"
            log.info("compiling the decode step for batch %s (cached after the first time)", label)
            t = time.perf_counter()
            length = 32
            x = torch.zeros(b, self.spec.hidden_size, dtype=act, device=dev)
            pos = torch.zeros(b, dtype=torch.int64, device=dev)
            store = (torch.arange(hkv, device=dev) * slots).view(hkv, 1).expand(hkv, b)
            kv = (torch.arange(hkv, device=dev) * slots).view(hkv, 1, 1).expand(hkv, b, length)
            mask = torch.zeros(b, length, dtype=torch.bool, device=dev)
            mask[:, -1] = True
            try:
                self._run(x, pos, store.contiguous(), kv.contiguous(), mask, scratch)
            except Exception as e:  # dynamo's, inductor's, a missing compiler
                self._disable(e)
                self._ready.set()
                return False
            log.info(
                "compiled the decode step for batch %s in %.1fs", label, time.perf_counter() - t
            )
        self._ready.set()
        return True

    def warm_up_in_background(self) -> None:
        """Compile on a thread while the engine serves: decode steps run eagerly until
        :attr:`ready` (a cold start answers as soon as the weights are loaded; the
        compiled step takes over some seconds later)."""
        self._warming = threading.Thread(target=self.warm_up, name="compile-decode", daemon=True)
        self._warming.start()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the warm-up is done; whether the compiled step is in use."""
        self._ready.wait(timeout)
        return self.ready
