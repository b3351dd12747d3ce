"""Colocated mode: one process, one engine that prefills and decodes, behind the same
router logic as the disaggregated system (validation, tokenizing, admission, deadlines,
streaming), which calls the engine's decode servicer in-process: no network hop, no
second implementation of Generate. The baseline that disaggregation is measured against."""

from __future__ import annotations

import asyncio

import grpc

from baton.v1 import generation_pb2 as gen
from baton.v1 import generation_pb2_grpc as gen_grpc
from baton.v1 import worker_pb2 as wk
from baton.v1 import worker_pb2_grpc as wk_grpc
from decode_worker.peers import Peers
from decode_worker.server import DecodeServicer
from router.clients import LocalWorkerClient
from router.config import RouterConfig
from router.server import build
from services.serving.server import Lifecycle, method_name, run_server, service_name
from services.worker.async_engine import AsyncEngine
from services.worker.config import WorkerConfig
from services.worker.runtime import make_engine
from services.worker.worker_service import WorkerServicer


def serve(worker: WorkerConfig, router: RouterConfig) -> None:
    engine = make_engine(worker.engine, worker.threads)
    aengine = AsyncEngine(engine, worker.max_waiting)
    lifecycle = Lifecycle((method_name(gen, "Generation", "Generate"),))

    async def main():
        # Never given a KV handle (no prefill workers here): it computes every prompt.
        decode = DecodeServicer(aengine, worker.engine_id, "", Peers(), receiver=None)
        # Its own lifecycle: a drain of this service must not make its router think the
        # engine drains (the router would then refuse what it accepted before SIGTERM).
        stats = WorkerServicer(aengine, worker.engine_id, "colocated", Lifecycle())
        servicer, registry = build(router, lifecycle, [],
                                   [LocalWorkerClient(worker.address, decode, stats)])

        def register(server: grpc.aio.Server) -> list[str]:
            gen_grpc.add_GenerationServicer_to_server(servicer, server)
            wk_grpc.add_WorkerServiceServicer_to_server(stats, server)
            return [service_name(gen, "Generation"), service_name(wk, "WorkerService")]

        async def stop():
            await registry.close()
            servicer.intake.close()
            aengine.stop()

        await run_server(worker.address, register, lifecycle,
                         idle=lambda: aengine.stats.idle, on_start=registry.start,
                         on_stop=stop, grace_s=worker.drain_grace, serving_at_start=False)

    asyncio.run(main())
