"""Tenancy bookkeeping, exactly (issue 17): users and grants, per-user exports and charges,
quotas, reclaiming persistent exports, fair-share eviction, the per-user store and topics,
request JSON checks, tokenizing off the loop, the program registry's namespaces."""

from __future__ import annotations

import asyncio
import json
import random
import threading

import pytest

from pastry.control.events import Finished, Message
from pastry.control.kvstore import KvStore, KvStoreConfig, KvStoreError
from pastry.control.messaging import MessageBus
from pastry.control.outbox import Outbox
from pastry.control.policies import FairShare
from pastry.control.quotas import Quotas, parse_quota, share_of
from pastry.control.resources import (
    ExportError,
    OutOfResources,
    QuotaExceeded,
    ResourceManager,
    TerminateNewest,
)
from pastry.control.tokenization import Tokenization, TokenizeTooLarge
from pastry.control.users import (
    Account,
    Directory,
    Grants,
    User,
    UsersError,
    parse_grant,
    parse_users,
    split_scoped,
)
from pastry.server import limits
from pastry.server.registry import ProgramRegistry, RegistryError, UploadQuotaError
from test_resources import Recorder, snapshot

# ------------------------------------------------------------------------------ users


def test_users_file_and_directory():
    accounts = parse_users("# team\nalice:tok-a\n\nroot:tok-r:operator\n", "users.txt")
    assert [(a.user, a.token) for a in accounts] == [
        (User("alice"), "tok-a"),
        (User("root", operator=True), "tok-r"),
    ]
    assert "tok-a" not in repr(accounts)  # tokens are never printed
    d = Directory.build("tok-admin", accounts, [("alice", "root")])
    assert d.authenticate("tok-a") == User("alice")
    assert d.authenticate("tok-admin") == User("admin", operator=True)
    for bad in (None, "", "tok-", "tok-a ", "tök-a", "\ud800", 42):
        assert d.authenticate(bad) is None
    assert not d.open and not d.single_user
    assert d.grants.may_read("root", "alice") and not d.grants.may_read("alice", "root")
    assert Directory().authenticate("anything") == User("local", operator=True)
    assert Directory.build("t").single_user


@pytest.mark.parametrize(
    "text, message",
    [
        ("alice", "line 1: expected NAME:TOKEN or NAME:TOKEN:operator"),
        ("alice:t:admin", "line 1: expected NAME:TOKEN"),
        ("\nal ice:t", "line 2: user name 'al ice' is not valid"),
        ("alice:", "line 1: the token of user 'alice' is empty"),
        ("alice:tök", "printable ASCII"),
    ],
)
def test_users_file_errors_name_the_line(text, message):
    with pytest.raises(UsersError, match=message):
        parse_users(text, "users.txt")


def test_directory_refuses_ambiguity():
    a, b = Account(User("a"), "same"), Account(User("b"), "same")
    with pytest.raises(UsersError, match="users 'a' and 'b' have the same token"):
        Directory([a, b])
    with pytest.raises(UsersError, match="user 'a' is defined twice"):
        Directory([a, Account(User("a"), "other")])
    with pytest.raises(UsersError, match="unknown user 'nobody'"):
        Directory([a], [("a", "nobody")])
    assert parse_grant("a:*") == ("a", "*") and Grants([("a", "*")]).may_read("x", "a")
    with pytest.raises(UsersError, match="OWNER:READER"):
        parse_grant("a")


def test_scoped_names():
    assert split_scoped("~alice/x/y") == ("alice", "x/y")
    assert split_scoped("plain") == (None, "plain")
    for own in ("~", "~alice", "~alice/", "~bad name/x", "a~b/c"):
        assert split_scoped(own) == (None, own)
    assert split_scoped("~alice/", prefix=True) == ("alice", "")


# ------------------------------------------------------------------------------ resources


def manager(pages=8, embeds=4, users=None, **kw) -> ResourceManager:
    rec = kw.pop("on_terminate", None)
    m = ResourceManager(pages, embeds, on_terminate=rec, **kw)
    if isinstance(rec, Recorder):
        rec.manager = m
    for inst, user in (users or {}).items():
        m.add_instance(inst, user)
    return m


