"""Colocated mode: one process whose engine takes both roles, behind the same public
Generation API as the router. The simplest deployment, and the baseline disaggregation is
measured against."""

from __future__ import annotations

import asyncio
import time
import uuid

import grpc

from baton.v1 import generation_pb2 as gen
from baton.v1 import generation_pb2_grpc as gen_grpc
from baton.v1 import worker_pb2 as wk
from baton.v1 import worker_pb2_grpc as wk_grpc
from services.engine.engine import LLMEngine
from services.serving.convert import FINISH, chat_messages, logprobs_messages, set_stop_reason
from services.serving.server import run_server, service_name
from services.worker.async_engine import AsyncEngine, Overloaded
from services.worker.common import (
    WorkerServicer,
    abort_overloaded,
    engine_config,
    max_waiting,
    model_info,
    sampling_params,
)


class ColocatedServicer(gen_grpc.GenerationServicer):
    def __init__(self, aengine: AsyncEngine):
        self.aengine = aengine
        self.engine = aengine.engine

    def _prompt(self, request) -> list[int] | str:
        kind = request.WhichOneof("prompt")
        if kind == "text":
            return request.text
        if kind == "token_ids":
            return list(request.token_ids.ids)
        if kind == "chat":
            return self.engine.apply_chat_template(chat_messages(request.chat))
        raise ValueError("the request has no prompt (text, token_ids or chat)")

    async def Generate(self, request, context):
        t0 = time.monotonic()
        rid = request.request_id or uuid.uuid4().hex
        try:
            params = sampling_params(request.sampling)
            prompt = self._prompt(request)
        except (ValueError, TypeError) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

        def add(engine: LLMEngine):
            engine.add_request(prompt, params, request_id=rid, priority=request.priority,
                               cache_salt=request.cache_salt or None)

        first = True
        try:
            async for out in self.aengine.generate(rid, add):
                if out.error:
                    await context.abort(grpc.StatusCode.INTERNAL, out.error)
                reply = gen.GenerateResponse(request_id=rid, token_ids=out.new_token_ids,
                                             text=out.new_text,
                                             finish_reason=FINISH[out.finish_reason])
                if out.logprobs and out.new_token_ids:
                    reply.logprobs.extend(logprobs_messages(out.logprobs[-len(
                        out.new_token_ids):]))
                set_stop_reason(reply, out.stop_reason)
                if first or out.finished:
                    reply.timings.CopyFrom(gen.Timings(
                        queue_s=out.queue_time or 0.0, prefill_s=out.prefill_time or 0.0,
                        first_token_s=time.monotonic() - t0 if first else 0.0))
                    first = False
                if out.finished:
                    reply.usage.CopyFrom(gen.Usage(
                        prompt_tokens=len(out.prompt_token_ids),
                        completion_tokens=len(out.token_ids),
                        cached_tokens=out.num_cached_tokens))
                yield reply
        except Overloaded as e:
            await abort_overloaded(context, e)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    async def Tokenize(self, request, context):
        try:
            if request.WhichOneof("prompt") == "chat":
                ids = self.engine.apply_chat_template(chat_messages(request.chat))
            else:
                ids = self.engine.tokenizer.encode(request.text) if request.text else []
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return gen.TokenizeResponse(token_ids=ids)

    async def GetModelInfo(self, request, context):
        return gen.GetModelInfoResponse(info=model_info(self.engine))


def serve(args) -> None:
    engine = LLMEngine(engine_config(args))
    aengine = AsyncEngine(engine, max_waiting(args))

    def register(server: grpc.aio.Server) -> list[str]:
        gen_grpc.add_GenerationServicer_to_server(ColocatedServicer(aengine), server)
        wk_grpc.add_WorkerServiceServicer_to_server(
            WorkerServicer(aengine, args.engine_id, "colocated"), server)
        return [service_name(gen, "Generation"), service_name(wk, "WorkerService")]

    async def stop():
        aengine.stop()

    asyncio.run(run_server(args.address, register, on_stop=stop,
                           grace_s=getattr(args, "drain_grace", 30.0)))
