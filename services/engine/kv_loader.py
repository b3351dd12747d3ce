"""Decode role: pulling a request's prompt KV from the engine that prefilled it.

One component, driven by the scheduler, the only place a remote request's blocks change
while its KV is in flight. Its contract:

- `start(request)`: called by the scheduler's one admission path when a request with a
  KV handle (`request.remote`) reaches the head of the waiting queue. The prompt blocks
  our own prefix cache already holds are taken as hits; the rest are allocated
  unpublished and the receiver starts copying into them. Returns False, with nothing
  changed, when the pool is short. A handle already past its deadline starts no pull: it
  lands as failed at the next `land`.
- `land()`: every pull the receiver reports done. On success the prompt counts as
  computed, and the blocks are published to the prefix cache if the handle is `verified`
  (else the request's blocks, pulled or computed on them, are never published: an
  unverified peer's bytes serve only their own request); on failure the request's blocks
  are freed. Returns (request, error or None) for each live request; requests abandoned
  while loading are freed here and not returned.
- `abandon(request)`: the request ended while its pull is in flight. Its blocks stay
  allocated until the receiver lets go of them (it may still write), then `land` frees
  them. `busy` stays True until then.
- A pull that has not landed PULL_TIMEOUT_S after it started (a transport stuck on a
  peer that froze) fails like any other: the request goes on under the load-failure
  policy with new blocks, and the old ones are set aside until the receiver lets go.
- `wait(budget_s)`: poll until the pulls in flight land or the budget is spent: a prompt's
  blocks are a few MB and usually land (and their lease is confirmed) within a few
  milliseconds, so the request can decode in this step instead of the next.

Request status is the scheduler's to set; this component never touches it.
"""

from __future__ import annotations

import itertools
import logging
import time

from baton.kv_transfer.base import KVReceiver, TransferState

from .block_pool import KVCacheBlock
from .kv_cache_manager import KVCacheManager
from .request import Request

log = logging.getLogger(__name__)

PULL_TIMEOUT_S = 10.0


class RemoteKVLoader:
    def __init__(self, kv: KVCacheManager, receiver: KVReceiver):
        self.kv = kv
        self.receiver = receiver
        self.loading: dict[str, Request] = {}  # pulls in flight, abandoned ones included
        self._abandoned: set[str] = set()
        self._settled: dict[str, str | None] = {}  # request id -> error, decided already
        # Transfer ids are unique per pull, so a timed-out pull (still in the receiver)
        # and a later request of the same id never share one.
        self._transfer: dict[str, tuple[str, float]] = {}  # request id -> (id, started)
        self._pull_ids = itertools.count()
        self._set_aside: dict[str, list[KVCacheBlock]] = {}  # transfer id -> its blocks
        self.num_blocks_pulled = 0  # remote blocks copied in
        self.num_blocks_local = 0  # remote blocks found in our own prefix cache instead
        self.num_failures = 0

    @property
    def busy(self) -> bool:
        return bool(self.loading) or bool(self._set_aside)

    def start(self, req: Request) -> bool:
        handle = req.remote
        assert handle is not None, "start() takes requests with a KV handle"
        now = time.monotonic()
        req.load_start = now
        if now > handle.deadline:  # the prefill engine may have reused those blocks
            self.loading[req.request_id] = req
            self._settled[req.request_id] = (
                "the prefill worker's lease ended before the pull could start")
            return True
        hits = self.kv.get_computed_blocks(req)[:len(handle.block_ids)]
        num_local = len(hits) * self.kv.block_size
        if not self.kv.allocate_slots(req, handle.num_tokens - num_local, hits,
                                      publish=False):
            return False
        req.num_computed_tokens = num_local
        req.num_cached_tokens = num_local
        self.kv.record_lookup(handle.num_tokens, num_local)
        local_ids = self.kv.block_ids(req.request_id)[len(hits):]
        remote_ids = list(handle.block_ids[len(hits):])
        self.num_blocks_local += len(hits)
        self.loading[req.request_id] = req
        if not handle.verified:
            self.kv.keep_private(req)
        if not remote_ids:  # every block was in our own prefix cache
            self._settled[req.request_id] = None
            return True
        self.num_blocks_pulled += len(local_ids)
        tid = f"{req.request_id}/{next(self._pull_ids)}"
        self._transfer[req.request_id] = (tid, now)
        self.receiver.start_load(tid, handle, remote_ids, local_ids)
        return True

    def abandon(self, req: Request) -> None:
        if req.request_id in self.loading:
            self._abandoned.add(req.request_id)

    def land(self) -> list[tuple[Request, str | None]]:
        self._free_set_aside()
        landed = []
        now = time.monotonic()
        for rid, req in list(self.loading.items()):
            if rid in self._settled or self._peek_done(rid):
                error = self._settled.pop(rid)
            elif now - self._transfer[rid][1] > PULL_TIMEOUT_S:
                tid = self._transfer[rid][0]
                self._set_aside[tid] = self.kv.take(req)  # freed once the receiver is done
                error = f"the pull did not land within {PULL_TIMEOUT_S:.0f}s"
            else:
                continue
            del self.loading[rid]
            self._transfer.pop(rid, None)
            req.load_end = now
            if rid in self._abandoned:
                self._abandoned.discard(rid)
                self.kv.free(req)
                continue
            if error is not None:
                self.num_failures += 1
                self.kv.free(req)
            else:
                assert req.remote is not None  # a request loading KV has its handle
                req.num_computed_tokens = req.remote.num_tokens
                self.kv.publish(req, req.num_computed_tokens)
            landed.append((req, error))
        return landed

    def _free_set_aside(self) -> None:
        for tid in list(self._set_aside):
            if self.receiver.poll(tid)[0].done:
                self.kv.free_blocks(self._set_aside.pop(tid))

    def wait(self, budget_s: float) -> None:
        """Sleep-poll until every pull in flight is done or `budget_s` has passed."""
        deadline = time.monotonic() + budget_s
        pending = [rid for rid in self.loading if rid not in self._settled]
        while pending and time.monotonic() < deadline:
            time.sleep(0.0002)
            pending = [rid for rid in pending if not self._peek_done(rid)]

    def _peek_done(self, rid: str) -> bool:
        # poll() forgets a finished transfer, so remember its answer for land().
        if rid in self._settled:
            return True
        state, error = self.receiver.poll(self._transfer[rid][0])
        if not state.done:
            return False
        self._settled[rid] = None if state is TransferState.SUCCESS else (
            error or "transfer failed")
        return True
