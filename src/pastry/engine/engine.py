"""The engine: a model, its memory pools, and one batched handler per call type.

``Engine.execute(batch)`` validates each call (a bad call becomes a :class:`CallError`
result and has no effect), then runs each run of consecutive same-type calls as one batched
operation, in batch order. It is synchronous and single-threaded; ``wire/handle.py`` runs
it on a worker thread, ``engine/serve.py`` serves it over ZeroMQ.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from pastry.engine import native
from pastry.engine.attention import ItemPlan, build_metadata, forward_context, take
from pastry.engine.compiled import CompiledDecode
from pastry.engine.dtypes import resolve_dtype
from pastry.engine.hugepages import huge_pages
from pastry.engine.logits import (
    LogitsProcessor,
    log_softmax,
    mask_allows_any,
    needs_processing,
    token_logprobs,
    top_logprobs,
)
from pastry.engine.lora import Adapter, plan_adapters, use_adapters
from pastry.engine.model import LlamaModel
from pastry.engine.pool import EmbedPool, HostPool, KvPool, PoolSizes
from pastry.engine.quant import Codes, Int4Codes, Int8Codes, kept_codes
from pastry.engine.sampling import SamplingParams, sample, top_k_dist
from pastry.engine.transfer import KvSender, host_id
from pastry.wire.calls import (
    MAX_LOGPROBS,
    Call,
    CallError,
    CopyKv,
    Dist,
    EmbedTxt,
    EngineInfo,
    Forward,
    Logprobs,
    MaskKv,
    NextDist,
    Result,
    Sample,
    Sampled,
    SendKv,
    SwapIn,
    SwapOut,
    mask_words,
)
from pastry.wire.config import EngineConfig, ModelConfig

log = logging.getLogger(__name__)

# oneDNN JIT-compiles a kernel per matrix shape (~1 ms each) and keeps 1024 by default; a
# serving engine sees many batch shapes, so keep more. Read when oneDNN is first used.
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "8192")

# The API trait groups this engine implements (see pastry.api.TRAITS), plus engine-level
# capabilities the control layer may use (kv_swap).
TRAITS = (
    "allocate",
    "forward",
    "forward_with_adapter",
    "input_text",
    "tokenize",
    "output_text",
    "kv_swap",
)

# Call types that run in one handler invocation when adjacent in a batch: NextDist and
# Sample rows share one lm_head.
_HANDLER_GROUP: dict[type, type] = {NextDist: Sample}
# Rows of prompt log-probabilities computed at once (bounds the [rows, vocab] logits).
_LOGPROB_CHUNK = 256


class ForwardPlan(NamedTuple):
    """A checked ``Forward``: what its batch runs on (slots are ``page * page_size + i``)."""

    ins: np.ndarray  # input embed slots
    ctx_slots: np.ndarray  # the context's KV slots, in order
    out_slots: np.ndarray | None  # where the new tokens' K/V go (None: not stored)
    out_embeds: np.ndarray  # embed slots receiving outputs
    out_indices: np.ndarray  # which inputs' outputs
    positions: np.ndarray | None  # None: those stored with the input embeds
    mask: np.ndarray | None  # bool [n, ctx + n], or None: causal
    adapter: int  # LoRA adapter id, -1 for the base model
    targets: np.ndarray | None  # prompt log-probability targets (None: none)


@dataclasses.dataclass(slots=True)
class _Layout:
    """Where each checked forward of one batch lies in the batch's rows (lists in its order)."""

    items: list = dataclasses.field(default_factory=list)  # ItemPlan per forward
    store_rows: list = dataclasses.field(default_factory=list)  # rows whose K/V are stored
    store_slots: list = dataclasses.field(default_factory=list)  # ... and the slots they go to
    positions: list = dataclasses.field(default_factory=list)
    out_embeds: list = dataclasses.field(default_factory=list)
    out_rows: list = dataclasses.field(default_factory=list)
    lora_spans: list = dataclasses.field(default_factory=list)  # (first row, rows, adapter)
    scored: list = dataclasses.field(default_factory=list)  # (result, first row, targets, top)
    rows: int = 0

    @classmethod
    def of(cls, ok, stored_pos: np.ndarray | None) -> _Layout:
        lay = cls()
        for i, c, plan in ok:
            row, n = lay.rows, len(plan.ins)
            if plan.targets is not None:
                lay.scored.append((i, row, plan.targets, c.logprob_top))
            positions = plan.positions
            if positions is None:
                positions = stored_pos[row : row + n]
            lay.positions.append(positions)
            lay.items.append(ItemPlan(row, n, plan.ctx_slots, positions, plan.mask, plan.out_slots))
            if plan.out_slots is not None:
                lay.store_rows.append(np.arange(row, row + n))
                lay.store_slots.append(plan.out_slots)
            lay.out_embeds.append(plan.out_embeds)
            lay.out_rows.append(plan.out_indices + row)
            if plan.adapter >= 0:
                lay.lora_spans.append((row, n, plan.adapter))
            lay.rows += n
        return lay


