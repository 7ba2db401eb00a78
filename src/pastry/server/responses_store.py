"""Each user's stored Responses (``store``, the default): a response's body, its input
items, its conversation and the persistent KV export of that conversation
(``responses/<id>``), which a follow-up naming it as ``previous_response_id`` imports
(:mod:`pastry.server.responses`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from pastry.control.resources import ExportError
from pastry.server.openai_params import History
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
    the oldest goes (with its KV export)."""

    server: PastryServer
    limit: int | None
    users: dict[str, OrderedDict[str, Stored]] = field(default_factory=dict)

    def get(self, user: str, rid: str) -> Stored | None:
        return self.users.get(user, {}).get(rid)

    def put(self, user: str, rid: str, stored: Stored) -> None:
        mine = self.users.setdefault(user, OrderedDict())
        mine[rid] = stored
        while self.limit is not None and len(mine) > self.limit:
            _, dropped = mine.popitem(last=False)
            self._forget(user, dropped)

    def delete(self, user: str, rid: str) -> bool:
        stored = self.users.get(user, {}).pop(rid, None)
        if stored is None:
            return False
        self._forget(user, stored)
        return True

    def _forget(self, user: str, stored: Stored) -> None:
        if stored.history is not None and stored.history.export is not None:
            drop_export(self.server, stored.model, user, stored.history.export)


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
