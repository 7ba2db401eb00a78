"""The engine: a model, its memory pools, and one batched handler per call type.

``Engine.execute(batch)`` validates each call (a bad call becomes a :class:`CallError`
result and has no effect), then runs each run of consecutive same-type calls as one batched
operation, in batch order. It is synchronous and single-threaded; ``wire/handle.py`` runs
it on a worker thread, ``engine/serve.py`` serves it over ZeroMQ.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from pastry.engine import native
from pastry.engine.attention import ItemPlan, build_metadata, forward_context, take
from pastry.engine.build import build_model
from pastry.engine.checks import CallChecker, accept, decode_apart
from pastry.engine.compiled import CompiledDecode
from pastry.engine.dtypes import resolve_dtype
from pastry.engine.heads import OutputHeads
from pastry.engine.lora import Adapter, plan_adapters, use_adapters
from pastry.engine.model import LlamaModel
from pastry.engine.page_ops import PageOps, cat_ids
from pastry.engine.pool import EmbedPool, HostPool, KvPool, PoolSizes
from pastry.engine.quant import kept_codes
from pastry.engine.transfer import KvSender, host_id
from pastry.wire.calls import (
    Call,
    CallError,
    CopyKv,
    EmbedImg,
    EmbedTxt,
    EngineInfo,
    Forward,
    MaskKv,
    NextDist,
    Result,
    Sample,
    SendKv,
    SwapIn,
    SwapOut,
)
from pastry.wire.config import EngineConfig
from pastry.wire.images import ImageError, decode_image

if TYPE_CHECKING:
    from pastry.engine.vision.llava import ImageEncoder  # or an Idefics3Encoder

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

# The largest encoded image an EmbedImg may carry (the control layer's quota is lower).
MAX_IMAGE_BYTES = 64 << 20

# Call types that run in one handler invocation when adjacent in a batch: NextDist and
# Sample rows share one lm_head.
_HANDLER_GROUP: dict[type, type] = {NextDist: Sample}


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


class Engine:
    """One model with its KV, embedding and host pools, executing batches of calls
    (:meth:`execute`); ``check`` is its boundary (:mod:`pastry.engine.checks`)."""

    def __init__(
        self,
        model: LlamaModel,
        config: EngineConfig,
        *,
        name: str = "",
        tokenizer_json: str = "",
        chat_template: str | None = None,
        special_tokens: dict[str, str] | None = None,
        encoder: ImageEncoder | None = None,
    ) -> None:
        self.model = model
        self.encoder = encoder
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
        self.heads = OutputHeads(model, self.device, config.seed)
        self._adapters: list[Adapter | None] = []  # by id; None: unloaded (ids stay)
        self.pages = PageOps(self.kv, self.host, self.device)
        self.check = CallChecker(
            self.cfg,
            page_size=config.page_size,
            num_pages=sizes.num_pages,
            num_host_pages=sizes.num_host_pages,
            num_embeds=sizes.num_embeds,
            max_batch_tokens=config.max_batch_tokens,
            adapters=self._adapters,
            image_layout=encoder.layout if encoder else None,
            max_image_bytes=MAX_IMAGE_BYTES,
        )
        self.info = self._describe(sizes, name, tokenizer_json, chat_template, special_tokens)
        self._handlers: dict[type, Callable[[list[tuple[int, Call]], list[Result]], None]] = {
            EmbedTxt: self._embed_txt,
            EmbedImg: self._embed_img,
            Forward: self._forward,
            Sample: self._output,  # and NextDist (_HANDLER_GROUP)
            CopyKv: self._copy_kv,
            MaskKv: self._mask_kv,
            SwapOut: self._swap_out,
            SwapIn: self._swap_in,
            SendKv: self._send_kv,
        }

    def _describe(
        self,
        sizes: PoolSizes,
        name: str,
        tokenizer_json: str,
        chat_template: str | None,
        special_tokens: dict[str, str] | None,
    ) -> EngineInfo:
        """What the engine tells its controllers about itself (``EngineInfo``)."""
        return EngineInfo(
            model_name=name or self.cfg.name,
            arch=self.cfg.arch,
            vocab_size=self.cfg.vocab_size,
            hidden_size=self.cfg.hidden_size,
            num_layers=self.cfg.num_layers,
            max_position=self.cfg.max_position,
            dtype=str(self.dtype).removeprefix("torch."),
            device=str(self.device),
            page_size=self.config.page_size,
            num_pages=sizes.num_pages,
            num_embeds=sizes.num_embeds,
            num_host_pages=sizes.num_host_pages,
            max_batch_tokens=self.config.max_batch_tokens,
            traits=TRAITS + (("input_image",) if self.encoder else ()),
            bos_token_id=self.cfg.bos_token_id,
            eos_token_ids=tuple(self.cfg.eos_token_ids),
            tokenizer_json=tokenizer_json,
            chat_template=chat_template,
            special_tokens=dict(special_tokens or {}),
            kv_peers=(f"shm:{self.config.kv_shm}",) if self.config.kv_shm else (),
            host=host_id(),
            image_layout=self.encoder.layout if self.encoder else None,
        )

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
        tok, encoder = ckpt.tokenizer, None
        if ckpt.vision is not None:
            from pastry.engine.vision.encoders import load_encoder

            encoder = load_encoder(ckpt.path, ckpt.vision, dtype, device, tok)
        engine = cls(
            model,
            config,
            name=ckpt.name,
            tokenizer_json=tok.to_json(),
            chat_template=tok.chat_template,
            special_tokens=tok.special_tokens,
            encoder=encoder,
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

    # ------------------------------------------------------------------ embed_txt

    def _embed_txt(self, run, results) -> None:
        ok = accept(run, results, self.check.embed_txt)
        if not ok:
            return
        tokens = self._tensor([c.tokens for _, c, _ in ok])
        slots = self._tensor([c.out_embeds for _, c, _ in ok])
        self.embeds.hidden.index_copy_(0, slots, self.model.embed(tokens))
        self.embeds.positions.index_copy_(0, slots, self._tensor([c.positions for _, c, _ in ok]))

    # ------------------------------------------------------------------ embed_img

    def _embed_img(self, run, results) -> None:
        """Every image of the run through the encoder at once; an image that does not
        decode, or whose span is not its call's slots, fails its call alone."""
        ok = accept(run, results, self.check.embed_img)
        decoded, calls = [], []
        for i, c, _ in ok:
            try:
                decoded.append(decode_image(np.asarray(c.image).tobytes()))
                calls.append((i, c))
            except ImageError as e:
                results[i] = CallError(f"EmbedImg: {e}")
        if not calls:
            return
        spans = self.encoder.spans(decoded, self.model.embed)
        kept = []
        for (i, c), span in zip(calls, spans, strict=True):
            if len(span) == len(c.out_embeds):
                kept.append((c, span))
            else:
                results[i] = CallError(
                    f"EmbedImg: the image takes {len(span)} embeds on this model, got "
                    f"{len(c.out_embeds)}"
                )
        if not kept:
            return
        slots = self._tensor([c.out_embeds for c, _ in kept])
        rows = torch.cat([span for _, span in kept]).to(self.dtype)
        self.embeds.hidden.index_copy_(0, slots, rows)
        self.embeds.positions.index_copy_(0, slots, self._tensor([c.positions for c, _ in kept]))

    # ------------------------------------------------------------------ forward

    def _forward(self, run, results) -> None:
        ok = accept(run, results, self.check.forward)
        # one prefill among decode steps would send them all through the eager model
        compiling = self.compiled is not None and self.compiled.ready
        longer, decode = decode_apart(ok) if compiling else (ok, [])
        # Split into sub-batches that respect max_batch_tokens; the decode items last.
        chunks, chunk, tokens = [], [], 0
        for i, call, plan in longer:
            n = len(plan.ins)
            if chunk and tokens + n > self.config.max_batch_tokens:
                chunks.append(chunk)
                chunk, tokens = [], 0
            chunk.append((i, call, plan))
            tokens += n
        if chunk:
            chunks.append(chunk)
        if decode:
            chunks.append(decode)
        for i, chunk in enumerate(chunks):  # the last one's layers are final: send them
            on_layer = self.transfer.on_layer if i == len(chunks) - 1 else None
            self._forward_chunk(chunk, results, on_layer)

    def _forward_chunk(self, ok, results, on_layer=None) -> None:
        dev = self.device
        in_slots = cat_ids([plan.ins for _, _, plan in ok])
        in_slots_t = torch.from_numpy(in_slots).to(dev)
        stored_pos = None
        if any(plan.positions is None for _, _, plan in ok):
            stored_pos = take(self.embeds.positions, in_slots_t).cpu().numpy()
        lay = _Layout.of(ok, stored_pos)
        positions = cat_ids(lay.positions)
        store_rows_np = cat_ids(lay.store_rows)
        store_slots_np = cat_ids(lay.store_slots)
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
        oe = cat_ids(lay.out_embeds)
        if len(oe):
            oe_t = torch.from_numpy(oe).to(dev)
            rows_t = torch.from_numpy(cat_ids(lay.out_rows)).to(dev)
            self.embeds.hidden.index_copy_(0, oe_t, take(hidden, rows_t).to(self.dtype))
            self.embeds.positions.index_copy_(0, oe_t, take(pos_t, rows_t))
        for i, first, targets, top in lay.scored:
            results[i] = self.heads.prompt_logprobs(hidden, first, targets, top)

    # ------------------------------------------------------------------ output heads

    def _output(self, run, results) -> None:
        """NextDist and Sample rows (:meth:`OutputHeads.outputs`)."""
        ok = accept(run, results, self.check.output)
        if not ok:
            return
        slots = torch.tensor([c.embed for _, c, _ in ok], device=self.device)
        hidden = take(self.embeds.hidden, slots)
        outs = self.heads.outputs([c for _, c, _ in ok], hidden)
        for (i, _, _), out in zip(ok, outs, strict=True):
            results[i] = out

    # ------------------------------------------------------------------ KV page operations

    def _copy_kv(self, run, results) -> None:
        ok = accept(run, results, self.check.copy_kv)
        if ok:
            self.pages.copy([src for _, _, (src, _) in ok], [dst for _, _, (_, dst) in ok])

    def _mask_kv(self, run, results) -> None:
        for _, _, (page, masked) in accept(run, results, self.check.mask_kv):
            self.pages.mask(page, masked)

    def _swap_out(self, run, results) -> None:
        if ok := accept(run, results, self.check.swap):
            self.pages.swap([p for _, _, (p, _) in ok], [h for _, _, (_, h) in ok], to_host=True)

    def _swap_in(self, run, results) -> None:
        if ok := accept(run, results, self.check.swap):
            self.pages.swap([p for _, _, (p, _) in ok], [h for _, _, (_, h) in ok], to_host=False)

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
        return torch.from_numpy(cat_ids(arrays)).to(self.device)
