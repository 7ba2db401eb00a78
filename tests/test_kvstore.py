"""KvStore: operations, byte accounting, limits, wait_for."""

from __future__ import annotations

import asyncio

import pytest

from pastry.control.kvstore import KvStore, KvStoreConfig, KvStoreError


def test_basic_operations_and_accounting():
    store = KvStore()
    assert store.get("a") is None and not store.exists("a")
    store.set("a", "1", instance_id="inst-1")
    store.set("b/x", "22")
    store.set("b/y", "333", instance_id="inst-2")
    assert store.get("a") == "1" and store.exists("a")
    assert store.last_writer("a") == "inst-1" and store.last_writer("b/x") is None
    assert store.list_keys() == ["a", "b/x", "b/y"]
    assert store.list_keys("b/") == ["b/x", "b/y"]
    assert store.list_keys("zz") == []
    assert len(store) == 3 and store.total_bytes == (1 + 1) + (3 + 2) + (3 + 3)
    store.set("a", "replaced", instance_id="inst-3")
    assert store.get("a") == "replaced" and store.last_writer("a") == "inst-3"
    assert store.total_bytes == (1 + 8) + 5 + 6
    assert store.delete("a") is True and store.delete("a") is False
    assert store.get("a") is None and store.last_writer("a") is None
    assert store.total_bytes == 11
    store.set("e", "")  # empty values are values
    assert store.get("e") == "" and store.exists("e")
    store.check_integrity()


def test_limits_name_the_limit_and_leave_store_unchanged():
    store = KvStore(KvStoreConfig(max_key_bytes=4, max_value_bytes=6, max_total_bytes=12))
    with pytest.raises(KvStoreError, match=r"5 bytes, over the limit of 4 bytes.*max_key_bytes"):
        store.set("kkkkk", "v")
    with pytest.raises(KvStoreError, match="max_key_bytes"):
        store.get("éèê")  # 3 characters, 6 bytes
    with pytest.raises(KvStoreError, match=r"8 bytes, over the limit of 6.*max_value_bytes"):
        store.set("k", "éééé")
    with pytest.raises(KvStoreError, match="must not be empty"):
        store.set("", "v")
    store.set("k1", "vvvvvv")  # 8 bytes
    with pytest.raises(KvStoreError, match=r"to 13 bytes, over the limit of 12.*max_total"):
        store.set("k2", "abc")
    store.set("k1", "v")  # shrinking frees room
    store.set("k2", "abc")
    assert store.total_bytes == 3 + 5 and store.list_keys() == ["k1", "k2"]
    with pytest.raises(TypeError):
        store.set("k", 1)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        store.get(None)  # type: ignore[arg-type]
    store.check_integrity()


def test_wait_for():
    async def main():
        store = KvStore()
        store.set("ready", "yes")
        assert await store.wait_for("ready", timeout=0) == "yes"

        waiters = [asyncio.create_task(store.wait_for("plan", timeout=5)) for _ in range(2)]
        await asyncio.sleep(0)
        assert store.waiting() == 2
        store.set("other", "x")
        await asyncio.sleep(0)
        assert not any(w.done() for w in waiters)
        store.set("plan", "v1", instance_id="planner")
        store.set("plan", "v2")
        assert await asyncio.gather(*waiters) == ["v1", "v1"]
        assert store.waiting() == 0

        with pytest.raises(TimeoutError, match=r"key 'never' was not set within 0\.01 s"):
            await store.wait_for("never", timeout=0.01)
        assert store.waiting() == 0

        task = asyncio.create_task(store.wait_for("never"))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert store.waiting() == 0
        store.check_integrity()

    asyncio.run(main())
