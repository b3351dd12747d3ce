"""Replay a workload through a topology on simulated time, and score it as the goodput
benchmark scores a measured run (tools/bench/goodput_stats.py: the same Timing records,
the same `summarize`).

Each worker is a SimWorker (Baton's scheduler and block pool, the profile's step times).
The router is Baton's own: its Registry and Policy, whose polls read each worker's stats
and KV events every `poll_s` of simulated time through the registry's own `_poll`. A
request goes as router/core.py sends it:

    arrival ─> registry.local_prefill: the decode worker computes it? ─ yes ─┐
       │ no                                                                 │
       ▼                                                                    ▼
    the cheapest prefill worker (registry.prefills) computes it, holds a    decode worker
    lease ─ first token: + to_prefill_s ─> registry.pick_decode ─           (prefer: it)
    + to_decode_s ─> the decode worker pulls (pull_fixed_s + per block),
    the lease is released, it decodes; each token reaches the client as its step ends.

With no prefill worker (decode2, colocated) every prompt is computed where it is decoded.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from baton.kv_transfer.base import KVHandle
from baton.router.kv_index import PromptBlocks
from baton.router.policy import Policy
from baton.router.registry import Registry
from baton.router.worker import Worker
from baton.services.engine import SamplingParams
from baton.services.engine.request import Request, RequestStatus
from baton.tools.bench.goodput_load import Job
from baton.tools.bench.goodput_stats import Timing, summarize

from .sim_worker import SimWorker, finished_ok
from .step_model import StepModel


@dataclass(frozen=True)
class Topology:
    """What runs: `prefill` + `decode` workers, each on `*_threads` cores (a colocated
    topology: no prefill worker, decode workers computing their own prompts), the
    router's policy, and each engine's limits."""

    name: str = "pd"
    prefill: int = 1
    decode: int = 1
    prefill_threads: int = 1
    decode_threads: int = 1
    prefill_tp: int = 1
    decode_tp: int = 1
    policy: Policy = field(default_factory=Policy)
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    transport: str = "nixl"

    @property
    def cores(self) -> int:
        return (self.prefill * self.prefill_threads * self.prefill_tp
                + self.decode * self.decode_threads * self.decode_tp)


def named(name: str, **kw) -> Topology:
    """The goodput benchmark's topologies on two cores (goodput_topology.py)."""
    never = Policy(disaggregation="never")
    base = {
        "pd": Topology("pd"),
        "pd-auto": Topology("pd-auto"),
        "pd-always": Topology("pd-always", policy=Policy(disaggregation="always")),
        "pd-never": Topology("pd-never", policy=never),
        "decode2": Topology("decode2", prefill=0, decode=2, policy=never),
        "colocated": Topology("colocated", prefill=0, decode=1, decode_threads=2,
                              policy=never),
    }
    if name not in base:
        raise ValueError(f"topology {name!r}: one of {', '.join(base)}")
    return replace(base[name], **kw)


@dataclass
class _Job:
    timing: Timing
    prompt: list[int]
    output_len: int
    first: float | None = None


class _Client:
    """A Worker's client as the registry calls it (stats, KV events): answered at once
    from the simulated worker."""

    def __init__(self, worker: SimWorker):
        self.worker = worker

    async def stats(self, timeout: float | None = None):
        return self.worker.stats()

    async def kv_events(self, engine_id: str, seq: int, timeout: float | None = None):
        return self.worker.kv_events(seq if engine_id == self.worker.engine_id else 0)

    def fail_inflight(self) -> None:
        pass


