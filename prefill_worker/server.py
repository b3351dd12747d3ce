"""The prefill worker: an engine in the prefill role behind PrefillService and
WorkerService. A prompt runs (chunked, prefix-cached) to its first token; unless that token
ends the request, its blocks stay held under a lease and the reply carries a KV handle
naming the lease. The decode worker that pulls the blocks releases the lease, and trusts
its pull only if the release finds the lease still held. Every release here (ReleaseKv;
AbortPrefill, the router's for an answer that never reached it; a call that ended
cancelled) is `AsyncEngine.release_lease`, the lease table's one path
(services/engine/leases.py; the whole life of a lease: docs/structures.md). In the
handshake it proves that it holds the cluster token, when one is set."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict

import grpc

from baton.kv_transfer.connectors import make_sender
from baton.services.common.finish import FinishReason
from baton.services.engine.engine import LLMEngine
from baton.services.lora.calls import lora_of
from baton.services.rpc import tracing
from baton.services.rpc.cluster import ClusterToken
from baton.services.rpc.convert import sampling_params
from baton.services.rpc.errors import Aborted, InvalidArgument
from baton.services.rpc.security import Security
from baton.services.worker import spans
from baton.services.worker.async_engine import AsyncEngine
from baton.services.worker.config import WorkerConfig
from baton.services.worker.messages import (
    delta_message,
    layout_from_message,
    layout_message,
    timings_message,
)
from baton.services.worker.metrics import WorkerMetrics
from baton.services.worker.runtime import make_engine, run_worker
from baton.worker.v1 import worker_pb2 as wk
from baton.worker.v1 import worker_pb2_grpc as wk_grpc

log = logging.getLogger(__name__)

GIVEN_UP_KEPT = 4096  # request ids given up before their call came (PrefillServicer)


class PrefillServicer(wk_grpc.PrefillServiceServicer):
    def __init__(self, aengine: AsyncEngine, engine_id: str, transport: str,
                 transport_metadata: bytes, metrics: WorkerMetrics,
                 cluster: ClusterToken | None = None):
        engine = aengine.engine
        self.aengine = aengine
        self.metrics = metrics
        self.engine_id = engine_id
        self.transport = transport
        self.transport_metadata = transport_metadata
        self.cluster = cluster or ClusterToken(None)
        self.layout = engine.kv_layout
        self.lease_s = engine.config.kv_lease_timeout_s
        # request id -> whether the router has given it up (AbortPrefill), for each
        # Prefill call under way: its lease, when granted, goes to nobody.
        self._given_up: dict[str, bool] = {}
        # Request ids given up before their Prefill call arrived (the abort overtook the
        # call on a loaded machine), oldest first, kept GIVEN_UP_KEPT at most and for a
        # lease's life: the call, when it comes, is refused.
        self._given_up_early: OrderedDict[str, float] = OrderedDict()

    async def Prefill(self, request, context):
        rid = request.request_id
        if not rid:
            raise InvalidArgument("request_id: required")
        if rid in self._given_up:
            raise InvalidArgument(f"request_id {rid!r} is already in use")
        if self._given_up_early.pop(rid, None) is not None:
            raise Aborted("the router gave the request up (AbortPrefill)")
        self._given_up[rid] = False
        try:
            return await self._prefill(rid, request, context)
        finally:
            del self._given_up[rid]

    async def _prefill(self, rid: str, request, context):
        params = sampling_params(request.sampling, self.aengine.engine.sampling_defaults)
        prompt = list(request.prompt_token_ids)
        grammar = await self.aengine.compile(params)  # refused here, before the queue
        lora = await lora_of(self.aengine, request.lora if request.HasField("lora") else None)
        if self._given_up[rid]:
            raise Aborted("the router gave the request up (AbortPrefill)")

        def add(engine: LLMEngine):
            engine.add_request(prompt, params, request_id=rid, priority=request.priority,
                               cache_salt=request.cache_salt or None, kv_hold=True,
                               grammar=grammar, lora=lora)

        out = None
        async for o in self.aengine.generate(rid, add):
            out = o
        if out is None or out.error or out.finish_reason == FinishReason.ABORT:
            raise Aborted(out.error if out is not None and out.error else "aborted")
        self.metrics.observe(out)
        spans.prompt(out, tracing.extract(context.invocation_metadata()))
        reply = wk.PrefillResponse(delta=delta_message(out),
                                   cached_tokens=out.num_cached_tokens,
                                   timings=timings_message(out))
        if out.handed_off and self._given_up[rid]:
            # The router's AbortPrefill came before the grant (its deadline passed before
            # ours, which began when the call reached us, or the caller left): it found no
            # lease to end, so this one is ended here.
            self.aengine.release_lease(rid, out.kv_lease_id)
            log.info("lease of %s ended as it was granted: the router had given the "
                     "request up", rid)
            raise Aborted("the router gave the request up (AbortPrefill)")
        if out.handed_off:
            reply.handle.CopyFrom(wk.KvHandle(
                engine_id=self.engine_id, request_id=rid, lease_id=out.kv_lease_id,
                block_ids=out.kv_block_ids, num_tokens=len(out.prompt_token_ids),
                fingerprint=self.layout.fingerprint, lease_s=self.lease_s))
            # A call that ends cancelled (the caller left) or past its deadline handed the
            # lease to nobody: gRPC drops an answer sent after the deadline (or it reaches
            # a router past its own), and the call does not read as cancelled then. An
            # answer that went out but never arrived is the router's to end (AbortPrefill,
            # after the grant; before it, `_given_up` above).
            lease = out.kv_lease_id
            context.add_done_callback(
                lambda ctx: _undelivered(ctx) and self.aengine.release_lease(rid, lease))
        return reply

    async def ReleaseKv(self, request, context):
        # Only the grant a handle names: a release must come from whoever saw the handle.
        if not request.request_id or not request.lease_id:
            raise InvalidArgument("request_id and lease_id: both are required (the KV "
                                  "handle's)")
        released = self.aengine.release_lease(request.request_id, request.lease_id)
        return wk.ReleaseKvResponse(released=released)

    async def AbortPrefill(self, request, context):
        # The router's: a Prefill call of its ended without the answer reaching it.
        if not request.request_id:
            raise InvalidArgument("request_id: required")
        rid = request.request_id
        if rid in self._given_up:  # still under way: its grant is ended
            self._given_up[rid] = True
        else:  # ended here already, or not here yet: a call that comes is refused
            self._remember_given_up(rid)
        return wk.AbortPrefillResponse(
            released=self.aengine.release_lease(request.request_id, None))

    def _remember_given_up(self, rid: str) -> None:
        now = time.monotonic()
        early = self._given_up_early
        early[rid] = now
        while early and (len(early) > GIVEN_UP_KEPT
                         or next(iter(early.values())) < now - self.lease_s):
            early.popitem(last=False)

    async def Handshake(self, request, context):
        self.layout.check_compatible(layout_from_message(request.layout))
        return wk.HandshakeResponse(
            engine_id=self.engine_id, layout=layout_message(self.layout),
            transport=self.transport, transport_metadata=self.transport_metadata,
            proof=self.cluster.prove(request.nonce, self.engine_id, self.transport,
                                     self.transport_metadata, self.layout))


def _undelivered(context) -> bool:
    """Whether a call, once ended, may not have delivered its answer: cancelled, or at
    or past its deadline."""
    left = context.time_remaining()
    return context.cancelled() or (left is not None and left <= 0)


def serve(config: WorkerConfig) -> None:
    transport = config.kv_transport
    if transport is None:  # the CLI sets it (NIXL where it loads, else gRPC)
        raise ValueError("kv_transport: not set (nixl or grpc)")
    security = Security.of(config)
    engine = make_engine(config.engine, config.threads, role="prefill",
                         cpus=config.cpu_set)
    sender = make_sender(transport, config.engine_id, engine.kv_layout,
                         engine.rank_kv_caches)

    def add(server: grpc.aio.Server, aengine: AsyncEngine, metrics: WorkerMetrics) -> None:
        wk_grpc.add_PrefillServiceServicer_to_server(
            PrefillServicer(aengine, config.engine_id, transport,
                            sender.metadata(), metrics, security.cluster), server)

    run_worker(config, "prefill", engine, "PrefillService", add, closers=[sender.close])
