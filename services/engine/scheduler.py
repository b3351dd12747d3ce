"""Continuous batching with chunked prefill and preemption by recompute.

There is no prefill phase and no decode phase. Each request has `num_computed_tokens`,
and each step spends a token budget to make it catch up with `num_tokens` (prompt plus
output). Running requests go first (a decode costs one token), then waiting requests
take what budget is left, in chunks. When the pool is out of blocks, the running request
that would run last (the lowest priority, or the latest arrival) is preempted: its blocks
are freed, its computed count is reset, and it goes back to the front of the waiting
queue to recompute later.

Disaggregation adds two states outside the running set. A decode-role request whose prompt
KV lives on a prefill engine is admitted like any waiting request, but only the blocks its
own prefix cache lacks are allocated unpublished and listed in `loads`; it waits in
`loading` (WAITING_FOR_KV) until the engine reports the copy done, then joins `running`
with its whole prompt computed. A prefill-role request (`kv_hold`) ends after its first
token as PREFILLED: its blocks stay allocated under a lease until released or expired.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time
from dataclasses import dataclass, field

from services.engine.kv_cache_manager import KVCacheManager
from services.engine.request import Request, RequestStatus

log = logging.getLogger(__name__)


@dataclass
class SchedulerOutput:
    """Requests to run this step with their token counts, one-token entries first."""

    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # Remote KV to pull: (request, remote block ids, local block ids), same order.
    loads: list[tuple[Request, list[int], list[int]]] = field(default_factory=list)


class WaitingQueue:
    """A heap on Request.sort_key: arrival under FCFS, (priority, arrival) under priority."""

    def __init__(self, priority_policy: bool):
        self.priority_policy = priority_policy
        self._heap: list[tuple[tuple, int, Request]] = []
        self._seq = itertools.count()

    def push(self, request: Request) -> None:
        # A preempted request keeps its original arrival time, so under both policies it
        # sorts ahead of everything that arrived after it: "back to the front".
        heapq.heappush(self._heap, (request.sort_key(self.priority_policy), next(self._seq),
                                    request))

    def peek(self) -> Request:
        return self._heap[0][2]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[2]

    def remove(self, request: Request) -> None:
        self._heap = [e for e in self._heap if e[2] is not request]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self):
        return (e[2] for e in sorted(self._heap))


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, policy: str = "fcfs"):
        if policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling policy must be 'fcfs' or 'priority', got {policy!r}")
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.priority_policy = policy == "priority"
        self.waiting = WaitingQueue(self.priority_policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_partial_prefills = 0  # steps that ran a prompt chunk short of its end
        # Requests whose remote KV is in flight, aborted ones included: their blocks may
        # still be written by the transport, so they are freed only when it reports done.
        self.loading: dict[str, Request] = {}
        self.leases: dict[str, tuple[Request, float]] = {}  # id -> (request, expiry)
        self.lease_timeout_s = 30.0
        self.num_blocks_pulled = 0  # remote blocks loaded (decode role)
        self.num_blocks_local = 0  # remote prompt blocks found in our own prefix cache
        self._expired: list[str] = []  # loading requests whose lease ran out before a pull
        # A failed pull: "recompute" the prompt locally (default), or "fail" the request.
        self.load_failure_policy = "recompute"
        self.num_load_failures = 0
        self.num_leases_expired = 0

    def add_request(self, request: Request) -> None:
        if (request.request_id in self.requests or request.request_id in self.loading
                or request.request_id in self.leases):
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.push(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self.loading)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []

        # 1. Running requests, in priority order, so a preemption victim is always taken
        #    from the end: the request that would have run last.
        self.running.sort(key=lambda r: r.sort_key(self.priority_policy))
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.kv.allocate_slots(req, n):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                scheduled.append((req, n))
                budget -= n
                i += 1

        # 2. Waiting requests, while budget, sequence slots and blocks last. Not after a
        #    preemption this step: the pool is short, and newcomers would only thrash it.
        while (not out.preempted and budget > 0 and len(self.waiting)
               and len(self.running) + len(self.loading) < self.max_num_seqs):
            req = self.waiting.peek()
            if req.remote is not None and req.num_computed_tokens == 0:
                if not self._admit_remote(req, out.loads):
                    break
                continue
            # Prefix-cache hits cost no budget: only the tokens after them are computed.
            hits = self.kv.get_computed_blocks(req)
            num_cached = len(hits) * self.kv.block_size
            n = min(req.num_tokens - num_cached, budget)
            if not self.kv.allocate_slots(req, n, hits):
                break
            req.num_computed_tokens = num_cached
            if req.num_cached_tokens < 0:  # first admission, not a resume after preemption
                req.num_cached_tokens = num_cached
                self.kv.record_lookup(req.num_tokens, num_cached)
            if req.scheduled_time is None:
                req.scheduled_time = time.monotonic()
            self.waiting.pop()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled.append((req, n))
            budget -= n

        self.num_partial_prefills += sum(
            1 for r, n in scheduled if r.num_computed_tokens + n < r.num_tokens)
        # One-token entries (decodes) first: the attention kernels batch them together.
        out.scheduled = [e for e in scheduled if e[1] == 1] + [e for e in scheduled if e[1] > 1]
        return out

    def schedule_loads(self) -> list[tuple[Request, list[int], list[int]]]:
        """Admit the remote-KV requests at the head of the waiting queue, before the step
        is scheduled: a transport that finishes at once lets them decode in this step."""
        loads: list[tuple[Request, list[int], list[int]]] = []
        while (len(self.waiting) and len(self.running) + len(self.loading) < self.max_num_seqs):
            req = self.waiting.peek()
            if req.remote is None or req.num_computed_tokens != 0:
                break
            # Keep a block per running request, so admitting one does not force the step
            # that follows to preempt a running request that crosses a block boundary.
            if (self.kv.pool.num_free_blocks - len(req.remote.block_ids)
                    < len(self.running)):
                break
            if not self._admit_remote(req, loads):
                break
        return loads

    def _admit_remote(self, req: Request, loads: list) -> bool:
        """Allocate a decode-role request's prompt blocks: prefix-cache hits are kept, the
        rest are listed for the transport and published only once filled. Costs no token
        budget. False if the pool is short."""
        remote = req.remote
        assert remote is not None
        if time.monotonic() > remote.deadline:
            # The prefill engine may have freed (and reused) those blocks by now.
            self.waiting.pop()
            self.loading[req.request_id] = req
            req.status = RequestStatus.WAITING_FOR_KV
            req.load_start = time.monotonic()
            self._expired.append(req.request_id)
            return True
        hits = self.kv.get_computed_blocks(req)[:len(remote.block_ids)]
        num_local = len(hits) * self.kv.block_size
        if not self.kv.allocate_slots(req, remote.num_tokens - num_local, hits, publish=False):
            return False
        self.waiting.pop()
        req.num_computed_tokens = num_local
        req.num_cached_tokens = num_local
        self.kv.record_lookup(remote.num_tokens, num_local)
        req.scheduled_time = time.monotonic()
        local_ids = self.kv.block_ids(req.request_id)[len(hits):]
        self.num_blocks_local += len(hits)
        self.num_blocks_pulled += len(local_ids)
        req.status = RequestStatus.WAITING_FOR_KV
        self.loading[req.request_id] = req
        loads.append((req, list(remote.block_ids[len(hits):]), local_ids))
        return True

    def finish_load(self, request_id: str, error: str | None) -> Request | None:
        """The transport is done with this request's blocks. On success the request joins
        the running set with its prompt computed; on failure it ends aborted. Returns the
        request if it is still live (not aborted while loading)."""
        req = self.loading.pop(request_id, None)
        if req is None:
            return None
        req.load_end = time.monotonic()
        if req.status != RequestStatus.WAITING_FOR_KV:  # aborted meanwhile: free now
            self.kv.free(req)
            return None
        assert req.remote is not None
        if error is None and req.load_end > req.remote.deadline:
            error = "the load ended after the prefill worker's lease may have expired"
        if error is not None:
            self.num_load_failures += 1
            self.kv.free(req)
            if self.load_failure_policy == "recompute":
                # Prefill the prompt (and the first token) here instead, and carry on.
                log.warning("KV load of %s failed (%s); recomputing it locally", request_id,
                            error)
                req.remote = None
                req.num_computed_tokens = 0
                req.status = RequestStatus.WAITING
                self.waiting.push(req)
                return req
            req.error = f"KV transfer failed: {error}"
            self.requests.pop(request_id, None)
            req.status = RequestStatus.FINISHED_ABORTED
            return req
        req.num_computed_tokens = req.remote.num_tokens
        self.kv.publish(req, req.num_computed_tokens)
        # The KV is ours now: a preemption from here on recomputes it locally (the prefill
        # worker's copy is released once we report the load done).
        req.remote = None
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        return req

    def take_expired_loads(self) -> list[str]:
        """Requests admitted with an expired lease: fail them without pulling."""
        expired, self._expired = self._expired, []
        return expired

    def release_lease(self, request_id: str) -> bool:
        """Free a prefill-role request's held blocks. False if there was no such lease."""
        entry = self.leases.pop(request_id, None)
        if entry is None:
            return False
        self.kv.free(entry[0])
        return True

    def expire_leases(self, now: float) -> list[str]:
        """Release every lease past its expiry: a decode worker that never came back."""
        expired = [rid for rid, (_, t) in self.leases.items() if t <= now]
        for rid in expired:
            log.warning("KV lease of %s expired after %.0fs: no decode worker pulled it",
                        rid, self.lease_timeout_s)
            self.release_lease(rid)
        self.num_leases_expired += len(expired)
        return expired

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.num_preemptions += 1
        self.waiting.push(req)

    def update(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Advance computed counts and append the sampled tokens. `sampled` maps request ids
        to their new token for the requests that caught up this step. Returns the requests
        that got a token; those that hit a stop condition are finished and freed.
        """
        got_token = []
        for req, n in out.scheduled:
            req.num_computed_tokens += n
            token = sampled.get(req.request_id)
            if token is None:
                continue  # a prefill chunk that has not reached the end yet
            req.token_ids.append(token)
            if req.first_token_time is None:
                req.first_token_time = time.monotonic()
            got_token.append(req)
            status = self._check_stop(req, token)
            if status is None and req.kv_hold:
                status = RequestStatus.PREFILLED
            if status is not None:
                self.finish(req, status)
        return got_token

    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        if token in req.stop_ids or token in req.eos_ids:
            return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= req.params.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def finish(self, req: Request, status: RequestStatus) -> None:
        """End a request for good: free its blocks and forget it. Safe to call once per id.
        PREFILLED keeps the blocks under a lease; a request still loading keeps them until
        the transport is done (finish_load frees them)."""
        if self.requests.pop(req.request_id, None) is None:
            return
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status == RequestStatus.WAITING:
            self.waiting.remove(req)
        loading = req.status == RequestStatus.WAITING_FOR_KV
        req.status = status
        if status == RequestStatus.PREFILLED:
            self.leases[req.request_id] = (req, time.monotonic() + self.lease_timeout_s)
        elif not loading:
            self.kv.free(req)

    def abort(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is not None:
            self.finish(req, RequestStatus.FINISHED_ABORTED)
        return req
