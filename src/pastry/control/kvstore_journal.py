"""The key-value store on disk: a snapshot and a journal, so that it survives the server.

``<root>/snapshot.json`` holds the whole store as of some point (written atomically:
:func:`pastry.durable.atomic_write`, with its contents' SHA-256); ``<root>/journal`` is
every ``set`` and ``delete`` since, one line each (``<crc32> <json>``), appended by a
writer thread of its own and flushed to the disk (``fsync``) once per group of lines, so a
burst of sets costs one flush. The store is the snapshot with the journal replayed.

What a kill can lose: the sets of the last moments, not yet flushed (the writer flushes as
soon as it has lines; :meth:`StoreJournal.close`, which ``SIGTERM`` reaches, flushes
everything). What it cannot do is leave a half-applied store: a line cut off by the kill
fails its CRC and is dropped (logged), and a damaged line before the end, or a damaged
snapshot, is reported (``ERROR``, :attr:`StoreJournal.problems`) and moved aside
(``*.corrupt``), never loaded — the store starts from what came before the damage.

When the journal outgrows the live data (``compact_bytes`` and twice the store's size), the
writer writes a new snapshot and starts an empty journal; a kill between the two replays
the journal over the new snapshot, which gives the same store (each line sets or deletes a
key to its final value in order).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import zlib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from pastry import durable

log = logging.getLogger(__name__)

VERSION = 1
Entry = tuple[Any, str, str]  # user, key, value


def _line(op: list) -> bytes:
    text = json.dumps(op, ensure_ascii=False, separators=(",", ":")).encode()
    return b"%08x %s\n" % (zlib.crc32(text), text)


def _parse(line: bytes) -> list | None:
    """The operation of a journal line, or None when it is damaged or cut off."""
    crc, sep, text = line.rstrip(b"\n").partition(b" ")
    if not sep or not line.endswith(b"\n") or crc != b"%08x" % zlib.crc32(text):
        return None
    try:
        op = json.loads(text)
    except ValueError:
        return None
    ok = isinstance(op, list) and (
        (len(op) == 4 and op[0] == "set") or (len(op) == 3 and op[0] == "del")
    )
    return op if ok else None


class StoreJournal:
    """The store's files under ``root`` (created, mode 0700). The store applies each change
    and records it under :attr:`lock`; ``live_bytes`` reports its size (for compaction) and
    ``snapshot`` its entries (called on the writer thread, with :attr:`lock` held)."""

    def __init__(self, root: Path, compact_bytes: int = 8 << 20) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.snapshot_path = self.root / "snapshot.json"
        self.journal_path = self.root / "journal"
        self.compact_bytes = compact_bytes
        self.problems: list[str] = []  # what the start found damaged (also logged)
        self.lock = threading.Lock()  # held while lines are queued and while compacting
        self._pending: list[bytes] = []
        self._wake = threading.Condition(self.lock)
        self._closed = False
        self._journal_bytes = 0
        self._thread: threading.Thread | None = None
        self.live_bytes: Callable[[], int] = lambda: 0
        self.snapshot: Callable[[], Iterable[Entry]] = lambda: ()

    # ------------------------------------------------------------------ start

    def load(self) -> list[Entry]:
        """The store as the files hold it (then the writer starts)."""
        durable.leftovers(self.root)
        data: dict[tuple[Any, str], str] = {}
        for user, key, value in self._read_snapshot():
            data[(user, key)] = value
        for op in self._read_journal():
            if op[0] == "set":
                data[(op[1], op[2])] = op[3]
            else:
                data.pop((op[1], op[2]), None)
        self._thread = threading.Thread(target=self._write, name="pastry store", daemon=True)
        self._thread.start()
        return [(user, key, value) for (user, key), value in data.items()]

    def _read_snapshot(self) -> list[Entry]:
        if not self.snapshot_path.exists():
            return []
        try:
            doc = json.loads(self.snapshot_path.read_text())
            entries = doc["entries"]
            if doc.get("version") != VERSION or doc.get("sha256") != _digest(entries):
                raise ValueError("its digest does not match")
            return [(u, k, v) for u, k, v in entries]
        except (OSError, ValueError, KeyError, TypeError) as e:
            self._damaged(self.snapshot_path, f"the store's snapshot is damaged ({e})")
            return []

    def _read_journal(self) -> list[list]:
        if not self.journal_path.exists():
            return []
        *whole, rest = self.journal_path.read_bytes().split(b"\n")
        lines = [line + b"\n" for line in whole] + ([rest] if rest else [])
        ops = []
        for i, line in enumerate(lines):
            op = _parse(line)
            if op is not None:
                ops.append(op)
                continue
            kept = sum(len(x) for x in lines[:i])
            if i == len(lines) - 1:  # the last write, cut off by a kill: never acknowledged
                log.warning("the store's journal ended in a cut-off write (%d bytes): dropped",
                            len(line))  # fmt: skip
                with open(self.journal_path, "r+b") as f:
                    f.truncate(kept)
                    os.fsync(f.fileno())
            else:
                self._damaged(
                    self.journal_path,
                    f"the store's journal is damaged at line {i + 1} of {len(lines)}; the "
                    f"{len(ops)} operations before it are loaded",
                )
                durable.atomic_write(self.journal_path, b"".join(lines[:i]))
            break
        self._journal_bytes = self.journal_path.stat().st_size
        return ops

    def _damaged(self, path: Path, message: str) -> None:
        aside = path.with_name(path.name + ".corrupt")
        os.replace(path, aside)
        durable.fsync_dir(self.root)
        message = f"{message}: moved aside to {aside.name}"
        log.error(message)
        self.problems.append(message)

    # ------------------------------------------------------------------ changes

    def record_set(self, user: Any, key: str, value: str) -> None:
        """Record a ``set`` the store just applied (with :attr:`lock` held)."""
        self._queue(_line(["set", user, key, value]))

    def record_delete(self, user: Any, key: str) -> None:
        """Record a ``delete`` the store just applied (with :attr:`lock` held)."""
        self._queue(_line(["del", user, key]))

    def _queue(self, line: bytes) -> None:
        if self._closed:
            raise RuntimeError("the store's journal is closed")
        self._pending.append(line)
        self._wake.notify()

    def close(self) -> None:
        """Flush every recorded change to the disk and stop the writer."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join()

    # ------------------------------------------------------------------ the writer

    def _write(self) -> None:
        f = open(self.journal_path, "ab")  # noqa: SIM115 (the writer's, until it returns)
        os.chmod(self.journal_path, 0o600)
        try:
            while True:
                with self._wake:
                    while not self._pending and not self._closed:
                        self._wake.wait()
                    lines, self._pending = self._pending, []
                    closed = self._closed
                self._append(f, lines)
                if self._journal_bytes > max(self.compact_bytes, 2 * self.live_bytes()):
                    f = self._compact(f)
                if closed:
                    return
        finally:
            f.close()

    def _append(self, f, lines: list[bytes]) -> None:
        if lines:
            data = b"".join(lines)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
            self._journal_bytes += len(data)

    def _compact(self, f):
        """A new snapshot of the store as it is, then an empty journal. The journal is
        complete up to the snapshot first, so a kill before it is emptied replays to the
        snapshot's own state."""
        with self.lock:  # the store as of now, and every line of a change up to now
            entries = [list(e) for e in self.snapshot()]
            lines, self._pending = self._pending, []
        self._append(f, lines)
        doc = {"version": VERSION, "sha256": _digest(entries), "entries": entries}
        durable.atomic_write(self.snapshot_path, json.dumps(doc, ensure_ascii=False))
        f.close()
        durable.atomic_write(self.journal_path, b"")
        self._journal_bytes = 0
        return open(self.journal_path, "ab")


def _digest(entries: list) -> str:
    text = json.dumps(entries, ensure_ascii=False, sort_keys=True)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
