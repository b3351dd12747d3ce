"""Two processes share one KV block store root (services/engine/kv_offload/store.py), as
the workers of a host share the host tier: putting and reading at once, the files under
the root never exceed the budget nor differ from the shared count whenever the lock is
free, no process reads wrong bytes, and the blocks one wrote are hits for another."""

from __future__ import annotations

import fcntl
import multiprocessing
import os
import struct
import time

from baton.services.engine.kv_offload.store import BlockStore

NS = "3fa9c0d1e2b3a4f5-r0of1"
SIZE = 16 * 1024
KEYS = 150  # both writers' puts land on these keys, overlapping


def key(i: int) -> str:
    return f"{NS}/{i:032x}"


def payload(i: int) -> bytes:
    return (i.to_bytes(4, "little") * (SIZE // 4))[:SIZE]


def writer(root: str, budget: int, start: int, go, results) -> None:
    """Put 400 blocks and read others back, counting any read that returned wrong bytes."""
    store = BlockStore(root, budget, "host")
    go.wait()  # both writers, and the observer, ready
    began, wrong, stored = time.monotonic(), 0, 0
    for n in range(start, start + 400):
        stored += store.put(key(n % KEYS), payload(n % KEYS))
        i = (n * 7) % KEYS
        got = store.get(key(i), SIZE)
        wrong += got is not None and got != payload(i)
    results.put((start, stored, wrong, store.stats.hits, store.stats.evictions,
                 (began, time.monotonic())))


def files_and_count(root: str) -> tuple[int, int]:
    """Under the store's lock: the bytes of every file under the root but the lock and the
    key file (temp files included: nothing else is there), and the shared count the lock
    file holds (docstring of store.py)."""
    fd = os.open(os.path.join(root, ".lock"), os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        count = struct.unpack("<q", os.pread(fd, 8, 0))[0]
        total = 0
        for folder, _, names in os.walk(root):
            for name in names:
                if name not in (".lock", ".key"):
                    try:
                        total += os.lstat(os.path.join(folder, name)).st_size
                    except FileNotFoundError:  # only a file removed outside the lock
                        total = -1
        return total, count
    finally:
        os.close(fd)


def test_two_processes_share_one_root_under_its_budget(tmp_path):
    root = str(tmp_path / "kv")
    first = BlockStore(root, 1 << 30, "host")
    one = os.path.getsize(first.path(key(0))) if first.put(key(0), payload(0)) else 0
    first.close()
    budget = 40 * one + one // 3
    ctx = multiprocessing.get_context("spawn")
    go, results = ctx.Barrier(3), ctx.Queue()
    procs = [ctx.Process(target=writer, args=(root, budget, start, go, results))
             for start in (0, 75)]
    for p in procs:
        p.start()
    go.wait(timeout=60)
    seen, outs = [], []
    while len(outs) < len(procs):  # observe while they run
        seen.append(files_and_count(root))
        while not results.empty():
            outs.append(results.get())
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0, f"writer exited {p.exitcode}"
    assert len(seen) > 1
    bad = [(total, count) for total, count in seen if total != count or total > budget]
    assert not bad, f"budget {budget}: (files, count) seen {bad[:5]}"
    for start, stored, wrong, hits, evictions, _ in outs:
        assert (wrong, stored) == (0, 400), (start, stored, wrong)
        assert hits > 0 and evictions > 0, (start, hits, evictions)
    (a0, a1), (b0, b1) = (out[-1] for out in outs)
    assert a0 < b1 and b0 < a1, "the writers did not run at the same time"
    store = BlockStore(root, budget, "host")  # a third process, as far as files go
    held = store.keys()
    assert 0 < len(held) <= 40
    for k in held:
        assert store.get(k, SIZE) == payload(int(k.split("/")[1], 16))
    assert store.stats.hits == len(held)
    store.check()
    assert files_and_count(root) == (store.used_bytes(),) * 2
