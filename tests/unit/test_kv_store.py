"""The KV offload tiers' block store (services/engine/kv_offload/store.py): round trip, a
damaged file is a counted miss and removed, LRU under the budget, a restart sees the old
blocks, keys that could leave the root refused, crashed writers' temp files cleaned.
Two processes sharing one root: tests/integration/test_kv_store_processes.py; what another
local user could do to a tier: test_kv_tier_files.py."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest

from baton.services.engine.kv_offload import store as store_module
from baton.services.engine.kv_offload.store import BlockStore, split_key

NS = "3fa9c0d1e2b3a4f5-r0of1"


def key(i: int) -> str:
    return f"{NS}/{i:032x}"


def payload(i: int, size: int = 4096) -> bytes:
    """Distinct bytes per block, so that one block's bytes never pass for another's."""
    return (i.to_bytes(4, "little") * (size // 4 + 1))[:size]


def file_size(store: BlockStore, i: int, size: int = 4096) -> int:
    store.put(key(i), payload(i, size))
    return store.path(key(i)).stat().st_size


def age(store: BlockStore, keys_by_age: list[str]) -> None:
    """Set the files' mtimes a second apart, oldest first, all in the past: the ages the
    blocks would have had were they written and read seconds apart."""
    now = time.time_ns()
    for n, k in enumerate(keys_by_age):
        t = now - (len(keys_by_age) - n) * 1_000_000_000
        os.utime(store.path(k), ns=(t, t))


def test_round_trip_and_the_counts(tmp_path):
    store = BlockStore(tmp_path, 1 << 20, "host")
    sizes = (0, 1, 4096, 100_000, 64)
    for i, size in enumerate(sizes[:-1]):
        assert store.put(key(i), memoryview(payload(i, size))) is True
    assert store.put(key(4), memoryview(payload(4, 64)).cast("Q"))  # a typed view: its bytes
    for i, size in enumerate(sizes):
        assert store.contains(key(i))
        assert store.get(key(i), size) == payload(i, size)
    assert store.get(key(99), 64) is None and not store.contains(key(99))
    assert sorted(store.keys()) == sorted(key(i) for i in range(5))
    s = store.stats
    assert (s.hits, s.misses, s.saves, s.corrupt, s.forged, s.foreign) == (5, 1, 5, 0, 0, 0)
    assert s.save_bytes == s.load_bytes == sum(sizes)
    assert store.used_bytes() == sum(store.path(key(i)).stat().st_size for i in range(5))
    assert store.path(key(2)) == tmp_path / store.key_id / NS / "00" / f"{2:032x}.kv"
    store.check()


def _damage_payload(path):
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(data)


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[:-1])


def _grow(path):
    path.write_bytes(path.read_bytes() + b"\0")


def _swap(path):
    """Give this file the contents of block 1's file (and block 1 this one's)."""
    other = path.parent / f"{1:032x}.kv"
    a, b = path.read_bytes(), other.read_bytes()
    path.write_bytes(b)
    other.write_bytes(a)


MAC_AT = 16 + len(key(0))  # magic, version, lengths, key: then the MAC's 32 bytes


@pytest.mark.parametrize("damage,why", [
    (_damage_payload, "forged"), (_truncate, "corrupt"), (_grow, "corrupt"),
    (_swap, "corrupt")] + [pytest.param(n, "forged" if n >= MAC_AT else "corrupt",
                                        id=f"header-byte-{n}") for n in range(MAC_AT + 32)])
def test_a_damaged_file_is_a_counted_miss_and_is_removed(tmp_path, damage, why):
    """Damage to the header is found before the payload is read (corrupt); to the MAC or
    the payload, by the MAC (forged: the reader cannot tell damage from forgery)."""
    store = BlockStore(tmp_path, 1 << 20, "disk")
    for i in range(3):
        store.put(key(i), payload(i))
    path = store.path(key(0))
    before = store.used_bytes()
    if isinstance(damage, int):
        data = bytearray(path.read_bytes())
        data[damage] ^= 0xFF
        path.write_bytes(data)
    else:
        damage(path)
    assert store.contains(key(0))
    assert store.get(key(0), 4096) is None
    assert not path.exists() and not store.contains(key(0))
    assert (getattr(store.stats, why), store.stats.misses, store.stats.hits) == (1, 1, 0)
    assert store.stats.corrupt + store.stats.forged + store.stats.foreign == 1
    assert store.evicted() == [key(0)]  # gone from the tier: a "removed" event
    assert store.used_bytes() == before - (before // 3)
    if damage is _swap:  # block 1's file holds block 0's block now: a miss too
        assert store.get(key(1), 4096) is None and store.stats.corrupt == 2
        assert store.used_bytes() == before // 3
    assert store.get(key(2), 4096) == payload(2)
    assert store.put(key(0), payload(0)) and store.get(key(0), 4096) == payload(0)  # recomputed
    store.check()


def test_least_recently_used_goes_first_and_a_get_or_put_refreshes(tmp_path):
    probe = BlockStore(tmp_path / "probe", 1 << 20, "host")
    one = file_size(probe, 0)
    store = BlockStore(tmp_path / "lru", 4 * one, "host")
    for i in range(4):
        assert store.put(key(i), payload(i))
    age(store, [key(i) for i in range(4)])  # 0 oldest
    assert store.get(key(0), 4096) == payload(0)  # 1 is now the oldest
    assert store.put(key(2), payload(2)) is True  # already there: refreshed, not stored
    assert store.stats.saves == 4
    assert store.put(key(4), payload(4))
    assert store.evicted() == [key(1)]
    assert store.put(key(5), payload(5))
    assert store.evicted() == [key(3)]  # 0 and 2 were refreshed after 3
    assert sorted(store.keys()) == [key(i) for i in (0, 2, 4, 5)]
    assert store.stats.evictions == 2 and store.used_bytes() == 4 * one
    store.check()


def test_a_block_read_elsewhere_after_the_scan_is_not_evicted(tmp_path):
    """Eviction candidates come from a scan; a block read since (here by another store on
    the root, as another process would) is younger than the rest and stays."""
    probe = BlockStore(tmp_path / "probe", 1 << 20, "host")
    one = file_size(probe, 0)
    store = BlockStore(tmp_path / "lru", 4 * one, "host")
    for i in range(4):
        store.put(key(i), payload(i))
    age(store, [key(i) for i in range(4)])
    assert store.put(key(4), payload(4)) and store.evicted() == [key(0)]  # scanned here
    other = BlockStore(tmp_path / "lru", 4 * one, "host")
    assert other.get(key(1), 4096) == payload(1)
    assert store.put(key(5), payload(5))
    assert store.evicted() == [key(2)]
    assert sorted(store.keys()) == [key(i) for i in (1, 3, 4, 5)]
    store.check()


def test_the_budget_holds_and_a_block_over_it_is_refused(tmp_path):
    probe = BlockStore(tmp_path / "probe", 1 << 20, "host")
    one = file_size(probe, 0)
    budget = 10 * one + one // 2
    store = BlockStore(tmp_path / "store", budget, "host")
    for i in range(50):
        assert store.put(key(i), payload(i))
        blocks = (tmp_path / "store" / store.key_id / NS).rglob("*.kv")
        on_disk = sum(f.stat().st_size for f in blocks)
        assert on_disk == store.used_bytes() <= budget
    assert len(store.keys()) == 10 and store.stats.evictions == 40
    assert store.put(key(99), payload(99, budget)) is False
    assert not store.contains(key(99)) and len(store.keys()) == 10
    store.check()


def test_eviction_does_not_scan_the_tree_on_every_put(tmp_path, monkeypatch):
    probe = BlockStore(tmp_path / "probe", 1 << 20, "host")
    one = file_size(probe, 0, 256)
    store = BlockStore(tmp_path / "store", 20 * one, "host")
    scans = []
    scan = BlockStore._scan
    monkeypatch.setattr(BlockStore, "_scan", lambda self: scans.append(1) or scan(self))
    for i in range(400):
        assert store.put(key(i), payload(i, 256))
    assert store.stats.evictions == 380
    assert len(scans) <= 400 // 20 + 1, len(scans)  # about one per budget's worth of puts
    store.check()


def test_a_new_store_on_the_root_sees_the_blocks_already_there(tmp_path):
    first = BlockStore(tmp_path, 1 << 20, "disk")
    for i in range(5):
        first.put(key(i), payload(i))
    used = first.used_bytes()
    first.close()
    again = BlockStore(tmp_path, 1 << 20, "disk")
    assert sorted(again.keys()) == [key(i) for i in range(5)]
    assert all(again.contains(key(i)) and again.get(key(i), 4096) == payload(i)
               for i in range(5))
    assert again.used_bytes() == used and again.stats.hits == 5
    again.check()


def test_a_smaller_budget_at_start_evicts_down_to_it(tmp_path):
    first = BlockStore(tmp_path, 1 << 20, "disk")
    for i in range(5):
        first.put(key(i), payload(i))
    age(first, [key(i) for i in range(5)])
    one = first.path(key(0)).stat().st_size
    again = BlockStore(tmp_path, 2 * one, "disk")
    assert sorted(again.keys()) == [key(3), key(4)]
    assert again.evicted() == [key(0), key(1), key(2)]
    again.check()


def test_a_file_removed_between_contains_and_get_is_a_plain_miss(tmp_path):
    store = BlockStore(tmp_path, 1 << 20, "host")
    store.put(key(0), payload(0))
    assert store.contains(key(0))
    # Another process, as far as the files go, with room for one block: evicts block 0.
    other = BlockStore(tmp_path, store.path(key(0)).stat().st_size, "host")
    assert other.put(key(1), payload(1))
    assert not store.path(key(0)).exists()
    assert store.get(key(0), 4096) is None
    assert (store.stats.misses, store.stats.corrupt) == (1, 0)
    store.check()


@pytest.mark.parametrize("bad", [
    "", "abc", "/abc", "abc/", "a/b/c", "../abc", "abc/..", "./abc", "abc/.x", ".ns/ab",
    "ns/a b", "ns/a\\b", "ns/a\0b", "ns/é", "ns/" + "a" * 129, None, b"ns/ab"])
def test_a_key_that_could_leave_the_root_is_refused(tmp_path, bad):
    store = BlockStore(tmp_path, 1 << 20, "host")
    with pytest.raises(ValueError, match="bad KV store key"):
        split_key(bad)
    for call in (store.contains, lambda k: store.get(k, 1), lambda k: store.put(k, b"x")):
        with pytest.raises(ValueError, match="bad KV store key"):
            call(bad)
    assert sorted(tmp_path.iterdir()) == [tmp_path / ".key", tmp_path / ".lock"]


def test_a_crashed_writers_temp_file_is_named_then_cleaned_once_old(tmp_path):
    store = BlockStore(tmp_path, 1 << 20, "disk")
    store.put(key(0), payload(0))
    tmp = store.path(key(1)).with_name(f".{1:032x}.12345.0.tmp")
    tmp.write_bytes(b"half a block")  # what a writer killed mid-write leaves
    with pytest.raises(AssertionError, match="temp file left behind: .*12345"):
        store.check()
    assert BlockStore(tmp_path, 1 << 20, "disk").keys() == [key(0)]
    assert tmp.exists()  # young: maybe a writer still at work
    old = time.time() - store_module.TMP_MAX_AGE_S - 1
    os.utime(tmp, (old, old))
    again = BlockStore(tmp_path, 1 << 20, "disk")
    assert not tmp.exists()
    assert again.get(key(0), 4096) == payload(0)
    again.check()


def test_check_names_each_problem(tmp_path):
    store = BlockStore(tmp_path, 1 << 20, "disk")
    for i in range(3):
        store.put(key(i), payload(i))
    store.check()
    (tmp_path / store.key_id / NS / "zz").mkdir()
    (tmp_path / store.key_id / NS / "zz" / "notes.txt").write_text("x")
    bad = store.path(key(0))
    bad.write_bytes(bad.read_bytes()[:-1])
    store.budget_bytes = 10
    with pytest.raises(AssertionError) as e:
        store.check()
    for words in ("stray file: ", "notes.txt", f"{0:032x}.kv is corrupt", "over budget",
                  "the shared count says"):
        assert words in str(e.value)


def test_threads_putting_and_getting_keep_the_budget(tmp_path, monkeypatch):
    make_room, inside, most = BlockStore._make_room, [], []

    def make_room_then_yield(self, size):  # inside the lock: let another thread try it
        inside.append(1)
        fits = make_room(self, size)
        os.sched_yield()
        most.append(len(inside))
        inside.pop()
        return fits

    monkeypatch.setattr(BlockStore, "_make_room", make_room_then_yield)
    probe = BlockStore(tmp_path / "probe", 1 << 20, "host")
    one = file_size(probe, 0, 1024)
    store = BlockStore(tmp_path / "store", 30 * one, "host")
    wrong = []

    def work(start):
        for i in range(start, start + 200):
            assert store.put(key(i % 120), payload(i % 120, 1024))
            got = store.get(key((i * 7) % 120), 1024)
            if got is not None and got != payload((i * 7) % 120, 1024):
                wrong.append(i)

    threads = [threading.Thread(target=work, args=(n * 50,)) for n in range(4)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # the threads interleave inside each other's calls
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert not wrong
    assert max(most) == 1, "two threads inside the store's lock at once"
    assert store.used_bytes() <= 30 * one
    assert store.stats.hits + store.stats.misses == 800 and store.stats.corrupt == 0
    store.check()
