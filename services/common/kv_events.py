"""KV events: which prefix-cache blocks a worker holds, told to the routers that ask.

The engine's block pool reports every block hash it publishes (stored) and every one
it evicts (removed). The log keeps the last `capacity` events, numbered from 1, and a
mirror of the hashes held now. A router polls with the number of the last event it has
seen and gets the net change since:

    events   ... 41 42 43 44 45 46 ...      ring: the last `capacity` of them
                       ^ router's cursor
    read(43)  -> stored/removed since 43, collapsed per hash (the last event wins)
    read(7)   -> 7 fell out of the ring: a snapshot (every hash held now) instead

A snapshot is also the answer for a cursor of 0 (a router that just started) and after
a reset of the whole prefix cache. Written by the engine thread, read by the gRPC
handler's: one lock guards both.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from dataclasses import dataclass, field

STORED, REMOVED, CLEARED = 1, 2, 3
DEFAULT_CAPACITY = 1 << 16  # events; past them, a reader that lags gets a snapshot


@dataclass
class KvEvents:
    seq: int  # the last event this covers: the reader's next cursor
    snapshot: bool  # `stored` is everything held: drop what was known before
    stored: list[bytes] = field(default_factory=list)
    removed: list[bytes] = field(default_factory=list)


class KvEventLog:
    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self._lock = threading.Lock()
        self._ring: deque[tuple[int, bytes]] = deque(maxlen=capacity)
        self._held: set[bytes] = set()
        self._seq = 0  # events ever appended
        self._cleared_at = 0  # the last CLEARED event's number

    def stored(self, block_hash: bytes) -> None:
        with self._lock:
            if block_hash not in self._held:
                self._held.add(block_hash)
                self._append(STORED, block_hash)

    def removed(self, block_hash: bytes) -> None:
        with self._lock:
            if block_hash in self._held:
                self._held.discard(block_hash)
                self._append(REMOVED, block_hash)

    def cleared(self) -> None:
        with self._lock:
            self._held.clear()
            self._append(CLEARED, b"")
            self._cleared_at = self._seq

    def _append(self, kind: int, block_hash: bytes) -> None:
        self._seq += 1
        self._ring.append((kind, block_hash))

    @property
    def seq(self) -> int:
        return self._seq

    def read(self, after: int) -> KvEvents:
        """The net change since event `after` (a snapshot when the ring no longer holds
        every event since, or `after` is 0 or from the future: another engine's)."""
        with self._lock:
            oldest = self._seq - len(self._ring) + 1  # the first event still in the ring
            if after <= 0 or after > self._seq or after + 1 < oldest \
                    or after < self._cleared_at:
                return KvEvents(self._seq, True, stored=list(self._held))
            last: dict[bytes, int] = {}
            # From the end: the events since `after` are the newest, and a deque is walked
            # quickly from either end (the engine thread waits on this lock meanwhile).
            for kind, h in itertools.islice(reversed(self._ring), self._seq - after):
                last.setdefault(h, kind)
        newest_last = list(reversed(last.items()))  # the order the events came in
        return KvEvents(self._seq, False,
                        stored=[h for h, k in newest_last if k == STORED],
                        removed=[h for h, k in newest_last if k == REMOVED])

    def __len__(self) -> int:
        return len(self._held)
