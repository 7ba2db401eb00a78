"""The export registry: named sets of physical ids that inferlets share.

``export`` puts physical ids in a named entry that holds its own references; ``import_``
gives the importer new handles to the same ids (:mod:`pastry.control.resources`). Names
are per user: an entry lives under ``(user, name)``. A non-persistent export ends with its
exporter; a persistent one lives until unexported, or until it is *reclaimed*: persistent
exports are a cache, dropped least recently imported first when memory is short or their
user is over its limit. The server's own *holds* (:meth:`Sharing.hold`: pages that must
stay allocated while another engine writes them) are entries under a :class:`Hold` key no
inferlet can name: never listed, imported or reclaimed. The registry keeps the entries and
their order; the resource manager moves the references.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Container, Iterable
from dataclasses import dataclass

from pastry.control.pages import PLURAL, ExportError, Kind, ResourceError

UNSET = object()  # no user given (a default that None, a user, cannot be)


@dataclass(frozen=True, slots=True)
class Hold:
    """A hold of the server's own on some pages (:meth:`Sharing.hold`), and its key's
    name in the registry (not a string: no inferlet can name, list or unexport it)."""

    serial: int


Key = tuple[object, "str | Hold"]  # (user, name)


@dataclass(frozen=True, slots=True)
class Export:
    kind: Kind
    ids: tuple[int, ...]
    owner: int  # the exporting instance
    persistent: bool
    user: object = None  # the namespace it lives in (the exporter's user)


class ExportRegistry:
    """Every export, by ``(user, name)`` in creation order; the non-persistent ones by
    exporting instance; the persistent ones with the time of their last import."""

    def __init__(self) -> None:
        self.exports: dict[Key, Export] = {}
        self.by_instance: dict[int, set[Key]] = {}  # non-persistent exports per exporter
        self.last_import: dict[Key, int] = {}  # persistent exports' LRU clock
        self._clock = itertools.count()
        self._drops = 0  # entries removed so far (dates the cached references below)
        self._refs: tuple[tuple, Counter[int]] | None = None

    def add_instance(self, instance: int) -> None:
        self.by_instance[instance] = set()

    def remove_instance(self, instance: int) -> list[Export]:
        """Forget ``instance``: its non-persistent exports, removed and returned."""
        out = [self.pop(key) for key in list(self.by_instance.get(instance, ()))]
        self.by_instance.pop(instance, None)
        return out

    def add(self, key: Key, export: Export) -> None:
        self.exports[key] = export
        if export.persistent:
            self.last_import[key] = next(self._clock)
        else:
            self.by_instance[export.owner].add(key)

    def touch(self, key: Key) -> None:
        """A persistent export was imported: it is the most recently used."""
        if key in self.last_import:
            self.last_import[key] = next(self._clock)

    def pop(self, key: Key) -> Export:
        exp = self.exports.pop(key)
        self._drops += 1  # (entries only join otherwise: see gain)
        if exp.persistent:
            del self.last_import[key]
        else:
            self.by_instance[exp.owner].discard(key)
        return exp

    def of_instance(self, instance: int) -> list[Export]:
        """The non-persistent exports of ``instance``."""
        return [self.exports[k] for k in self.by_instance.get(instance, ())]

    @property
    def any_persistent(self) -> bool:
        return bool(self.last_import)

    def listing(self, owner: object = UNSET) -> list[tuple[str, str, int]]:
        """``(name, kind, count)`` of every export in ``owner``'s namespace (default: every
        user's), oldest first."""
        return [
            (name, exp.kind, len(exp.ids))
            for (user, name), exp in self.exports.items()
            if type(name) is str and (owner is UNSET or user == owner)
        ]

    def lru(self, kind: Kind, user: object = UNSET) -> list[Key]:
        """Persistent exports of ``kind`` that may be reclaimed (of ``user``, or everyone's),
        least recently imported first."""
        keys = [
            k for k, e in self.exports.items()
            if e.persistent and type(k[1]) is str and e.kind == kind
            and (user is UNSET or e.user == user)
        ]  # fmt: skip
        return sorted(keys, key=self.last_import.__getitem__)

    def references(self, kind: Kind) -> Counter[int]:
        """References per id held by the exports of ``kind``."""
        refs: Counter[int] = Counter()
        for exp in self.exports.values():
            if exp.kind == kind:
                refs.update(exp.ids)
        return refs

    def kv_ids(self) -> set[int]:
        """Every KV page some export references."""
        return {i for e in self.exports.values() if e.kind == "kv" for i in e.ids}

    def gain(
        self, kind: Kind, wanted: int, counts: list[int], cached: Container[int] = ()
    ) -> tuple[int, list[Key]]:
        """Which persistent exports to drop, least recently used first, to free ``wanted``
        ids (all that free anything if that is not enough), and how many ids they free;
        ``counts``: the pool's references per id. Exports whose ids are all held by
        something else (or by the prefix cache, ``cached``) are never chosen."""
        lru = self.lru(kind)
        # The references the persistent exports hold per id: kept while the set of
        # exports is the same (exports only join, so drops and the count identify it);
        # this runs at every allocation short of memory
        stamp = (kind, self._drops, len(self.last_import))
        if self._refs is None or self._refs[0] != stamp:
            total: Counter[int] = Counter()
            for key in lru:
                total.update(self.exports[key].ids)
            self._refs = (stamp, total)
        total = self._refs[1]
        # (a page the prefix cache holds stays there, maybe in use by what is cached after it)
        only = {pid for pid, k in total.items() if counts[pid] == k and pid not in cached}
        dropped: Counter[int] = Counter()
        gain, chosen = 0, []
        for key in lru:
            if gain >= wanted or not only:
                break
            mine = [pid for pid in self.exports[key].ids if pid in only]
            if not mine:
                continue
            chosen.append(key)
            dropped.update(mine)
            gain += sum(1 for pid in set(mine) if dropped[pid] == total[pid])
        return gain, chosen

    def check_integrity(self, users: dict[int, object]) -> None:
        """Entries agree with their keys, exporters and the LRU clock (``users``: the
        registered instances' users)."""
        assert self.by_instance.keys() == users.keys(), "exports of unknown instances"
        for inst, keys in self.by_instance.items():
            for key in keys:
                exp = self.exports.get(key)
                assert exp is not None and exp.owner == inst and not exp.persistent, (inst, key)
        for key, exp in self.exports.items():
            assert key[0] == exp.user, (key, exp.user)
            if not exp.persistent:
                assert key in self.by_instance.get(exp.owner, ()), (key, exp.owner)
                assert users[exp.owner] == exp.user, (key, exp.owner)
            assert all(pid >= 0 for pid in exp.ids), f"export {key!r} names host pages"
        assert self.last_import.keys() == {k for k, e in self.exports.items() if e.persistent}