def _drive(coro):
    """Run a coroutine that never waits (the registry's poll of a simulated client)."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    coro.close()
    raise RuntimeError("a simulated call waited")


class Simulation:
    def __init__(self, topology: Topology, profile: dict, kv_cache_gib: float = 1.0,
                 prefix_caching: bool = False, poll_s: float = 0.5):
        self.topology, self.poll_s = topology, poll_s
        self.now = 0.0
        self._events: list[tuple[float, int, Callable[[float], None]]] = []
        self._seq = itertools.count()
        hand = profile.get("handoff", {}).get(topology.transport, {})
        self.to_prefill_s = hand.get("to_prefill_s", 0.0)
        self.to_decode_s = hand.get("to_decode_s", 0.0)
        pull = (hand.get("pull_fixed_s", 0.0), hand.get("pull_per_block_s", 0.0))
        self.block_size = profile.get("block_size", 16)
        self.jobs: dict[str, _Job] = {}
        self.sims: dict[str, SimWorker] = {}
        self.leases: dict[str, tuple[SimWorker, int | None]] = {}  # pulls not yet landed
        self.prefilled_on: dict[str, SimWorker] = {}
        self.pending = 0
        workers = {"prefill": [], "decode": []}
        t = topology
        for role, count, threads, tp in (
                ("prefill", t.prefill, t.prefill_threads, t.prefill_tp),
                ("decode", t.decode, t.decode_threads, t.decode_tp)):
            engine = engine_profile(profile, threads, tp)
            num_blocks = int(kv_cache_gib * 2**30 // engine["block_bytes"])
            for i in range(count):
                sim = SimWorker(f"{i}", role, StepModel.from_json(engine["model"]), num_blocks,
                                self.block_size, topology.max_num_seqs,
                                topology.max_num_batched_tokens, engine["max_model_len"],
                                prefix_caching, self.at, pull, self._token, self._ended,
                                self._pulled, engine.get("service"), self._spanned)
                address = f"{role}-{i}"
                self.sims[address] = sim
                workers[role].append(Worker(address, role, _Client(sim)))  # type: ignore[arg-type]
        self.registry = Registry(workers["prefill"], workers["decode"], poll_s=poll_s,
                                 policy=topology.policy)
        for w in self.registry.prefill:
            _drive(self.registry._poll(w))
        for d in self.registry.decode:  # paired with every prefill engine, as after start
            pairs: dict[str, str | None] = {str(p.engine_id): None
                                            for p in self.registry.prefill}
            d.pairs = pairs
            _drive(self.registry._poll(d))
        self.at(poll_s, self._poll)

    # ---- the event loop --------------------------------------------------------------

    def at(self, when: float, fn: Callable[[float], None]) -> None:
        heapq.heappush(self._events, (when, next(self._seq), fn))

    def run(self, jobs: list[Job], sent: list[float], limit_s: float | None = None
            ) -> list[Timing]:
        """Every job sent at its time; their Timings once all have ended (or `limit_s`
        of simulated time has passed, by default an hour past the last send: those
        unfinished carry an error, as a request no engine can take never ends)."""
        if limit_s is None:
            limit_s = max(sent, default=0.0) + 3600.0
        for i, (job, t) in enumerate(zip(jobs, sent, strict=True)):
            self.at(t, lambda now, i=i, job=job: self._arrive(f"r{i}", job, now))
        self.pending = len(jobs)
        while self._events and self.pending:
            self.now, _, fn = heapq.heappop(self._events)
            if self.now > limit_s:
                break
            fn(self.now)
        out = []
        for rid in (f"r{i}" for i in range(len(jobs))):
            job = self.jobs.get(rid)
            if job is None:
                out.append(Timing(sent[int(rid[1:])], len(jobs[int(rid[1:])].prompt),
                                  error="not sent before the limit"))
                continue
            t = job.timing
            if len(t.token_times) < job.output_len and not t.error:
                t.error = "unfinished at the simulation's limit"
            out.append(t)
        return out

    def _poll(self, now: float) -> None:
        for w in self.registry.workers:
            _drive(self.registry._poll(w))
        if self.pending:
            self.at(now + self.poll_s, self._poll)

    # ---- the router (router/core.py's order) -----------------------------------------

    def _arrive(self, rid: str, job: Job, now: float) -> None:
        self.jobs[rid] = _Job(Timing(now, len(job.prompt), output_len=job.output_len),
                              list(job.prompt), job.output_len)
        blocks = PromptBlocks(job.prompt)
        local, why = self.registry.local_prefill(blocks)
        if local is None or not why:
            for worker in self.registry.prefills(blocks):
                worker.routed += 1
                worker.routed_tokens += self._work(worker, blocks)
                worker.index.predict(blocks)
                req = self._request(rid, now)
                req.kv_hold = True
                self.prefilled_on[rid] = self.sims[worker.address]
                self.sims[worker.address].add(req, now)
                return
        self._decode(rid, blocks, None, None, local, now)

    def _decode(self, rid: str, blocks: PromptBlocks, handle: KVHandle | None,
                first: int | None, prefer: Worker | None, now: float) -> None:
        worker, _ = self.registry.pick_decode(handle.engine_id if handle else None, set(),
                                              blocks, prefer=prefer)
        if handle is None:
            worker.routed_tokens += self._work(worker, blocks)
        worker.index.predict(blocks)
        req = self._request(rid, now)
        if handle is not None and first is not None:
            req.token_ids.append(first)
            req.remote = handle
        self.sims[worker.address].add(req, now)

    def _work(self, worker: Worker, blocks: PromptBlocks) -> int:
        return max(0, round(self.registry.policy.uncached(worker, blocks)))

    def _request(self, rid: str, now: float) -> Request:
        job = self.jobs[rid]
        params = SamplingParams(max_tokens=job.output_len, ignore_eos=True, temperature=0.0)
        return Request(rid, job.prompt, params, (), arrival_time=now)

    # ---- what the workers tell ---------------------------------------------------------

    def _token(self, req: Request, now: float) -> None:
        # Every token reaches the client `to_prefill_s` after its step ends: the router's
        # hop (measured on the first token, whose wait beyond the prefill it is). The same
        # for each token of a stream, so it moves TTFT, not the gaps.
        self.jobs[req.request_id].timing.token_times.append(now + self.to_prefill_s)

    def _ended(self, req: Request, now: float) -> None:
        job = self.jobs[req.request_id]
        if req.status is RequestStatus.PREFILLED:
            sim = self.prefilled_on.pop(req.request_id)
            held = sim.scheduler.leases.blocks(req.request_id, req.lease_id or 0) or []
            if job.output_len <= 1:  # its one token was the whole answer
                sim.release(req.request_id, req.lease_id)
                self._done(job)
                return
            handle = KVHandle(sim.engine_id, req.request_id, req.lease_id or 0, tuple(held),
                              req.num_prompt_tokens, verified=True)
            self.leases[req.request_id] = (sim, req.lease_id)
            first, blocks = req.token_ids[-1], PromptBlocks(job.prompt)
            self.at(now + self.to_decode_s,
                    lambda t: self._decode(req.request_id, blocks, handle, first, None, t))
            return
        if not finished_ok(req):
            job.timing.error = f"ended {req.status.value}"
        self._done(job)

    def _done(self, job: _Job) -> None:
        self.pending -= 1

    def _spanned(self, engine_id: str, start: float, end: float) -> None:
        """A pull from engine `engine_id` runs from `start` to `end`: on its core too."""
        sender = next((s for s in self.sims.values() if s.engine_id == engine_id), None)
        if sender is not None:
            sender.spans.append((start, end))

    def _pulled(self, request_id: str, now: float) -> None:
        held = self.leases.pop(request_id, None)
        if held is not None:
            held[0].release(request_id, held[1])


def engine_profile(profile: dict, threads: int, tp: int = 1) -> dict:
    """The profiled engine with `threads` threads (and TP size `tp`); KeyError if none."""
    for e in profile["engines"]:
        if e["threads"] == threads and e.get("tensor_parallel", 1) == tp:
            return e
    have = sorted((e["threads"], e.get("tensor_parallel", 1)) for e in profile["engines"])
    raise KeyError(f"the profile has no engine with {threads} threads at TP {tp} "
                   f"(it has (threads, TP) {have}): profile with --threads {threads}")


def simulate(topology: Topology, profile: dict, jobs: list[Job], sent: list[float],
             slos: dict[str, float], **kw) -> dict:
    """The goodput benchmark's result for one simulated run (summarize's fields), plus
    each worker's busy share."""
    sim = Simulation(topology, profile, **kw)
    timings = sim.run(jobs, sent)
    result = summarize(timings, slos)
    span = max(sim.now, 1e-9)
    result["busy"] = {a: round(s.busy_s / span, 3) for a, s in sim.sims.items()}
    return result
