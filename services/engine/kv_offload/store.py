"""`BlockStore`: KV blocks as files under one root, shared by every process on the host
that opens the same root, kept under a byte budget, least recently used out first.

The host tier is a store rooted in /dev/shm (tmpfs: memory every process maps), the disk
tier one rooted on a disk path; the store is the same. Torch-free: blocks are bytes.

    root/                            this user's, mode 0700, not a link: else refused
      .lock                          flock'd around all accounting; holds the bytes in use
                                     (block files + temp files being written), int64 LE
      .key                           the MAC key, where no cluster token gives it
      <key id>/<namespace>/<hh>/<hash>.kv     one block, key "<namespace>/<hash>",
                                              hh = hash[:2], key id: block_file.key_id
      <key id>/<namespace>/<hh>/.<hash>.<pid>.<n>.tmp   a block being written

A block file (block_file.py, its format) carries a MAC over its header and payload under
the tier's key: a flipped byte anywhere, a short or long file, a file holding another
block's bytes or another size than the reader expects, or one written without the key is
a miss, counted by why (StoreStats), removed, never returned. So is a block's name that
is not this user's regular file (a link, a FIFO, another user's file): each file is
opened never through a link nor waiting on a FIFO, then checked. Only the tier's files
(this user's regular block and temp files) count against the budget; nothing else under
the root is counted or evicted.

A put reserves its bytes in the shared count (evicting first) and creates its temp file
at its full size under the lock, writes it outside, and os.replace's it into place under
the lock: readers never see a partial file, and at any moment the lock is free the tier's
files under the root (temp files included) hold no more than the count, which is at most
the budget. A get hit refreshes the file's mtime; eviction takes the oldest mtimes first,
from a list of the oldest files that each process builds by scanning the tree only when
its list runs out (not on every put). Each file's mtime is re-read before it is evicted,
so a block another process read since the scan stays. No fsync: a block lost or torn by
a crash of the machine fails its MAC and is a miss.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import heapq
import itertools
import os
import struct
import threading
import time
from collections import deque
from pathlib import Path

from ..private_files import ForeignFile, open_own, private_folder, problems
from . import block_file
from .block_file import BadBlock
from .tree import SUFFIX, TMP_SUFFIX, entries, split_key, walk

USAGE = struct.Struct("<q")
TMP_MAX_AGE_S = 10.0  # a temp file older than this is a crashed writer's
CANDIDATES = 4096  # the oldest files a scan keeps as eviction candidates
REJECTED = ("corrupt", "forged", "foreign")  # why a block file was a miss: StoreStats


@dataclasses.dataclass
class StoreStats:
    """This process's counts. A miss is every get that returned None, rejected files too;
    a file is rejected (and removed) as `corrupt` (it does not parse, or holds another
    block or size), `forged` (its MAC differs: written without the tier's key, or damaged
    since) or `foreign` (not this user's regular file: a link, a FIFO, another user's)."""

    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    forged: int = 0
    foreign: int = 0
    saves: int = 0
    save_bytes: int = 0
    load_bytes: int = 0
    evictions: int = 0


class BlockStore:
    """KV blocks under `root`, at most `budget_bytes` of files, shared with every process
    that opens the same root (each should pass the same budget) with the same key: the
    one derived from `secret` (the cluster token), else the root's key file. Thread-safe.
    `medium` ("host" or "disk") names the tier, for metrics, events and errors.
    ValueError if the root, its lock or its key file is not this user's own."""

    def __init__(self, root: str | os.PathLike, budget_bytes: int, medium: str,
                 secret: str | None = None):
        if medium not in ("host", "disk"):
            raise ValueError(f"medium must be 'host' or 'disk', not {medium!r}")
        self.root = Path(root)
        self.budget_bytes = int(budget_bytes)
        self.medium = medium
        self.stats = StoreStats()
        self._mutex = threading.Lock()  # this process's threads, around the flock
        self._stats_lock = threading.Lock()
        self._evicted: list[str] = []
        self._candidates: deque[tuple[int, str, str]] = deque()  # (mtime_ns, path, key)
        self._usage = 0  # the shared count, valid while the lock is held
        self._names = itertools.count()
        private_folder(str(self.root), f"the KV {medium} tier's folder")
        lock = str(self.root / ".lock")
        try:
            self._lock_fd = open_own(lock, os.O_RDWR | os.O_CREAT)[0]
        except ForeignFile as e:
            raise ValueError(f"the KV {medium} tier's lock {lock} {e.strerror}: remove it, "
                             "or choose another folder") from None
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)  # the first process makes the key
            try:
                self._mac_key = block_file.tier_key(str(self.root), secret)
            finally:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
        except BaseException:
            os.close(self._lock_fd)
            raise
        self.key_id = block_file.key_id(self._mac_key)
        self._root = os.path.join(self.root, self.key_id)  # this key's blocks
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
        return os.path.lexists(self._file(key)[0])

    def get(self, key: str, size: int) -> bytes | None:
        """`key`'s payload, which the caller knows to be `size` bytes; None (a miss) if
        it is absent, or if its file is rejected (counted by why, and removed)."""
        path = self._file(key)[0]
        try:
            fd, st = open_own(path, os.O_RDONLY)
        except ForeignFile:
            return self._reject(path, None, key, "foreign")
        except OSError:  # absent, removed since contains(), or unreadable
            self._count(misses=1)
            return None
        try:
            with open(fd, "rb") as f:
                payload = block_file.read(f, self._mac_key, key.encode(), st.st_size, size)
                os.utime(fd)  # a hit is the youngest (LRU)
        except BadBlock as e:
            return self._reject(path, st, key, e.reason)
        except OSError:
            self._count(misses=1)
            return None
        self._count(hits=1, load_bytes=len(payload))
        return payload

    def put(self, key: str, data: bytes | memoryview) -> bool:
        """Store `data` under `key`; False if it could not be (larger than the budget, the
        budget held by other processes' writes, a write error). A block already there is
        left as it is, its age refreshed; anything else under its name is replaced."""
        path, folder, h = self._file(key)
        payload = memoryview(data)
        if payload.format != "B" or payload.ndim != 1:
            payload = payload.cast("B")
        if self._touch(path):
            return True
        header = block_file.header(self._mac_key, key.encode(), payload)
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
        """The bytes the tier's block files hold (and those being written), all processes."""
        with self._locked():
            return self._usage

    def keys(self, namespace: str | None = None) -> list[str]:
        """Every block's key; or those under `namespace`, by name alone (no stat: cheap).
        Only this store's key's blocks: another key's are not for it to read."""
        if namespace is None:
            return [key for kind, _, _, key in walk(self.root, self.key_id)
                    if kind == "block" and key]
        return [f"{namespace}/{f.name[:-len(SUFFIX)]}" for shard in entries(
            os.path.join(self._root, namespace)) for f in entries(shard.path)
            if f.name.endswith(SUFFIX) and not f.name.startswith(".")]

    def evicted(self) -> list[str]:
        """The keys this process evicted, or removed as rejected, since the last call."""
        with self._mutex:
            out, self._evicted = self._evicted, []
        return out

    def check(self) -> None:
        """AssertionError naming each problem: files over the budget or not matching the
        shared count, a temp file left behind, a file that is rejected, a stray file.
        For a quiet store (after a run): a put in flight has a temp file."""
        found, total = [], 0
        with self._locked():
            for kind, path, st, key in walk(self.root, self.key_id):
                if kind == "block":
                    total += st.st_size
                    if key and (why := self._rejects(path, key)):
                        found.append(f"{path} is {why} as {key!r}")
                elif kind == "tmp":
                    found.append(f"temp file left behind: {path}")
                else:
                    found.append(f"stray file: {path}")
            if total > self.budget_bytes:
                found.append(f"over budget: {total} bytes > {self.budget_bytes}")
            if total != self._usage:
                found.append(f"the shared count says {self._usage} bytes, the block "
                             f"files hold {total}")
        assert not found, f"KV {self.medium} store {self.root}: " + "; ".join(found)

    def _rejects(self, path: str, key: str) -> str:
        """Why the block file at `path` would be a miss ("" if it would not)."""
        try:
            fd, st = open_own(path, os.O_RDONLY)
        except ForeignFile:
            return "foreign"
        with open(fd, "rb") as f:
            try:
                block_file.read(f, self._mac_key, key.encode(), st.st_size, None)
            except BadBlock as e:
                return e.reason
        return ""

    def _reject(self, path: str, st: os.stat_result | None, key: str, reason: str) -> None:
        self._discard(path, st, key)
        self._count(misses=1, **{reason: 1})

    # Under the lock from here on, but for _touch and _count.

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
        """Count the tier's files under the root, remove crashed writers' temp files, and
        keep the oldest blocks as eviction candidates."""
        now, total, blocks = time.time(), 0, []
        for kind, path, st, key in walk(self.root, self.key_id):
            if kind == "stray":
                continue  # not the tier's: neither counted nor evicted
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
                st = os.lstat(path)
            except FileNotFoundError:
                continue  # evicted by another process
            if st.st_mtime_ns != mtime_ns:
                continue  # read or rewritten since the scan: younger than the rest
            self._unlink(path, st.st_size)
            if key:  # this store's key's: the others' are not told
                self._evicted.append(key)
            self._count(evictions=1)
        return True

    def _discard(self, path: str, st: os.stat_result | None, key: str) -> None:
        """Remove a rejected file, unless it has been replaced since it was read (`st`;
        None: a foreign file, unless it is the tier's own now), and count the files again:
        a damaged file's size may not be the one counted (rare)."""
        with self._locked():
            try:
                now = os.lstat(path)
            except FileNotFoundError:
                return
            if (now.st_ino, now.st_dev) == (st.st_ino, st.st_dev) if st is not None \
                    else problems(now, "file", private=False):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                self._evicted.append(key)
                self._scan()

    def _unlink(self, path: str, size: int) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
            self._usage -= size

    def _create(self, tmp: str, size: int) -> int:
        """The temp file, created at its full size (so a scan counts what it will hold)."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
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

    @staticmethod
    def _touch(path: str) -> bool:
        """Refresh the block file at `path`; False if there is none of the tier's (a put
        then replaces whatever else is there)."""
        try:
            if problems(os.lstat(path), "file", private=False):
                return False
            os.utime(path, follow_symlinks=False)
            return True
        except FileNotFoundError:
            return False

    def _count(self, **counts: int) -> None:
        with self._stats_lock:
            for name, n in counts.items():
                setattr(self.stats, name, getattr(self.stats, name) + n)
