"""Small drivers over the raw engine API, shared by the engine tests and benchmarks."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from pastry.engine.engine import Engine
from pastry.wire.calls import Dist, EmbedTxt, Forward, NextDist, Sample, ids
from pastry.wire.config import EngineConfig

# Pools big enough for the engine tests' sequences, small enough to start fast.
SMALL_POOLS = dict(num_pages=256, num_embeds=2048, num_host_pages=16, page_size=4)


def load(path, dtype: str = "float32", **kw) -> Engine:
    """An engine on checkpoint ``path`` with :data:`SMALL_POOLS` (``kw`` overrides)."""
    return Engine.load(path, EngineConfig(dtype=dtype, **{**SMALL_POOLS, **kw}))


class Pages:
    """Hands out distinct page and embed ids, like the control layer would."""

    def __init__(self, engine: Engine, first_page: int = 0, first_embed: int = 0) -> None:
        self.engine = engine
        self.next_page = first_page
        self.next_embed = first_embed

    def pages(self, n: int) -> np.ndarray:
        out = ids(range(self.next_page, self.next_page + n))
        self.next_page += n
        assert self.next_page <= self.engine.info.num_pages
        return out

    def embeds(self, n: int) -> np.ndarray:
        out = ids(range(self.next_embed, self.next_embed + n))
        self.next_embed += n
        assert self.next_embed <= self.engine.info.num_embeds
        return out


@dataclass
class Seq:
    """A token sequence whose KV lives in engine pages (append-only)."""

    alloc: Pages
    pages: list[int] = field(default_factory=list)
    length: int = 0

    @property
    def page_size(self) -> int:
        return self.alloc.engine.page_size

    def last_len(self) -> int:
        return self.length - (len(self.pages) - 1) * self.page_size if self.pages else 0

    def forward_calls(
        self, tokens, positions=None, mask=None, store: bool = True
    ) -> tuple[list, int]:
        """Calls that append ``tokens``; returns (calls, embed slot of the last hidden state)."""
        n = len(tokens)
        pos = ids(range(self.length, self.length + n)) if positions is None else ids(positions)
        emb = self.alloc.embeds(n)
        out = self.alloc.embeds(1)
        ps = self.page_size
        offset = self.length % ps
        new_pages: list[int] = []
        out_pages: list[int] = []
        room = 0
        if store:
            room = (ps - offset) % ps if self.pages else 0
            need = max(0, -(-(n - room) // ps))
            new_pages = list(self.alloc.pages(need))
            out_pages = ([self.pages[-1]] if room else []) + new_pages
        fwd = Forward(
            in_embeds=emb,
            ctx_pages=ids(self.pages),
            ctx_last_len=self.last_len(),
            out_pages=ids(out_pages),
            out_offset=offset if room else 0,
            out_embeds=out,
            out_indices=ids([n - 1]),
            positions=pos,
            mask=mask,
        )
        if store:
            self.pages += new_pages
            self.length += n
        return [EmbedTxt(ids(tokens), pos, emb), fwd], int(out[0])

    def step(self, tokens, **kw) -> np.ndarray:
        """Append tokens and return the full next-token distribution of the last one."""
        calls, out = self.forward_calls(tokens, **kw)
        res = self.alloc.engine.execute(
            [*calls, NextDist(out, k=self.alloc.engine.info.vocab_size)]
        )
        assert res[:-1] == [None, None], res
        return dense(res[-1], self.alloc.engine.info.vocab_size)

    def greedy(self, prompt, n: int) -> list[int]:
        """Prefill ``prompt`` and decode ``n`` tokens greedily with on-device sampling."""
        eng = self.alloc.engine
        calls, out = self.forward_calls(prompt)
        toks = []
        for _ in range(n):
            res = eng.execute([*calls, Sample(out)])
            assert res[:-1] == [None, None], res
            toks.append(res[-1])
            calls, out = self.forward_calls([toks[-1]])
        return toks


def dense(d: Dist, vocab: int) -> np.ndarray:
    p = np.zeros(vocab, dtype=np.float64)
    p[d.ids] = d.probs
    return p


def every_output(alloc: Pages, tokens) -> tuple[list, np.ndarray]:
    """Calls that prefill ``tokens`` into a new sequence with every position's output in an
    embed slot of its own: (the calls, those slots)."""
    calls, _ = Seq(alloc).forward_calls(tokens)
    outs = alloc.embeds(len(tokens))
    fwd = calls[1]
    calls[1] = Forward(
        in_embeds=fwd.in_embeds,
        out_pages=fwd.out_pages,
        out_embeds=outs,
        out_indices=ids(range(len(tokens))),
        positions=fwd.positions,
    )
    return calls, outs


def all_probs(eng: Engine, tokens) -> np.ndarray:
    """The engine's next-token distribution after every prefix of ``tokens``."""
    calls, outs = every_output(Pages(eng), tokens)
    v = eng.info.vocab_size
    res = eng.execute([*calls, *[NextDist(int(o), k=v) for o in outs]])
    return np.stack([dense(d, v) for d in res[2:]])


def hf_from_gguf(f, **kw):
    """transformers' GGUF loader on file ``f`` (float32, eval mode)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        f.parent, gguf_file=f.name, dtype=torch.float32, **kw
    ).eval()


def hf_model(path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def hf_checkpoint(src, path, config_cls, model_cls, **overrides):
    """A random-weight checkpoint written by transformers itself in ``path``: the tiny llama
    ``src``'s shapes (hidden 64, 2 layers, 4 heads, 2 KV heads), vocabulary and tokenizer,
    with ``overrides`` applied to the ``config_cls`` arguments."""
    import json
    import shutil
    from pathlib import Path

    src, path = Path(src), Path(path)
    cfg = config_cls(
        **{
            "vocab_size": json.loads((src / "config.json").read_text())["vocab_size"],
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 512,
            **overrides,
        }
    )
    torch.manual_seed(0)
    model_cls(cfg).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, path / name)
    return path
