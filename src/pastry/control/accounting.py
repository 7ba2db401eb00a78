"""What each party holds, and how much it may: :class:`Accounting`.

What a party *holds* is the number of distinct physical ids it references: an instance
through its handles and its non-persistent exports, a user through its instances and its
persistent exports (a page swapped to host memory is still held: charges count what
handles map to). Limits cap them: per instance several sources may each set one (the
sandbox's ``SandboxLimits``, the server's ``--instance-share``), the smallest applies; per
user one (``--max-kv-pages-per-user``...). The resource manager charges and uncharges as
references come and go (:mod:`pastry.control.resources`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence

from pastry.control.pages import KINDS, PLURAL, QUOTA_NOUN, Kind, QuotaExceeded


def subtract(counter: Counter[int], ids: Iterable[int]) -> None:
    """Drop one reference per listed id; ids that reach 0 leave the counter."""
    for pid in ids:
        k = counter[pid] - 1
        if k:
            counter[pid] = k
        else:
            del counter[pid]


def check_cap(max_held: object) -> int:
    if not isinstance(max_held, int) or isinstance(max_held, bool) or max_held < 0:
        raise ValueError(f"a limit must be a non-negative integer or None, got {max_held!r}")
    return max_held


class Accounting:
    """Charges (references per id, per instance and per user) and their limits."""

    def __init__(self) -> None:
        # instance -> kind -> source -> most ids it may hold
        self.limits: dict[int, dict[Kind, dict[str, int]]] = {}
        # user -> kind -> (most ids it may hold, who set that limit)
        self.user_limits: dict[object, dict[Kind, tuple[int, str]]] = {}
        self.charge: dict[Kind, dict[int, Counter[int]]] = {k: {} for k in KINDS}
        self.user_charge: dict[Kind, dict[object, Counter[int]]] = {k: {} for k in KINDS}

    def add_instance(self, instance: int) -> None:
        for kind in KINDS:
            self.charge[kind][instance] = Counter()

    def remove_instance(self, instance: int) -> None:
        self.limits.pop(instance, None)
        for kind in KINDS:
            del self.charge[kind][instance]

    # ------------------------------------------------------------------ limits

    def set_limit(self, instance: int, kind: Kind, max_held: int | None, source: str) -> None:
        limits = self.limits.setdefault(instance, {}).setdefault(kind, {})
        if max_held is None:
            limits.pop(source, None)
            return
        limits[source] = check_cap(max_held)

    def limit(self, instance: int, kind: Kind) -> int | None:
        caps = self.limits.get(instance, {}).get(kind)
        return min(caps.values()) if caps else None

    def set_user_limit(self, user: object, kind: Kind, max_held: int | None, source: str) -> None:
        limits = self.user_limits.setdefault(user, {})
        if max_held is None:
            limits.pop(kind, None)
            return
        limits[kind] = (check_cap(max_held), source)

    def user_limit(self, user: object, kind: Kind) -> int | None:
        cap = self.user_limits.get(user, {}).get(kind)
        return None if cap is None else cap[0]

    def check(
        self,
        instance: int,
        user: object,
        kind: Kind,
        new: int | Sequence[int],
        make_room: Callable[[int], bool],
    ) -> None:
        """Raise :class:`QuotaExceeded` if taking ``new`` (a number of fresh ids, or the ids
        of an import) would take the instance or its user over a limit. A user over its
        limit first gets the chance to ``make_room(over)`` (drop persistent exports)."""
        held = self.charge[kind][instance]
        n = new if isinstance(new, int) else len(set(new) - held.keys())
        caps = self.limits.get(instance, {}).get(kind)
        if caps:
            source = min(caps, key=caps.__getitem__)
            if len(held) + n > caps[source]:
                raise QuotaExceeded(
                    f"{QUOTA_NOUN[kind]} quota exceeded: inferlet {instance} holds {len(held)}, "
                    f"asked for {n} more, quota {caps[source]} (set by {source}). Free "
                    f"{PLURAL[kind]} it no longer needs, or raise {source}"
                )
        cap = self.user_limits.get(user, {}).get(kind)
        if cap is None:
            return
        ucharge = self.user_charge[kind].get(user, Counter())
        un = new if isinstance(new, int) else len(set(new) - ucharge.keys())
        over = len(ucharge) + un - cap[0]
        if over > 0 and not make_room(over):
            raise QuotaExceeded(
                f"{QUOTA_NOUN[kind]} quota exceeded: user {user} holds {len(ucharge)} (with "
                f"its persistent exports), inferlet {instance} asked for {un} more, quota "
                f"{cap[0]} (set by {cap[1]}). End instances or unexport what the user no "
                f"longer needs, or raise {cap[1]}"
            )

    # ------------------------------------------------------------------ charges

    def add(self, kind: Kind, instance: int, user: object, ids: Iterable[int]) -> None:
        """``instance`` (of ``user``) references ``ids`` once more each."""
        ids = list(ids)
        self.charge[kind][instance].update(ids)
        self.add_user(kind, user, ids)

    def add_user(self, kind: Kind, user: object, ids: Sequence[int]) -> None:
        if not ids:
            return
        counter = self.user_charge[kind].get(user)
        if counter is None:
            counter = self.user_charge[kind][user] = Counter()
        counter.update(ids)

    def remove(self, kind: Kind, instance: int, user: object, ids: Iterable[int]) -> None:
        ids = list(ids)
        subtract(self.charge[kind][instance], ids)
        self.remove_user(kind, user, ids)

    def remove_user(self, kind: Kind, user: object, ids: Iterable[int]) -> None:
        counter = self.user_charge[kind].get(user)
        if counter is None:
            return
        subtract(counter, ids)
        if not counter:
            del self.user_charge[kind][user]

    def moved(self, instance: int, user: object, moved: list[tuple[int, int]]) -> None:
        """KV handles of ``instance`` now map elsewhere (swapped out or in): a page held on
        host memory is still held (charges count table values, device or host)."""
        if moved:
            self.remove("kv", instance, user, [old for old, _ in moved])
            self.add("kv", instance, user, [new for _, new in moved])

    def charged(self, instance: int, kind: Kind) -> int:
        return len(self.charge[kind][instance])

    def user_charged(self, user: object, kind: Kind) -> int:
        return len(self.user_charge[kind].get(user, ()))

    def user_ids(self, user: object, kind: Kind) -> Counter[int]:
        """The user's references per id (read only)."""
        return self.user_charge[kind].get(user, Counter())

    def check_integrity(self, tables: dict, exports: dict, users: dict[int, object]) -> None:
        """Every instance's and user's charge equals its references, recounted from the
        handle ``tables`` (kind -> instance -> table), the ``exports`` (key -> export) and
        the instances' ``users``."""
        for kind in KINDS:
            inst: dict[int, Counter[int]] = {i: Counter() for i in users}
            by_user: dict[object, Counter[int]] = {}
            for i, table in tables[kind].items():
                inst[i].update(table.values())
                by_user.setdefault(users[i], Counter()).update(table.values())
            for exp in exports.values():
                if exp.kind != kind:
                    continue
                if not exp.persistent:
                    inst[exp.owner].update(exp.ids)
                by_user.setdefault(exp.user, Counter()).update(exp.ids)
            by_user = {u: c for u, c in by_user.items() if c}
            assert self.charge[kind] == inst, f"{kind}: instance charges differ from references"
            assert self.user_charge[kind] == by_user, f"{kind}: user charges differ from references"
