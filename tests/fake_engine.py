"""A model-free engine with the shape of ``pastry.engine.engine.Engine``, for process tests.

The engine server loads it with ``--engine-factory fake_engine:make`` (``tests/`` on
``PYTHONPATH``). Its answers are pure functions of the calls, so a test can check that each
result reached the right caller:

- ``Sample(embed=e, seed=s)`` -> ``1000 * e + (s or 0)``; a negative temperature is rejected
  with a ``CallError``;
- ``NextDist(embed=e, k=k)`` -> ``Dist(ids=[e, e+1, ..][:k], probs=...)``; ``k == 0`` raises
  inside ``execute`` (an engine bug: the whole batch fails);
- ``CopyKv(src_page=-1, dst_page=ms)`` sleeps ``ms`` milliseconds (a slow batch);
- every other call -> ``None``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from pastry.wire.calls import CallError, CopyKv, Dist, EngineInfo, NextDist, Result, Sample
from pastry.wire.config import EngineConfig


class FakeEngine:
    def __init__(self, model_dir: str | Path, config: EngineConfig) -> None:
        self.config = config
        self.batches = 0
        self.info = EngineInfo(
            model_name=Path(model_dir).name,
            arch="fake",
            vocab_size=1000,
            hidden_size=8,
            num_layers=1,
            max_position=4096,
            dtype=config.dtype,
            device=config.device,
            page_size=config.page_size,
            num_pages=config.num_pages or 64,
            num_embeds=config.num_embeds or 32,
            num_host_pages=config.num_host_pages,
            max_batch_tokens=config.max_batch_tokens,
            traits=("fake", "sample"),
            bos_token_id=1,
            eos_token_ids=(2, 3),
            tokenizer_json='{"model": {}}',
            chat_template=None,
            special_tokens={"bos": "<s>"},
        )

    def execute(self, batch: Sequence) -> list[Result]:
        self.batches += 1
        return [self._one(c) for c in batch]

    def _one(self, call) -> Result:
        if isinstance(call, Sample):
            if call.temperature < 0:
                return CallError(f"temperature must be >= 0, got {call.temperature}")
            return 1000 * call.embed + (call.seed or 0)
        if isinstance(call, NextDist):
            if call.k == 0:
                raise RuntimeError("fake engine bug")
            ids = np.arange(call.embed, call.embed + call.k, dtype=np.int64)
            probs = np.full(call.k, 1.0 / call.k, dtype=np.float32)
            return Dist(ids=ids, probs=probs)
        if isinstance(call, CopyKv) and call.src_page == -1:
            time.sleep(call.dst_page / 1000)
        return None


def make(model_dir: str, config: EngineConfig) -> FakeEngine:
    return FakeEngine(model_dir, config)


def make_broken(model_dir: str, config: EngineConfig) -> FakeEngine:
    raise RuntimeError(f"cannot load {model_dir}: checkpoint is broken")
