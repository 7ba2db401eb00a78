"""The controller: the shared state of the control layer.

One :class:`Controller` per server owns the models (an engine handle, its tokenizer, batch
scheduler and resource manager each) and the shared services (messaging, key-value store,
HTTP). Each inferlet instance talks to it through its own
:class:`~pastry.control.session.Session` (the host side of the inferlet API), made by
:meth:`Controller.session` and released by :meth:`Controller.end_session`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pastry.control.kvstore import KvStore
from pastry.control.messaging import MessageBus
from pastry.control.policies import BatchPolicy, Fcfs, SchedulePolicy
from pastry.control.resources import ResourceManager
from pastry.control.scheduler import BatchScheduler
from pastry.control.session import Session
from pastry.engine.calls import EngineInfo
from pastry.engine.handle import EngineHandle
from pastry.engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass
class Model:
    """One served model: its engine, tokenizer, scheduler and memory bookkeeping."""

    name: str
    engine: EngineHandle
    info: EngineInfo
    tokenizer: Tokenizer
    scheduler: BatchScheduler
    resources: ResourceManager

    adapters: dict[str, int] = field(default_factory=dict)  # LoRA adapter name -> engine id

    @property
    def traits(self) -> list[str]:
        return list(self.info.traits)


class Controller:
    """Shared state of the control layer. Create inside a running event loop.

    Each engine's model gets a :class:`BatchScheduler` with the ``batching`` policy (default
    :class:`~pastry.control.policies.Adaptive`) and its own schedule policy, made by calling
    ``schedule`` (default :class:`~pastry.control.policies.Fcfs`).
    """

    def __init__(
        self,
        engines: Sequence[EngineHandle],
        batching: BatchPolicy | None = None,
        http_allow: Sequence[str] = (),
        schedule: Callable[[], SchedulePolicy] = Fcfs,
    ) -> None:
        self.models: dict[str, Model] = {}
        self.sessions: dict[int, Session] = {}
        self.bus = MessageBus()
        self.store = KvStore()
        self.http_allow = list(http_allow)
        self._http = None
        self.on_terminate: Callable[[int, str], None] = lambda instance, reason: None
        for eng in engines:
            info = eng.info
            sched = BatchScheduler(
                eng.execute, info.max_batch_tokens, info.page_size, batching, schedule()
            )
            res = ResourceManager(info.num_pages, info.num_embeds, on_terminate=self._evict)
            tok = Tokenizer.from_json(info.tokenizer_json, info.chat_template, info.special_tokens)
            # Adapters are loaded on the engine before serving and listed in its info.
            adapters = {name: i for i, name in enumerate(info.adapters)}
            self.models[info.model_name] = Model(
                info.model_name, eng, info, tok, sched, res, adapters
            )
            sched.start()

    @property
    def default_model(self) -> str:
        return next(iter(self.models))

    def session(self, instance: int, args: Sequence[str] = ()) -> Session:
        s = Session(self, instance, list(args))
        self.sessions[instance] = s
        for m in self.models.values():
            m.resources.add_instance(instance)
        return s

    def end_session(self, instance: int) -> None:
        """Release everything an instance holds, however it ended. Idempotent."""
        s = self.sessions.pop(instance, None)
        if s is not None:
            s.close()
        for m in self.models.values():
            m.resources.remove_instance(instance)
        self.bus.unsubscribe_all(str(instance))

    def _evict(self, instance: int, reason: str) -> None:
        """Resource policy callback: end ``instance`` now so its memory can be reused."""
        self.on_terminate(instance, reason)
        self.end_session(instance)

    @property
    def http(self):
        if self._http is None:
            from pastry.control.http import HttpClient

            self._http = HttpClient(self.http_allow)
        return self._http

    async def close(self) -> None:
        for instance in list(self.sessions):
            self.end_session(instance)
        for m in self.models.values():
            await m.scheduler.stop()