def test_export_names_are_per_user():
    m = manager(users={1: "alice", 2: "bob", 3: "alice"})
    m.export(1, "kv", m.alloc(1, "kv", 2), "sys", persistent=True)
    m.export(2, "kv", m.alloc(2, "kv", 1), "sys")  # the same name, bob's own
    assert m.list_exports("alice") == [("sys", "kv", 2)]
    assert m.list_exports("bob") == [("sys", "kv", 1)]
    assert m.import_(3, "kv", "sys") == [0, 1]  # alice's other instance
    assert m.translate(3, "kv", [0, 1]) == [0, 1]
    with pytest.raises(ExportError, match="no export named 'sys'"):
        m.import_(2, "kv", "sys", owner="carol")
    assert m.import_(2, "kv", "sys", owner="alice") == [1, 2]  # a reader the caller allowed
    m.unexport(2, "sys")  # bob's, not alice's
    assert m.list_exports() == [("sys", "kv", 2)]
    with pytest.raises(ExportError, match="no export named 'other'"):
        m.unexport(2, "other")
    m.unexport(None, "sys", owner="alice")
    assert m.list_exports() == []
    m.check_integrity()


def test_charges_count_distinct_ids_and_exports():
    m = manager(pages=16, users={1: "alice", 2: "alice"})
    h = m.alloc(1, "kv", 3)
    m.export(1, "kv", h, "x")
    assert (m.charged(1, "kv"), m.user_charged("alice", "kv")) == (3, 3)
    m.import_(2, "kv", "x")
    m.import_(2, "kv", "x")  # twice: the same pages
    assert (m.held(2, "kv"), m.charged(2, "kv"), m.user_charged("alice", "kv")) == (6, 3, 3)
    # an instance cannot hold more by exporting and freeing: its exports are its own
    m.free(1, "kv", h)
    assert m.charged(1, "kv") == 3
    m.set_limit(1, "kv", 4, "the test")
    with pytest.raises(QuotaExceeded, match="inferlet 1 holds 3, asked for 2 more, quota 4"):
        m.alloc(1, "kv", 2)
    m.export(2, "kv", [0, 1], "keep", persistent=True)
    m.remove_instance(1)
    m.remove_instance(2)
    assert m.user_charged("alice", "kv") == 2  # the persistent export stays the user's
    m.check_integrity()


def test_limits_from_several_sources_the_smallest_wins():
    m = manager(users={1: None})
    m.set_limit(1, "kv", 5, "--instance-share 0.5")
    m.set_limit(1, "kv", 3, "SandboxLimits.max_kv_pages")
    assert m.limit(1, "kv") == 3
    with pytest.raises(QuotaExceeded, match=r"quota 3 \(set by SandboxLimits.max_kv_pages\)"):
        m.alloc(1, "kv", 4)
    m.set_limit(1, "kv", None, "SandboxLimits.max_kv_pages")
    assert m.limit(1, "kv") == 5 and len(m.alloc(1, "kv", 4)) == 4


def test_a_user_over_its_quota_loses_its_oldest_persistent_exports_first():
    m = manager(pages=16, users={1: "alice", 2: "alice", 3: "bob"})
    m.set_user_limit("alice", "kv", 6, "--user-share 0.375")
    m.export(1, "kv", m.alloc(1, "kv", 2), "a", persistent=True)
    m.export(1, "kv", m.alloc(1, "kv", 2), "b", persistent=True)
    m.export(3, "kv", m.alloc(3, "kv", 2), "a", persistent=True)  # bob's: never alice's to drop
    m.remove_instance(1)
    m.import_(2, "kv", "a")  # "a" is used again: "b" is now the least recently used
    m.free(2, "kv", [0, 1])
    before = snapshot(m)
    with pytest.raises(QuotaExceeded) as e:
        m.alloc(2, "kv", 7)  # even without her exports: over
    assert str(e.value) == (
        "KV page quota exceeded: user alice holds 4 (with its persistent exports), inferlet 2 "
        "asked for 7 more, quota 6 (set by --user-share 0.375). End instances or unexport "
        "what the user no longer needs, or raise --user-share 0.375"
    )
    assert snapshot(m) == before  # nothing was dropped in vain
    assert len(m.alloc(2, "kv", 4)) == 4  # 4 + 4 > 6: "b" goes
    assert m.list_exports("alice") == [("a", "kv", 2)] and m.list_exports("bob") == [("a", "kv", 2)]
    assert m.user_charged("alice", "kv") == 6
    assert m.import_(2, "kv", "a", owner="bob") == [6, 7]  # 6 + 2 > 6: her "a" goes
    assert m.list_exports("alice") == [] and m.user_charged("alice", "kv") == 6
    with pytest.raises(QuotaExceeded, match="user alice holds 6"):
        m.alloc(2, "kv", 1)  # nothing left to reclaim
    m.check_integrity()


