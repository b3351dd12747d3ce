"""WorkerService, on every worker: its load and state for the router (from the engine
thread's snapshot, never the live engine), the blocks its prefix cache holds (KV events,
from a log the engine thread writes under a lock), and leased KV blocks as bytes for the
gRPC fallback transport (the heads asked for, from every tensor-parallel rank's caches)."""

from __future__ import annotations

import asyncio

from baton.kernels import kv_layout
from baton.kv_transfer.blocks import read_heads
from baton.worker.v1 import worker_pb2 as wk
from baton.worker.v1 import worker_pb2_grpc as wk_grpc

from ..common.errors import shown
from ..lora import calls as lora_calls
from ..rpc.errors import FailedPrecondition, InvalidArgument
from ..rpc.server import Lifecycle
from .async_engine import AsyncEngine
from .messages import kv_events_message, layout_message, model_info_message

READ_CHUNK_BLOCKS = 8  # blocks per ReadKvBlocks message


class WorkerServicer(wk_grpc.WorkerServiceServicer):
    def __init__(self, aengine: AsyncEngine, engine_id: str, role: str, lifecycle: Lifecycle):
        engine = aengine.engine
        self.aengine = aengine
        self.engine_id = engine_id
        self.role = role
        self.lifecycle = lifecycle
        # Every rank's caches, where this process maps them (tp_cache.py); else why not
        # (ranks on other hosts: the worker serves, but hands out no KV).
        self.rank_caches: list | None = None  # [rank][layer]
        self.num_blocks, self.no_caches = 0, ""
        try:
            self.rank_caches = engine.rank_kv_caches
            self.num_blocks = kv_layout.num_blocks(self.rank_caches[0][0])
        except ValueError as e:
            self.no_caches = str(e)
        self.num_kv_heads = engine.kv_layout.num_kv_heads
        self.layout = layout_message(engine.kv_layout)
        self.model_info = model_info_message(engine.model_info)

    async def GetStats(self, request, context):
        s = self.aengine.stats
        return wk.GetStatsResponse(
            engine_id=self.engine_id, role=self.role, num_waiting=s.num_waiting,
            num_running=s.num_running, num_loading=s.num_loading, num_leases=s.num_leases,
            num_blocks=s.num_blocks, num_free_blocks=s.num_free_blocks,
            num_blocks_pulled=s.num_blocks_pulled, num_blocks_local=s.num_blocks_local,
            model_info=self.model_info, layout=self.layout,
            num_load_failures=s.num_load_failures, num_leases_expired=s.num_leases_expired,
            draining=self.lifecycle.draining, num_preemptions=s.num_preemptions,
            prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits, num_prompt_tokens=s.num_prompt_tokens,
            num_generation_tokens=s.num_generation_tokens,
            num_queued_prefill_tokens=s.num_queued_prefill_tokens,
            num_spec_drafts=s.num_spec_drafts,
            num_spec_draft_tokens=s.num_spec_draft_tokens,
            num_spec_accepted_tokens=s.num_spec_accepted_tokens,
            engine_stalled_since=self.aengine.stalled_since() or 0.0,
            lora_adapters=s.loras, kv_offload=dict(s.kv_offload))

    async def LoadLora(self, request, context):
        a = request.adapter
        await lora_calls.load(self.aengine, a.name, a.path, a.version)
        return wk.LoadLoraResponse()

    async def UnloadLora(self, request, context):
        return wk.UnloadLoraResponse(unloaded=await lora_calls.unload(self.aengine,
                                                                      request.name))

    async def GetKvEvents(self, request, context):
        engine = self.aengine.engine
        after = request.after if request.engine_id == self.engine_id else 0
        return kv_events_message(engine.kv_events.read(after), self.engine_id,
                                 self.layout.block_size, engine.config.enable_prefix_caching)

    async def ReadKvBlocks(self, request, context):
        """The blocks held under lease `lease_id` of `request_id`, checked before the
        read and again after it (a lease that ended meanwhile fails the read: its bytes
        may be another request's); the heads asked for, every head when none are."""
        ids = list(request.block_ids)
        if self.rank_caches is not None and any(not 0 < b < self.num_blocks for b in ids):
            raise InvalidArgument(f"block_ids: must be in 1..{self.num_blocks - 1}")
        if not request.request_id or not request.lease_id:
            raise InvalidArgument("request_id and lease_id: both are required")
        heads = range(self.num_kv_heads)
        if request.head_count:
            heads = range(request.head_start, request.head_start + request.head_count)
            if heads.start < 0 or heads.stop > self.num_kv_heads or not heads:
                raise InvalidArgument(f"head_start, head_count: heads {heads.start}.."
                                      f"{heads.stop - 1} are not among the "
                                      f"{self.num_kv_heads} KV heads")
        self._check_leased(request.request_id, request.lease_id, ids, "before")
        if (rank_caches := self.rank_caches) is None:
            raise FailedPrecondition(self.no_caches)
        for i in range(0, len(ids), READ_CHUNK_BLOCKS):
            chunk = ids[i:i + READ_CHUNK_BLOCKS]
            # Off the event loop: a long prompt is tens of MB to gather.
            data = await asyncio.to_thread(read_heads, rank_caches, self.num_kv_heads,
                                           chunk, heads)
            yield wk.ReadKvBlocksResponse(data=data)
        self._check_leased(request.request_id, request.lease_id, ids, "after")

    def _check_leased(self, rid: str, lease_id: int, ids: list[int], when: str) -> None:
        held = self.aengine.lease_blocks(rid, lease_id)
        if held is None or not set(ids) <= set(held):
            raise FailedPrecondition(f"blocks are not held under lease {lease_id} of "
                                     f"request {shown(rid)} ({when} the read)")
