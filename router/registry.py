"""The workers the router knows: static addresses, health from a stats poll, load scores,
and which prefill/decode pairs have shaken hands (compatible KV layouts).

Load score, as vLLM's data-parallel balancer: waiting * 4 + running, from each worker's
last stats, plus the requests routed to it since (counted as waiting), so a burst between
two polls does not all land on one worker.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import grpc

from baton.v1 import worker_pb2 as wk
from baton.v1 import worker_pb2_grpc as wk_grpc
from services.serving.server import CHANNEL_OPTIONS

log = logging.getLogger(__name__)


@dataclass
class Worker:
    address: str
    role: str
    channel: grpc.aio.Channel | None = None  # made in Registry.start, inside the loop
    healthy: bool = False
    stats: wk.GetStatsResponse | None = None
    routed: int = 0  # requests sent since the last stats poll
    pairs: dict[str, str | None] = field(default_factory=dict)  # prefill addr -> error

    @property
    def score(self) -> int:
        s = self.stats
        waiting = (s.num_waiting + s.num_loading if s else 0) + self.routed
        return waiting * 4 + (s.num_running if s else 0)


class Registry:
    def __init__(self, prefill: list[str], decode: list[str], poll_s: float = 0.5):
        self.prefill = [Worker(a, "prefill") for a in prefill]
        self.decode = [Worker(a, "decode") for a in decode]
        self.poll_s = poll_s
        self._task: asyncio.Task | None = None

    @property
    def workers(self) -> list[Worker]:
        return self.prefill + self.decode

    def model_info(self):
        for w in self.workers:
            if w.stats is not None:
                return w.stats.model_info
        return None

    async def start(self) -> None:
        for w in self.workers:
            w.channel = _channel(w.address)
        await self.refresh()
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for w in self.workers:
            if w.channel is not None:
                await w.channel.close()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            try:
                await self.refresh()
            except Exception:  # keep polling whatever one round hit
                log.exception("worker refresh failed")

    async def refresh(self) -> None:
        await asyncio.gather(*(self._poll(w) for w in self.workers))
        pending = [(d, p) for d in self.decode if d.healthy for p in self.prefill
                   if p.healthy and p.address not in d.pairs]
        await asyncio.gather(*(self._connect(d, p) for d, p in pending))

    async def _poll(self, w: Worker) -> None:
        stub = wk_grpc.WorkerServiceStub(w.channel)
        try:
            w.stats = await stub.GetStats(wk.GetStatsRequest(), timeout=2)
            w.routed = 0
            if not w.healthy:
                log.info("%s worker %s is up (%s)", w.role, w.address, w.stats.engine_id)
            w.healthy = True
        except grpc.aio.AioRpcError as e:
            if w.healthy:
                log.warning("%s worker %s is down: %s", w.role, w.address, e.code())
            w.healthy = False
            # A restarted worker must shake hands again (pairs live on decode workers).
            w.pairs.clear()
            for d in self.decode:
                d.pairs.pop(w.address, None)

    async def _connect(self, d: Worker, p: Worker) -> None:
        """Ask the decode worker to shake hands with the prefill worker. FAILED_PRECONDITION
        (layouts differ) marks the pair unusable for good; other errors retry next poll."""
        stub = wk_grpc.DecodeServiceStub(d.channel)
        try:
            await stub.Connect(wk.ConnectRequest(prefill_address=p.address), timeout=15)
            d.pairs[p.address] = None
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                d.pairs[p.address] = e.details()
                log.error("decode %s cannot take KV from prefill %s: %s", d.address,
                          p.address, e.details())

    def prefills(self) -> list[Worker]:
        """Healthy prefill workers, least loaded first."""
        return sorted((w for w in self.prefill if w.healthy), key=lambda w: w.score)

    def pick_decode(self, prefill: Worker | None, exclude: set[str] = frozenset()) -> Worker:
        """The least loaded healthy decode worker, not in `exclude`; paired with `prefill`
        (shook hands, compatible layouts) when one is given. LookupError says why not."""
        decodes = [d for d in self.decode if d.healthy and d.address not in exclude]
        if prefill is not None:
            paired = [d for d in decodes if d.pairs.get(prefill.address, "") is None]
            if not paired:
                errors = [e for d in decodes if (e := d.pairs.get(prefill.address))]
                if errors:
                    raise LookupError("no compatible decode worker: " + "; ".join(errors))
                raise LookupError(f"no healthy decode worker connected to {prefill.address}")
            decodes = paired
        if not decodes:
            raise LookupError("no healthy decode worker")
        d = min(decodes, key=lambda w: w.score)
        d.routed += 1
        return d


def _channel(address: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
