"""`BlockStore`: KV blocks as files under one root, shared by every process on the host
that opens the same root, kept under a byte budget, least recently used out first.

The host tier is a store rooted in /dev/shm (tmpfs: memory every process maps), the disk
tier one rooted on a disk path; the store is the same. Torch-free: blocks are bytes.

    root/
      .lock                          flock'd around all accounting; holds the bytes in use
                                     (block files + temp files being written), int64 LE
      <namespace>/<hh>/<hash>.kv     one block, key "<namespace>/<hash>", hh = hash[:2]
      <namespace>/<hh>/.<hash>.<pid>.<n>.tmp   a block being written

    a block file:
    | magic "BTKV" | version u16 | key_len u16 | payload_len u64 | key | crc32 u32 | payload |
      4 bytes        2             2             8                 key_len  4         payload_len
    crc32 covers every byte before it and the payload: a flipped byte anywhere, a short or
    long file, or a file holding another key's block is a miss, removed, never returned.

A put reserves its bytes in the shared count (evicting first) and creates its temp file
at its full size under the lock, writes it outside, and os.replace's it into place under
the lock: readers never see a partial file, and at any moment the lock is free the files
under the root (temp files included) hold no more than the count, which is at most the
budget. A get hit refreshes the file's mtime; eviction takes the oldest mtimes first, from
a list of the oldest files that each process builds by scanning the tree only when its
list runs out (not on every put). Each file's mtime is re-read before it is evicted, so a
block another process read since the scan stays. No fsync: a block lost or torn by a
crash of the machine fails its checksum and is a miss.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import heapq
import itertools
import os
import re
import struct
import threading
import time
import zlib
from collections import deque
from pathlib import Path

MAGIC = b"BTKV"
VERSION = 1
HEAD = struct.Struct("<4sHHQ")  # magic, version, key length, payload length
CRC = struct.Struct("<I")
USAGE = struct.Struct("<q")
SUFFIX, TMP_SUFFIX = ".kv", ".tmp"
PART = re.compile(r"[0-9A-Za-z_-][0-9A-Za-z_.-]{0,127}")  # no leading dot: no "..", no temp
TMP_MAX_AGE_S = 10.0  # a temp file older than this is a crashed writer's
CANDIDATES = 4096  # the oldest files a scan keeps as eviction candidates


@dataclasses.dataclass
class StoreStats:
    """This process's counts. A miss is every get that returned None, corrupt ones too."""

    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    saves: int = 0
    save_bytes: int = 0
    load_bytes: int = 0
    evictions: int = 0


def split_key(key: str) -> tuple[str, str]:
    """"<namespace>/<hash>" -> its two parts, or ValueError: each part of [0-9A-Za-z_.-],
    1 to 128 characters, not starting with a dot, exactly one "/"."""
    parts = key.split("/") if isinstance(key, str) else []
    if len(parts) != 2 or not all(PART.fullmatch(p) for p in parts):
        raise ValueError(f"bad KV store key {key!r}: want <namespace>/<hash>, each part of "
                         "[0-9A-Za-z_.-] (1-128 characters, no leading dot)")
    return parts[0], parts[1]


def _header(key: bytes, payload: memoryview) -> bytes:
    head = HEAD.pack(MAGIC, VERSION, len(key), payload.nbytes) + key
    return head + CRC.pack(zlib.crc32(payload, zlib.crc32(head)))


def _parse(f, key: bytes, size: int) -> bytes | None:
    """The payload of the block file open as `f` (`size` bytes long), or None if any of it
    is wrong: magic, version, key, length, checksum."""
    head = f.read(HEAD.size)
    if len(head) != HEAD.size:
        return None
    magic, version, key_len, length = HEAD.unpack(head)
    if magic != MAGIC or version != VERSION or key_len != len(key) \
            or size != HEAD.size + key_len + CRC.size + length:
        return None
    rest = f.read(key_len + CRC.size)
    if rest[:key_len] != key:
        return None
    payload = f.read(length)
    if len(payload) != length or CRC.unpack(rest[key_len:])[0] != zlib.crc32(
            payload, zlib.crc32(head + key)):
        return None
    return payload


