"""What the page table says, read only: :class:`PageLedger`.

The queries of :class:`~pastry.control.resources.ResourceManager` that change nothing —
who is registered, what each instance and user holds, how full the pools are, what ending
instances would free — in one place: what eviction and memory policies read
(:class:`pastry.control.policies.eviction.Ledger`), and the batch scheduler's swapper.
"""

from __future__ import annotations

from collections.abc import Iterable

from pastry.control.pages import Kind


class PageLedger:
    """The read-only half of the resource manager (a base class: the manager has the
    rooms these read, ``pools``, ``handles``, ``accounting``, ``host``, ``users``)."""

    def instances(self) -> list[int]:
        """Registered instances, oldest first."""
        return list(self.users)

    def holders(self) -> list[int]:
        """Instances whose handles or non-persistent exports name any page or embedding of
        this pool (device or host): what a restarted engine takes from them."""
        tables = self.handles.tables
        return [
            i for i in self.users
            if self.exports.by_instance.get(i) or any(tables[k][i] for k in tables)
        ]  # fmt: skip

    def registered(self, instance: int) -> bool:
        return instance in self.users

    def user_of(self, instance: int) -> object:
        self.require(instance)
        return self.users[instance]

    def held(self, instance: int, kind: Kind) -> int:
        """Handles of ``kind`` that ``instance`` holds (shared ones included)."""
        return len(self.table(instance, kind))

    def charged(self, instance: int, kind: Kind) -> int:
        """Distinct ids of ``kind`` the instance holds (handles and its non-persistent
        exports): what its limits count."""
        self.table(instance, kind)
        return self.accounting.charged(instance, kind)

    def user_charged(self, user: object, kind: Kind) -> int:
        """Distinct ids of ``kind`` the user holds (its instances' and its persistent
        exports'): what its limit counts."""
        self.pool(kind)
        return self.accounting.user_charged(user, kind)

    def usage(self, kind: Kind) -> tuple[int, int, int]:
        """``(free, used, total)`` physical ids of ``kind``."""
        pool = self.pool(kind)
        return pool.free, pool.used, pool.size

    def referenced(self, kind: Kind) -> int:
        """Physical ids of ``kind`` that handles or exports reference (the memory programs
        use: ``usage`` counts cached pages nobody uses as used too)."""
        pool = self.pool(kind)
        idle = pool.held - (self.cache.referenced_pages if kind == "kv" and self.cache else 0)
        return pool.used - idle

    def kv_owners(self) -> dict[str, int]:
        """The KV pool by owner: pages programs reference (their handles and exports),
        pages only the prefix cache keeps, free pages, and the pool's size."""
        free, used, total = self.usage("kv")
        programs = self.referenced("kv")
        return {"programs": programs, "cache": used - programs, "free": free, "total": total}

    def cached_pages(self) -> int:
        """Pages in the prefix cache's tree (in use by programs or not)."""
        return self.cache.cached_pages if self.cache is not None else 0

    def refcount(self, kind: Kind, pid: int) -> int:
        """References to physical id ``pid`` (handles plus exports)."""
        return self.pool(kind).refcount(pid)

    def reclaimable(self, kind: Kind, instances: Iterable[int]) -> int:
        """How many ids of ``kind`` would be freed if all of ``instances`` ended now."""
        return self.reclaiming.reclaimable(kind, instances)

    # swap space

    def handles_on_host(self, instance: int) -> int:
        """How many of ``instance``'s KV handles map to host pages (0: all resident)."""
        return self.host.on_host(instance)

    def pages_on_host(self, instance: int) -> int:
        """How many distinct host pages ``instance``'s handles map to."""
        if not self.host.on_host(instance):
            return 0
        return len({pid for pid in self.table(instance, "kv").values() if pid < 0})

    def host_usage(self) -> tuple[int, int, int]:
        """``(free, used, total)`` host pages (swap space)."""
        return self.host.usage()