class Sharing:
    """Exports and imports of resource manager ``m``'s instances (through its public
    doors; the registry keeps the entries)."""

    def __init__(self, m) -> None:
        self.m = m
        self.serials = itertools.count(1)

    def export(
        self,
        instance: int,
        kind: Kind,
        handles: Iterable[int],
        name: str,
        persistent: bool = False,
    ) -> None:
        """Publish the physical ids of ``handles`` under ``name`` in the instance's user's
        namespace (the registry takes its own references). A non-persistent export is
        dropped when ``instance`` ends and counts as the instance's; a persistent one lives
        until :meth:`unexport` (or is reclaimed) and counts as its user's. The handles stay
        the exporter's."""
        if not isinstance(name, str) or not name:
            raise ExportError(f"export name must be a non-empty string, got {name!r}")
        self._add(instance, kind, handles, name, persistent)

    def hold(self, instance: int, kind: Kind, handles: Iterable[int]) -> Hold:
        """The server's own reference to the physical ids of ``handles`` (e.g. pages another
        engine is writing into): they stay allocated until :meth:`release`, whatever the
        instance does meanwhile, even after it ends. Counted as its user's, like a
        persistent export, but never reclaimed, listed or importable."""
        hold = Hold(next(self.serials))
        self._add(instance, kind, handles, hold, True)
        return hold

    def release(self, hold: Hold, user: object) -> None:
        """Drop a :meth:`hold` of ``user``'s (a no-op once released)."""
        if (user, hold) in self.m.exports.exports:
            self.m.drop_export((user, hold))

    def _add(self, instance: int, kind: Kind, handles, name: str | Hold, persistent: bool) -> None:
        table = self.m.table(instance, kind)
        handles = list(handles)
        if not all(h in table for h in handles):
            raise self.m.handles.invalid(instance, kind, handles)
        user = self.m.users[instance]
        key = (user, name)
        if key in self.m.exports.exports:
            raise ExportError(
                f"export name {name!r} is already taken; unexport it first or choose another name"
            )
        ids = tuple(table[h] for h in handles)
        if any(pid < 0 for pid in ids):
            raise ResourceError(
                f"inferlet {instance}: cannot export pages that are swapped out to host memory "
                "(the scheduler brings them back before the instance's commands run)"
            )
        self.m.take_refs(kind, ids)
        self.m.exports.add(key, Export(kind, ids, instance, persistent, user))
        if persistent:
            self.m.accounting.add_user(kind, user, ids)
        else:
            self.m.accounting.add(kind, instance, user, ids)

    def import_(self, instance: int, kind: Kind, name: str, owner: object = UNSET) -> list[int]:
        """New handles of ``instance`` for the physical ids exported as ``name`` in
        ``owner``'s namespace (default: the instance's own user; reading another's is the
        caller's to allow), in the exported order (each takes a reference). Over the
        instance's or its user's limit raises :class:`QuotaExceeded`."""
        self.m.table(instance, kind)
        key = (self.m.users[instance] if owner is UNSET else owner, name)
        exp = self.m.exports.exports.get(key)
        if exp is None:
            raise ExportError(f"no export named {name!r}; list_exports() shows what exists")
        if exp.kind != kind:
            raise ExportError(
                f"export {name!r} holds {PLURAL[exp.kind]}, not {PLURAL[kind]}; "
                f"import it as kind {exp.kind!r}"
            )
        return self._take(instance, kind, key, exp)

    def claim(self, instance: int, kind: Kind, hold: Hold, user: object) -> list[int]:
        """New handles of ``instance`` for the ids of ``user``'s :meth:`hold` (a reference
        each; the hold stays until released): how the server hands pages from one
        instance to another. Over the instance's or its user's limit raises
        :class:`QuotaExceeded`."""
        self.m.table(instance, kind)
        key = (user, hold)
        exp = self.m.exports.exports.get(key)
        if exp is None or exp.kind != kind:
            raise ExportError(f"{hold} of {PLURAL[kind]} does not exist (released already?)")
        return self._take(instance, kind, key, exp)

    def _take(self, instance: int, kind: Kind, key: Key, exp: Export) -> list[int]:
        self.m.reclaiming.check_limit(instance, kind, exp.ids, keep=key)
        self.m.exports.touch(key)
        self.m.take_refs(kind, exp.ids)
        return self.m.bind(instance, kind, list(exp.ids))

    def unexport(self, instance: int | None, name: str, owner: object = None) -> None:
        """Drop the export ``name`` of the instance's user and its references (handles
        imported from it stay valid).

        A non-persistent export may only be dropped by its exporter; a persistent one by any
        instance of its user. ``instance=None`` is the server itself and may drop any
        export (of ``owner``'s namespace).
        """
        if instance is not None:
            self.m.require(instance)
            owner = self.m.users[instance]
        key = (owner, name)
        exp = self.m.exports.exports.get(key)
        if exp is None:
            raise ExportError(f"no export named {name!r}; list_exports() shows what exists")
        if instance is not None and not exp.persistent and exp.owner != instance:
            raise ExportError(
                f"export {name!r} belongs to inferlet {exp.owner}; only its exporter can "
                f"unexport a non-persistent export (it ends with its exporter)"
            )
        self.m.drop_export(key)

    def list_exports(self, owner: object = UNSET) -> list[tuple[str, str, int]]:
        """``(name, kind, count)`` of every export in ``owner``'s namespace (default: every
        user's), oldest first."""
        return self.m.exports.listing(owner)