class BlockStore:
    """KV blocks under `root`, at most `budget_bytes` of files, shared with every process
    that opens the same root (each should pass the same budget). Thread-safe. `medium`
    ("host" or "disk") names the tier, for metrics and events."""

    def __init__(self, root: str | os.PathLike, budget_bytes: int, medium: str):
        if medium not in ("host", "disk"):
            raise ValueError(f"medium must be 'host' or 'disk', not {medium!r}")
        self.root, self._root = Path(root), str(root)
        self.budget_bytes = int(budget_bytes)
        self.medium = medium
        self.stats = StoreStats()
        self._mutex = threading.Lock()  # this process's threads, around the flock
        self._stats_lock = threading.Lock()
        self._evicted: list[str] = []
        self._candidates: deque[tuple[int, str, str]] = deque()  # (mtime_ns, path, key)
        self._usage = 0  # the shared count, valid while the lock is held
        self._names = itertools.count()
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._lock_fd = os.open(self.root / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        with self._locked():  # a start: stale temp files out, the count made exact
            self._scan()
            self._make_room(0)

    def close(self) -> None:
        with self._mutex:
            if self._lock_fd >= 0:
                os.close(self._lock_fd)
                self._lock_fd = -1

    def path(self, key: str) -> Path:  # where `key`'s block lives (or would)
        return Path(self._file(key)[0])

    def _file(self, key: str) -> tuple[str, str, str]:
        """(the block file, its directory, its hash), as strings: cheaper than Paths."""
        ns, h = split_key(key)
        folder = os.path.join(self._root, ns, h[:2])
        return os.path.join(folder, h + SUFFIX), folder, h

    def contains(self, key: str) -> bool:
        return os.path.exists(self._file(key)[0])

    def get(self, key: str) -> bytes | None:
        path = self._file(key)[0]
        payload = None
        try:
            with open(path, "rb") as f:
                st = os.fstat(f.fileno())
                payload = _parse(f, key.encode(), st.st_size)
                if payload is not None:
                    os.utime(f.fileno())  # a hit is the youngest (LRU)
        except OSError:  # absent, removed since contains(), or unreadable
            self._count(misses=1)
            return None
        if payload is None:
            self._discard(path, st, key)
            self._count(misses=1, corrupt=1)
            return None
        self._count(hits=1, load_bytes=len(payload))
        return payload

    def put(self, key: str, data: bytes | memoryview) -> bool:
        """Store `data` under `key`; False if it could not be (larger than the budget, the
        budget held by other processes' writes, a write error). A key already there is
        left as it is, its age refreshed."""
        path, folder, h = self._file(key)
        payload = memoryview(data)
        if payload.format != "B" or payload.ndim != 1:
            payload = payload.cast("B")
        if self._touch(path):
            return True
        header = _header(key.encode(), payload)
        size = len(header) + payload.nbytes
        if size > self.budget_bytes:
            return False
        tmp = os.path.join(folder, f".{h}.{os.getpid()}.{next(self._names)}{TMP_SUFFIX}")
        with self._locked():
            if self._touch(path):
                return True
            if not self._make_room(size):
                return False
            self._usage += size  # counted before the file exists: a crash over-counts
            try:
                fd = self._create(tmp, size)
            except OSError:
                self._usage -= size
                return False
        try:
            with open(fd, "wb", closefd=True) as f:
                f.write(header)
                f.write(payload)
        except OSError:
            with self._locked():
                self._unlink(tmp, size)
            return False
        with self._locked():
            if self._touch(path):  # another process stored it meanwhile
                self._unlink(tmp, size)
                return True
            try:
                os.utime(tmp)  # the new block is the youngest
                os.replace(tmp, path)
            except OSError:  # gone too (a stall, taken for a crashed writer's): not counted
                self._unlink(tmp, size)
                return False
        self._count(saves=1, save_bytes=payload.nbytes)
        return True

    def used_bytes(self) -> int:
        """The bytes the root's block files hold (and those being written), all processes."""
        with self._locked():
            return self._usage

    def keys(self, namespace: str | None = None) -> list[str]:
        """Every block's key; or those under `namespace`, by name alone (no stat: cheap)."""
        if namespace is None:
            return [key for kind, _, _, key in self._walk() if kind == "block"]
        return [f"{namespace}/{f.name[:-len(SUFFIX)]}" for shard in _entries(
            os.path.join(self._root, namespace)) for f in _entries(shard.path)
            if f.name.endswith(SUFFIX) and not f.name.startswith(".")]

    def evicted(self) -> list[str]:
        """The keys this process evicted, or removed as corrupt, since the last call."""
        with self._mutex:
            out, self._evicted = self._evicted, []
        return out

    def check(self) -> None:
        """AssertionError naming each problem: files over the budget or not matching the
        shared count, a temp file left behind, a file that does not parse, a stray file.
        For a quiet store (after a run): a put in flight has a temp file."""
        problems, total = [], 0
        with self._locked():
            for kind, path, st, key in self._walk():
                if kind == "block":
                    total += st.st_size
                    with open(path, "rb") as f:  # under the lock: nothing removes it
                        if _parse(f, key.encode(), st.st_size) is None:
                            problems.append(f"{path} does not parse as {key!r}")
                elif kind == "tmp":
                    problems.append(f"temp file left behind: {path}")
                else:
                    problems.append(f"stray file: {path}")
            if total > self.budget_bytes:
                problems.append(f"over budget: {total} bytes > {self.budget_bytes}")
            if total != self._usage:
                problems.append(f"the shared count says {self._usage} bytes, the block "
                                f"files hold {total}")
        assert not problems, f"KV {self.medium} store {self.root}: " + "; ".join(problems)

    # Under the lock from here on, but for _walk, _touch and _count.

    @contextlib.contextmanager
    def _locked(self):
        with self._mutex:
            if self._lock_fd < 0:
                raise ValueError("the KV block store is closed")
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
            start = -1
            try:
                raw = os.pread(self._lock_fd, USAGE.size, 0)
                self._usage = start = USAGE.unpack(raw)[0] if len(raw) == USAGE.size else -1
                if self._usage < 0:  # a new root (or a damaged count): count the files
                    self._scan()
                yield
            finally:
                if self._usage != start:
                    os.pwrite(self._lock_fd, USAGE.pack(self._usage), 0)
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def _scan(self) -> None:
        """Count every file under the root, remove crashed writers' temp files, and keep
        the oldest blocks as eviction candidates."""
        now, total, blocks = time.time(), 0, []
        for kind, path, st, key in self._walk():
            if kind == "tmp" and now - st.st_mtime > TMP_MAX_AGE_S:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                continue
            total += st.st_size
            if kind == "block":
                blocks.append((st.st_mtime_ns, path, key))
        self._usage = total
        self._candidates = deque(heapq.nsmallest(CANDIDATES, blocks))

    def _make_room(self, size: int) -> bool:
        """Evict the oldest blocks until `size` more bytes fit the budget; False if they
        cannot (the rest is other processes' writes in flight)."""
        scanned = False
        while self._usage + size > self.budget_bytes:
            if not self._candidates:
                if scanned:
                    return False
                self._scan()
                scanned = True
                continue
            mtime_ns, path, key = self._candidates.popleft()
            try:
                st = os.stat(path)
            except FileNotFoundError:
                continue  # evicted by another process
            if st.st_mtime_ns != mtime_ns:
                continue  # read or rewritten since the scan: younger than the rest
            self._unlink(path, st.st_size)
            self._evicted.append(key)
            self._count(evictions=1)
        return True

    def _discard(self, path: str, st: os.stat_result, key: str) -> None:
        """Remove a corrupt block file, unless it has been replaced since it was read, and
        count the files again: a damaged file's size may not be the one counted (rare)."""
        with self._locked():
            try:
                now = os.stat(path)
            except FileNotFoundError:
                return
            if (now.st_ino, now.st_dev) == (st.st_ino, st.st_dev):
                self._unlink(path, now.st_size)
                self._evicted.append(key)
                self._scan()

    def _unlink(self, path: str, size: int) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
            self._usage -= size

    def _create(self, tmp: str, size: int) -> int:
        """The temp file, created at its full size (so a scan counts what it will hold)."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
        try:
            fd = os.open(tmp, flags, 0o600)
        except FileNotFoundError:
            os.makedirs(os.path.dirname(tmp), mode=0o700, exist_ok=True)
            fd = os.open(tmp, flags, 0o600)
        try:
            os.ftruncate(fd, size)
        except OSError:
            os.close(fd)
            os.unlink(tmp)
            raise
        return fd

    def _walk(self):
        """(kind, path, stat, key) for every file under the root but the lock: kind is
        "block", "tmp" or "stray" (key "" unless a block)."""
        for ns in _entries(self.root):
            if ns.is_dir(follow_symlinks=False) and PART.fullmatch(ns.name):
                for shard in _entries(ns.path):
                    if shard.is_dir(follow_symlinks=False):
                        for f in _entries(shard.path):
                            yield from _kind(ns.name, shard.name, f)
                    else:
                        yield from _stat("stray", shard, "")
            elif ns.name != ".lock":
                yield from _stat("stray", ns, "")

    @staticmethod
    def _touch(path: str) -> bool:
        try:
            os.utime(path)
            return True
        except FileNotFoundError:
            return False

    def _count(self, **counts: int) -> None:
        with self._stats_lock:
            for name, n in counts.items():
                setattr(self.stats, name, getattr(self.stats, name) + n)


def _entries(path) -> list[os.DirEntry]:
    try:
        with os.scandir(path) as it:
            return list(it)
    except (FileNotFoundError, NotADirectoryError):
        return []


def _stat(kind: str, entry: os.DirEntry, key: str):
    try:
        yield kind, entry.path, entry.stat(follow_symlinks=False), key
    except FileNotFoundError:
        pass


def _kind(ns: str, shard: str, entry: os.DirEntry):
    """A file of a shard directory as _walk names it."""
    name = entry.name
    stem = name.removesuffix(SUFFIX)
    if name.endswith(SUFFIX) and PART.fullmatch(stem) and stem[:2] == shard \
            and entry.is_file(follow_symlinks=False):
        yield from _stat("block", entry, f"{ns}/{stem}")
    elif name.startswith(".") and name.endswith(TMP_SUFFIX):
        yield from _stat("tmp", entry, "")
    else:
        yield from _stat("stray", entry, "")
