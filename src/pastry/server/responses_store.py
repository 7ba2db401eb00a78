"""Each user's stored Responses (``store``, the default): a response's body, its input
items, its conversation and the persistent KV export of that conversation
(``responses/<id>``), which a follow-up naming it as ``previous_response_id`` imports
(:mod:`pastry.server.responses`). With a directory, each is also kept on disk
(:mod:`pastry.server.responses_disk`) and the store starts with what it holds.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from pastry.control.resources import ExportError
from pastry.server.openai_params import History
from pastry.server.responses_disk import ResponseFiles
from pastry.server.service import PastryServer


@dataclass
class Stored:
    """A stored response: its body, its input items, the conversation up to and with its
    answer (chat messages, without the instructions, which a follow-up does not inherit),
    and the tokens and KV export of that conversation."""

    body: dict
    input_items: list[dict]
    conversation: list[dict]
    history: History | None
    model: str
    served: str = ""  # the model name it was asked for (a LoRA adapter's, or the model's)


@dataclass
class ResponseStore:
    """Each user's stored responses, least recently stored first; over ``limit`` per user
    the oldest goes (with its KV export). ``files``: where they are kept on disk (None:
    in memory only); the store starts with what they hold, within ``limit``."""

    server: PastryServer
    limit: int | None
    files: ResponseFiles | None = None
    users: dict[str, OrderedDict[str, Stored]] = field(default_factory=dict)
    seq: int = 0  # stored responses so far (their order on disk)

    def __post_init__(self) -> None:
        if self.files is None:
            return
        for p in self.files.load():
            self.seq = max(self.seq, p["seq"])
            h = p["history"]
            # the KV export was the engine's and did not survive: a follow-up recomputes it
            history = None if h is None else History(h["tokens"], h["text"])
            stored = Stored(p["body"], p["input_items"], p["conversation"], history, p["model"], p["served"])  # fmt: skip
            self.users.setdefault(p["user"], OrderedDict())[p["id"]] = stored
        for user, mine in self.users.items():  # a lower limit than when they were stored
            while self.limit is not None and len(mine) > self.limit:
                rid, _ = mine.popitem(last=False)
                self.files.discard(user, rid)

    def get(self, user: str, rid: str) -> Stored | None:
        return self.users.get(user, {}).get(rid)

    async def put(self, user: str, rid: str, stored: Stored) -> None:
        """Store ``stored`` (returns once it is on the disk, with a directory)."""
        mine = self.users.setdefault(user, OrderedDict())
        mine[rid] = stored
        self.seq += 1
        evicted = []
        while self.limit is not None and len(mine) > self.limit:
            old, dropped = mine.popitem(last=False)
            self._forget(user, dropped)
            evicted.append(old)
        if self.files is not None:
            if rid in mine:  # not evicted at once (a limit of 0)
                await self.files.write(_payload(user, rid, self.seq, stored))
            for old in evicted:
                await self.files.remove(user, old)

    async def delete(self, user: str, rid: str) -> bool:
        stored = self.users.get(user, {}).pop(rid, None)
        if stored is None:
            return False
        self._forget(user, stored)
        if self.files is not None:
            await self.files.remove(user, rid)
        return True

    def _forget(self, user: str, stored: Stored) -> None:
        if stored.history is not None and stored.history.export is not None:
            drop_export(self.server, stored.model, user, stored.history.export)


def _payload(user: str, rid: str, seq: int, stored: Stored) -> dict:
    h = stored.history
    return {
        "user": user,
        "id": rid,
        "seq": seq,
        "body": stored.body,
        "input_items": stored.input_items,
        "conversation": stored.conversation,
        "history": None if h is None else {"tokens": h.tokens, "text": h.text},
        "model": stored.model,
        "served": stored.served,
    }


def drop_export(server: PastryServer, model: str, user: str, name: str) -> None:
    """Unexport ``user``'s persistent export ``name`` if it is still there."""
    m = server.controller.models.get(model)
    if m is None:
        return
    try:
        m.resources.unexport(None, name, user)
    except ExportError:  # already dropped (memory was short) or never made
        return
    m.scheduler.wake()  # waiting prefills may use its pages
