"""The inferlet instance a request handler acts for: :class:`Caller`.

A caller holds what is private to one instance — its handle spaces (queues,
subscriptions, grammar constraints: small integers that mean nothing outside it), its
client's inbox and outbox, its user — and the public doors the handlers use: look a handle
up (an :class:`ApiError` naming it when it is not the instance's), queue an op on a queue,
scope a name to a user's namespace. :class:`~pastry.control.session.Session` is a caller
that dispatches requests to the handlers; routing (:mod:`pastry.control.routing`) uses the
same doors.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pastry.api import ApiError
from pastry.control.commands import Command, Op, Queue, Stage
from pastry.control.constraints import MAX_CONSTRAINTS, HostConstraint
from pastry.control.model import Model
from pastry.control.outbox import Inbox, Outbox
from pastry.control.quotas import QuotaError
from pastry.control.resources import QuotaExceeded, ResourceError
from pastry.control.users import LOCAL, split_scoped

T = TypeVar("T")


@dataclass
class QueueRef:
    """One of the instance's queues: the engine it runs on and its scheduler queue."""

    model: Model  # the engine the queue runs on (one of the model's engines)
    queue: Queue
    placed: bool = True  # False: the router may still move it (control/routing.py)
    loop: Any = None  # the generation loop running on it (control/loops.py), if any


def resource_call(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` with the resource manager's errors as the inferlet sees them: over a
    quota, :class:`QuotaError`; any other refusal, :class:`ApiError` with its message."""
    try:
        return fn(*args)
    except QuotaExceeded as e:
        raise QuotaError(str(e)) from None
    except ResourceError as e:
        raise ApiError(str(e)) from None


@dataclass(eq=False)
class Caller:
    """The state of one inferlet instance that its requests act on.

    ``controller`` is the :class:`~pastry.control.controller.Controller` (its models and
    shared services; not imported here, since it imports the handlers). ``inbox`` holds
    the client's messages for ``receive``; ``outbox`` the instance's events for its client.
    """

    controller: Any
    instance: int
    args: list[str]
    inbox: Inbox = field(default_factory=Inbox)
    outbox: Outbox = field(default_factory=Outbox)
    queues: dict[int, QueueRef] = field(default_factory=dict)
    subscriptions: dict[int, Any] = field(default_factory=dict)
    constraints: dict[int, HostConstraint] = field(default_factory=dict)
    closed: bool = False
    user: str = LOCAL
    max_constraints: int = MAX_CONSTRAINTS  # live grammar constraints (runners may lower it)
    _ids: itertools.count = field(default_factory=itertools.count)

    # ------------------------------------------------------------------ handles

    def new_handle(self) -> int:
        """A fresh handle for a queue, subscription or constraint (never reused)."""
        return next(self._ids)

    def check_open(self) -> None:
        if self.closed:
            raise ApiError("this inferlet has ended")

    def queue(self, q: int) -> QueueRef:
        self.check_open()
        ref = self.queues.get(q)
        if ref is None:
            raise ApiError(
                f"queue {q} does not exist in this inferlet (create one with create_queue)"
            )
        return ref

    def model(self, name: str) -> Model:
        try:
            return self.controller.models[name]
        except KeyError:
            raise ApiError(
                f"no model named '{name}' (available: {', '.join(self.controller.models)})"
            ) from None

    def subscription(self, sub: int) -> Any:
        s = self.subscriptions.get(sub)
        if s is None:
            raise ApiError(f"subscription {sub} does not exist in this inferlet")
        return s

    def constraint(self, c: int) -> HostConstraint:
        self.check_open()
        grammar = self.constraints.get(c)
        if grammar is None:
            raise ApiError(
                f"constraint {c} does not exist in this inferlet (create one with "
                "create_constraint; a freed one is gone)"
            )
        return grammar

    # ------------------------------------------------------------------ queueing

    def submit(
        self, ref: QueueRef, stage: Stage, op: Op, tokens: int = 0, last_stage: Stage | None = None
    ) -> asyncio.Future:
        """Queue ``op`` on ``ref`` now; the returned future resolves when it has run."""
        cmd = Command(stage, op, tokens=tokens, last_stage=last_stage)
        return ref.model.scheduler.submit(ref.queue, cmd)

    # ------------------------------------------------------------------ namespaces

    def split(self, name: object) -> tuple[str, str]:
        """``(owner, name)``: ``~OWNER/NAME`` is in OWNER's namespace, the rest in ours."""
        if not isinstance(name, str):
            raise ApiError(f"expected a string name, got {type(name).__name__}")
        owner, rest = split_scoped(name)
        return (self.user if owner is None else owner), rest

    def readable(self, name: object) -> tuple[str, str] | None:
        """:meth:`split`, or None for another user's namespace that is not granted."""
        owner, rest = self.split(name)
        return (owner, rest) if self.controller.grants.may_read(self.user, owner) else None

    def scoped(self, name: object, write: bool) -> tuple[str, str]:
        """``(owner, name)`` of an export name, store key or topic: this user's, or for
        ``~OWNER/NAME`` the owner's, which only reading may name and only with a grant."""
        owner, rest = self.split(name)
        if owner == self.user:
            return owner, rest
        if write:
            raise ApiError(
                f"{name[:80]!r} is in user {owner}'s namespace: another user's exports, store "
                "keys and topics can only be read (where granted), never written"
            )
        if not self.controller.grants.may_read(self.user, owner):
            raise ApiError(
                f"{name[:80]!r}: user {owner} has not granted user {self.user} access to its "
                f"namespace (the operator grants it with --grant {owner}:{self.user})"
            )
        return owner, rest
