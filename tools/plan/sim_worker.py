"""A worker in the simulator: Baton's own scheduler, block pool, KV cache manager, KV
loads and P/D connector, driven on simulated time; the model's forward pass replaced by
the profile's step time (step_model.py). Only the compute is simulated: which requests
run in which step, what is preempted, when a prompt is chunked, when a pull lands and a
lease is freed, are the engine's own decisions.

    kick(now) ─> schedule() (the real one) ─> the step's batch ─> StepModel: seconds
        ─> at now + seconds: update() with one sampled token per request that caught up
        ─> tokens out (to the simulator), kick again

A worker's clock is the simulator's time when an event reaches it, plus what its
scheduler slept since (a KV load it waits a moment for): a worker that waits does not
move anyone else's time.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from baton.kv_transfer.base import KVHandle, KVReceiver, TransferState
from baton.services.common.kv_events import KvEventLog
from baton.services.engine.block_pool import BlockPool
from baton.services.engine.clock import Clock
from baton.services.engine.engine_stats import queued_prefill_tokens
from baton.services.engine.kv_cache_manager import KVCacheManager
from baton.services.engine.kv_connector.pd import PDConnector
from baton.services.engine.outputs import SampledTokens
from baton.services.engine.request import Request, RequestStatus
from baton.services.engine.scheduler import Scheduler
from baton.services.worker.messages import kv_events_message
from baton.v1 import generation_pb2 as gen
from baton.worker.v1 import worker_pb2 as wk

from .calibrate import cost
from .step_model import StepModel

TOKEN = 100  # what every simulated step samples (ignore_eos: never an end by itself)


class WorkerClock(Clock):
    def __init__(self):
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.t += seconds


class SimReceiver(KVReceiver):
    """A pull that takes the profile's time, `fixed + per_block * blocks` after it starts,
    then lands (its completion is an event, so the worker steps again then). A pull that
    starts while its worker steps lands later: they share the core (SimWorker.core_busy)."""

    def __init__(self, clock: WorkerClock, fixed_s: float, per_block_s: float,
                 at: Callable[[float, Callable[[float], None]], None],
                 landed: Callable[[str, float], None],
                 step_ends: Callable[[], float] = lambda: 0.0,
                 spanned: Callable[[KVHandle, float, float], None] = lambda h, a, b: None):
        self.clock, self.fixed_s, self.per_block_s = clock, fixed_s, per_block_s
        self.at, self.landed, self.step_ends, self.spanned = at, landed, step_ends, spanned
        self.done: dict[str, float] = {}

    def add_peer(self, engine_id, layout, metadata) -> None:
        pass

    def start_load(self, transfer_id: str, handle: KVHandle, remote_block_ids: list[int],
                   local_block_ids: list[int]) -> None:
        now = self.clock.now()
        work = self.fixed_s + self.per_block_s * len(local_block_ids)
        end = now + work + min(work, max(0.0, self.step_ends() - now))
        self.done[transfer_id] = end
        self.spanned(handle, now, end)
        self.at(end, lambda t: self.landed(handle.request_id, t))

    def poll(self, transfer_id: str) -> tuple[TransferState, str | None]:
        end = self.done.get(transfer_id)
        if end is None or self.clock.now() < end:
            return TransferState.TRANSFERRING, None
        del self.done[transfer_id]
        return TransferState.SUCCESS, None


class SimWorker:
    """One engine (module docstring). `on_token(request, time)` hears every token sampled;
    `on_end(request, time)` every request that ended here (PREFILLED included)."""

    def __init__(self, name: str, role: str, model: StepModel, num_blocks: int,
                 block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, prefix_caching: bool,
                 at: Callable[[float, Callable[[float], None]], None],
                 pull: tuple[float, float] = (0.0, 0.0),
                 on_token: Callable[[Request, float], None] = lambda r, t: None,
                 on_end: Callable[[Request, float], None] = lambda r, t: None,
                 on_pulled: Callable[[str, float], None] = lambda rid, t: None,
                 service: dict | None = None,
                 on_span: Callable[[str, float, float], None] = lambda e, a, b: None):
        self.name, self.role, self.model, self.at = name, role, model, at
        self.service = service  # served over offline step costs (calibrate.py)
        self.engine_id = f"{role}-{name}"
        self.clock = WorkerClock()
        self.events = KvEventLog()
        self.pool = BlockPool(num_blocks, self.events)
        self.kv = KVCacheManager(self.pool, block_size, prefix_caching)
        connectors = []
        self.step_end = 0.0  # when the running step ends
        self.spans: list[tuple[float, float]] = []  # pulls on this core: (start, end)
        self.on_span = on_span
        if role in ("decode", "colocated"):
            self.receiver = SimReceiver(self.clock, *pull, at, self._pulled,
                                        lambda: self.step_end if self.stepping else 0.0,
                                        self._spanned)
            connectors.append(PDConnector(self.receiver, block_size))
        self.scheduler = Scheduler(self.kv, max_num_seqs, max_num_batched_tokens,
                                   max_model_len, connectors=connectors,
                                   lease_timeout_s=math.inf, clock=self.clock)
        self.block_size = block_size
        self.on_token, self.on_end, self.on_pulled = on_token, on_end, on_pulled
        self.stepping = False
        self.busy_s = 0.0  # seconds spent in steps
        self.steps = 0

    # ---- what the simulator calls ------------------------------------------------------

    def add(self, request: Request, now: float) -> None:
        self.scheduler.add_request(request)
        self.kick(now)

    def release(self, request_id: str, lease_id: int | None) -> None:
        """The decode side has pulled: the lease ends, its blocks go back to the pool."""
        self.scheduler.leases.release(request_id, lease_id)

    def kick(self, now: float) -> None:
        """Start a step now, unless one runs or there is nothing to run."""
        if self.stepping or not self.scheduler.has_unfinished_requests():
            return
        self.clock.t = max(self.clock.t, now)
        out = self.scheduler.schedule()
        for req in out.finished:  # a failed load under "fail": not simulated, but ended
            self.on_end(req, self.clock.t)
        if not out.scheduled:
            return  # waiting for a pull to land, or for blocks: a later event kicks
        batch = [(n, r.num_computed_tokens) for r, n in out.scheduled]
        seconds = max(0.0, cost(self.service, batch, self.model.predict(batch)))
        seconds += min(seconds, self.core_busy(self.clock.t))  # a pull shares the core
        self.stepping = True
        self.step_end = self.clock.t + seconds
        self.busy_s += seconds
        self.steps += 1
        self.at(self.clock.t + seconds, lambda t: self._stepped(out, t))

    # ---- the router's view (router/registry.py polls these) -------------------------------

    def stats(self) -> wk.GetStatsResponse:
        s = self.scheduler
        return wk.GetStatsResponse(
            engine_id=self.engine_id, role=self.role, num_waiting=len(s.waiting),
            num_running=len(s.running), num_loading=s.num_loading, num_leases=len(s.leases),
            num_blocks=self.pool.num_blocks - 1, num_free_blocks=self.pool.num_free_blocks,
            num_queued_prefill_tokens=queued_prefill_tokens(s),
            model_info=gen.ModelInfo(block_size=self.block_size))

    def kv_events(self, after: int) -> wk.GetKvEventsResponse:
        return kv_events_message(self.events.read(after), self.engine_id, self.block_size,
                                 self.kv.enable_prefix_caching)

    # ---- inside ---------------------------------------------------------------------------

    def _stepped(self, out, now: float) -> None:
        self.clock.t = max(self.clock.t, now)
        # A request samples when the step brought it to its last token (the model
        # runner's rule): its prompt's last chunk, or a decode.
        sampled = {r.request_id: SampledTokens([TOKEN]) for r, n in out.scheduled
                   if r.num_computed_tokens + n >= r.num_tokens}
        got = self.scheduler.update(out, sampled)
        for req in got:
            self.on_token(req, now)
            if req.status.finished:
                self.on_end(req, now)
        self.stepping = False
        self.kick(now)

    def core_busy(self, now: float) -> float:
        """Seconds of pulls still to run on this worker's core at `now`.

        A pull's time was measured with both engines idle, and it is CPU on both
        workers' cores (each worker's NIXL progress thread shares its one pinned core;
        issue 53). Of a pull and a step that overlap, the one that starts second ends
        min(its work, what is left of the other) later, as if the core ran both at half
        speed while both ran; the first keeps its own time (the shared time is counted
        once, not twice). A step's side is here (kick), on either worker; a pull's is
        SimReceiver's, for the receiving worker's step only.
        """
        self.spans = [(a, b) for a, b in self.spans if b > now]
        return sum(b - max(a, now) for a, b in self.spans)

    def _spanned(self, handle: KVHandle, start: float, end: float) -> None:
        self.spans.append((start, end))
        self.on_span(handle.engine_id, start, end)  # the sending side's core

    def _pulled(self, request_id: str, now: float) -> None:
        self.on_pulled(request_id, now)
        self.kick(now)


def finished_ok(req: Request) -> bool:
    return req.status in (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED)
