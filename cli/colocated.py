"""Colocated mode: one process, one engine that prefills and decodes, behind the same
router as the disaggregated system (validation, tokenizing, admission, deadlines,
streaming, the HTTP API, metrics), which calls the engine's decode and worker servicers
in-process: no network hop, no second implementation of Generate, and no worker RPC on
the public port. The baseline that disaggregation is measured against."""

from __future__ import annotations

import asyncio

from baton.decode_worker.peers import Peers
from baton.decode_worker.server import DecodeServicer
from baton.router.clients import LocalWorkerClient
from baton.router.config import RouterConfig
from baton.router.server import WORK_METHODS, build, run
from baton.services.rpc import tracing
from baton.services.rpc.security import Security
from baton.services.rpc.server import Lifecycle
from baton.services.worker.async_engine import AsyncEngine
from baton.services.worker.config import WorkerConfig
from baton.services.worker.metrics import WorkerMetrics
from baton.services.worker.runtime import make_engine, watch_ranks
from baton.services.worker.worker_service import WorkerServicer


def serve(worker: WorkerConfig, router_config: RouterConfig) -> None:
    tracing.setup("baton-colocated", worker.service)
    engine = make_engine(worker.engine, worker.threads, role="colocated",
                         cpus=worker.cpu_set)
    aengine = AsyncEngine(engine, worker.max_waiting, worker.engine_stall_timeout)
    metrics = WorkerMetrics(lambda: aengine.stats, engine.model_info.model,
                            engine.kv_layout.block_bytes,  # served with the router's
                            engine.model_info.served_model_name)
    metrics.watch(aengine)
    watch_ranks(aengine)  # a tensor-parallel rank gone: the service stops
    lifecycle = Lifecycle(WORK_METHODS)

    async def main():
        # Never given a KV handle (no prefill workers here): it computes every prompt.
        decode = DecodeServicer(aengine, worker.engine_id, "", Peers(Security.of(worker)),
                                receiver=None, metrics=metrics)
        # Its own lifecycle: a drain of this service must not make its router think the
        # engine drains (the router would then refuse what it accepted before SIGTERM).
        stats = WorkerServicer(aengine, worker.engine_id, "colocated", Lifecycle())
        # Only the router calls its worker, and in-process: the worker's own services
        # (loads of adapters at any version, KV events, Prefill and Decode) are never on
        # the public port, whatever API key a caller holds.
        router = build(router_config, lifecycle, [],
                       [LocalWorkerClient(worker.service.address, decode, stats)],
                       vllm_metrics=False)  # the engine's `vllm:` names: one set a port

        async def stop():
            aengine.stop()

        await run(router_config, router, lifecycle, idle=lambda: aengine.stats.idle,
                  on_stop=stop, registries=[metrics.registry])

    asyncio.run(main())
    if aengine.dead_since is not None:  # a rank died: a failure, for the supervisor
        raise SystemExit(1)
