"""What another local user can do to a KV tier (services/engine/kv_offload/), refused: a
tier folder they made first, opened to them, or a link; a link planted as the lock or
the key file; a block forged without the tier's key (a CRC32 is no key); a FIFO or a link
under a block's name; a header that claims a huge payload; junk that would fill the
budget. Each folder case is refused at start naming what is wrong; each file case is a
counted miss, and the tier goes on. The MAC key: the cluster token's, else a key file."""

from __future__ import annotations

import os
import struct
import threading
import zlib

import pytest

from baton.services.engine.kv_offload import block_file
from baton.services.engine.kv_offload.store import BlockStore

NS = "3fa9c0d1e2b3a4f5-r0of1"
SIZE = 4096
OTHER_UID = 12345


def key(i: int) -> str:
    return f"{NS}/{i:032x}"


def payload(i: int) -> bytes:
    return (i.to_bytes(4, "little") * (SIZE // 4))[:SIZE]


def _plant(path, data: bytes = b"") -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def _other_users(folder) -> None:
    folder.mkdir(mode=0o700)
    os.chown(folder, OTHER_UID, OTHER_UID)


def _open_to_all(folder) -> None:
    folder.mkdir()
    folder.chmod(0o777)


def _a_link(folder) -> None:
    real = folder.with_name("real")
    real.mkdir(mode=0o700)
    folder.symlink_to(real)


@pytest.mark.parametrize("make,words", [
    (_other_users, f"is owned by uid {OTHER_UID}, not by this process's uid {os.geteuid()}"),
    (_open_to_all, "has mode 0777: group or others may open it"),
    (_a_link, "is a symbolic link")])
def test_a_tier_folder_that_is_not_this_users_own_is_refused(tmp_path, make, words):
    folder = tmp_path / "baton-kv"
    make(folder)
    with pytest.raises(ValueError, match=f"the KV host tier's folder {folder} {words}"):
        BlockStore(folder, 1 << 20, "host")
    assert not os.path.lexists(folder / ".lock")  # nothing written through it
    assert not os.path.lexists(tmp_path / "real" / ".lock")


def test_a_missing_tier_folder_is_made_private(tmp_path):
    old = os.umask(0o022)
    try:
        BlockStore(tmp_path / "a" / "b" / "kv", 1 << 20, "disk")
    finally:
        os.umask(old)
    assert (tmp_path / "a" / "b" / "kv").stat().st_mode & 0o777 == 0o700
    assert (tmp_path / "a" / "b" / "kv" / ".key").stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize("name", [".lock", ".key"])
def test_a_link_planted_as_the_lock_or_key_is_refused_and_its_target_untouched(tmp_path,
                                                                               name):
    folder, victim = tmp_path / "kv", tmp_path / "victim"
    folder.mkdir(mode=0o700)
    victim.write_bytes(b"a file of the victim's\n")
    victim.chmod(0o600)
    (folder / name).symlink_to(victim)
    with pytest.raises(ValueError, match=f"{folder / name} is a symbolic link"):
        BlockStore(folder, 1 << 20, "host")
    assert victim.read_bytes() == b"a file of the victim's\n"


@pytest.mark.parametrize("spoil,words", [
    (lambda p: p.chmod(0o644), "has mode 0644"),
    (lambda p: os.chown(p, OTHER_UID, OTHER_UID), f"is owned by uid {OTHER_UID}"),
    (lambda p: p.write_bytes(b"short"), "holds 5 bytes, not 32")])
def test_a_key_file_that_is_not_this_users_own_is_refused(tmp_path, spoil, words):
    BlockStore(tmp_path, 1 << 20, "host").close()
    spoil(tmp_path / ".key")
    with pytest.raises(ValueError, match=f"key file {tmp_path / '.key'} {words}"):
        BlockStore(tmp_path, 1 << 20, "host")


def test_stores_with_the_same_key_share_blocks_and_others_never_read_them(tmp_path):
    plain = BlockStore(tmp_path, 1 << 20, "host")  # no token: the key file
    assert plain.put(key(1), payload(1))
    assert BlockStore(tmp_path, 1 << 20, "host").get(key(1), SIZE) == payload(1)
    a = BlockStore(tmp_path, 1 << 20, "host", secret="cluster token one")
    assert a.put(key(2), payload(2))
    assert BlockStore(tmp_path, 1 << 20, "host", "cluster token one").get(key(2), SIZE) \
        == payload(2)
    b = BlockStore(tmp_path, 1 << 20, "host", secret="cluster token two")
    assert not b.contains(key(1)) and not b.contains(key(2)) and b.keys() == []
    assert b.get(key(2), SIZE) is None and (b.stats.misses, b.stats.forged) == (1, 0)
    # One budget for all keys: each store counts every key's blocks.
    assert b.used_bytes() == a.used_bytes() == 2 * plain.path(key(1)).stat().st_size
    assert a.key_id != b.key_id != plain.key_id


def _old_format(k: str, data: bytes) -> bytes:
    """A block as version 1 wrote it: a CRC32 anyone can compute, no key."""
    head = struct.pack("<4sHHQ", b"BTKV", 1, len(k), len(data)) + k.encode()
    return head + struct.pack("<I", zlib.crc32(data, zlib.crc32(head))) + data


def _other_key(k: str, data: bytes) -> bytes:
    """A block in this format, its MAC made with a key other than the tier's."""
    return block_file.header(bytes(32), k.encode(), memoryview(data)) + data


@pytest.mark.parametrize("forge,why", [(_old_format, "corrupt"), (_other_key, "forged")])
def test_a_block_forged_without_the_key_is_a_counted_miss(tmp_path, forge, why):
    store = BlockStore(tmp_path, 1 << 20, "host")
    assert store.put(key(0), payload(0))
    path = store.path(key(1))
    _plant(path, forge(key(1), payload(1)))
    assert store.contains(key(1))
    assert store.get(key(1), SIZE) is None
    assert (getattr(store.stats, why), store.stats.misses, store.stats.hits) == (1, 1, 0)
    assert not path.exists() and store.evicted() == [key(1)]
    assert store.get(key(0), SIZE) == payload(0)
    store.check()


def _get_within(store: BlockStore, k: str, timeout_s: float = 5.0):
    """store.get(k), or AssertionError if it has not returned within `timeout_s`."""
    out = []
    thread = threading.Thread(target=lambda: out.append(store.get(k, SIZE)), daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():  # let it go: a writer opens the FIFO, so its reader returns
        os.close(os.open(store.path(k), os.O_WRONLY | os.O_NONBLOCK))
        raise AssertionError(f"get({k!r}) still blocked after {timeout_s} s")
    return out[0]


def test_a_fifo_or_a_link_under_a_blocks_name_is_a_miss_at_once(tmp_path):
    store = BlockStore(tmp_path, 1 << 20, "host")
    victim = tmp_path.parent / f"{tmp_path.name}-victim"
    victim.write_bytes(_other_key(key(2), payload(2)))
    fifo, link = store.path(key(1)), store.path(key(2))
    os.makedirs(fifo.parent, exist_ok=True)
    os.mkfifo(fifo)
    link.symlink_to(victim)
    assert _get_within(store, key(1)) is None
    assert _get_within(store, key(2)) is None
    assert (store.stats.foreign, store.stats.misses) == (2, 2)
    assert not os.path.lexists(fifo) and not os.path.lexists(link) and victim.exists()
    assert store.put(key(1), payload(1)) and store.get(key(1), SIZE) == payload(1)


def _bytes_read() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar")).split()[1])


@pytest.mark.parametrize("version", [1, block_file.VERSION])
def test_a_header_claiming_a_huge_payload_is_a_miss_before_it_is_read(tmp_path, version):
    """A sparse file whose size agrees with its header's 48 MiB: nothing past the header
    is read, as the reader expects SIZE bytes (and version 1 is not this format)."""
    store = BlockStore(tmp_path, 1 << 30, "host")
    huge, k = 48 << 20, key(1).encode()
    head = struct.pack("<4sHHQ", b"BTKV", version, len(k), huge) + k
    tail = 4 if version == 1 else block_file.MAC_BYTES  # the CRC32, or the MAC
    path = store.path(key(1))
    _plant(path, head + bytes(tail))
    os.truncate(path, len(head) + tail + huge)
    before = _bytes_read()
    assert store.get(key(1), SIZE) is None
    assert _bytes_read() - before < 1 << 20
    assert store.stats.corrupt == 1 and not path.exists()


def test_junk_under_the_root_neither_counts_nor_stops_the_saves(tmp_path):
    """300 MiB (sparse) of files that are not the tier's: a stray name at the root and in
    a shard, and another user's file under a block's name. None counts against the
    budget, none is evicted, every save fits, and a save under that block's name
    replaces the file there."""
    first = BlockStore(tmp_path, 1 << 20, "host")
    first.put(key(0), payload(0))
    one = first.path(key(0)).stat().st_size
    junk = [tmp_path / "notes", first.path(key(0)).parent / "notes.txt",
            first.path(key(99))]
    for path in junk:
        _plant(path)
        os.truncate(path, 100 << 20)
    os.chown(junk[-1], OTHER_UID, OTHER_UID)
    first.close()
    store = BlockStore(tmp_path, 8 * one, "host")
    assert store.used_bytes() == one
    for i in range(1, 20):
        assert store.put(key(i), payload(i)), i
    assert store.used_bytes() == 8 * one
    assert (store.stats.saves, store.stats.evictions) == (19, 12)
    assert all(p.stat().st_size == 100 << 20 for p in junk)
    assert key(99) not in store.keys()
    assert store.put(key(99), payload(99)) and store.get(key(99), SIZE) == payload(99)
    assert store.used_bytes() == 8 * one and store.stats.evictions == 13
