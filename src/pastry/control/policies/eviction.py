"""Eviction policies: who ends when memory runs out (:class:`EvictionPolicy`).

:class:`TerminateNewest` (the paper's FCFS policy, the resource manager's default) ends the
newest instances whoever they belong to, so a user who started early and holds the whole
pool keeps it while every later user is refused. :class:`FairShare` picks its victims from
the user that holds the most ids of the kind in short supply (its newest instance first),
and only then moves on to the next-heaviest, so one tenant cannot starve the others. With a
single user it is exactly FCFS.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from pastry.control.pages import Kind


class Ledger(Protocol):
    """What an eviction policy reads of the resource manager (it never changes it)."""

    def instances(self) -> list[int]: ...

    def usage(self, kind: Kind) -> tuple[int, int, int]: ...

    def reclaimable(self, kind: Kind, instances: Iterable[int]) -> int: ...

    def user_of(self, instance: int) -> object: ...

    def user_charged(self, user: object, kind: Kind) -> int: ...

    def held(self, instance: int, kind: Kind) -> int: ...


class EvictionPolicy(Protocol):
    """Chooses which inferlet instances to terminate when an ``alloc`` cannot be met.

    Called by :meth:`ResourceManager.alloc` when fewer than ``needed`` ids of ``kind`` are
    free, before anything has changed. It must only read the manager (``instances()``,
    ``held()``, ``usage()``, ``reclaimable()``), never change it. It returns the instances to
    terminate, in the order they should end; ``[]`` refuses (the requester gets
    :class:`OutOfResources`). If the list contains ``requester`` the requester itself is the
    one to give way: the manager then terminates nobody and raises :class:`OutOfResources`
    to the requester. An optional ``description`` attribute names the policy in messages.
    """

    def choose_victims(
        self, manager: Ledger, kind: Kind, needed: int, requester: int
    ) -> list[int]: ...


class TerminateNewest:
    """The paper's FCFS policy: terminate the most recently created instances until enough
    ids would return to the free list.

    Walks instances newest first; reaching the requester means that the requester is the
    newest one left, so it is returned (and nobody older is ever chosen). Only ids that would
    really be freed count (those referenced by the chosen instances alone). A chosen instance
    whose end would free nothing more (e.g. it holds only pages shared with older inferlets)
    is left running.
    """

    description = "FCFS policy: the newest inferlets end first"

    def choose_victims(self, manager: Ledger, kind: Kind, needed: int, requester: int) -> list[int]:
        free = manager.usage(kind)[0]
        victims: list[int] = []
        for inst in reversed(manager.instances()):
            if inst == requester:
                return [*victims, requester]
            victims.append(inst)
            if free + manager.reclaimable(kind, victims) >= needed:
                break
        else:
            return victims  # the requester is not registered; the manager rejects the call
        return only_needed(manager, kind, victims)


def only_needed(manager: Ledger, kind: Kind, victims: list[int]) -> list[int]:
    """``victims`` less those whose end would free nothing the others' end does not (e.g.
    an instance holding only pages shared with the others): they are left running."""
    total = manager.reclaimable(kind, victims)
    for inst in list(victims):
        rest = [v for v in victims if v != inst]
        if manager.reclaimable(kind, rest) == total:
            victims = rest
    return victims


class FairShare:
    """Terminate the newest instances of the heaviest user first (an
    :class:`EvictionPolicy`).

    Repeatedly takes the user holding the most (:meth:`ResourceManager.user_charged`, less
    what its already chosen instances would free) and chooses its newest instance not yet
    chosen. Reaching the requester means that the requester's user is the heaviest and the
    requester its newest instance: it gives way (returned last, nobody is terminated).
    Chosen instances whose end would free nothing more are left running.
    """

    description = (
        "fair-share FCFS policy: the newest inferlets of the user holding the most end first"
    )

    def choose_victims(self, manager: Ledger, kind: Kind, needed: int, requester: int) -> list[int]:
        free = manager.usage(kind)[0]
        order = manager.instances()
        rank = {inst: i for i, inst in enumerate(order)}  # creation order
        newest_first: dict[object, list[int]] = {}
        for inst in reversed(order):
            newest_first.setdefault(manager.user_of(inst), []).append(inst)
        weight = {user: manager.user_charged(user, kind) for user in newest_first}
        victims: list[int] = []
        while True:
            left = [u for u, insts in newest_first.items() if insts]
            if not left:
                return victims  # the requester is not registered; the manager rejects it
            # the heaviest user; on a tie, the one with the newest instance
            user = max(left, key=lambda u: (weight[u], rank[newest_first[u][0]]))
            inst = newest_first[user].pop(0)
            if inst == requester:
                return [*victims, requester]
            weight[user] -= manager.reclaimable(kind, [inst])
            victims.append(inst)
            if free + manager.reclaimable(kind, victims) >= needed:
                break
        return only_needed(manager, kind, victims)
