"""The prefill worker: an engine in the prefill role behind PrefillService and
WorkerService. A prompt runs (chunked, prefix-cached) to its first token; unless that token
ends the request, its blocks stay held under a lease and the reply carries a KV handle
naming the lease. The decode worker that pulls the blocks releases the lease, and trusts
its pull only if the release finds the lease still held. In the handshake it proves that
it holds the cluster token, when one is set."""

from __future__ import annotations

import logging

import grpc

from baton.v1 import generation_pb2 as gen
from baton.v1 import worker_pb2 as wk
from baton.v1 import worker_pb2_grpc as wk_grpc
from kv_transfer import make_sender
from services.engine.engine import LLMEngine
from services.serving import tracing
from services.serving.cluster import ClusterToken
from services.serving.errors import Aborted, InvalidArgument
from services.serving.security import Security
from services.worker import spans
from services.worker.async_engine import AsyncEngine
from services.worker.config import WorkerConfig
from services.worker.messages import (
    delta_message,
    layout_from_message,
    layout_message,
    sampling_params,
)
from services.worker.metrics import WorkerMetrics
from services.worker.runtime import make_engine, run_worker

log = logging.getLogger(__name__)


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

    async def Prefill(self, request, context):
        params = sampling_params(request.sampling, self.aengine.engine.sampling_defaults)
        rid = request.request_id
        if not rid:
            raise InvalidArgument("request_id: required")
        prompt = list(request.prompt_token_ids)
        grammar = await self.aengine.compile(params)  # refused here, before the queue

        def add(engine: LLMEngine):
            engine.add_request(prompt, params, request_id=rid, priority=request.priority,
                               cache_salt=request.cache_salt or None, kv_hold=True,
                               grammar=grammar)

        out = None
        async for o in self.aengine.generate(rid, add):
            out = o
        if out is None or out.error or out.finish_reason == "abort":
            raise Aborted(out.error if out is not None and out.error else "aborted")
        self.metrics.observe(out)
        spans.prompt(out, tracing.extract(context.invocation_metadata()))
        reply = wk.PrefillResponse(
            delta=delta_message(out), cached_tokens=out.num_cached_tokens,
            timings=gen.Timings(queue_s=out.queue_time or 0.0,
                                prefill_s=out.prefill_time or 0.0))
        if out.handed_off:
            reply.handle.CopyFrom(wk.KvHandle(
                engine_id=self.engine_id, request_id=rid, lease_id=out.kv_lease_id,
                block_ids=out.kv_block_ids, num_tokens=len(out.prompt_token_ids),
                fingerprint=self.layout.fingerprint, lease_s=self.lease_s))
            if context.cancelled():  # nobody will come for these blocks
                self.aengine.release_lease(rid, out.kv_lease_id)
        return reply

    async def ReleaseKv(self, request, context):
        # Only the grant a handle names: a release must come from whoever saw the handle.
        if not request.request_id or not request.lease_id:
            raise InvalidArgument("request_id and lease_id: both are required (the KV "
                                  "handle's)")
        released = self.aengine.release_lease(request.request_id, request.lease_id)
        return wk.ReleaseKvResponse(released=released)

    async def Handshake(self, request, context):
        self.layout.check_compatible(layout_from_message(request.layout))
        return wk.HandshakeResponse(
            engine_id=self.engine_id, layout=layout_message(self.layout),
            transport=self.transport, transport_metadata=self.transport_metadata,
            proof=self.cluster.prove(request.nonce, self.engine_id, self.transport,
                                     self.transport_metadata))


def serve(config: WorkerConfig) -> None:
    security = Security.of(config)
    engine = make_engine(config.engine, config.threads)
    sender = make_sender(config.kv_transport, config.engine_id, engine.kv_layout,
                         engine.kv_caches)

    def add(server: grpc.aio.Server, aengine: AsyncEngine, metrics: WorkerMetrics) -> None:
        wk_grpc.add_PrefillServiceServicer_to_server(
            PrefillServicer(aengine, config.engine_id, config.kv_transport,
                            sender.metadata(), metrics, security.cluster), server)

    run_worker(config, "prefill", engine, "PrefillService", add, closers=[sender.close])
