"""Continuous batching with chunked prefill and preemption by recompute.

There is no prefill phase and no decode phase. Each request has `num_computed_tokens`,
and each step spends a token budget to make it catch up with `num_tokens` (prompt plus
output). Running requests go first (a decode costs one token), then waiting requests
take what budget is left, in chunks. When the pool is out of blocks, the running request
that would run last (the lowest priority, or the latest arrival) is preempted: its blocks
are freed, its computed count is reset, and it goes back to the front of the waiting
queue to recompute later.

KV from outside the pool, and disaggregation, add two outcomes, each kept by one
component:
- a request that a KV connector has something for (kv_connector/: a decode role's
  request whose prompt KV sits on a prefill engine, `request.remote`; a prefix found in
  an offload tier) is admitted like any waiting request, but instead of computing those
  tokens it starts a load (KVLoads) and waits as WAITING_FOR_KV until that lands; then it
  runs with them computed. A load that failed follows the load-failure policy: under
  "recompute" only what did not land is computed.
- prefill role: a `kv_hold` request ends after its first token as PREFILLED, its blocks
  held under a lease (LeaseTable) until released or expired.

Only this class sets a request's status.
"""

from __future__ import annotations

import heapq
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from .clock import WALL, Clock
from .kv_cache_manager import KVCacheManager
from .kv_connector.base import KVConnector
from .kv_loads import KVLoads
from .leases import LeaseTable
from .outputs import SampledTokens
from .request import Request, RequestStatus

log = logging.getLogger(__name__)

LOAD_WAIT_S = 0.005  # how long a schedule may wait for the KV loads it just started


@dataclass
class SchedulerOutput:
    """What one step runs: requests with their token counts (one-token entries first) and
    every scheduled request's block ids; and what ended or moved without running."""

    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    block_ids: dict[str, list[int]] = field(default_factory=dict)
    preempted: list[Request] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)  # a failed load under "fail"


