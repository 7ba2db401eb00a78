"""Eviction across users: when memory runs out, the user holding the most gives way.

:class:`~pastry.control.resources.TerminateNewest` (the paper's FCFS policy) ends the
newest instances whoever they belong to, so a user who started early and holds the whole
pool keeps it while every later user is refused. :class:`FairShare` picks its victims from
the user that holds the most ids of the kind in short supply (its newest instance first),
and only then moves on to the next-heaviest, so one tenant cannot starve the others. With a
single user it is exactly FCFS.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pastry.control.resources import only_needed

if TYPE_CHECKING:
    from pastry.control.resources import Kind, ResourceManager


class FairShare:
    """Terminate the newest instances of the heaviest user first (an
    :class:`~pastry.control.resources.EvictionPolicy`).

    Repeatedly takes the user holding the most (:meth:`ResourceManager.user_charged`, less
    what its already chosen instances would free) and chooses its newest instance not yet
    chosen. Reaching the requester means that the requester's user is the heaviest and the
    requester its newest instance: it gives way (returned last, nobody is terminated).
    Chosen instances whose end would free nothing more are left running.
    """

    description = (
        "fair-share FCFS policy: the newest inferlets of the user holding the most end first"
    )

    def choose_victims(
        self, manager: ResourceManager, kind: Kind, needed: int, requester: int
    ) -> list[int]:
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
