"""The items of a Responses answer, and the events of a streamed one
(:mod:`pastry.server.responses`): an assistant ``message`` and ``function_call`` items,
opened, grown and closed in order as ``response.output_item.added``,
``response.content_part.added``, ``response.output_text.delta`` / ``.done``,
``response.function_call_arguments.delta`` / ``.done`` and ``response.output_item.done``.
"""

from __future__ import annotations

import json
import secrets
import uuid
from typing import Any

from starlette.types import Send


def message_item(text: str, logprobs: list[dict], status: str = "completed", mid: str | None = None) -> dict:  # fmt: skip
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}
    return {"type": "message", "id": mid or "msg_" + uuid.uuid4().hex, "status": status, "role": "assistant", "content": [part]}  # fmt: skip


def call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {"type": "function_call", "id": "fc_" + uuid.uuid4().hex, "call_id": call_id, "name": name, "arguments": arguments, "status": status}  # fmt: skip


class EventWriter:
    """The events of one streamed response: items opened, grown and closed in order."""

    def __init__(self, send: Send, obfuscate: bool) -> None:
        self.send, self.obfuscate = send, obfuscate
        self.seq = 0
        self.items: list[dict] = []  # finished items
        self.open: dict | None = None  # the item being written
        self.text = ""
        self.logprobs: list[dict] = []

    async def emit(self, kind: str, **fields) -> None:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        if self.obfuscate and kind.endswith(".delta"):
            data["obfuscation"] = secrets.token_urlsafe(12)[: 4 + self.seq % 8]
        chunk = f"event: {kind}\ndata: {json.dumps(data)}\n\n".encode()
        await self.send({"type": "http.response.body", "body": chunk, "more_body": True})

    @property
    def index(self) -> int:
        return len(self.items)

    async def piece(self, delta: Any, logprobs: list[dict]) -> None:
        """A delta of the chat stream: text (a str) or tool calls ({"tool_calls": [...]})."""
        if isinstance(delta, str):
            if not delta and not logprobs:
                return
            if self.open is None or self.open["type"] != "message":
                await self.close_item()
                self.open = message_item("", [], "in_progress")
                self.open["content"] = []
                await self.emit("response.output_item.added", output_index=self.index, item=self.open)  # fmt: skip
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                await self.emit("response.content_part.added", item_id=self.open["id"], output_index=self.index, content_index=0, part=part)  # fmt: skip
            self.text += delta
            self.logprobs += logprobs
            await self.emit("response.output_text.delta", item_id=self.open["id"], output_index=self.index, content_index=0, delta=delta, logprobs=logprobs)  # fmt: skip
            return
        for call in (delta or {}).get("tool_calls", []):
            fn = call.get("function") or {}
            if call.get("id"):  # a new call
                await self.close_item()
                self.open = call_item(call["id"], fn.get("name", ""), "", "in_progress")
                await self.emit("response.output_item.added", output_index=self.index, item=dict(self.open))  # fmt: skip
            if fn.get("arguments"):
                self.open["arguments"] += fn["arguments"]
                await self.emit("response.function_call_arguments.delta", item_id=self.open["id"], output_index=self.index, delta=fn["arguments"])  # fmt: skip

    async def close_item(self) -> None:
        item, self.open = self.open, None
        if item is None:
            return
        at = self.index
        if item["type"] == "message":
            part = {"type": "output_text", "text": self.text, "annotations": [], "logprobs": self.logprobs}  # fmt: skip
            await self.emit("response.output_text.done", item_id=item["id"], output_index=at, content_index=0, text=self.text, logprobs=self.logprobs)  # fmt: skip
            await self.emit("response.content_part.done", item_id=item["id"], output_index=at, content_index=0, part=part)  # fmt: skip
            item = {**item, "status": "completed", "content": [part]}
            self.text, self.logprobs = "", []
        else:
            await self.emit("response.function_call_arguments.done", item_id=item["id"], output_index=at, name=item["name"], arguments=item["arguments"])  # fmt: skip
            item = {**item, "status": "completed"}
        self.items.append(item)
        await self.emit("response.output_item.done", output_index=at, item=item)
