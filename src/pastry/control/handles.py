"""Per-instance handle tables: virtual handles of every inferlet over physical ids.

Handles are ``first, first + 1, ...`` per instance and kind, never reused, so a stale
handle can never alias a newer allocation. A bound handle maps to one physical id (a KV
handle whose page is in host memory maps to ``-1 - host_page``); a *reserved* handle is
given out but bound later (a prefill binds its pages at admission). The tables are the
hot path of every batch: :meth:`HandleTables.translate` is one dict lookup per handle, and
:meth:`HandleTables.tables` hands the batch scheduler an instance's two tables for its
one-pass translation. :class:`~pastry.control.resources.ResourceManager` owns one.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

import numpy as np

from pastry.control.pages import KINDS, NOUN, PLURAL, InvalidHandle, Kind


class HandleTables:
    """The handle tables of every registered instance, by kind. ``tables[kind][instance]``
    is that instance's handle -> physical id table: read it, change it only through this
    class or the resource manager."""

    def __init__(self, first_handle: int = 0) -> None:
        self.first = first_handle  # handles start here (distinct per engine)
        self.tables: dict[Kind, dict[int, dict[int, int]]] = {k: {} for k in KINDS}
        self.next: dict[Kind, dict[int, int]] = {k: {} for k in KINDS}  # next fresh handle
        self.reserved: dict[Kind, dict[int, set[int]]] = {k: {} for k in KINDS}

    def add(self, instance: int) -> None:
        for kind in KINDS:
            self.tables[kind][instance] = {}
            self.next[kind][instance] = self.first
            self.reserved[kind][instance] = set()

    def remove(self, instance: int) -> dict[Kind, dict[int, int]]:
        """Forget ``instance``; returns its tables (what its handles referenced)."""
        out = {}
        for kind in KINDS:
            out[kind] = self.tables[kind].pop(instance)
            del self.next[kind][instance]
            del self.reserved[kind][instance]
        return out

    def bind(self, instance: int, kind: Kind, ids: list[int]) -> list[int]:
        """New handles of ``instance`` for ``ids``, in order."""
        start = self.next[kind][instance]
        handles = list(range(start, start + len(ids)))
        self.tables[kind][instance].update(zip(handles, ids, strict=True))
        self.next[kind][instance] = start + len(ids)
        return handles

    def reserve(self, instance: int, kind: Kind, n: int) -> list[int]:
        start = self.next[kind][instance]
        handles = list(range(start, start + n))
        self.next[kind][instance] = start + n
        self.reserved[kind][instance].update(handles)
        return handles

    def bind_reserved(
        self, instance: int, kind: Kind, handles: Sequence[int], ids: Sequence[int]
    ) -> None:
        mine = self.reserved[kind][instance]
        missing = [h for h in handles if h not in mine]
        if missing or len(handles) != len(ids):
            raise InvalidHandle(
                f"inferlet {instance}: {NOUN[kind]} handles {missing} are not reserved "
                "(freed or bound already)"
            )
        mine.difference_update(handles)
        self.tables[kind][instance].update(zip(handles, ids, strict=True))

    def holds(self, instance: int, kind: Kind, handles: Iterable[int]) -> bool:
        """Whether every handle is ``instance``'s, bound or reserved."""
        table, reserved = self.tables[kind][instance], self.reserved[kind][instance]
        return all(h in table or h in reserved for h in handles)

    # ------------------------------------------------------------------ translation

    def translate(self, instance: int, kind: Kind, handles: Sequence[int]) -> list[int]:
        """Physical ids of ``handles`` (``KeyError``: the resource manager names why)."""
        table = self.tables[kind][instance]
        return [table[h] for h in handles]

    def translate_array(self, instance: int, kind: Kind, handles: np.ndarray) -> np.ndarray:
        arr = np.asarray(handles)
        flat = arr.ravel().tolist()
        get = self.tables[kind][instance].__getitem__
        return np.fromiter(map(get, flat), dtype=np.int64, count=len(flat)).reshape(arr.shape)

    def references(self, kind: Kind) -> Counter[int]:
        """References per device id from every instance's handles."""
        refs: Counter[int] = Counter()
        for table in self.tables[kind].values():
            refs.update(pid for pid in table.values() if pid >= 0)
        return refs

    # ------------------------------------------------------------------ errors

    def invalid(
        self, instance: int, kind: Kind, handles: Iterable[int], twice_is_bad: bool = False
    ) -> InvalidHandle:
        """An error naming every bad handle of ``handles`` and why it is bad."""
        table = self.tables[kind][instance]
        nxt = self.next[kind][instance]
        other = "embed" if kind == "kv" else "kv"
        problems: dict[str, None] = {}  # ordered set of messages
        seen: set[int] = set()
        for h in handles:
            is_int = isinstance(h, (int, np.integer)) and not isinstance(h, bool)
            what = f"{NOUN[kind]} handle {int(h) if is_int else repr(h)}"
            if h in table:
                if twice_is_bad and h in seen:
                    problems[f"{what} is listed twice"] = None
                seen.add(h)
            elif h in self.reserved[kind].get(instance, ()):
                problems[
                    f"{what} is not filled yet (a queued prefill fills it: use it on that "
                    f"queue, or synchronize the queue first)"
                ] = None
            elif not is_int:
                problems[f"{what} is not an integer handle"] = None
            elif self.first <= h < nxt:
                problems[f"{what} was freed"] = None
            else:
                hint = ""
                if h in self.tables[other][instance]:
                    hint = f"; it is one of its {NOUN[other]} handles, wrong kind?"
                problems[f"{what} is not owned by this inferlet (never allocated by it{hint})"] = (
                    None
                )
        return InvalidHandle(f"inferlet {instance}: " + "; ".join(problems))

    def check_integrity(self, instances: Iterable[int]) -> None:
        """Every registered instance has its tables; handles are in ``[first, next)``; no
        handle is both bound and reserved."""
        registered = set(instances)
        for kind in KINDS:
            assert self.tables[kind].keys() == registered, kind
            assert self.next[kind].keys() == registered, kind
            assert self.reserved[kind].keys() == registered, kind
            for inst, table in self.tables[kind].items():
                nxt = self.next[kind][inst]
                bad = [h for h in table if not self.first <= h < nxt]
                assert not bad, f"inferlet {inst} has {kind} handles {bad} outside [.., {nxt})"
                res = self.reserved[kind][inst]
                assert not res & table.keys(), (inst, "bound and reserved")
                assert all(self.first <= h < nxt for h in res), inst