class Invalid(Exception):
    """A call is malformed or names memory that does not exist."""


class Engine:
    def __init__(
        self,
        model: LlamaModel,
        config: EngineConfig,
        *,
        name: str = "",
        tokenizer_json: str = "",
        chat_template: str | None = None,
        special_tokens: dict[str, str] | None = None,
    ) -> None:
        self.model = model
        self.cfg = model.cfg
        self.config = config
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        sizes = PoolSizes.resolve(self.cfg, config, self.dtype, self.device)
        log.info("%s", sizes.describe(config.page_size))
        self.page_size = config.page_size
        self.kv = KvPool(
            self.cfg, sizes.num_pages, config.page_size, self.dtype, self.device, config.kv_shm
        )
        self.transfer = KvSender(self.kv)
        self.host = HostPool(self.kv, sizes.num_host_pages)
        self.embeds = EmbedPool(sizes.num_embeds, self.cfg.hidden_size, self.dtype, self.device)
        for layer, k, v in zip(model.layers, self.kv.k, self.kv.v, strict=True):
            layer.self_attn.k_cache, layer.self_attn.v_cache = k, v
        self.compiled = self._compiled_decode(config)
        self._rng = np.random.default_rng(config.seed)
        self._adapters: list[Adapter | None] = []  # by id; None: unloaded (ids stay)
        self._swap_staging: tuple[torch.Tensor, torch.Tensor] | None = None
        self.info = EngineInfo(
            model_name=name or self.cfg.name,
            arch=self.cfg.arch,
            vocab_size=self.cfg.vocab_size,
            hidden_size=self.cfg.hidden_size,
            num_layers=self.cfg.num_layers,
            max_position=self.cfg.max_position,
            dtype=str(self.dtype).removeprefix("torch."),
            device=str(self.device),
            page_size=config.page_size,
            num_pages=sizes.num_pages,
            num_embeds=sizes.num_embeds,
            num_host_pages=sizes.num_host_pages,
            max_batch_tokens=config.max_batch_tokens,
            traits=TRAITS,
            bos_token_id=self.cfg.bos_token_id,
            eos_token_ids=tuple(self.cfg.eos_token_ids),
            tokenizer_json=tokenizer_json,
            chat_template=chat_template,
            special_tokens=dict(special_tokens or {}),
            kv_peers=(f"shm:{config.kv_shm}",) if config.kv_shm else (),
            host=host_id(),
        )
        self._handlers: dict[type, Callable[[list[tuple[int, Call]], list[Result]], None]] = {
            EmbedTxt: self._embed_txt,
            Forward: self._forward,
            Sample: self._output,  # and NextDist (_HANDLER_GROUP)
            CopyKv: self._copy_kv,
            MaskKv: self._mask_kv,
            SwapOut: self._swap_out,
            SwapIn: self._swap_in,
            SendKv: self._send_kv,
        }

    def _compiled_decode(self, config: EngineConfig) -> CompiledDecode | None:
        """The compiled decode step, compiled now or (``compile_background``) on a thread."""
        if not config.compile:
            return None
        if self.device.type != "cpu":
            log.info("compile applies to CPU engines; %s decodes eagerly", self.device)
            return None
        compiled = CompiledDecode(self.model, self.kv.data)
        if config.compile_background:
            compiled.warm_up_in_background()
        else:
            compiled.warm_up()
        return compiled

    @classmethod
    def load(cls, model_dir: str | Path, config: EngineConfig | None = None) -> Engine:
        """Load a Hugging Face checkpoint directory or a GGUF file onto ``config.device``."""
        from pastry.engine.checkpoint import load_checkpoint

        config = config or EngineConfig()
        t0 = time.perf_counter()
        ckpt = load_checkpoint(model_dir)
        device = torch.device(config.device)
        dtype = resolve_dtype(config.dtype, ckpt.config, device)
        if device.type == "cpu" and dtype == torch.bfloat16:
            # build (the first time) or load the native kernels while the weights are read
            threading.Thread(target=native.load, name="native-kernels", daemon=True).start()
        weights = ckpt.load_state_dict(dtype, device)
        weights.update(kept_codes(ckpt.path, ckpt.config, config.quantize, device))
        model = build_model(ckpt.config, dtype, device, weights, config.quantize)
        del weights
        tok = ckpt.tokenizer
        engine = cls(
            model,
            config,
            name=ckpt.name,
            tokenizer_json=tok.to_json(),
            chat_template=tok.chat_template,
            special_tokens=tok.special_tokens,
        )
        log.info(
            "loaded %s (%s, %.1fM params, %s on %s) in %.1fs: %d KV pages x %d tokens, %d embeds",
            engine.info.model_name,
            ckpt.config.arch,
            ckpt.config.num_params / 1e6,
            engine.info.dtype,
            device,
            time.perf_counter() - t0,
            engine.info.num_pages,
            config.page_size,
            engine.info.num_embeds,
        )
        return engine

    # ------------------------------------------------------------------ adapters

    def load_adapter(self, path: str | Path, name: str | None = None) -> int:
        """Load a PEFT LoRA adapter directory (default name: the directory's); returns the
        id that ``Forward.adapter`` names. Batches validated after it returns may use it."""
        name = name or Path(path).name
        if name in (names := self.adapters()):
            raise ValueError(
                f"an adapter named '{name}' is already loaded (id {names.index(name)})"
            )
        adapter = Adapter.load(path, self.cfg, self.dtype, self.device, name)
        self._adapters.append(adapter)
        self.info = dataclasses.replace(self.info, adapters=tuple(self.adapters()))
        log.info(
            "loaded adapter %d '%s' (r=%d, %s)",
            len(names),
            name,
            adapter.rank,
            ", ".join(adapter.targets),
        )
        return len(names)

    def unload_adapter(self, name: str) -> int:
        """Unload the adapter ``name``; returns its id, which no later adapter takes (a
        forward still naming it fails). Batches validated after it returns no longer see it."""
        names = self.adapters()
        if not name or name not in names:
            loaded = ", ".join(n for n in names if n) or "none"
            raise ValueError(f"no adapter named '{name}' is loaded (loaded: {loaded})")
        aid = names.index(name)
        self._adapters[aid] = None
        self.info = dataclasses.replace(self.info, adapters=tuple(self.adapters()))
        log.info("unloaded adapter %d '%s'", aid, name)
        return aid

    def adapters(self) -> list[str]:
        """Names of the adapters by id ("" for one that was unloaded)."""
        return [a.name if a is not None else "" for a in self._adapters]

    def _adapter_ids(self) -> str:
        ids = [i for i, a in enumerate(self._adapters) if a is not None]
        spans = f"0..{len(ids) - 1}" if ids == list(range(len(ids))) else ", ".join(map(str, ids))
        loaded = f"{spans} for the {len(ids)} loaded adapters" if ids else "no adapter is loaded"
        return f"valid ids: -1 for the base model, {loaded}"

    # ------------------------------------------------------------------ execution

    @torch.inference_mode()
    def execute(self, batch: Sequence[Call]) -> list[Result]:
        """Run a batch; one result per call, in order (see ``calls.py``)."""
        results: list[Result] = [None] * len(batch)
        sends = [c for c in batch if type(c) is SendKv]
        if sends:  # before the forward, whose per-layer hook starts sending
            self.transfer.declare(sends)
        indexed = list(enumerate(batch))
        group = _HANDLER_GROUP.get
        for kind, run in itertools.groupby(indexed, key=lambda ic: group(type(ic[1]), type(ic[1]))):
            handler = self._handlers.get(kind)
            run = list(run)
            if handler is None:
                for i, _ in run:
                    results[i] = CallError(f"unknown call type {kind.__name__}")
                continue
            handler(run, results)
        return results

    def _accept(
        self, run: list[tuple[int, Call]], results: list[Result], check: Callable[[Call], object]
    ) -> list[tuple[int, Call, object]]:
        """Validate each call; rejected ones get a CallError, accepted ones their plan."""
        ok = []
        for i, call in run:
            try:
                ok.append((i, call, check(call)))
            except Invalid as e:
                results[i] = CallError(f"{type(call).__name__}: {e}")
            except (TypeError, ValueError, AttributeError, IndexError) as e:
                results[i] = CallError(f"{type(call).__name__}: malformed call ({e})")
        return ok

    # ------------------------------------------------------------------ validation helpers

    def _ids(self, arr, limit: int, what: str, fix: str) -> np.ndarray:
        arr = np.asarray(arr)
        if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
            raise Invalid(f"{what} must be a 1-D integer array")
        if arr.size <= 16:  # most calls name a few ids: numpy's reductions cost more here
            values = arr.tolist()
            lo, hi = (min(values), max(values)) if values else (0, 0)
        else:
            lo, hi = arr.min(), arr.max()
        if arr.size and (lo < 0 or hi >= limit):
            bad = arr[(arr < 0) | (arr >= limit)][0]
            raise Invalid(f"{what} {int(bad)} is out of range [0, {limit}){fix}")
        return arr.astype(np.int64, copy=False)

    def _embed_ids(self, arr, what: str) -> np.ndarray:
        return self._ids(arr, self.embeds.num, what, "")

    def _page_ids(self, arr, what: str) -> np.ndarray:
        return self._ids(arr, self.kv.num_pages, what, "")

    def _positions(self, arr, n: int) -> np.ndarray:
        pos = self._ids(arr, self.cfg.max_position, "position", " (the model's max_position)")
        if len(pos) != n:
            raise Invalid(f"{n} inputs but {len(pos)} positions")
        return pos

    def _scalar(self, value, lo: int, hi: int, what: str) -> int:
        if not isinstance(value, int | np.integer) or isinstance(value, bool):
            raise Invalid(f"{what} must be an integer, got {value!r}")
        if not lo <= value < hi:
            raise Invalid(f"{what} {value} is out of range [{lo}, {hi})")
        return int(value)

    # ------------------------------------------------------------------ embed_txt

    def _check_embed_txt(self, c: EmbedTxt) -> None:
        tokens = self._ids(c.tokens, self.cfg.vocab_size, "token id", " (vocab size)")
        out = self._embed_ids(c.out_embeds, "out embed")
        if len(out) != len(tokens):
            raise Invalid(f"{len(tokens)} tokens but {len(out)} out embeds")
        self._positions(c.positions, len(tokens))

    def _embed_txt(self, run, results) -> None:
        ok = self._accept(run, results, self._check_embed_txt)
        if not ok:
            return
        tokens = self._tensor([c.tokens for _, c, _ in ok])
        slots = self._tensor([c.out_embeds for _, c, _ in ok])
        self.embeds.hidden.index_copy_(0, slots, self.model.embed(tokens))
        self.embeds.positions.index_copy_(0, slots, self._tensor([c.positions for _, c, _ in ok]))

    # ------------------------------------------------------------------ forward

    def _check_forward(self, c: Forward) -> ForwardPlan:
        """A forward checked against the pools, as the slots and arrays it runs on."""
        ins = self._embed_ids(c.in_embeds, "input embed")
        n = len(ins)
        if n == 0:
            raise Invalid("no inputs")
        if n > self.config.max_batch_tokens:
            raise Invalid(
                f"{n} inputs exceed the engine's max_batch_tokens ({self.config.max_batch_tokens}); "
                "split the forward"
            )
        ctx_pages, last, ctx_slots = self._context_slots(c)
        out_slots = self._output_slots(c, n, ctx_pages, last)
        out_embeds = self._embed_ids(c.out_embeds, "output embed")
        out_idx = self._ids(c.out_indices, n, "output index", " (number of inputs)")
        if len(out_idx) != len(out_embeds):
            raise Invalid(f"{len(out_embeds)} output embeds but {len(out_idx)} output indices")
        positions = None if c.positions is None else self._positions(c.positions, n)
        mask = None
        if c.mask is not None:
            mask = np.asarray(c.mask)
            want = (n, len(ctx_slots) + n)
            if mask.dtype != np.bool_ or mask.shape != want:
                raise Invalid(f"mask must be bool of shape {want}, got {mask.dtype} {mask.shape}")
            if not mask.any(axis=1).all():
                raise Invalid(
                    "every input token must attend to at least one token (mask row is empty)"
                )
        adapter = self._scalar(c.adapter, -(1 << 62), 1 << 62, "adapter")
        if not -1 <= adapter < len(self._adapters) or (
            adapter >= 0 and self._adapters[adapter] is None
        ):
            raise Invalid(f"adapter {adapter} is not loaded ({self._adapter_ids()})")
        targets = self._logprob_targets(c, n)
        return ForwardPlan(ins, ctx_slots, out_slots, out_embeds, out_idx, positions, mask,
                           adapter, targets)  # fmt: skip

    def _context_slots(self, c: Forward) -> tuple[np.ndarray, int, np.ndarray]:
        """(context pages, the last one's length, the context's slots in order)."""
        ps = self.page_size
        ctx_pages = self._page_ids(c.ctx_pages, "context page")
        if not len(ctx_pages):
            if c.ctx_last_len != 0:
                raise Invalid(f"ctx_last_len is {c.ctx_last_len} but there are no context pages")
            return ctx_pages, 0, np.zeros(0, dtype=np.int64)
        last = self._scalar(c.ctx_last_len, 1, ps + 1, "ctx_last_len")
        ctx_len = (len(ctx_pages) - 1) * ps + last
        return ctx_pages, last, (ctx_pages[:, None] * ps + np.arange(ps)).reshape(-1)[:ctx_len]

    def _output_slots(
        self, c: Forward, n: int, ctx_pages: np.ndarray, last: int
    ) -> np.ndarray | None:
        """The slots the new tokens' K/V go to (None: not stored)."""
        ps = self.page_size
        out_pages = self._page_ids(c.out_pages, "output page")
        if not len(out_pages):
            return None
        off = self._scalar(c.out_offset, 0, ps, "out_offset")
        if len(out_pages) * ps - off < n:
            raise Invalid(
                f"{len(out_pages)} output pages from offset {off} hold "
                f"{len(out_pages) * ps - off} tokens, not {n}"
            )
        out_list = out_pages.tolist()
        if len(set(out_list)) != len(out_list):
            raise Invalid("output pages repeat a page")
        # New tokens may share only the last context page, after its valid tokens.
        shared = set(out_list).intersection(ctx_pages.tolist())
        if shared and (
            shared != {int(ctx_pages[-1])} or out_list[0] != ctx_pages[-1] or off < last
        ):
            raise Invalid(
                "output slots overlap the context; a token cannot overwrite its own context"
            )
        return (out_pages[:, None] * ps + np.arange(ps)).reshape(-1)[off : off + n]

    def _logprob_targets(self, c: Forward, n: int) -> np.ndarray | None:
        """The prompt log-probability targets (None: none asked)."""
        if not len(c.logprob_targets):
            if c.logprob_top:
                raise Invalid("logprob_top needs logprob_targets")
            return None
        targets = np.asarray(c.logprob_targets)
        vocab = self.cfg.vocab_size
        if targets.ndim != 1 or targets.dtype.kind not in "iu":
            raise Invalid("logprob_targets must be a 1-D integer array")
        if targets.min() < -1 or targets.max() >= vocab:
            raise Invalid(f"logprob_targets must be token ids below {vocab} or -1 (none)")
        if len(targets) != n:
            raise Invalid(f"{n} inputs but {len(targets)} logprob targets")
        self._scalar(c.logprob_top, 0, MAX_LOGPROBS + 1, "logprob_top")
        return targets.astype(np.int64, copy=False)

    def _forward(self, run, results) -> None:
        ok = self._accept(run, results, self._check_forward)
        # Split into sub-batches that respect max_batch_tokens.
        chunks, chunk, tokens = [], [], 0
        for i, call, plan in ok:
            n = len(plan.ins)
            if chunk and tokens + n > self.config.max_batch_tokens:
                chunks.append(chunk)
                chunk, tokens = [], 0
            chunk.append((i, call, plan))
            tokens += n
        if chunk:
            chunks.append(chunk)
        for i, chunk in enumerate(chunks):  # the last one's layers are final: send them
            on_layer = self.transfer.on_layer if i == len(chunks) - 1 else None
            self._forward_chunk(chunk, results, on_layer)

    def _forward_chunk(self, ok, results, on_layer=None) -> None:
        dev = self.device
        in_slots = self._cat([plan.ins for _, _, plan in ok])
        in_slots_t = torch.from_numpy(in_slots).to(dev)
        stored_pos = None
        if any(plan.positions is None for _, _, plan in ok):
            stored_pos = take(self.embeds.positions, in_slots_t).cpu().numpy()
        lay = _Layout.of(ok, stored_pos)
        positions = self._cat(lay.positions)
        store_rows_np = self._cat(lay.store_rows)
        store_slots_np = self._cat(lay.store_slots)
        pos_t = torch.from_numpy(positions).to(dev)
        if len(store_slots_np):
            # Slots written by this batch are attendable (and positioned) for every item of
            # it: a forward that extends another forward of the same batch sees its tokens,
            # since each layer writes all new K/V before any item gathers its context.
            slots_t = torch.from_numpy(store_slots_np).to(dev)
            self.kv.attendable.index_fill_(0, slots_t, True)
            rows_t = torch.from_numpy(store_rows_np).to(dev)
            self.kv.positions.index_copy_(0, slots_t, take(pos_t, rows_t))
        meta = build_metadata(
            lay.items,
            store_rows_np,
            store_slots_np,
            lay.rows,
            self.kv.attendable,
            self.kv.positions,
            self.cfg.sliding_window,
            self.cfg.num_kv_heads,
        )
        meta.on_layer = on_layer
        x = take(self.embeds.hidden, in_slots_t)
        lora = plan_adapters(lay.lora_spans, self._adapters, dev)
        with forward_context(meta), use_adapters(lora):
            if lora is None and self.compiled is not None and self.compiled.accepts(meta):
                hidden = self.compiled(x, pos_t, meta)
            else:
                hidden = self.model(x, pos_t)
        oe = self._cat(lay.out_embeds)
        if len(oe):
            oe_t = torch.from_numpy(oe).to(dev)
            rows_t = torch.from_numpy(self._cat(lay.out_rows)).to(dev)
            self.embeds.hidden.index_copy_(0, oe_t, take(hidden, rows_t).to(self.dtype))
            self.embeds.positions.index_copy_(0, oe_t, take(pos_t, rows_t))
        for i, first, targets, top in lay.scored:
            results[i] = self._prompt_logprobs(hidden, first, targets, top)

    def _prompt_logprobs(self, hidden, first: int, targets: np.ndarray, top: int) -> Logprobs:
        """Log-probabilities of ``targets`` at rows ``first ...`` of ``hidden``, in chunks."""
        n = len(targets)
        lp = np.full(n, np.nan, dtype=np.float32)
        ids = np.zeros((n, top), dtype=np.int64)
        lps = np.zeros((n, top), dtype=np.float32)
        for s in range(0, n, _LOGPROB_CHUNK):
            e = min(n, s + _LOGPROB_CHUNK)
            logp = log_softmax(self.model.logits(hidden[first + s : first + e]))
            t = torch.from_numpy(np.maximum(targets[s:e], 0)).to(self.device)
            got = token_logprobs(logp, t).cpu().numpy()
            lp[s:e] = np.where(targets[s:e] >= 0, got, np.nan)
            if top:
                ti, tv = top_logprobs(logp, top)
                ids[s:e], lps[s:e] = ti.cpu().numpy(), tv.cpu().numpy()
        return Logprobs(lp, ids, lps)

    # ------------------------------------------------------------------ output heads

    def _check_processing(self, c: NextDist | Sample) -> None:
        vocab = self.cfg.vocab_size
        if c.mask is not None:
            mask = np.asarray(c.mask)
            want = mask_words(vocab)
            if mask.dtype != np.int32 or mask.shape != (want,):
                raise Invalid(
                    f"mask must be int32 of shape ({want},) (a packed bitmask over {vocab} "
                    f"tokens), got {mask.dtype} {mask.shape}"
                )
            if not mask_allows_any(mask, vocab):
                raise Invalid("mask allows no token")
        bias_ids = self._ids(c.bias_ids, vocab, "bias token id", " (vocab size)")
        values = np.asarray(c.bias_values)
        if values.shape != bias_ids.shape or values.dtype != np.float32:
            raise Invalid(
                f"bias_values must be float32, one per bias id ({len(bias_ids)}), got "
                f"{values.dtype} {values.shape}"
            )
        if np.isnan(values).any() or (values == np.inf).any():
            raise Invalid("bias_values must not be NaN or +inf")
        self._ids(c.penalty_tokens, vocab, "penalty token id", " (vocab size)")
        self._ids(c.penalty_prompt, vocab, "penalty prompt token id", " (vocab size)")
        rep = c.repetition_penalty
        if not (isinstance(rep, int | float) and 0 < rep < float("inf")):
            raise Invalid(f"repetition_penalty must be a finite number > 0, got {rep!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(c, name)
            if not (isinstance(v, int | float) and abs(v) < float("inf")):
                raise Invalid(f"{name} must be a finite number, got {v!r}")

    def _check_output(self, c: NextDist | Sample) -> None:
        self._scalar(c.embed, 0, self.embeds.num, "embed")
        if isinstance(c, NextDist):
            self._scalar(c.k, 1, self.cfg.vocab_size + 1, "k")
        else:
            if not (isinstance(c.temperature, int | float) and 0 <= c.temperature < float("inf")):
                raise Invalid(f"temperature must be a finite number >= 0, got {c.temperature!r}")
            self._scalar(c.top_k, 0, 1 << 31, "top_k")
            if not (isinstance(c.top_p, int | float) and 0 < c.top_p <= 1):
                raise Invalid(f"top_p must be in (0, 1], got {c.top_p!r}")
            if not (isinstance(c.min_p, int | float) and 0 <= c.min_p <= 1):
                raise Invalid(f"min_p must be in [0, 1], got {c.min_p!r}")
            if c.seed is not None:
                self._scalar(c.seed, -(1 << 63), 1 << 63, "seed")
            self._scalar(c.logprobs, -1, MAX_LOGPROBS + 1, "logprobs")
        if needs_processing(c):
            self._check_processing(c)

    def _output(self, run, results) -> None:
        """NextDist and Sample rows: one lm_head, one pass of logit processing, then the
        distributions, the samples and their log-probabilities."""
        ok = self._accept(run, results, self._check_output)
        if not ok:
            return
        calls = [c for _, c, _ in ok]
        dev = self.device
        slots = torch.tensor([c.embed for c in calls], device=dev)
        logits = self.model.logits(take(self.embeds.hidden, slots))
        want_lp = [r for r, c in enumerate(calls) if isinstance(c, Sample) and c.logprobs >= 0]
        logp = log_softmax(logits[want_lp]) if want_lp else None  # raw: before processing
        processor = LogitsProcessor.build(calls, logits.shape[1], dev)
        if processor is not None:
            processor.apply(logits)
        dists = [r for r, c in enumerate(calls) if isinstance(c, NextDist)]
        if dists:
            rows = logits if len(dists) == len(calls) else logits[dists]
            k_max = max(calls[r].k for r in dists)
            ids, probs = top_k_dist(rows, k_max)
            ids, probs = ids.cpu().numpy(), probs.cpu().numpy()
            for j, r in enumerate(dists):
                k = calls[r].k
                results[ok[r][0]] = Dist(ids=ids[j, :k].copy(), probs=probs[j, :k].copy())
        samples = [r for r, c in enumerate(calls) if isinstance(c, Sample)]
        if not samples:
            return
        sc = [calls[r] for r in samples]
        rows = logits if len(samples) == len(calls) else logits[samples]
        if all(c.temperature == 0 for c in sc):
            # all greedy: the argmax, without building the sampling parameters (the seeds
            # are still drawn, so that later unseeded samples see the same random stream)
            for c in sc:
                if c.seed is None:
                    self._draw_seed()
            self._finish_samples(ok, calls, samples, want_lp, logp, rows.argmax(dim=-1), results)
            return
        params = SamplingParams(
            temperature=torch.tensor([float(c.temperature) for c in sc], device=dev),
            top_k=torch.tensor([c.top_k for c in sc], dtype=torch.int64, device=dev),
            top_p=torch.tensor([float(c.top_p) for c in sc], device=dev),
            min_p=torch.tensor([float(c.min_p) for c in sc], device=dev),
            seed=torch.tensor(
                [self._draw_seed() if c.seed is None else c.seed for c in sc],
                dtype=torch.int64,
                device=dev,
            ),
        )
        self._finish_samples(ok, calls, samples, want_lp, logp, sample(rows, params), results)

    def _finish_samples(self, ok, calls, samples, want_lp, logp, tokens_t, results) -> None:
        """The sampled rows' results: the token, or with its log-probabilities when asked."""
        tokens = tokens_t.tolist()
        for r, t in zip(samples, tokens, strict=True):
            results[ok[r][0]] = t
        if logp is None:
            return
        at = {r: j for j, r in enumerate(samples)}
        chosen = token_logprobs(logp, tokens_t[[at[r] for r in want_lp]]).tolist()
        top_ids, top_lps = top_logprobs(logp, max(calls[r].logprobs for r in want_lp))
        top_ids, top_lps = top_ids.cpu().numpy(), top_lps.cpu().numpy()
        for j, r in enumerate(want_lp):
            n = calls[r].logprobs
            results[ok[r][0]] = Sampled(
                tokens[at[r]], chosen[j], top_ids[j, :n].copy(), top_lps[j, :n].copy()
            )

    def _draw_seed(self) -> int:
        return int(self._rng.integers(0, 1 << 62))

    # ------------------------------------------------------------------ KV page operations

    def _check_copy_kv(self, c: CopyKv):
        ps = self.page_size
        src = self._scalar(c.src_page, 0, self.kv.num_pages, "src_page")
        dst = self._scalar(c.dst_page, 0, self.kv.num_pages, "dst_page")
        so = self._scalar(c.src_offset, 0, ps, "src_offset")
        do = self._scalar(c.dst_offset, 0, ps, "dst_offset")
        n = self._scalar(c.length, 0, ps + 1, "length")
        if so + n > ps or do + n > ps:
            raise Invalid(f"copy of {n} tokens from offset {so} to {do} crosses a page end ({ps})")
        return np.arange(src * ps + so, src * ps + so + n), np.arange(
            dst * ps + do, dst * ps + do + n
        )

    def _copy_kv(self, run, results) -> None:
        ok = self._accept(run, results, self._check_copy_kv)
        if not ok:
            return
        src = torch.from_numpy(self._cat([p[0] for _, _, p in ok])).to(self.device)
        dst = torch.from_numpy(self._cat([p[1] for _, _, p in ok])).to(self.device)
        for t in (*self.kv.k, *self.kv.v):
            t[:, dst] = t[:, src]
        for t in (self.kv.attendable, self.kv.positions):
            t[dst] = t[src]

    def _check_mask_kv(self, c: MaskKv):
        page = self._scalar(c.page, 0, self.kv.num_pages, "page")
        masked = np.asarray(c.masked)
        if masked.dtype != np.bool_ or masked.shape != (self.page_size,):
            raise Invalid(
                f"masked must be bool of shape ({self.page_size},), got {masked.dtype} {masked.shape}"
            )
        return page, masked

    def _mask_kv(self, run, results) -> None:
        for _, _, (page, masked) in self._accept(run, results, self._check_mask_kv):
            ps = self.page_size
            self.kv.attendable[page * ps : (page + 1) * ps] = torch.from_numpy(~masked).to(
                self.device
            )

    def _check_swap(self, host_pages, pages):
        pages = self._page_ids(pages, "page")
        host = self._ids(host_pages, self.host.num_pages, "host page", "")
        if len(pages) != len(host):
            raise Invalid(f"{len(pages)} pages but {len(host)} host pages")
        return pages, host

    def _swap_out(self, run, results) -> None:
        ok = self._accept(run, results, lambda c: self._check_swap(c.host_pages, c.pages))
        self._swap(ok, to_host=True)

    def _swap_in(self, run, results) -> None:
        ok = self._accept(run, results, lambda c: self._check_swap(c.host_pages, c.pages))
        self._swap(ok, to_host=False)

    def _swap(self, ok, to_host: bool) -> None:
        """Every page of the run at once: one gather of the pages from all layers' K and V
        (a page-granular ``index_select`` on the pool's backing tensor) into a staging
        buffer, one bulk copy across (none on CPU), one scatter into the destination pool;
        the same for the slots' attendable bits and positions. The staging buffers are
        kept (pinned on CUDA): fresh ones cost a page fault per 4 KiB on every swap."""
        if not ok:
            return
        dev = self.device
        pages = torch.from_numpy(self._cat([p[0] for _, _, p in ok])).to(dev)
        host = torch.from_numpy(self._cat([p[1] for _, _, p in ok]))
        n = len(host)
        kv, hk = self.kv, self.host
        rows, ps = kv.data.shape[0] * kv.data.shape[1], self.page_size
        d_kv = kv.data.view(rows, kv.num_pages, -1)  # [layers x heads, page, page's K or V]
        h_kv = hk.data.view(rows, hk.num_pages, -1)
        d_buf, h_buf = self._swap_buffers(rows, n, d_kv.shape[2])
        small = ((kv.attendable, hk.attendable), (kv.positions, hk.positions))
        if to_host:
            torch.index_select(d_kv, 1, pages, out=d_buf)
            if h_buf is not d_buf:
                h_buf.copy_(d_buf)
            h_kv.index_copy_(1, host, h_buf)
            for d, h in small:
                h.view(-1, ps).index_copy_(0, host, d.view(-1, ps).index_select(0, pages).cpu())
        else:
            torch.index_select(h_kv, 1, host, out=h_buf)
            if h_buf is not d_buf:
                d_buf.copy_(h_buf, non_blocking=True)
            d_kv.index_copy_(1, pages, d_buf)
            for d, h in small:
                d.view(-1, ps).index_copy_(0, pages, h.view(-1, ps).index_select(0, host).to(dev))
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def _swap_buffers(self, rows: int, n: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Contiguous ``[rows, n, width]`` staging views on the device and in host memory
        (the same tensor on CPU), grown as needed and kept."""
        need = rows * n * width
        have = self._swap_staging
        if have is None or have[0].numel() < need:
            dtype = self.kv.data.dtype
            d = torch.empty(need, dtype=dtype, device=self.device)
            h = d if self.device.type == "cpu" else torch.empty(need, dtype=dtype, pin_memory=True)
            have = self._swap_staging = (d, h)
        return tuple(t[:need].view(rows, n, width) for t in have)  # type: ignore[return-value]

    # ------------------------------------------------------------------ KV transfer

    def _send_kv(self, run, results) -> None:
        for i, call in run:
            error = self.transfer.complete(call)
            if error is not None:
                results[i] = CallError(f"SendKv: {error}")

    def close(self) -> None:
        """Stop the transfer thread and remove a shared-memory KV pool file."""
        self.transfer.close()
        self.kv.close()

    def _tensor(self, arrays: list[np.ndarray]) -> torch.Tensor:
        return torch.from_numpy(self._cat(arrays)).to(self.device)

    @staticmethod
    def _cat(arrays: list[np.ndarray]) -> np.ndarray:
        if len(arrays) == 1:
            return np.array(arrays[0], dtype=np.int64)
        if not arrays:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate(arrays).astype(np.int64, copy=False)


def build_model(
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    weights: dict[str, torch.Tensor | Codes],
    quantize: str = "auto",
) -> LlamaModel:
    """Construct the model on ``device`` in ``dtype``, load weights, quantize (see
    ``EngineConfig.quantize``) and prepack for CPU."""
    quantized = any(isinstance(w, Int4Codes | Int8Codes) for w in weights.values())
    if quantize == "none" and quantized:
        weights = {
            k: w.dequantize().to(dtype) if isinstance(w, Int4Codes | Int8Codes) else w
            for k, w in weights.items()
        }
    if device.type != "cpu" and (
        quantize in ("int8", "int4", "int4-hybrid") or (quantized and quantize == "auto")
    ):
        raise ValueError(
            f"quantized weights run on the CPU only (device is {device}); use --quantize none "
            "to expand them"
        )
    if device.type == "cpu" and dtype in (torch.bfloat16, torch.float32):
        # bf16 products of few rows over the packed weights, int4 expanded for many rows,
        # float32 products over panels (engine/native.py; built once, before the weights
        # are packed, which checks them)
        native.load()
    # the weights stream once per decode step: on huge pages, fewer TLB misses (hugepages.py)
    with huge_pages() if device.type == "cpu" else contextlib.nullcontext():
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)  # allocate parameters directly in the target dtype
        try:
            with torch.device(device):
                model = LlamaModel(cfg)
        finally:
            torch.set_default_dtype(previous)
        model.load_hf_state_dict(weights)
        if device.type == "cpu" and dtype == torch.bfloat16:
            model.set_act_dtype(torch.float32)  # bf16 weights and K/V, float32 in between
        if quantize in ("int8", "int4", "int4-hybrid"):
            model.quantize(quantize)
        model.eval()
        model.prepack()
    return model
