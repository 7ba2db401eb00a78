"""The controller: the shared state of the control layer.

One :class:`Controller` per server owns the models (an engine handle, its tokenizer, batch
scheduler and resource manager each) and the shared services (messaging, key-value store,
HTTP). Each inferlet instance talks to it through its own
:class:`~pastry.control.session.Session` (the host side of the inferlet API), made by
:meth:`Controller.session` and released by :meth:`Controller.end_session`.

Every session belongs to a user; the shared services keep one namespace per user, and
``quotas`` (:class:`~pastry.control.quotas.Quotas`) caps what one instance and one user
take (``docs/security.md``). A controller made without ``quotas`` has none.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from pathlib import Path

from pastry.control.kvstore import KvStore, KvStoreConfig
from pastry.control.kvstore_journal import StoreJournal
from pastry.control.mcp import McpHub, McpServer
from pastry.control.messaging import MessageBus
from pastry.control.model import Model
from pastry.control.policies import (
    AdmissionPolicy,
    BatchPolicy,
    CacheAwareSchedule,
    FairShare,
    Fcfs,
    LongestPrefixMatch,
    SchedulePolicy,
)
from pastry.control.prefill import Prefiller
from pastry.control.prefix_cache import PrefixCache
from pastry.control.programs import ProcessTable
from pastry.control.provenance import KvProvenance
from pastry.control.quotas import Quotas, share_of
from pastry.control.resources import KINDS, ResourceManager
from pastry.control.routing import Routing
from pastry.control.scheduler import BatchScheduler
from pastry.control.session import Session
from pastry.control.swap import KvSwapper
from pastry.control.tokenization import Tokenization
from pastry.control.users import LOCAL, Grants
from pastry.wire.calls import EngineInfo
from pastry.wire.handle import EngineHandle
from pastry.wire.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class Controller:
    """Shared state of the control layer. Create inside a running event loop.

    Each engine's model gets a :class:`BatchScheduler` with the ``batching`` policy (default
    :class:`~pastry.control.policies.Adaptive`), at most ``max_batch`` forward calls per
    batch (None: no cap) and its own schedule policy, made by calling ``schedule`` (default
    :class:`~pastry.control.policies.Fcfs`), composed with the admission order of waiting
    prefills made by ``admission`` (default
    :class:`~pastry.control.policies.LongestPrefixMatch`). Every instance is a program in
    ``programs``, the process table all schedulers share. An engine with swap space (the
    ``kv_swap`` trait and host pages) gets a :class:`KvSwapper`: page shortage preempts
    programs with their KV kept in host memory before anyone is terminated.
    ``prefix_cache`` keeps an automatic prefix cache (RadixAttention,
    :mod:`pastry.control.prefix_cache`) per engine. ``mcp_servers`` are the MCP servers
    inferlets may use (:mod:`pastry.control.mcp`). ``store_dir``: where the key-value store
    is kept (:mod:`pastry.control.kvstore_journal`; None: in memory only).
    """

    def __init__(
        self,
        engines: Sequence[EngineHandle],
        batching: BatchPolicy | None = None,
        http_allow: Sequence[str] = (),
        schedule: Callable[[], SchedulePolicy] = Fcfs,
        max_batch: int | None = None,
        quotas: Quotas | None = None,
        grants: Grants | None = None,
        several_users: bool = False,
        prefix_cache: bool = True,
        admission: Callable[[], AdmissionPolicy] = LongestPrefixMatch,
        mcp_servers: Sequence[McpServer] = (),
        store_dir: Path | None = None,
    ) -> None:
        self.models: dict[str, Model] = {}  # each model's first engine
        self.engines: dict[str, list[Model]] = {}  # every engine of each model, by rank
        self.sessions: dict[int, Session] = {}
        self.programs = ProcessTable()
        self.quotas = quotas or Quotas.none()
        self.grants = grants or Grants()
        # a per-user share of memory only makes sense with several users
        self._user_share = self.quotas.user_share if several_users else None
        self.bus = MessageBus()
        self.store = KvStore(
            KvStoreConfig(
                max_user_bytes=self.quotas.store_bytes_per_user,
                user_limit_source="--max-store-bytes-per-user",
            ),
            None if store_dir is None else StoreJournal(store_dir),
        )
        self.http_allow = list(http_allow)
        self._http = None
        self.mcp = McpHub(mcp_servers, check_url=lambda url: self.http.check(url))
        self.on_terminate: Callable[[int, str], None] = lambda instance, reason: None
        for eng in engines:
            self._add_engine(eng, batching, schedule, admission, max_batch, prefix_cache)
        self.routing = Routing(self.engines, self.programs)

    def _add_engine(
        self,
        eng: EngineHandle,
        batching: BatchPolicy | None,
        schedule: Callable[[], SchedulePolicy],
        admission: Callable[[], AdmissionPolicy],
        max_batch: int | None,
        prefix_cache: bool,
    ) -> None:
        """One engine's model: its scheduler, resources, prefix cache and prefiller."""
        info = eng.info
        replicas = self.engines.setdefault(info.model_name, [])
        rank = len(replicas)
        if replicas:
            check_replica(replicas[0].info, info)
        sched = BatchScheduler(
            eng.execute, info.max_batch_tokens, info.page_size, batching,
            CacheAwareSchedule(schedule(), admission()), programs=self.programs,
            engine=info.model_name if not rank else f"{info.model_name}/{rank}",
            max_batch=max_batch,
        )  # fmt: skip
        cache = provenance = None
        if prefix_cache:  # one per engine: its pages are its own
            cache = PrefixCache(info.page_size)
            provenance = KvProvenance(
                info.page_size, info.num_pages, info.num_embeds, info.vocab_size,
                info.max_position, info.max_batch_tokens,
            )  # fmt: skip
        # Handles of different engines never collide (a page handle names its engine).
        res = ResourceManager(
            info.num_pages, info.num_embeds, policy=FairShare(), on_terminate=self._evict,
            num_host_pages=info.num_host_pages if "kv_swap" in info.traits else 0,
            first_handle=rank << 24, cache=cache, provenance=provenance,
        )  # fmt: skip
        swapper = KvSwapper(res, sched) if res.host_usage()[2] else None
        prefiller = Prefiller(res, sched, info.page_size, cache, provenance)
        if prefix_cache:
            sched.on_dispatch = prefiller.on_dispatch
            sched.on_complete = prefiller.on_complete
        tok = (
            replicas[0].tokenizer
            if replicas
            else Tokenizer.from_json(info.tokenizer_json, info.chat_template, info.special_tokens)
        )
        # Adapters are loaded on the engine before serving and listed in its info.
        adapters = {name: i for i, name in enumerate(info.adapters) if name}
        tokens = (  # one tokenizer cache per model
            replicas[0].tokens if replicas else Tokenization(tok, self.quotas.tokenize_bytes)
        )
        model = Model(
            info.model_name, eng, tok, sched, res, adapters, swapper=swapper, rank=rank,
            tokens=tokens, prefiller=prefiller,
        )  # fmt: skip
        replicas.append(model)
        self.models.setdefault(info.model_name, model)
        sched.start()

    @property
    def default_model(self) -> str:
        return next(iter(self.models))

    def session(self, instance: int, args: Sequence[str] = (), user: str = LOCAL) -> Session:
        """A new session of ``user``, registered with every model's resource manager under
        the quotas (an instance's share of each pool; its user's, when set)."""
        s = Session(self, instance, list(args), user=user)
        self.sessions[instance] = s
        self.programs.start(instance, user=user)
        q = self.quotas
        for m in self.all_engines():
            res = m.resources
            res.add_instance(instance, user)
            for kind in KINDS:
                size = res.usage(kind)[2]
                cap = share_of(q.instance_share, size)
                if cap is not None:
                    res.set_limit(instance, kind, cap, f"--instance-share {q.instance_share:g}")
                cap = share_of(self._user_share, size)
                if cap is not None and res.user_limit(user, kind) is None:
                    res.set_user_limit(user, kind, cap, f"--user-share {self._user_share:g}")
        return s

    def end_session(self, instance: int) -> None:
        """Release everything an instance holds, however it ended. Idempotent."""
        s = self.sessions.pop(instance, None)
        if s is not None:
            s.close()
        self.routing.end_instance(instance)
        for m in self.all_engines():
            m.resources.remove_instance(instance)
            m.scheduler.wake()  # prefills may wait for the pages it held
        self.programs.end(instance)
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

    def all_engines(self) -> list[Model]:
        """Every engine of every model."""
        return [m for replicas in self.engines.values() for m in replicas]

    async def load_adapter(self, model: str, name: str, path: str) -> None:
        """Load the PEFT LoRA directory ``path`` as adapter ``name`` on every engine of
        ``model`` (between batches) and name it for inferlets (``forward_with_adapter``).
        ``ValueError`` / ``EngineError`` say why it cannot be loaded."""
        if any(name in m.adapters for m in self.engines[model]):
            raise ValueError(f"an adapter named '{name}' is already loaded on {model}")
        done = []
        try:
            for m in self.engines[model]:
                self._adapters_of(m, await m.engine.load_adapter(name, path))
                done.append(m)
        except BaseException:
            for m in done:  # all engines or none
                self._adapters_of(m, await m.engine.unload_adapter(name))
            raise

    async def unload_adapter(self, model: str, name: str) -> None:
        """Unload adapter ``name`` from every engine of ``model``; requests still using it
        fail. ``KeyError`` if it is not loaded."""
        if name not in self.models[model].adapters:
            raise KeyError(name)
        for m in self.engines[model]:
            m.adapters.pop(name, None)  # no new forward names it from now on
            self._adapters_of(m, await m.engine.unload_adapter(name))

    @staticmethod
    def _adapters_of(m: Model, info: EngineInfo) -> None:
        m.adapters = {n: i for i, n in enumerate(info.adapters) if n}

    async def close(self) -> None:
        for instance in list(self.sessions):
            self.end_session(instance)
        for m in self.all_engines():
            await m.scheduler.stop()
        await self.mcp.close()
        await asyncio.to_thread(self.store.close)  # the store's last changes to the disk


def check_replica(first: EngineInfo, other: EngineInfo) -> None:
    """Engines of one model must agree on what inferlets see (tokens, pages, layers)."""
    keys = ("arch", "vocab_size", "hidden_size", "num_layers", "dtype", "page_size",
            "tokenizer_json", "eos_token_ids", "adapters")  # fmt: skip
    differ = [k for k in keys if getattr(first, k) != getattr(other, k)]
    if differ:
        raise ValueError(
            f"two engines serve '{first.model_name}' differently ({', '.join(differ)}): the "
            "engines of one model must load the same checkpoint with the same options"
        )