def test_persistent_exports_are_reclaimed_before_anyone_ends():
    rec = Recorder()
    m = manager(pages=8, users={1: "alice", 2: "bob"}, on_terminate=rec)
    for name in ("old", "new"):
        pages = m.alloc(1, "kv", 2)
        m.export(1, "kv", pages, name, persistent=True)
        m.free(1, "kv", pages)  # left behind: only the export holds them
    held = m.alloc(1, "kv", 2)
    m.export(1, "kv", held, "shared", persistent=True)  # also held by a handle: frees nothing
    m.import_(2, "kv", "old", owner="alice")
    m.free(2, "kv", [0, 1])  # "old" was used more recently than "new"
    assert m.usage("kv")[0] == 2
    assert len(m.alloc(2, "kv", 4)) == 4  # 2 free + "new"
    assert rec.calls == [] and [n for n, _, _ in m.list_exports()] == ["old", "shared"]
    assert len(m.alloc(2, "kv", 2)) == 2  # then "old"; "shared" would free nothing
    assert rec.calls == [] and [n for n, _, _ in m.list_exports()] == ["shared"]
    m.check_integrity()


def test_fair_share_ends_the_heaviest_users_newest_instance():
    rec = Recorder()
    m = manager(pages=12, users={1: "alice", 2: "bob", 3: "alice", 4: "bob"}, on_terminate=rec,
                policy=FairShare())  # fmt: skip
    m.alloc(1, "kv", 4)
    m.alloc(2, "kv", 1)
    m.alloc(3, "kv", 3)
    m.alloc(4, "kv", 2)  # alice 7, bob 3; 2 free
    assert len(m.alloc(4, "kv", 4)) == 4  # alice's newest (3) ends, not bob's newer 4
    assert rec.ended == [3] and "holding the most" in rec.calls[0][1]
    with pytest.raises(OutOfResources, match="chose inferlet 4 itself"):
        m.alloc(4, "kv", 4)  # now bob holds the most, and 4 is his newest: it gives way
    assert rec.ended == [3]
    m.check_integrity()


