"""KV events: which prefix-cache blocks a worker holds, told to the routers that ask.

The engine's block pool reports every block hash it publishes (stored) and every one
it evicts (removed). A worker's offload tiers report theirs the same way, each event
naming its medium: "pool" (the block pool, the default), "host" (shared memory) or
"disk". A hash may be held in several media at once; each (hash, medium) is its own
entry. The log keeps the last `capacity` events, numbered from 1, and a mirror of the
hashes each medium holds now. A router polls with the number of the last event it has
seen and gets the net change since:

    events   ... 41 42 43 44 45 46 ...      ring: the last `capacity` of them
                       ^ router's cursor
    read(43)  -> stored/removed since 43, collapsed per (hash, medium): the last wins
    read(7)   -> 7 fell out of the ring: a snapshot (every hash held now, every medium)

A snapshot is also the answer for a cursor of 0 (a router that just started) and after
a reset of the whole prefix cache. That reset (`cleared`) is the pool's alone: the
tiers keep their blocks, and a tier that drops blocks says so block by block. Written
by the engine thread, read by the gRPC handler's: one lock guards both.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from dataclasses import dataclass, field

STORED, REMOVED, CLEARED = 1, 2, 3
POOL, HOST, DISK = "pool", "host", "disk"
TIERS = (HOST, DISK)  # the media besides the pool, the order an engine looks in them
DEFAULT_CAPACITY = 1 << 16  # events; past them, a reader that lags gets a snapshot
# A snapshot's hashes per tier, at most: it must fit one gRPC message (64 MiB), and a
# router keeps a bounded index anyway. A large disk tier is told in part.
SNAPSHOT_TIER_HASHES = 1 << 18  # ~9 MiB on the wire


@dataclass
class TierEvents:
    stored: list[bytes] = field(default_factory=list)
    removed: list[bytes] = field(default_factory=list)


@dataclass
class KvEvents:
    seq: int  # the last event this covers: the reader's next cursor
    snapshot: bool  # `stored` and the tiers' are everything held: drop what was known
    stored: list[bytes] = field(default_factory=list)  # the pool's
    removed: list[bytes] = field(default_factory=list)
    tiers: dict[str, TierEvents] = field(default_factory=dict)  # medium -> its events


class KvEventLog:
    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self._lock = threading.Lock()
        self._ring: deque[tuple[int, bytes, str]] = deque(maxlen=capacity)
        self._held: dict[str, set[bytes]] = {m: set() for m in (POOL, *TIERS)}
        self._seq = 0  # events ever appended
        self._cleared_at = 0  # the last CLEARED event's number

    def _medium(self, medium: str) -> set[bytes]:
        held = self._held.get(medium)
        if held is None:
            raise ValueError(f"medium must be one of {', '.join(self._held)}, got {medium!r}")
        return held

    def stored(self, block_hash: bytes, medium: str = POOL) -> None:
        held = self._medium(medium)
        with self._lock:
            if block_hash not in held:
                held.add(block_hash)
                self._append(STORED, block_hash, medium)

    def removed(self, block_hash: bytes, medium: str = POOL) -> None:
        held = self._medium(medium)
        with self._lock:
            if block_hash in held:
                held.discard(block_hash)
                self._append(REMOVED, block_hash, medium)

    def cleared(self) -> None:
        """The pool's prefix cache was reset (the tiers keep theirs)."""
        with self._lock:
            self._held[POOL].clear()
            self._append(CLEARED, b"", POOL)
            self._cleared_at = self._seq

    def _append(self, kind: int, block_hash: bytes, medium: str) -> None:
        self._seq += 1
        self._ring.append((kind, block_hash, medium))

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
                return KvEvents(self._seq, True, stored=list(self._held[POOL]), tiers={
                    m: TierEvents(list(itertools.islice(self._held[m], SNAPSHOT_TIER_HASHES)))
                    for m in TIERS if self._held[m]})
            last: dict[str, dict[bytes, int]] = {m: {} for m in self._held}
            # From the end: the events since `after` are the newest, and a deque is walked
            # quickly from either end (the engine thread waits on this lock meanwhile).
            for kind, h, medium in itertools.islice(reversed(self._ring), self._seq - after):
                last[medium].setdefault(h, kind)
        net = {m: _net(kinds) for m, kinds in last.items()}
        pool = net.pop(POOL)
        return KvEvents(self._seq, False, stored=pool.stored, removed=pool.removed,
                        tiers={m: t for m, t in net.items() if t.stored or t.removed})

    def __len__(self) -> int:
        """Hashes the pool holds."""
        return len(self._held[POOL])

    def held(self, medium: str) -> int:
        return len(self._medium(medium))

    def hashes(self, medium: str) -> set[bytes]:
        """A copy of the hashes `medium` holds now."""
        held = self._medium(medium)
        with self._lock:
            return set(held)


def _net(last: dict[bytes, int]) -> TierEvents:
    """Each hash's last event, newest first, back in the order the events came in."""
    in_order = list(reversed(last.items()))
    return TierEvents(stored=[h for h, k in in_order if k == STORED],
                      removed=[h for h, k in in_order if k == REMOVED])
