"""The key-value store of the inferlets (``store-get`` / ``store-set`` / ... in Pie).

One :class:`KvStore` per server, used from its event loop only. It has one namespace per
user (every call takes ``user``; ``None`` is a user like any other): the instances of one
user share state through it (e.g. one writes ``"plan/42"``, others ``await
wait_for("plan/42")``), and no user sees another's keys. Reading another user's keys, where
the owner granted it, is the caller's to allow (``docs/security.md``). Keys and values are
strings; the last writer instance of each key is kept for debugging
(:meth:`KvStore.last_writer`).

Limits (:class:`KvStoreConfig`, all in UTF-8 bytes): key length, value size, the size of one
user's keys plus values, and the total of everyone's. A ``set`` that breaks one is rejected
with :class:`KvStoreError` naming the limit and leaves the store unchanged.

With a :class:`~pastry.control.kvstore_journal.StoreJournal` the store survives the server:
it starts as the journal's files hold it, and every change is recorded there.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

from pastry.control.kvstore_journal import StoreJournal


class KvStoreError(ValueError):
    """A store operation was rejected (bad key, value too large, store full)."""


@dataclass(frozen=True)
class KvStoreConfig:
    max_key_bytes: int = 1024
    max_value_bytes: int = 1 << 20
    max_total_bytes: int = 256 << 20
    max_user_bytes: int | None = None  # one user's keys plus values (None: only the total)
    user_limit_source: str = "KvStoreConfig.max_user_bytes"  # named in the error

    def __post_init__(self) -> None:
        for name in ("max_key_bytes", "max_value_bytes", "max_total_bytes", "max_user_bytes"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"KvStoreConfig.{name} must be >= 1, got {value}")


@dataclass(frozen=True, slots=True)
class _Entry:
    value: str
    size: int  # bytes of key + value
    writer: str | None


def _nbytes(s: str) -> int:
    return len(s) if s.isascii() else len(s.encode("utf-8"))


class KvStore:
    """A string-to-string store per user, with size limits and ``wait_for``."""

    def __init__(
        self, config: KvStoreConfig | None = None, journal: StoreJournal | None = None
    ) -> None:
        self.config = config or KvStoreConfig()
        self._data: dict[object, dict[str, _Entry]] = {}  # user -> key -> entry
        self._user_bytes: dict[object, int] = {}
        self._total = 0
        self._waiters: dict[tuple[object, str], list[asyncio.Future[str]]] = {}
        self.journal = journal
        # a change and its journal line together (the journal's writer reads a snapshot)
        self._changing = contextlib.nullcontext() if journal is None else journal.lock
        if journal is not None:
            for user, key, value in journal.load():  # as stored, whatever the limits now
                self._put(user, key, value, None)
            journal.live_bytes = lambda: self._total
            journal.snapshot = self._entries

    def _put(self, user: object, key: str, value: str, writer: str | None) -> None:
        """Set without checks (every check passed, or the journal holds it)."""
        data = self._data.setdefault(user, {})
        old = data.get(key)
        size = _nbytes(key) + _nbytes(value)
        growth = size - (old.size if old else 0)
        data[key] = _Entry(value, size, writer)
        self._user_bytes[user] = self._user_bytes.get(user, 0) + growth
        self._total += growth

    def _entries(self) -> list[tuple[object, str, str]]:
        return [(u, k, e.value) for u, data in self._data.items() for k, e in data.items()]

    def close(self) -> None:
        """Flush the journal (nothing to do without one)."""
        if self.journal is not None:
            self.journal.close()

    def get(self, key: str, user: object = None) -> str | None:
        """The value of ``key`` of ``user``, or ``None`` if it is not set."""
        entry = self._data.get(user, {}).get(self._check_key(key))
        return None if entry is None else entry.value

    def set(
        self, key: str, value: str, *, instance_id: str | None = None, user: object = None
    ) -> None:
        """Set ``user``'s ``key`` to ``value`` (replacing any old value), recording
        ``instance_id`` as its last writer, and wake every ``wait_for(key)`` of that user."""
        key_size = _nbytes(self._check_key(key))
        if not isinstance(value, str):
            raise TypeError(f"value must be a str, got {type(value).__name__}")
        value_size = _nbytes(value)
        cfg = self.config
        if value_size > cfg.max_value_bytes:
            raise KvStoreError(
                f"value for key {key[:64]!r} is {value_size} bytes, over the limit of "
                f"{cfg.max_value_bytes} bytes (KvStoreConfig.max_value_bytes)"
            )
        data = self._data.get(user, {})
        old = data.get(key)
        size = key_size + value_size
        growth = size - (old.size if old else 0)
        mine = self._user_bytes.get(user, 0) + growth
        if cfg.max_user_bytes is not None and growth > 0 and mine > cfg.max_user_bytes:
            raise KvStoreError(
                f"setting key {key[:64]!r} ({size} bytes with its key) would grow this user's "
                f"store to {mine} bytes, over the quota of {cfg.max_user_bytes} bytes "
                f"({cfg.user_limit_source}); delete unused keys first"
            )
        total = self._total + growth
        if growth > 0 and total > cfg.max_total_bytes:
            raise KvStoreError(
                f"setting key {key[:64]!r} ({size} bytes with its key) would grow the store to "
                f"{total} bytes, over the limit of {cfg.max_total_bytes} bytes "
                f"(KvStoreConfig.max_total_bytes); delete unused keys first"
            )
        with self._changing:
            self._data.setdefault(user, data)[key] = _Entry(value, size, instance_id)
            self._user_bytes[user] = mine
            self._total = total
            if self.journal is not None:
                self.journal.record_set(user, key, value)
        for waiter in self._waiters.pop((user, key), ()):
            if not waiter.done():
                waiter.set_result(value)

    def delete(self, key: str, user: object = None) -> bool:
        """Remove ``user``'s ``key``; returns whether it was set."""
        data = self._data.get(user, {})
        if self._check_key(key) not in data:
            return False
        with self._changing:
            entry = data.pop(key)
            self._total -= entry.size
            self._user_bytes[user] -= entry.size
            if not data:
                del self._data[user], self._user_bytes[user]
            if self.journal is not None:
                self.journal.record_delete(user, key)
        return True

    def exists(self, key: str, user: object = None) -> bool:
        return self._check_key(key) in self._data.get(user, {})

    def list_keys(self, prefix: str = "", user: object = None) -> list[str]:
        """``user``'s keys starting with ``prefix``, sorted."""
        if not isinstance(prefix, str):
            raise TypeError(f"prefix must be a str, got {type(prefix).__name__}")
        return sorted(k for k in self._data.get(user, {}) if k.startswith(prefix))

    def last_writer(self, key: str, user: object = None) -> str | None:
        """The instance id of the last ``set`` of ``key`` (``None`` if unset or unknown)."""
        entry = self._data.get(user, {}).get(self._check_key(key))
        return None if entry is None else entry.writer

    async def wait_for(self, key: str, timeout: float | None = None, user: object = None) -> str:
        """The value of ``user``'s ``key``: at once if it is set, else as soon as some
        ``set`` sets it. Raises ``TimeoutError`` after ``timeout`` seconds (``None``: wait
        forever)."""
        value = self.get(key, user)
        if value is not None:
            return value
        if timeout is not None and timeout < 0:
            raise ValueError(f"timeout must be >= 0 or None, got {timeout}")
        waiter: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        slot = (user, key)
        self._waiters.setdefault(slot, []).append(waiter)
        try:
            async with asyncio.timeout(timeout):
                return await waiter
        except TimeoutError:
            raise TimeoutError(f"key {key[:64]!r} was not set within {timeout} s") from None
        finally:
            waiters = self._waiters.get(slot)
            if waiters is not None and waiter in waiters:
                waiters.remove(waiter)
                if not waiters:
                    del self._waiters[slot]

    def __len__(self) -> int:
        return sum(len(d) for d in self._data.values())

    @property
    def total_bytes(self) -> int:
        """UTF-8 bytes of all keys plus values (what ``max_total_bytes`` limits)."""
        return self._total

    def user_bytes(self, user: object = None) -> int:
        """UTF-8 bytes of ``user``'s keys plus values (what ``max_user_bytes`` limits)."""
        return self._user_bytes.get(user, 0)

    def waiting(self) -> int:
        """Pending ``wait_for`` calls."""
        return sum(len(w) for w in self._waiters.values())

    def check_integrity(self) -> None:
        """Assert that the byte accounting is exact (for tests and idle checks)."""
        total = 0
        assert self._data.keys() == self._user_bytes.keys(), "users without keys or bytes"
        for user, data in self._data.items():
            assert data, f"empty namespace of user {user!r}"
            mine = 0
            for key, entry in data.items():
                assert entry.size == _nbytes(key) + _nbytes(entry.value), key
                mine += entry.size
            assert mine == self._user_bytes[user], (user, mine, self._user_bytes[user])
            total += mine
        assert total == self._total <= self.config.max_total_bytes, (total, self._total)
        for (user, key), waiters in self._waiters.items():
            assert waiters and key not in self._data.get(user, {}), (user, key)

    def _check_key(self, key: str) -> str:
        if not isinstance(key, str):
            raise TypeError(f"key must be a str, got {type(key).__name__}")
        limit = self.config.max_key_bytes
        if not key:
            raise KvStoreError("key must not be empty")
        if _nbytes(key) > limit:
            raise KvStoreError(
                f"key {key[:64]!r}... is {_nbytes(key)} bytes, over the limit of {limit} "
                f"bytes (KvStoreConfig.max_key_bytes)"
            )
        return key