@pytest.mark.parametrize("seed", range(4))
def test_fair_share_with_one_user_is_fcfs(seed):
    rng = random.Random(seed)
    for _ in range(50):
        held = [rng.randint(0, 4) for _ in range(rng.randint(1, 6))]
        ms = [manager(pages=sum(held) + 2, users={i: "u" for i in range(len(held))})
              for _ in range(2)]  # fmt: skip
        for m in ms:
            for i, n in enumerate(held):
                m.alloc(i, "kv", n)
        needed, requester = rng.randint(1, 8), rng.randrange(len(held))
        assert FairShare().choose_victims(ms[0], "kv", needed, requester) == (
            TerminateNewest().choose_victims(ms[1], "kv", needed, requester)
        )


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_ops_with_users_keep_integrity(seed):
    """Thousands of operations by instances of three users, under instance and user limits,
    with persistent exports: charges and refcounts always agree (check_integrity)."""
    rng = random.Random(seed)
    rec = Recorder()
    m = manager(pages=24, embeds=12, on_terminate=rec, policy=FairShare())
    for user in ("a", "b", "c"):
        for kind in ("kv", "embed"):
            m.set_user_limit(user, kind, 14)
    next_id, failures = 0, 0
    for _ in range(3000):
        insts = m.instances()
        op = rng.choice(["add", "alloc", "alloc", "free", "export", "import", "unex", "remove"])
        kind = rng.choice(["kv", "embed"])
        inst = rng.choice(insts) if insts else None
        try:
            if op == "add" or inst is None:
                m.add_instance(next_id, rng.choice("abc"))
                m.set_limit(next_id, kind, 9, "share")
                next_id += 1
            elif op == "alloc":
                m.alloc(inst, kind, rng.randint(0, 5))
            elif op == "free":
                held = list(m.handles.tables[kind][inst])
                m.free(inst, kind, rng.sample(held, rng.randint(0, len(held))))
            elif op == "export":
                held = list(m.handles.tables[kind][inst])
                m.export(inst, kind, rng.sample(held, rng.randint(0, len(held))),
                         f"e{rng.randint(0, 4)}", rng.random() < 0.5)  # fmt: skip
            elif op == "import":
                m.import_(inst, kind, f"e{rng.randint(0, 4)}", owner=rng.choice("abc"))
            elif op == "unex":
                m.unexport(inst, f"e{rng.randint(0, 4)}")
            else:
                m.remove_instance(inst)
        except (OutOfResources, ExportError):
            failures += 1
        m.check_integrity()
        for user in "abc":
            for k in ("kv", "embed"):
                assert m.user_charged(user, k) <= 14 or op == "export"
    assert failures and rec.calls


# ------------------------------------------------------------------------------ store, topics


def test_the_store_is_per_user_with_a_quota():
    store = KvStore(KvStoreConfig(max_user_bytes=10, max_total_bytes=15))
    store.set("k", "alice's", user="alice")
    store.set("k", "bob", user="bob")
    assert (store.get("k", "alice"), store.get("k", "bob"), store.get("k")) == (
        "alice's",
        "bob",
        None,
    )
    assert store.list_keys("", "alice") == ["k"] and store.list_keys() == []
    with pytest.raises(KvStoreError, match="this user's store to 14 bytes, over the quota of 10"):
        store.set("k2", "xxxxxxxx", user="bob")
    store.set("k", "shorter", user="alice")  # shrinking is always allowed
    with pytest.raises(KvStoreError, match="max_total_bytes"):
        store.set("z", "1234567", user="carol")
    assert store.delete("k", "bob") and not store.exists("k", "bob")
    assert store.user_bytes("alice") == 8 and store.total_bytes == 8
    store.check_integrity()

    async def wait():
        waiter = asyncio.create_task(store.wait_for("w", 5, user="bob"))
        await asyncio.sleep(0)
        store.set("w", "", user="alice")  # alice's "w" does not wake bob
        await asyncio.sleep(0)
        assert not waiter.done()
        store.set("w", "yes", user="bob")
        return await waiter

    assert asyncio.run(wait()) == "yes"


def test_topics_are_per_user():
    bus = MessageBus()
    mine, theirs = bus.subscribe("1", "t", "alice"), bus.subscribe("2", "t", "bob")
    assert bus.broadcast("3", "t", "hi", "alice") == 1
    assert (mine.get_nowait(), theirs.get_nowait()) == ("hi", None)
    assert bus.topics("alice") == {"t": 1} and bus.topics() == {}
    bus.check_integrity()


def test_outbox_counts_unread_message_bytes():
    async def go():
        box = Outbox()
        box.put_nowait(Message("héllo"))
        box.put_nowait(Message("x" * 10))
        assert box.queued_bytes == 16
        assert await box.get() == Message("héllo") and box.queued_bytes == 10
        box.put_nowait(Finished("end"))  # the end is not a message
        assert box.queued_bytes == 10
        await box.get()
        assert box.queued_bytes == 0

    asyncio.run(go())


# ------------------------------------------------------------------------------ requests


