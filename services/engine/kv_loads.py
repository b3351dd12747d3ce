"""KV loads: a waiting request's blocks filled from outside the pool by a connector
(kv_connector/: the P/D pull, the offload tiers), driven by the scheduler, the only place
a loading request's blocks change. Its contract:

- `claim(request, hits)`: the first connector in the stack with something for the
  request past its `hits` pool blocks, and how many tokens; None if none has.
- `start(request, claim, hits)`: the hits are taken, the rest of the loaded range is
  allocated unpublished and the connector starts filling it. False, nothing changed,
  when the pool is short.
- `land()`: every load that ended. On success the loaded tokens count as computed; on a
  failure the leading blocks the connector vouches for count, and the rest is the
  request's to recompute. Loaded blocks are published to the prefix cache if the
  connector says they may be (else the request's blocks, loaded or computed on them,
  never are). Returns (request, error or None) for each live request; requests
  abandoned while loading are freed here and not returned.
- `abandon(request)`: the request ended while its load is in flight. Its blocks stay
  allocated until the connector lets go of them (it may still write), then `land` frees
  them. `busy` stays True until then.
- A load that has not landed within its connector's `load_timeout_s` fails like any
  other, but the request holds no block after it (it starts over, finding its pool hits
  again, and that connector is not asked for it again): its blocks are set aside until
  the connector lets go.
- `wait(budget_s)`: poll until the loads in flight land or the budget is spent: a
  prompt's blocks are a few MB and usually land within a few milliseconds, so the
  request can run in this step instead of the next.

Request status is the scheduler's to set; this component never touches it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from .block_pool import KVCacheBlock
from .clock import WALL, Clock
from .kv_cache_manager import KVCacheManager
from .kv_connector.base import KVConnector, LoadResult, SavedBlock
from .request import Request


@dataclass
class _Load:
    req: Request
    conn: KVConnector
    load_id: str  # unique per load: a timed-out one and a later one never share it
    started: float
    num_hit_tokens: int  # pool hits in front of the loaded range
    num_tokens: int  # what the loaded range brings
    result: LoadResult | None = None  # once polled done


class KVLoads:
    def __init__(self, kv: KVCacheManager, connectors: list[KVConnector], clock: Clock = WALL):
        self.kv = kv
        self.clock = clock
        self.connectors = connectors
        self.loading: dict[str, Request] = {}  # loads in flight, abandoned ones included
        self._loads: dict[str, _Load] = {}  # by request id
        self._abandoned: set[str] = set()
        self._ids = itertools.count()
        self._set_aside: dict[str, tuple[KVConnector, list[KVCacheBlock]]] = {}
        self.num_failures = 0
        self.num_blocks_recomputed = 0  # of loads that failed part-way or whole

    @property
    def busy(self) -> bool:
        return (bool(self.loading) or bool(self._set_aside)
                or any(c.busy() for c in self.connectors))

    def claim(self, req: Request, num_hit_blocks: int) -> tuple[KVConnector, int] | None:
        for conn in self.connectors:
            if conn.name in req.kv_timed_out:
                continue
            n = conn.match(req, num_hit_blocks)
            if n is not None:
                return conn, n
        return None

    def start(self, req: Request, claim: tuple[KVConnector, int],
              hits: list[KVCacheBlock]) -> bool:
        conn, num_tokens = claim
        num_hit = len(hits) * self.kv.block_size
        if not self.kv.allocate_slots(req, num_tokens, hits, publish=False):
            return False
        req.load_start = now = self.clock.now()
        req.num_computed_tokens = num_hit
        if req.num_cached_tokens < 0:  # first admission, not a resume after preemption
            req.num_cached_tokens = num_hit
            self.kv.record_lookup(num_hit + num_tokens if req.remote else req.num_tokens,
                                  num_hit)
        if not conn.publishable(req):
            self.kv.keep_private(req)
        load = _Load(req, conn, f"{req.request_id}/{next(self._ids)}", now, num_hit,
                     num_tokens)
        self._loads[req.request_id] = load
        self.loading[req.request_id] = req
        conn.start_load(load.load_id, req, len(hits),
                        self.kv.block_ids(req.request_id)[len(hits):])
        return True

    def abandon(self, req: Request) -> None:
        if req.request_id in self.loading:
            self._abandoned.add(req.request_id)

    def land(self) -> list[tuple[Request, str | None]]:
        self._free_set_aside()
        landed = []
        now = self.clock.now()
        for rid, load in list(self._loads.items()):
            req = load.req
            if self._peek(load):
                result = load.result
                assert result is not None
            elif now - load.started > load.conn.load_timeout_s:
                # Freed once the connector is done: the request starts over with none.
                self._set_aside[load.load_id] = (load.conn, self.kv.take(req))
                req.kv_timed_out.add(load.conn.name)
                result = LoadResult(0, f"the load did not land within "
                                       f"{load.conn.load_timeout_s:.0f}s")
            else:
                continue
            del self._loads[rid], self.loading[rid]
            req.load_end = now
            if rid in self._abandoned:
                self._abandoned.discard(rid)
                self.kv.free(req)
                continue
            good = load.num_tokens if result.error is None else min(
                result.num_ok_blocks * self.kv.block_size, load.num_tokens)
            held = bool(self.kv.block_ids(rid))  # none after a timeout
            req.num_computed_tokens = load.num_hit_tokens + good if held else 0
            if result.error is not None:
                self.num_failures += 1
                self.num_blocks_recomputed += -(-(load.num_tokens - good)
                                                // self.kv.block_size)
            self.kv.publish(req, req.num_computed_tokens)
            landed.append((req, result.error))
        return landed

    def _free_set_aside(self) -> None:
        for load_id, (conn, blocks) in list(self._set_aside.items()):
            if conn.poll(load_id) is not None:
                del self._set_aside[load_id]
                self.kv.free_blocks(blocks)

    def wait(self, budget_s: float) -> None:
        """Sleep-poll until every load in flight is done or `budget_s` has passed."""
        deadline = self.clock.now() + budget_s
        pending = [load for load in self._loads.values() if not self._peek(load)]
        while pending and self.clock.now() < deadline:
            self.clock.sleep(0.0002)
            pending = [load for load in pending if not self._peek(load)]

    def _peek(self, load: _Load) -> bool:
        # poll() forgets a finished load, so keep its answer for land().
        if load.result is None:
            load.result = load.conn.poll(load.load_id)
        return load.result is not None

    def save(self) -> None:
        """The step has run: hand the blocks it made full to every connector."""
        blocks = [SavedBlock(*p) for p in self.kv.take_published()]
        if blocks:
            for conn in self.connectors:
                conn.save(blocks)
