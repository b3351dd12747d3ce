"""The workers the router knows: their state from stats polls, their load, and which
prefill engines each decode worker has shaken hands with.

A worker's state, from its polls:

    up        answers, not draining: takes new requests
    draining  answers with `draining`: no new requests, but what it holds goes on (a
              prefill worker's handles are still pulled: its pairs are kept)
    down      a poll refused, or unanswered for `worker_timeout_s` (dead, frozen,
              unreachable): calls in flight to it are failed, so their requests move on
              (the failure rules apply)

Pairs are keyed by the prefill *engine id* (from its stats): a handle names the engine
that holds its KV, and a restarted worker comes back under a new id, to be paired anew.

Load score, as vLLM's data-parallel balancer: waiting * 4 + running, from each worker's
last stats, plus the requests routed to it since (counted as waiting), so a burst between
two polls spreads out. Both prefill and decode picks count.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from baton.v1 import worker_pb2 as wk
from router.clients import WorkerError

log = logging.getLogger(__name__)


@dataclass
class Worker:
    address: str
    role: str
    client: object  # GrpcWorkerClient or LocalWorkerClient
    state: str = "unknown"  # "unknown" until its first poll, then up / draining / down
    stats: wk.GetStatsResponse | None = None
    last_seen: float = 0.0  # monotonic time of the last answered poll
    routed: int = 0  # requests sent since the last stats poll
    pairs: dict[str, str | None] = field(default_factory=dict)  # prefill engine id -> error

    @property
    def engine_id(self) -> str | None:
        return self.stats.engine_id if self.stats is not None else None

    @property
    def score(self) -> int:
        s = self.stats
        waiting = (s.num_waiting + s.num_loading if s else 0) + self.routed
        return waiting * 4 + (s.num_running if s else 0)


class Registry:
    def __init__(self, prefill: list[Worker], decode: list[Worker], poll_s: float = 0.5,
                 worker_timeout_s: float = 3.0,
                 on_ready: Callable[[bool, str], Awaitable[None]] | None = None):
        self.prefill = prefill
        self.decode = decode
        self.poll_s = poll_s
        self.worker_timeout_s = worker_timeout_s
        self.on_ready = on_ready  # told (ready, why) whenever readiness changes
        self._ready: tuple[bool, str] | None = None
        self._task: asyncio.Task | None = None
        self._connecting: dict[tuple[str, str], asyncio.Task] = {}  # handshakes under way

    @property
    def workers(self) -> list[Worker]:
        return self.prefill + self.decode

    def model_info(self):
        for w in self.workers:
            if w.stats is not None and w.state != "down":
                return w.stats.model_info
        return None

    async def start(self) -> None:
        """The first poll, and its handshakes (so the first requests are disaggregated);
        then polls every poll_s."""
        await self.refresh()
        await self.handshakes(timeout=30)
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def handshakes(self, timeout: float) -> None:
        """Wait for the handshakes under way (at most `timeout` seconds)."""
        if self._connecting:
            await asyncio.wait(list(self._connecting.values()), timeout=timeout)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for task in list(self._connecting.values()):
            task.cancel()
        for w in self.workers:
            await w.client.close()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            try:
                await self.refresh()
            except Exception:  # keep polling whatever one round hit
                log.exception("worker refresh failed")

    async def refresh(self) -> None:
        """Poll every worker, start the handshakes of new pairs, and say if readiness
        changed. Handshakes run in the background: a slow one never delays the polls
        that notice a dead or frozen worker."""
        await asyncio.gather(*(self._poll(w) for w in self.workers))
        by_id = {p.engine_id: p for p in self.prefill if p.state == "up"}
        for d in self.decode:
            if d.state != "up":
                continue
            for eid, p in by_id.items():
                key = (d.address, eid)
                if eid not in d.pairs and key not in self._connecting:
                    task = asyncio.get_running_loop().create_task(self._connect(d, p, eid))
                    self._connecting[key] = task
                    task.add_done_callback(lambda _, k=key: self._connecting.pop(k, None))
        await self._tell_readiness()

    async def _tell_readiness(self) -> None:
        ready = self.readiness()
        if ready != self._ready:
            self._ready = ready
            log.log(logging.INFO if ready[0] else logging.WARNING, "router %s: %s",
                    "ready" if ready[0] else "not ready", ready[1])
            if self.on_ready is not None:
                await self.on_ready(*ready)

    async def _poll(self, w: Worker) -> None:
        try:
            stats = await w.client.stats(timeout=self.worker_timeout_s)
        except WorkerError as e:
            # Refused at once (dead), or no answer within worker_timeout_s (frozen).
            if w.state != "down":
                if w.state != "unknown":
                    log.warning("%s worker %s is down: %s", w.role, w.address, e.code.name)
                w.state = "down"
                w.client.fail_inflight()  # those requests move on, as from a dead worker
            return
        if w.engine_id is not None and stats.engine_id != w.engine_id:
            log.info("%s worker %s restarted as %s", w.role, w.address, stats.engine_id)
            w.pairs.clear()  # a decode worker's handshakes died with its old engine
        state = "draining" if stats.draining else "up"
        if state != w.state:
            log.info("%s worker %s is %s (%s)", w.role, w.address, state, stats.engine_id)
        w.stats, w.state, w.last_seen, w.routed = stats, state, time.monotonic(), 0
        if w.role == "prefill":  # forget pairs with engines no prefill worker runs now
            live = {p.engine_id for p in self.prefill}
            for d in self.decode:
                for eid in [e for e in d.pairs if e not in live]:
                    del d.pairs[eid]

    async def _connect(self, d: Worker, p: Worker, engine_id: str) -> None:
        """Ask the decode worker to shake hands with the prefill worker. FAILED_PRECONDITION
        (layouts differ) marks the pair unusable for good; other errors retry next poll."""
        try:
            reply = await d.client.connect(p.address)
        except WorkerError as e:
            if e.code.name == "FAILED_PRECONDITION":
                d.pairs[engine_id] = e.details
                log.error("decode %s cannot take KV from prefill %s: %s", d.address,
                          p.address, e.details)
            return
        d.pairs[reply.prefill_engine_id] = None
        await self._tell_readiness()

    def readiness(self) -> tuple[bool, str]:
        """Whether a request can be served now, and why not. A decode worker alone can
        serve (it prefills itself). While prefill workers are up and their handshakes are
        still pending, not yet: the first requests would not be disaggregated."""
        decodes = [d for d in self.decode if d.state == "up"]
        if not decodes:
            return False, "no decode worker is up: " + _states(self.decode)
        prefills = [p for p in self.prefill if p.state == "up"]
        pending = [p for p in prefills if any(p.engine_id not in d.pairs for d in decodes)]
        usable = self.prefills()
        if pending and not usable:
            return False, "pairing the decode workers with the prefill workers"
        errors = sorted({e for d in decodes for e in d.pairs.values() if e})
        return True, (f"{len(usable)} prefill and {len(decodes)} decode workers usable"
                      + (f"; unusable pairs: {'; '.join(errors)}" if errors else ""))

    def prefills(self) -> list[Worker]:
        """Prefill workers that take new requests and that some decode worker can pull
        from (else their work would be thrown away), least loaded first."""
        paired = {eid for d in self.decode if d.state == "up"
                  for eid, error in d.pairs.items() if error is None}
        return sorted((w for w in self.prefill if w.state == "up" and w.engine_id in paired),
                      key=lambda w: w.score)

    def pick_decode(self, engine_id: str | None, exclude: set[str] = frozenset()
                    ) -> tuple[Worker, bool]:
        """The least loaded decode worker that takes new requests, not in `exclude`, and
        whether it has paired with prefill engine `engine_id` (so it can pull a handle from
        there). Paired workers first; with none paired, any (it will recompute the prompt).
        LookupError says why there is none."""
        decodes = [d for d in self.decode if d.state == "up" and d.address not in exclude]
        if not decodes:
            tried = f" (excluded: {', '.join(sorted(exclude))})" if exclude else ""
            raise LookupError("no decode worker can take the request: "
                              + _states(self.decode) + tried)
        paired = [d for d in decodes if engine_id and d.pairs.get(engine_id, "") is None]
        d = min(paired or decodes, key=lambda w: w.score)
        d.routed += 1
        return d, bool(paired)


def _states(workers: list[Worker]) -> str:
    return ", ".join(f"{w.address} {w.state}" for w in workers) or "none configured"