def test_json_depth_and_unicode_checks():
    assert limits.loads('{"a": [[1]], "s": "[[[[[[", "e": "\\ud83d\\ude00"}', 3) == {
        "a": [[1]],
        "s": "[[[[[[",
        "e": "😀",
    }
    with pytest.raises(limits.BadRequest, match="nested deeper than 3"):
        limits.loads('{"a": [[[1]]]}', 3)
    with pytest.raises(limits.BadRequest, match="nested deeper than 64"):
        limits.loads("[" * 100_000 + "]" * 100_000, 64)  # json itself would recurse
    with pytest.raises(limits.BadRequest, match="lone surrogate"):
        limits.loads('{"k": ["\\udc00"]}', 8)
    with pytest.raises(limits.BadRequest, match="lone surrogate"):
        limits.loads('{"\\ud800": 1}', 8)
    assert limits.loads('"\\\\ud800"', 8) == "\\ud800"  # an escaped backslash: plain text
    with pytest.raises(ValueError):
        limits.loads("{nope", 8)


def test_quotas():
    assert Quotas().instance_share == 0.5 and Quotas.none().backlog_bytes is None
    with pytest.raises(ValueError, match=r"instance_share must be in \(0, 1\]"):
        Quotas(instance_share=1.5)
    with pytest.raises(ValueError, match="json_depth cannot be switched off"):
        Quotas(json_depth=None)
    assert [parse_quota("backlog_bytes", t) for t in ("8MiB", "2k", "100", "none")] == [
        8 << 20,
        2048,
        100,
        None,
    ]
    assert (share_of(0.5, 1024), share_of(0.001, 10), share_of(1.0, 10)) == (512, 1, None)


def test_tokenization_off_the_loop(make_tiny):
    from pastry.wire.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(make_tiny("llama"))
    t = Tokenization(tok, max_bytes=1000, cache_min_chars=100)
    text = "hello world " * 50
    seen = []
    thread = threading.Thread(target=lambda: seen.append(t.encode_batch([text, "short"])))
    thread.start()
    thread.join()
    assert seen[0] == [tok.encode(text), tok.encode("short")]
    assert t.encode(text) == tok.encode(text) and t.hits == 1  # remembered, not the cap
    with pytest.raises(TokenizeTooLarge, match="at most 1000 bytes of text at once"):
        t.encode("x" * 1001)
    long = "a" * (4 * t.longest_token_bytes * 100 + 1)
    assert t.count([long, "hi"], limit=100) == [101, len(tok.encode("hi"))]
    assert t.fewest_tokens(long) <= len(tok.encode(long))


# ------------------------------------------------------------------------------ registry

PROG = "async def main(args):\n    return {!r}\n"


def test_registry_namespaces_builtins_and_quotas(tmp_path):
    reg = ProgramRegistry(tmp_path, max_programs_per_user=2, max_bytes_per_user=200)
    reg.add_builtins()
    alice, bob = User("alice"), User("bob")
    from importlib import resources

    copy = resources.files("pastry.inferlets").joinpath("chat.py").read_text()
    reg2 = ProgramRegistry(tmp_path / "big")
    reg2.add_builtins()
    reg2.upload(copy, "my-chat", alice)  # a byte-identical copy, another name
    with pytest.raises(RegistryError, match="'chat' is a built-in"):
        reg2.upload(PROG.format("evil"), "chat", alice)
    assert reg2.get("chat", "alice") is reg2.builtin("chat")
    assert reg2.info("my-chat", "alice").trusted is False  # a copy runs like any upload

    a = reg.upload(PROG.format("a"), "p", alice)
    b = reg.upload(PROG.format("b"), "p", bob)
    assert a.hash != b.hash and reg.resolve("p", "alice") == a and reg.resolve("p", "bob") == b
    with pytest.raises(RegistryError, match="no program"):
        reg.resolve(b.hash[:12], "alice")  # bob's program is not alice's to launch
    assert [p.name for p in reg.list("alice") if not p.builtin] == ["p"]
    reg.upload(PROG.format("a2"), "q", alice)
    with pytest.raises(UploadQuotaError, match="already stores 2 programs"):
        reg.upload(PROG.format("a3"), "r", alice)
    reg.upload(PROG.format("a3"), "q", alice)  # replacing keeps the count
    with pytest.raises(UploadQuotaError, match="over the quota of 200 bytes"):
        reg.upload("#" * 180 + "\n" + PROG.format("x"), "q", alice)
    reg.delete("q", alice)
    assert reg.usage("alice") == (1, a.size)
    with pytest.raises(RegistryError, match="not valid"):
        reg.upload(PROG.format("x"), "~bob/p", alice)
    # persisted with owner and trust; an index from before users belongs to 'local'
    again = ProgramRegistry(tmp_path)
    assert again.resolve("p", "alice") == a and again.resolve("p", "bob") == b
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    (legacy / f"{a.hash}.py").write_text(PROG.format("a"))
    rows = [{"hash": a.hash, "name": "old", "size": a.size, "builtin": False}]
    (legacy / "index.json").write_text(json.dumps(rows))
    old = ProgramRegistry(legacy, trusted_uploads=True).resolve("old", "local")
    assert (old.owner, old.trusted) == ("local", False)