# How long requests that fit may pass one waiting for its adapter to get a place.
LORA_PASS_S = 2.0


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
                 max_model_len: int, policy: str = "fcfs",
                 connectors: list[KVConnector] | None = None, lease_timeout_s: float = 30.0,
                 load_failure_policy: str = "recompute", max_loras: int | None = None,
                 clock: Clock = WALL):
        if policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling policy must be 'fcfs' or 'priority', got {policy!r}")
        if load_failure_policy not in ("recompute", "fail"):
            raise ValueError("load failure policy must be 'recompute' or 'fail', got "
                             f"{load_failure_policy!r}")
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.priority_policy = policy == "priority"
        self.waiting = WaitingQueue(self.priority_policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}  # every live request, leases excluded
        self.clock = clock  # real time, or the planner's simulated time (clock.py)
        self.leases = LeaseTable(kv, lease_timeout_s)
        self.loads = KVLoads(kv, connectors or [], clock)
        self.load_failure_policy = load_failure_policy
        self.max_loras = max_loras  # LoRA adapters in one step at most (None: no LoRA)
        self.lora_pass_s = LORA_PASS_S
        self.num_preemptions = 0
        self.num_partial_prefills = 0  # steps that ran a prompt chunk short of its end
        self.num_prompt_tokens = 0  # prompt tokens computed (cache hits excluded)
        self.num_generation_tokens = 0  # tokens sampled

    # ---- requests in and out -------------------------------------------------------

    def add_request(self, request: Request) -> None:
        rid = request.request_id
        if rid in self.requests or rid in self.leases or rid in self.loads.loading:
            raise ValueError(f"request_id {rid!r} is already in use")
        if request.remote is not None and not any(c.name == "pd"
                                                  for c in self.loads.connectors):
            raise ValueError("this engine has no KV receiver: it cannot take remote KV")
        self.requests[rid] = request
        self.waiting.push(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or self.loads.busy

    @property
    def num_loading(self) -> int:
        return len(self.loads.loading)

    def abort(self, request_id: str) -> Request | None:
        """End a request wherever it is. A PREFILLED one has no request left, only its
        lease: that is released (and None returned)."""
        self.leases.release(request_id)
        req = self.requests.get(request_id)
        if req is not None:
            self._finish(req, RequestStatus.FINISHED_ABORTED)
        return req

    # ---- the step -----------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self.loads.save()  # anything published since the last step ran (loads landed)
        self._land_loads(out)
        # Loads at the head of the queue start first, and the step waits a moment for
        # them: a pull that lands at once decodes in this very step.
        if self._admit_waiting(out, budget=0, loads_only=True)[1]:
            self.loads.wait(LOAD_WAIT_S)
            self._land_loads(out)
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []

        # 1. Running requests, in priority order, so a preemption victim is always taken
        #    from the end: the request that would have run last.
        self.running.sort(key=lambda r: r.sort_key(self.priority_policy))
        #    A decode with draft tokens (speculative decoding) runs them after its last
        #    token, as far as the budget lets it: they need KV slots like any token.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if req.spec_token_ids:
                req.spec_token_ids = req.spec_token_ids[:budget - n]
                n += len(req.spec_token_ids)
            while not self.kv.allocate_slots(req, n):
                if req.spec_token_ids:  # drafts are optional: drop them before preempting
                    n -= len(req.spec_token_ids)
                    req.spec_token_ids = []
                    continue
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
        if not out.preempted:
            scheduled += self._admit_waiting(out, budget)[0]

        self.num_partial_prefills += sum(
            1 for r, n in scheduled if r.num_computed_tokens + n < r.num_tokens)
        # One-token entries (decodes) first: the attention kernels batch them together.
        out.scheduled = [e for e in scheduled if e[1] == 1] + [e for e in scheduled if e[1] > 1]
        out.block_ids = {r.request_id: self.kv.block_ids(r.request_id) for r, _ in scheduled}
        return out

    def _admit_waiting(self, out: SchedulerOutput, budget: int, loads_only: bool = False
                       ) -> tuple[list[tuple[Request, int]], int]:
        """The one admission path: take waiting requests in order while budget, sequence
        slots and blocks last. Each gets its prefix-cache hits; then a request a connector
        claims starts its load (no token budget), any other a first chunk. Returns the
        chunks to run and the number of loads started."""
        scheduled: list[tuple[Request, int]] = []
        pulls = 0
        passed: list[Request] = []  # set aside while others pass them
        live = self._live_loras()  # the adapters of running and loading requests
        try:
            while len(self.waiting) and len(self.running) + self.num_loading < self.max_num_seqs:
                req = self.waiting.peek()
                if not self._lora_fits(req, live):
                    # It waits for an adapter to leave. Requests that fit pass it for
                    # lora_pass_s; then none does, and the running adapters drain.
                    now = self.clock.now()
                    req.lora_blocked_since = req.lora_blocked_since or now
                    if now - req.lora_blocked_since >= self.lora_pass_s:
                        break
                    passed.append(self.waiting.pop())
                    continue
                # Prefix-cache hits cost no budget: only the tokens after them are computed.
                hits = self.kv.get_computed_blocks(req)
                if req.remote is not None:  # the handle's blocks at most
                    hits = hits[:len(req.remote.block_ids)]
                claim = self.loads.claim(req, len(hits))
                if claim is not None:
                    # Keep a block per running request, so a load does not force the step
                    # that follows to preempt a running request that crosses a block
                    # boundary.
                    short = (self.kv.pool.num_free_blocks - -(-claim[1] // self.kv.block_size)
                             < len(self.running) + len(hits))
                    if (loads_only and short) or not self.loads.start(req, claim, hits):
                        break
                    self.waiting.pop()
                    req.status = RequestStatus.WAITING_FOR_KV
                    if req.scheduled_time is None:
                        req.scheduled_time = self.clock.now()
                    pulls += 1
                    if req.lora_name is not None:
                        live.add(req.lora_name)
                    continue
                if loads_only or budget <= 0:
                    break
                num_cached = len(hits) * self.kv.block_size
                n = min(req.num_tokens - num_cached, budget)
                if not self.kv.allocate_slots(req, n, hits):
                    break
                req.num_computed_tokens = num_cached
                if req.num_cached_tokens < 0:  # first admission, not a resume after preemption
                    req.num_cached_tokens = num_cached
                    self.kv.record_lookup(req.num_tokens, num_cached)
                if req.scheduled_time is None:
                    req.scheduled_time = self.clock.now()
                self.waiting.pop()
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                if req.lora_name is not None:
                    live.add(req.lora_name)
                scheduled.append((req, n))
                budget -= n
        finally:
            for req in passed:
                self.waiting.push(req)
        return scheduled, pulls

    def _live_loras(self) -> set[str]:
        """The adapters of the running requests and of those whose KV is arriving."""
        loading = self.loads.loading.values()
        return {r.lora_name for r in (*self.running, *loading) if r.lora_name is not None}

    def _lora_fits(self, req: Request, live: set[str]) -> bool:
        """A request's adapter may join: it runs already, or fewer than max_loras do
        (every running request is in every step, so this bounds a step's adapters).
        `live`: _live_loras, kept up to date by the admissions of this step."""
        if req.lora_name is None:
            return True
        return req.lora_name in live or len(live) < (self.max_loras or 0)

    def _land_loads(self, out: SchedulerOutput) -> None:
        """Loads that ended: run the request, or apply the load-failure policy."""
        for req, error in self.loads.land():
            if error is not None and self.load_failure_policy == "fail":
                req.error = f"KV transfer failed: {error}"
                self.requests.pop(req.request_id, None)
                self.kv.free(req)
                req.status = RequestStatus.FINISHED_ABORTED
                out.finished.append(req)
                continue
            if error is not None:
                source = req.remote.engine_id if req.remote is not None else "a KV tier"
                log.warning("KV load of %s from %s failed (%s); recomputing %d of its "
                            "tokens locally", req.request_id, source, error,
                            req.num_tokens - req.num_computed_tokens)
                req.kv_load_error = error
            # The KV is ours now: a preemption from here on recomputes it locally.
            req.remote = None
            if self.kv.block_ids(req.request_id):
                # What did not land is computed like the rest of a prompt, in chunks.
                req.status = RequestStatus.RUNNING
                self.running.append(req)
            else:  # a timed-out load: it holds no block, and starts over
                req.num_computed_tokens = 0
                req.status = RequestStatus.WAITING
                self.waiting.push(req)

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.spec_token_ids = []
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.num_preemptions += 1
        self.waiting.push(req)

    def update(self, out: SchedulerOutput, sampled: dict[str, SampledTokens],
               on_token: Callable[[Request, int], RequestStatus | None] | None = None
               ) -> list[Request]:
        """Advance computed counts and append the sampled tokens. `sampled` holds what
        each request that caught up this step drew: one token, or accepted drafts and one
        more (speculative decoding). Tokens are appended one at a time; after each,
        `on_token(req, token)` (the engine's detokenizer and grammar) may end the request,
        and so may the stop conditions; the tokens after that one are dropped. Returns
        the requests that got a token; those that hit a stop condition are finished
        (their blocks freed, or held under a lease for PREFILLED)."""
        self.loads.save()  # the step has run: its full blocks hold their KV now
        got_token = []
        for req, n in out.scheduled:
            self.num_prompt_tokens += max(0, min(req.num_computed_tokens + n,
                                                 req.num_prompt_tokens)
                                          - req.num_computed_tokens)
            s = sampled.get(req.request_id)
            # Draft positions ran after the last real token; only the accepted ones have
            # KV that counts. The rejected ones' slots are overwritten by the tokens that
            # come next (and no block holding them was published: block hashes cover
            # token_ids only).
            drafts = max(0, req.num_computed_tokens + n - req.num_tokens)
            req.spec_token_ids = []
            req.num_computed_tokens += n - drafts + (s.num_accepted if s is not None else 0)
            if s is None:
                continue  # a prefill chunk that has not reached the end yet
            if s.dead:
                self._finish(req, RequestStatus.FINISHED_CONSTRAINT)
                continue
            if req.first_token_time is None:
                req.first_token_time = self.clock.now()
            got_token.append(req)
            status = None
            for i, token in enumerate(s.token_ids):
                self.num_generation_tokens += 1
                req.token_ids.append(token)
                if req.params.logprobs is not None:
                    req.logprobs.append(s.logprobs[i] if s.logprobs else {})
                # A stop string wins over a length limit hit by the same token (as vLLM).
                status = (on_token(req, token) if on_token is not None else None
                          ) or self._check_stop(req, token)
                if status is not None:
                    break
            if status is None and req.kv_hold:
                status = RequestStatus.PREFILLED
            if status is not None:
                self._finish(req, status)
        return got_token

    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        # Under min_tokens the sampler masks these ids; one that comes anyway (a
        # constraint that allowed nothing else) does not end the output either.
        if token in req.min_tokens_ban and req.num_output_tokens > req.params.min_tokens:
            return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= req.params.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, req: Request, status: RequestStatus) -> None:
        """End a request for good: free its blocks and forget it. PREFILLED keeps the
        blocks under a lease; a request still loading keeps them until the receiver lets
        go (KVLoads frees them then)."""
        if self.requests.pop(req.request_id, None) is None:
            return
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status == RequestStatus.WAITING:
            self.waiting.remove(req)
        loading = req.status == RequestStatus.WAITING_FOR_KV
        req.status = status
        if loading:
            self.loads.abandon(req)
        elif status == RequestStatus.PREFILLED:
            req.lease_id = self.leases.grant(req, self.clock.now())
        else:
            self.kv.free(req)
