"""The key-value store on disk (issue 31, point 4): what was set survives a restart, a kill
leaves a state the store passed through (never a half-applied or damaged one), and damage
is reported and moved aside, never loaded."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from pastry import durable
from pastry.control.kvstore import KvStore
from pastry.control.kvstore_journal import StoreJournal


def opened(root, **kw) -> KvStore:
    return KvStore(journal=StoreJournal(root, **kw))


def contents(store: KvStore) -> dict:
    return {(u, k): store.get(k, u) for u in (None, "ann", "bob") for k in store.list_keys("", u)}


def test_sets_and_deletes_survive_a_restart_per_user(tmp_path):
    s = opened(tmp_path)
    s.set("plan/1", "a")
    s.set("plan/1", "b", user="ann")
    s.set("x", "é" * 100, user="bob")
    s.set("gone", "1", user="ann")
    assert s.delete("gone", user="ann")
    s.close()
    again = opened(tmp_path)
    assert contents(again) == {
        (None, "plan/1"): "a",
        ("ann", "plan/1"): "b",
        ("bob", "x"): "é" * 100,
    }
    again.check_integrity()
    assert again.total_bytes == s.total_bytes and again.user_bytes("bob") == s.user_bytes("bob")
    assert again.journal.problems == []
    assert (tmp_path / "journal").stat().st_mode & 0o077 == 0
    again.close()


def test_a_cut_off_last_write_is_dropped_and_the_rest_loaded(tmp_path, caplog):
    s = opened(tmp_path)
    for i in range(5):
        s.set(f"k{i}", str(i))
    s.close()
    journal = tmp_path / "journal"
    whole = journal.read_bytes()
    journal.write_bytes(whole + whole.splitlines(keepends=True)[0][:-7])  # a torn append
    with caplog.at_level(logging.WARNING):
        again = opened(tmp_path)
    assert contents(again) == {(None, f"k{i}"): str(i) for i in range(5)}
    assert "cut-off write" in caplog.text and again.journal.problems == []
    again.close()
    assert journal.read_bytes() == whole  # truncated back to its whole lines


def test_damage_is_reported_moved_aside_and_never_loaded(tmp_path, caplog):
    s = opened(tmp_path)
    for i in range(6):
        s.set(f"k{i}", str(i))
    s.close()
    journal = tmp_path / "journal"
    lines = journal.read_bytes().splitlines(keepends=True)
    lines[3] = lines[3].replace(b'"3"', b'"9"')  # the value changed: its CRC fails
    journal.write_bytes(b"".join(lines))
    with caplog.at_level(logging.ERROR):
        again = opened(tmp_path)
    assert contents(again) == {(None, f"k{i}"): str(i) for i in range(3)}  # before the damage
    assert "damaged at line 4 of 6" in caplog.text and len(again.journal.problems) == 1
    assert (tmp_path / "journal.corrupt").read_bytes() == b"".join(lines)
    again.close()
    # a damaged snapshot: reported, moved aside, the journal alone loaded
    again = opened(tmp_path, compact_bytes=1)  # every write compacts
    again.set("after", "x")
    again.close()
    snap = tmp_path / "snapshot.json"
    snap.write_text(snap.read_text().replace('"after"', '"AFTER"'))
    third = opened(tmp_path)
    assert contents(third) == {} and "snapshot is damaged" in third.journal.problems[0]
    assert (tmp_path / "snapshot.json.corrupt").exists()
    third.close()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_compaction_keeps_the_store_and_a_kill_inside_it_loses_nothing(tmp_path, monkeypatch):
    s = opened(tmp_path, compact_bytes=2000)
    for i in range(400):
        s.set(f"k{i % 37}", f"v{i}", user="ann" if i % 2 else None)
        if i % 5 == 0:
            s.delete(f"k{(i + 3) % 37}", user=None)
    want = contents(s)
    s.close()
    assert (tmp_path / "snapshot.json").exists() and (tmp_path / "journal").stat().st_size < 2000
    assert contents(opened(tmp_path)) == want
    # killed after the new snapshot, before the journal was emptied: replayed, the same
    calls = []

    def atomic_write(path, data, keep_previous=False):
        if path.name == "journal":
            calls.append(path)
            raise SystemExit  # the writer thread dies here, as in a kill (pytest warns of it)
        real(path, data, keep_previous)

    real = durable.atomic_write
    monkeypatch.setattr(durable, "atomic_write", atomic_write)
    s = opened(tmp_path, compact_bytes=1)
    s.journal.live_bytes = lambda: 0  # compact at the next write
    s.set("late", "1")
    s.journal._thread.join(timeout=30)
    assert calls and not s.journal._thread.is_alive()
    monkeypatch.setattr(durable, "atomic_write", real)
    assert contents(opened(tmp_path)) == {**want, (None, "late"): "1"}


WRITER = textwrap.dedent(
    """
    import sys
    from pastry.control.kvstore import KvStore
    from pastry.control.kvstore_journal import StoreJournal

    s = KvStore(journal=StoreJournal(sys.argv[1], compact_bytes=1 << 16))  # compacts often
    print("ready", flush=True)
    i = 0
    while True:
        s.set(f"k{i % 50}", f"{i}:" + "x" * (i % 300))
        s.set("last", str(i))
        i += 1
    """
)


@pytest.mark.parametrize("after", [0.3, 0.9])
def test_a_writer_killed_mid_stream_leaves_a_state_it_passed_through(tmp_path, after):
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE)
    assert proc.stdout.readline() == b"ready\n"
    time.sleep(after)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    s = opened(tmp_path)
    last = int(s.get("last"))
    assert last > 0 and s.journal.problems == []
    # the state after set number `last` of "last" (every k its latest value), or one set
    # later (the next k written, "last" not yet)
    value = lambda i: f"{i}:" + "x" * (i % 300)  # noqa: E731
    for j in range(50):
        i = max((n for n in range(last + 1) if n % 50 == j), default=None)
        allowed = {None if i is None else value(i)}
        if j == (last + 1) % 50:
            allowed.add(value(last + 1))
        assert s.get(f"k{j}") in allowed, (j, last)
    s.check_integrity()
    s.close()
