"""What prefill, decode and colocated workers share: the engine config from flags, the
WorkerService (stats, KV bytes, prefix lookup), and proto builders."""

from __future__ import annotations

import argparse
import asyncio
import logging

import grpc

from baton.v1 import generation_pb2 as gen
from baton.v1 import worker_pb2 as wk
from baton.v1 import worker_pb2_grpc as wk_grpc
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.engine.kv_blocks import read_blocks
from services.engine.kv_layout import KVLayout
from services.engine.request import Request
from services.engine.sampling_params import SamplingParams
from services.serving.convert import sampling_kwargs
from services.serving.server import run_server, service_name
from services.worker.async_engine import AsyncEngine, Overloaded

log = logging.getLogger(__name__)

READ_CHUNK_BLOCKS = 8  # blocks per ReadKvBlocks message


def engine_config(args: argparse.Namespace) -> EngineConfig:
    if args.threads:
        import torch

        torch.set_num_threads(int(args.threads))
    return EngineConfig(model=args.model, dtype=args.dtype, device=args.device,
                        block_size=args.block_size, kv_cache_gib=args.kv_cache_gib,
                        max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens,
                        max_model_len=int(args.max_model_len) if args.max_model_len else None,
                        gpu_memory_utilization=args.gpu_memory_utilization,
                        enforce_eager=args.enforce_eager,
                        attention_backend=args.attention_backend,
                        load_format=args.load_format,
                        kv_lease_timeout_s=getattr(args, "kv_lease_timeout", 30.0),
                        kv_load_failure_policy=getattr(args, "kv_load_failure_policy",
                                                       "recompute"))


def max_waiting(args) -> int:
    """The waiting-queue bound: --max-queue, else four times max_num_seqs."""
    return int(getattr(args, "max_queue", None) or 4 * args.max_num_seqs)


async def abort_overloaded(context, e: Overloaded) -> None:
    """RESOURCE_EXHAUSTED at once, with a retry-after hint in the trailing metadata."""
    context.set_trailing_metadata((("retry-after-ms", str(int(e.retry_after_s * 1000))),))
    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))


def run_worker(args, role: str, engine: LLMEngine, service: str, add_servicer,
               closers=()) -> None:
    """Serve `engine` in `role` until a signal: the role's servicer (added by
    `add_servicer(server, aengine)`, named `service` in worker.proto) and WorkerService."""
    aengine = AsyncEngine(engine, max_waiting(args))

    def register(server: grpc.aio.Server) -> list[str]:
        add_servicer(server, aengine)
        wk_grpc.add_WorkerServiceServicer_to_server(
            WorkerServicer(aengine, args.engine_id, role), server)
        return [service_name(wk, service), service_name(wk, "WorkerService")]

    async def stop():
        aengine.stop()
        for close in closers:
            close()

    log.info("%s engine %s, KV transport %s, layout %s", role, args.engine_id,
             getattr(args, "kv_transport", None), KVLayout.of_engine(engine).fingerprint)
    asyncio.run(run_server(args.address, register, on_stop=stop,
                           grace_s=getattr(args, "drain_grace", 30.0)))


def sampling_params(msg: gen.SamplingParams) -> SamplingParams:
    return SamplingParams(**sampling_kwargs(msg))


def layout_message(layout: KVLayout) -> wk.KvLayout:
    return wk.KvLayout(model=layout.model, dtype=layout.dtype, block_size=layout.block_size,
                       num_layers=layout.num_layers, num_kv_heads=layout.num_kv_heads,
                       head_dim=layout.head_dim, fingerprint=layout.fingerprint)


def layout_from_message(msg: wk.KvLayout) -> KVLayout:
    return KVLayout(model=msg.model, dtype=msg.dtype, block_size=msg.block_size,
                    num_layers=msg.num_layers, num_kv_heads=msg.num_kv_heads,
                    head_dim=msg.head_dim)


def model_info(engine: LLMEngine) -> gen.ModelInfo:
    return gen.ModelInfo(model=engine.model_name, max_model_len=engine.max_model_len,
                         vocab_size=engine.model_config.vocab_size,
                         eos_token_ids=list(engine.model_config.eos_token_ids),
                         block_size=engine.config.block_size, dtype=engine.config.dtype)


class WorkerServicer(wk_grpc.WorkerServiceServicer):
    def __init__(self, aengine: AsyncEngine, engine_id: str, role: str):
        self.aengine = aengine
        self.engine = aengine.engine
        self.engine_id = engine_id
        self.role = role
        self.layout = KVLayout.of_engine(self.engine)

    async def GetStats(self, request, context):
        s = self.engine.stats()
        return wk.GetStatsResponse(
            engine_id=self.engine_id, role=self.role, num_waiting=s["num_waiting"],
            num_running=s["num_running"], num_loading=s["num_loading"],
            num_leases=s["num_leases"], num_blocks=s["num_blocks"],
            num_free_blocks=s["num_free_blocks"], num_blocks_pulled=s["num_blocks_pulled"],
            num_blocks_local=s["num_blocks_local"], model_info=model_info(self.engine),
            num_load_failures=s["num_load_failures"],
            num_leases_expired=s["num_leases_expired"],
            layout=layout_message(self.layout))

    async def ReadKvBlocks(self, request, context):
        ids = list(request.block_ids)
        n = self.engine.pool.num_blocks
        if any(not 0 < b < n for b in ids):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"block ids must be in 1..{n - 1}")
        rid = request.request_id
        if rid and not self._leased(rid, ids):
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"blocks are not held for request {rid!r} (lease gone)")
        caches = self.engine.runner.kv_caches
        for i in range(0, len(ids), READ_CHUNK_BLOCKS):
            chunk = ids[i:i + READ_CHUNK_BLOCKS]
            # Off the event loop: a long prompt is tens of MB to gather.
            data = await asyncio.to_thread(read_blocks, caches, chunk)
            yield wk.ReadKvBlocksResponse(data=data)
        if rid and not self._leased(rid, ids):  # released or expired while we read
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"the lease of request {rid!r} ended during the read")

    def _leased(self, rid: str, ids: list[int]) -> bool:
        # Read from the event loop: dict lookups, atomic under the GIL; a lease that ends
        # right after is caught by the second check.
        if rid not in self.engine.scheduler.leases:
            return False
        return set(ids) <= set(self.engine.kv.block_ids(rid))

    async def LookupPrefix(self, request, context):
        def lookup(engine: LLMEngine) -> list[int]:
            probe = Request("lookup", list(request.token_ids) + [0], SamplingParams(), (),
                            cache_salt=request.cache_salt or None)
            return [b.block_id for b in engine.kv.get_computed_blocks(probe)]

        return wk.LookupPrefixResponse(block_ids=await self.aengine.call(lookup))
