"""An instance's mailboxes, with the bytes of what is not read yet counted.

:class:`Outbox` is an ``asyncio.Queue`` of :mod:`~pastry.control.events` that keeps
``queued_bytes``, the UTF-8 size of the :class:`~pastry.control.events.Message` events put
and not yet taken. The session compares it with the backlog quota before each ``send``
(``Quotas.backlog_bytes``): whoever relays events to a client takes the next one only when
the client has read the previous ones, so the count grows exactly when a client does not
keep up. The end event is always accepted.
"""

from __future__ import annotations

import asyncio

from pastry.control.events import Event, Message


def message_bytes(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


class Outbox(asyncio.Queue[Event]):
    def __init__(self) -> None:
        super().__init__()
        self.queued_bytes = 0

    def _put(self, item: Event) -> None:
        super()._put(item)
        if isinstance(item, Message):
            self.queued_bytes += message_bytes(item.text)

    def _get(self) -> Event:
        item = super()._get()
        if isinstance(item, Message):
            self.queued_bytes -= message_bytes(item.text)
        return item


class Inbox(asyncio.Queue[str]):
    def __init__(self) -> None:
        super().__init__()
        self.queued_bytes = 0

    def _put(self, item: str) -> None:
        super()._put(item)
        self.queued_bytes += message_bytes(item)

    def _get(self) -> str:
        item = super()._get()
        self.queued_bytes -= message_bytes(item)
        return item
