"""One served model as the control layer holds it: :class:`Model`.

An engine of a model (several engines of one model are its ranks: data parallel, P/D,
migration) with what the control layer keeps for it: its tokenizer, batch scheduler,
resource manager, KV swapper, prefill path and LoRA adapters. The
:class:`~pastry.control.controller.Controller` makes them; request handlers and routing
read them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pastry.control.prefill import Prefiller
from pastry.control.resources import ResourceManager
from pastry.control.scheduler import BatchScheduler
from pastry.control.swap import KvSwapper
from pastry.control.tokenization import Tokenization
from pastry.wire.calls import EngineInfo
from pastry.wire.handle import EngineHandle
from pastry.wire.tokenizer import Tokenizer


@dataclass
class Model:
    """One served model: its engine, tokenizer, scheduler and memory bookkeeping."""

    name: str
    engine: EngineHandle
    tokenizer: Tokenizer
    scheduler: BatchScheduler
    resources: ResourceManager

    adapters: dict[str, int] = field(default_factory=dict)  # LoRA adapter name -> engine id
    swapper: KvSwapper | None = None  # when the engine has swap space
    rank: int = 0  # which of the model's engines (several: data parallel, P/D, migration)
    tokens: Tokenization | None = None  # tokenizing off the event loop; set by the controller
    prefiller: Prefiller | None = None  # the cache-aware prefill path (prefix cache or not)

    def __post_init__(self) -> None:
        if self.tokens is None:
            self.tokens = Tokenization(self.tokenizer)

    @property
    def info(self) -> EngineInfo:
        """The engine's current report, read through its handle: after a supervised
        engine came back (restarted, or placed on another host) it names the new one's
        K/V endpoints and host, which P/D and migration send to."""
        return self.engine.info

    @property
    def traits(self) -> list[str]:
        return list(self.info.traits)