def test_charges_follow_swapped_pages():
    """A page swapped to host memory is still held: an instance cannot grow past its quota
    by having its pages moved out, and charges stay exact through swap out and in."""
    m = ResourceManager(8, 4, num_host_pages=8)
    m.add_instance(1, "alice")
    m.set_limit(1, "kv", 4, "--instance-share 0.5")
    h = m.alloc(1, "kv", 4)
    assert m.swap_out(1) == 4 and m.handles_on_host(1) == 4
    assert m.charged(1, "kv") == 4 and m.user_charged("alice", "kv") == 4
    m.check_integrity()
    with pytest.raises(QuotaExceeded, match="holds 4, asked for 1 more, quota 4"):
        m.alloc(1, "kv", 1)
    m.take_moves()
    assert m.swap_in(1) == 4 and m.charged(1, "kv") == 4
    m.check_integrity()
    m.take_moves()  # the batch that copies them back goes out
    m.free(1, "kv", h)
    assert m.charged(1, "kv") == 0 and m.user_charged("alice", "kv") == 0
    m.check_integrity()


def test_a_hold_hands_pages_from_one_instance_to_another():
    """How the router gives a requester the pages it received (start_generate)."""
    m = manager(pages=4, users={1: "router", 2: "alice"})
    pages = m.alloc(1, "kv", 2)
    ids = m.translate(1, "kv", pages)
    hold = m.hold(1, "kv", pages)
    mine = m.claim(2, "kv", hold, "router")
    m.release(hold, "router")
    m.free(1, "kv", pages)
    assert m.translate(2, "kv", mine) == ids
    assert m.charged(1, "kv") == 0 and m.charged(2, "kv") == 2
    assert m.user_charged("router", "kv") == 0 and m.user_charged("alice", "kv") == 2
    with pytest.raises(ExportError, match="released"):
        m.claim(2, "kv", hold, "router")
    m.check_integrity()


def test_the_servers_holds_are_never_reclaimed_listed_or_named():
    """The server's own holds (pages a KV transfer is writing) survive memory pressure,
    the instance's end and its user's export calls; released, they free their pages."""
    rec = Recorder()
    m = manager(pages=4, users={1: "router", 2: "alice"}, on_terminate=rec)
    pages = m.alloc(1, "kv", 2)
    hold = m.hold(1, "kv", pages)
    m.free(1, "kv", pages)
    with pytest.raises(OutOfResources):
        m.alloc(2, "kv", 3)  # only the held pages could make room: nobody else ends
    assert m.list_exports("router") == [] and m.list_exports() == []
    assert m.user_charged("router", "kv") == 2  # counted as its user's
    with pytest.raises(ExportError):
        m.import_(1, "kv", str(hold))
    m.remove_instance(1)
    m.check_integrity()
    with pytest.raises(OutOfResources):
        m.alloc(2, "kv", 3)  # still held after the instance ended
    m.release(hold, "router")
    m.release(hold, "router")  # released once; again is a no-op
    assert m.user_charged("router", "kv") == 0
    assert len(m.alloc(2, "kv", 3)) == 3
    m.check_integrity()
