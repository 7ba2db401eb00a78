"""The host side of the inferlet API for one instance: :class:`Session`.

A session is the :class:`~pastry.api.InferletApi` of one instance on the host: every API
method builds its request record (:mod:`pastry.api`) and :meth:`Session.call` hands it to
the handler of its kind (:mod:`pastry.control.handlers`), which acts on the instance's own
state (its :class:`~pastry.control.handlers.caller.Caller` part: queues, KV pages,
embeddings, subscriptions and constraints are small integers that mean nothing outside
it). Calls that touch the model queue an op on the model's batch scheduler
(:mod:`pastry.control.scheduler`), translated to physical ids when it is batched; the rest
are answered at once. Misuse (a foreign or freed handle, a wrong queue, bad lengths) raises
:class:`ApiError` in the calling inferlet only.

A session belongs to a user (``user``, :mod:`pastry.control.users`): its KV exports, store
keys and topics live in that user's namespace, and ``~OWNER/NAME`` reads another user's
where the owner granted it. Messages its client has not read count against the backlog
quota (``Quotas.backlog_bytes``): a sender over it is ended.

The :class:`~pastry.control.controller.Controller` creates and ends sessions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pastry import api
from pastry.api import ApiError, InferletApi
from pastry.control.handlers import HANDLERS, Caller, QueueRef
from pastry.control.handlers.instance import API_VERSION
from pastry.control.handlers.text import tokenize_async
from pastry.control.quotas import QuotaError
from pastry.control.resources import Kind

__all__ = ["API_VERSION", "ApiError", "QueueRef", "QuotaError", "Session"]


@dataclass(eq=False)
class Session(Caller, InferletApi):
    """The API as one inferlet instance sees it (see :class:`pastry.api.InferletApi`)."""

    def call(self, request: Any) -> Any:
        """Answer one request record with the handler of its kind."""
        return HANDLERS[request.__class__](self, request)

    # ------------------------------------------------------------------ host side only

    async def tokenize_async(self, q: int, text: str, add_special_tokens: bool = False):
        """``tokenize`` off the event loop (the model's tokenizing thread), for a runner
        that can suspend its inferlet meanwhile (the sandbox does for long texts)."""
        return await tokenize_async(self, api.Tokenize(q, text, add_special_tokens))

    def deliver(self, message: str) -> None:
        """Put a client's message in the inbox for ``receive``; raises :class:`QuotaError`
        while the instance leaves more than the backlog quota unread. Not part of the
        inferlet API: the server calls it."""
        limit = self.controller.quotas.backlog_bytes
        if limit is not None and self.inbox.queued_bytes > limit:
            raise QuotaError(
                f"instance {self.instance} has not read {self.inbox.queued_bytes} bytes of "
                f"messages sent to it, over the backlog quota of {limit} bytes "
                "(--max-backlog-bytes): wait for it to receive them"
            )
        self.inbox.put_nowait(message)

    def set_limit(self, kind: Kind, max_held: int | None, source: str) -> None:
        """Cap the ``kind`` handles this instance may hold at once, on every model (see
        :meth:`~pastry.control.resources.ResourceManager.set_limit`); going over raises
        :class:`QuotaError` in the inferlet. Not part of the inferlet API: runners call it."""
        for m in self.controller.all_engines():
            m.resources.set_limit(self.instance, kind, max_held, source)

    def close(self) -> None:
        self.closed = True
        for ref in self.queues.values():
            ref.model.scheduler.close_queue(ref.queue, "the inferlet ended")
        self.queues.clear()
        for sub in self.subscriptions.values():
            sub.close()
        self.subscriptions.clear()
        self.constraints.clear()


# Each API method calls its request kind's handler itself (Session.call's answer, one
# dispatch less per request): see pastry.api.answered_by.
for _name, _method in api.answered_by(HANDLERS).items():
    setattr(Session, _name, _method)
