"""The prefill worker: an engine in the prefill role behind PrefillService and
WorkerService. A prompt runs (chunked, prefix-cached) to its first token; unless that token
ends the request, its blocks stay held under a lease and the reply carries a KV handle."""

from __future__ import annotations

import logging

import grpc

from baton.v1 import worker_pb2 as wk
from baton.v1 import worker_pb2_grpc as wk_grpc
from kv_transfer import make_sender
from services.engine.engine import LLMEngine
from services.engine.kv_layout import IncompatibleLayout, KVLayout
from services.serving.convert import FINISH, logprobs_messages, set_stop_reason
from services.worker.async_engine import AsyncEngine, Overloaded
from services.worker.common import (
    abort_overloaded,
    engine_config,
    layout_from_message,
    layout_message,
    run_worker,
    sampling_params,
)

log = logging.getLogger(__name__)


class PrefillServicer(wk_grpc.PrefillServiceServicer):
    def __init__(self, aengine: AsyncEngine, engine_id: str, transport: str, sender):
        self.aengine = aengine
        self.engine_id = engine_id
        self.transport = transport
        self.sender = sender
        self.layout = KVLayout.of_engine(aengine.engine)

    async def Prefill(self, request, context):
        try:
            params = sampling_params(request.sampling)
        except (ValueError, TypeError) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        rid = request.request_id
        if not rid:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id is required")
        prompt = list(request.prompt_token_ids)

        def add(engine: LLMEngine):
            engine.add_request(prompt, params, request_id=rid, priority=request.priority,
                               cache_salt=request.cache_salt or None, kv_hold=True)

        out = None
        try:
            async for o in self.aengine.generate(rid, add):
                out = o
        except Overloaded as e:
            await abort_overloaded(context, e)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if out is None or out.error or (out.finish_reason == "abort"):
            await context.abort(grpc.StatusCode.ABORTED, out.error if out else "aborted")
        reply = wk.PrefillResponse(
            first_token_id=out.new_token_ids[0], text=out.new_text,
            finish_reason=FINISH[out.finish_reason], cached_tokens=out.num_cached_tokens,
            queue_s=out.queue_time or 0.0, prefill_s=out.prefill_time or 0.0)
        if out.logprobs:
            reply.logprobs.CopyFrom(logprobs_messages(out.logprobs[-1:])[0])
        set_stop_reason(reply, out.stop_reason)
        if out.kv_block_ids is not None:
            reply.handle.CopyFrom(wk.KvHandle(
                engine_id=self.engine_id, block_ids=out.kv_block_ids,
                num_tokens=len(out.prompt_token_ids), fingerprint=self.layout.fingerprint,
                lease_s=self.aengine.engine.scheduler.lease_timeout_s))
            if context.cancelled():  # nobody will come for these blocks
                await self.aengine.call(lambda e: e.release_lease(rid))
        return reply

    async def ReleaseKv(self, request, context):
        rid = request.request_id
        released = await self.aengine.call(lambda e: e.release_lease(rid))
        return wk.ReleaseKvResponse(released=released)

    async def Handshake(self, request, context):
        try:
            self.layout.check_compatible(layout_from_message(request.layout))
        except IncompatibleLayout as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"decode engine {request.engine_id}: {e}")
        return wk.HandshakeResponse(engine_id=self.engine_id,
                                    layout=layout_message(self.layout),
                                    transport=self.transport,
                                    transport_metadata=self.sender.metadata())


def serve(args) -> None:
    engine = LLMEngine(engine_config(args))
    sender = make_sender(args.kv_transport, args.engine_id, KVLayout.of_engine(engine),
                         engine.runner.kv_caches)

    def add(server: grpc.aio.Server, aengine: AsyncEngine) -> None:
        wk_grpc.add_PrefillServiceServicer_to_server(
            PrefillServicer(aengine, args.engine_id, args.kv_transport, sender), server)

    run_worker(args, "prefill", engine, "PrefillService", add, closers=[sender.close])
