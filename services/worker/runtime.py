"""What prefill, decode and colocated workers share: the engine on its thread, the
WorkerService and the drain."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
from collections.abc import Callable

import grpc

from baton.worker.v1 import worker_pb2 as wk
from baton.worker.v1 import worker_pb2_grpc as wk_grpc

from ..common.message_size import worker_request_bytes
from ..engine.config import EngineConfig
from ..engine.engine import LLMEngine, ReceiverFactory
from ..engine.tp_ranks import run_node
from ..rpc import tracing
from ..rpc.security import Security
from ..rpc.server import Lifecycle, method_name, run_server, service_name
from .async_engine import AsyncEngine
from .config import WorkerConfig
from .metrics import WorkerMetrics
from .watchdog import watch
from .worker_service import WorkerServicer

log = logging.getLogger(__name__)


def make_engine(config: EngineConfig, threads: int | None,
                kv_receiver: ReceiverFactory | None = None, role: str = "",
                cpus: set[int] | None = None) -> LLMEngine:
    if role and config.kv_role not in (None, role):  # --kv-transfer-config's kv_role
        raise ValueError(f"kv_transfer_config.kv_role says a {config.kv_role} worker; "
                         f"this one is a {role} worker")
    if cpus:
        pin(cpus)
        threads = threads or len(cpus)
    if threads:
        import torch

        torch.set_num_threads(threads)
    if config.node_rank > 0:  # a node past 0 serves nothing: it runs its ranks, then ends
        run_node(config)
        raise SystemExit(0)
    return LLMEngine(config, kv_receiver=kv_receiver)


def pin(cpus: set[int]) -> None:
    """This process's threads onto `cpus`: those running now, and (inherited) every thread
    and tensor-parallel rank started later. ValueError naming cores it may not use."""
    try:
        for tid in os.listdir("/proc/self/task"):
            os.sched_setaffinity(int(tid), cpus)
    except OSError as e:
        raise ValueError(f"cpus {sorted(cpus)}: this process may run on "
                         f"{sorted(os.sched_getaffinity(0))} only ({e.strerror})") from None


RANK_DEATH_GRACE_S = 2.0  # NOT_SERVING and every request failed, then the worker stops


def watch_ranks(aengine: AsyncEngine) -> None:
    """Once a tensor-parallel rank is gone: health turns NOT_SERVING, every request ends
    with the engine-failed error (the router moves it as from a dead worker), and the
    worker stops (SIGTERM to itself: the drain finds nothing left) for its supervisor to
    restart. Nothing to watch on one rank."""
    ranks = aengine.engine.ranks
    if ranks is None:
        return

    def died(why: str) -> None:
        aengine.die(why)
        threading.Timer(RANK_DEATH_GRACE_S, os.kill, (os.getpid(), signal.SIGTERM)).start()

    ranks.group.on_death(died)


def worker_lifecycle(service: str, engine: LLMEngine, security: Security) -> Lifecycle:
    """A worker's: its role's work method (what a drain refuses), the cluster token on
    every call, and no message bigger than the largest request its engine takes."""
    work = {"PrefillService": "Prefill", "DecodeService": "Decode"}[service]
    lifecycle = Lifecycle((method_name(wk, service, work),))
    lifecycle.authorize = security.cluster.check()
    lifecycle.max_receive_bytes = worker_request_bytes(engine.max_model_len,
                                                       engine.kv_layout.block_size)
    return lifecycle


def run_worker(config: WorkerConfig, role: str, engine: LLMEngine, service: str,
               add_servicer: Callable[[grpc.aio.Server, AsyncEngine, WorkerMetrics], None],
               closers=()) -> None:
    """Serve `engine` in `role` until SIGTERM, then drain: the role's servicer (added by
    `add_servicer(server, aengine, metrics)`, `service` in worker.proto, whose `Prefill`
    or `Decode` is the new work a drain refuses) and WorkerService. The drain ends when
    the engine holds nothing: no request, and (prefill) no lease a decode worker has yet
    to pull. Metrics on --metrics-port, traces to --otlp-traces-endpoint. With a cluster
    token, every call but health must carry it. Health is NOT_SERVING while the engine
    thread is stuck (watchdog.py). Refuses to listen beyond loopback with nothing that
    checks its callers (WorkerConfig.check_cluster_auth)."""
    config.check_cluster_auth()
    svc = config.service
    security = Security.of(config)
    tracing.setup(f"baton-{role}", svc)
    aengine = AsyncEngine(engine, config.max_waiting, config.engine_stall_timeout)
    metrics = WorkerMetrics(lambda: aengine.stats, engine.model_info.model,
                            engine.kv_layout.block_bytes, engine.model_info.served_model_name)
    metrics.watch(aengine)
    watch_ranks(aengine)
    metrics.serve(svc)
    lifecycle = worker_lifecycle(service, engine, security)

    def register(server: grpc.aio.Server) -> list[str]:
        add_servicer(server, aengine, metrics)
        wk_grpc.add_WorkerServiceServicer_to_server(
            WorkerServicer(aengine, config.engine_id, role, lifecycle), server)
        return [service_name(wk, service), service_name(wk, "WorkerService")]

    watchdog: list[asyncio.Task] = []

    async def start():
        watchdog.append(asyncio.get_running_loop().create_task(watch(aengine, lifecycle)))

    async def stop():
        for task in watchdog:
            task.cancel()
        aengine.stop()
        for close in closers:
            close()
        tracing.shutdown()

    log.info("%s engine %s, KV transport %s, layout %s", role, config.engine_id,
             config.kv_transport, engine.kv_layout.fingerprint)
    asyncio.run(run_server(svc.address, register, lifecycle,
                           idle=lambda: aengine.stats.idle, on_start=start,
                           on_stop=stop, grace_s=svc.drain_grace,
                           credentials=security.server_credentials(public=False)))
    if aengine.dead_since is not None:  # a rank died: a failure, for the supervisor
        raise SystemExit(1)