class Reservations:
    """Reserved handles of resource manager ``m``'s instances: given out now, bound at a
    queued call's admission (a prefill decides then which pages come from the cache)."""

    def __init__(self, m) -> None:
        self.m = m

    def reserve(self, instance: int, kind: Kind, n: int) -> list[int]:
        """``n`` new handles of ``kind`` bound to nothing yet (a queued call binds them:
        :meth:`bind_cached`, :meth:`bind_fresh`). They count against the instance's limit
        as fresh ids; using one before it is bound is an :class:`InvalidHandle` error."""
        self.m.table(instance, kind)
        if n < 0:
            raise ValueError(f"cannot reserve a negative number of {PLURAL[kind]} ({n})")
        self.m.reclaiming.check_limit(
            instance, kind, n + len(self.m.handles.reserved[kind][instance])
        )
        return self.m.handles.reserve(instance, kind, n)

    def unreserve(self, instance: int, kind: Kind, handles: Iterable[int]) -> None:
        """Give up reserved handles that were never bound (a no-op for any other)."""
        mine = self.m.handles.reserved[kind].get(instance)
        if mine is not None:
            mine.difference_update(handles)

    def bind_cached(self, instance: int, handles: Sequence[int], pages: Sequence[int]) -> None:
        """Bind reserved KV handles to pages held by the prefix cache (borrowed: each takes a
        reference, so the tree node stays in use while the handle lives)."""
        self.m.take_refs("kv", pages)
        self.bind_reserved(instance, "kv", handles, pages)

    def bind_fresh(self, instance: int, kind: Kind, handles: Sequence[int]) -> list[int]:
        """Bind reserved handles to newly allocated ids (evicting cached pages, then the
        eviction policy's victims, when short; raises like :meth:`alloc`). Returns the ids."""
        self.m.table(instance, kind)
        pool = self.m.pools[kind]
        n = len(handles)
        if pool.free < n and kind == "kv" and self.m.cached is not None:
            self.m.cached.evict(n - pool.free)
        if pool.free < n and self.m.exports.any_persistent:
            self.m.reclaiming.drop_cached(kind, n)
        if pool.free < n:
            self.m.reclaiming.reclaim(instance, kind, n)
        ids = pool.alloc(n)
        self.bind_reserved(instance, kind, handles, ids)
        return ids

    def unbind(self, instance: int, kind: Kind, handles: Sequence[int]) -> None:
        """Make bound handles reserved again (their references are dropped)."""
        table = self.m.table(instance, kind)
        if not all(h in table for h in handles):
            raise self.m.handles.invalid(instance, kind, handles)
        ids = [table.pop(h) for h in handles]
        self.m.handles.reserved[kind][instance].update(handles)
        self.m.accounting.remove(kind, instance, self.m.users[instance], ids)
        self.m.drop_refs(kind, ids, self.m.users[instance])

    def bind_reserved(
        self, instance: int, kind: Kind, handles: Sequence[int], ids: Sequence[int]
    ) -> None:
        self.m.table(instance, kind)
        self.m.handles.bind_reserved(instance, kind, handles, ids)
        self.m.accounting.add(kind, instance, self.m.users[instance], ids)

    # ------------------------------------------------------------------ prefix cache
