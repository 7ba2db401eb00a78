"""Swap space: the host pages KV pages move to, and the copies that move them.

A KV page an instance alone references may move to a *host page* (the engine's swap
space): its handles then map to ``-1 - host_id`` (:func:`on_host`) until it is swapped in
again. With ``defer_when_short`` (set by :class:`~pastry.control.swap.KvSwapper`), an
allocation the device cannot meet starts in host memory with nothing to copy (*unbacked*)
and gets device pages before the instance's next batch. :class:`HostPages` records the
copies and hands them to the next batch (:meth:`HostPages.take_moves`); host pages released
meanwhile stay held until then, so that no move of that batch can overwrite another's
source. The resource manager decides what moves (:mod:`pastry.control.resources`).
"""

from __future__ import annotations

from collections import Counter

from pastry.control.pages import PhysicalPool


def on_host(host_id: int) -> int:
    """The table value of a KV handle whose page is host page ``host_id``."""
    return -1 - host_id


class HostPages:
    """The host pool, per instance the number of its KV handles on host pages, and the
    pending moves."""

    def __init__(self, num_host_pages: int) -> None:
        self.pool = PhysicalPool(num_host_pages)
        self.handles_on_host: dict[int, int] = {}
        self.unbacked: set[int] = set()  # host pages of deferred allocs (nothing to copy)
        self.moves_out: list[tuple[int, int]] = []  # (device page, host page), not yet sent
        self.moves_in: list[tuple[int, int]] = []  # (host page, device page), not yet sent
        self.arriving: set[int] = set()  # device pages that moves_in fill
        self.held: list[int] = []  # host references released while moves are unsent
        self.defer_when_short = False  # set by the swapper: short allocs start on host

    def on_host(self, instance: int) -> int:
        return self.handles_on_host.get(instance, 0)

    def count(self, instance: int, delta: int) -> None:
        """``instance`` has ``delta`` more KV handles on host pages."""
        self.handles_on_host[instance] = self.handles_on_host.get(instance, 0) + delta

    def forget(self, instance: int) -> None:
        self.handles_on_host.pop(instance, None)

    def deferred(self, instance: int, n: int) -> list[int]:
        """``n`` host pages for an allocation the device cannot meet now (nothing to copy
        when they come in); their table values."""
        hosts = self.pool.alloc(n)
        self.unbacked.update(hosts)
        self.count(instance, n)
        return [on_host(h) for h in hosts]

    def moved_out(self, where: dict[int, int]) -> None:
        """Record copies device page -> host page."""
        self.moves_out.extend(where.items())

    def moved_in(self, host: int, device: int) -> None:
        """Record a copy host page -> device page (none for an unbacked page)."""
        if host in self.unbacked:
            self.unbacked.discard(host)  # a deferred alloc: nothing to copy
        else:
            self.moves_in.append((host, device))
            self.arriving.add(device)

    def release(self, hosts: list[int]) -> None:
        """Drop one reference per host page (held until the pending moves are sent)."""
        if self.moves_out or self.moves_in:
            self.held.extend(hosts)  # a pending move may still read or write them
            return
        for h in self.pool.decref(hosts):
            self.unbacked.discard(h)

    def take_moves(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The recorded copies, ``(device, host)`` out and ``(host, device)`` in, to run
        at the front of the batch about to be dispatched (out before in); forgets them and
        frees the host pages held meanwhile."""
        out, into = self.moves_out, self.moves_in
        self.moves_out, self.moves_in, self.arriving = [], [], set()
        held, self.held = self.held, []
        for h in self.pool.decref(held):
            self.unbacked.discard(h)
        return out, into

    def usage(self) -> tuple[int, int, int]:
        """``(free, used, total)`` host pages."""
        p = self.pool
        return p.free, p.used, p.size

    def check_integrity(self, kv_tables: dict[int, dict[int, int]], device: PhysicalPool) -> None:
        """Each host page's count equals the handles mapped to it plus the references held
        until the pending moves are sent; moves name pages in use."""
        host = self.pool
        host.check_integrity()
        refs: Counter[int] = Counter(self.held)
        for inst, table in kv_tables.items():
            mine = [-1 - pid for pid in table.values() if pid < 0]
            refs.update(mine)
            assert self.on_host(inst) == len(mine), (
                f"inferlet {inst}: {len(mine)} handles on host, counted {self.on_host(inst)}"
            )
        wrong = {
            h: (host.refcount(h), refs[h]) for h in range(host.size) if host.refcount(h) != refs[h]
        }
        assert not wrong, f"host pages whose (refcount, references) differ: {wrong}"
        assert all(host.refcount(h) > 0 for h in self.unbacked), "unbacked host pages are free"
        assert all(host.refcount(h) > 0 for _, h in self.moves_out), "swap-out into a free page"
        assert all(device.refcount(p) > 0 for _, p in self.moves_in), "swap-in into a free page"
        assert self.arriving == {p for _, p in self.moves_in}, "arriving pages out of date"
        assert not self.held or self.moves_out or self.moves_in, "held without moves"


class Swapping:
    """What moves to host memory and back, for resource manager ``m`` (through its public
    doors; :class:`HostPages` keeps the books)."""

    def __init__(self, m) -> None:
        self.m = m

    def swap_out(self, instance: int, max_pages: int | None = None) -> int:
        """Move up to ``max_pages`` of ``instance``'s swappable pages (newest handles first)
        to free host pages; returns how many moved. Bookkeeping only: the copies are
        recorded for :meth:`take_moves`, and the freed device pages may be handed out at
        once (the copies run first in the next batch)."""
        table = self.m.table(instance, "kv")
        host = self.m.host
        pages = self.swappable(instance)
        n = min(len(pages), host.pool.free, len(pages) if max_pages is None else max_pages)
        if n <= 0:
            return 0
        where = dict(zip(pages[:n], host.pool.alloc(n), strict=True))
        refs: Counter[int] = Counter()
        moved: list[tuple[int, int]] = []
        for h, pid in table.items():
            if pid in where:
                table[h] = on_host(where[pid])
                refs[pid] += 1
                moved.append((pid, table[h]))
        self.m.accounting.moved(instance, self.m.users[instance], moved)
        for pid, hp in where.items():
            host.pool.incref([hp] * (refs[pid] - 1))
            self.m.drop_refs("kv", [pid] * refs[pid], offer=False)  # its content leaves
        host.count(instance, refs.total())
        host.moved_out(where)
        return n

    def swap_in(self, instance: int) -> int:
        """Give every host page of ``instance`` a device page again (its handles keep their
        numbers); returns how many pages. Raises :class:`OutOfResources` (changing nothing)
        when the device has too few free pages: make room first."""
        table = self.m.table(instance, "kv")
        if not self.m.host.on_host(instance):
            return 0
        refs = Counter(-1 - pid for pid in table.values() if pid < 0)
        pool = self.m.pools["kv"]
        if pool.free < len(refs) and self.m.cached is not None:
            self.m.cached.evict(len(refs) - pool.free)
        if pool.free < len(refs):
            raise self.m.out_of(instance, "kv", len(refs), "to bring its swapped pages back")
        where = dict(zip(refs, pool.alloc(len(refs)), strict=True))
        if self.m.provenance is not None:  # the swap-in overwrites them (observed or not)
            self.m.provenance.forget(where.values())
        moved: list[tuple[int, int]] = []
        for h, pid in table.items():
            if pid < 0:
                table[h] = where[-1 - pid]
                moved.append((pid, table[h]))
        self.m.accounting.moved(instance, self.m.users[instance], moved)
        for hp, dev in where.items():
            pool.incref([dev] * (refs[hp] - 1))
            self.m.host.moved_in(hp, dev)
        self.m.host.count(instance, -self.m.host.on_host(instance))
        self.m.host.release(list(refs.elements()))
        return len(where)

    def swappable(self, instance: int) -> list[int]:
        """``instance``'s device pages that only its handles reference (not exported, not
        shared, not held by the prefix cache, not being filled by a pending swap-in),
        newest handles first. Hot (the swapper asks for every program that may give way
        or come in): one pass over the table, counting references only when a page has
        several handles."""
        table = self.m.handles.tables["kv"][instance]
        rc = self.m.pools["kv"].counts
        pids = [pid for pid in reversed(table.values()) if pid >= 0]  # newest handles first
        cache, arriving = self.m.cache, self.m.host.arriving
        if arriving or cache is not None:
            pids = [p for p in pids if p not in arriving and (cache is None or p not in cache)]
        if len(set(pids)) == len(pids):  # one handle per page (the usual case)
            return [pid for pid in pids if rc[pid] == 1]
        refs = Counter(pids)
        return [pid for pid in dict.fromkeys(pids) if rc[pid] == refs[pid]]
