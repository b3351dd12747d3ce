"""The P/D pull as a connector: a decode engine's request whose prompt KV sits on a
prefill engine (`request.remote`, a KVHandle) is loaded from there by the transfer's
receiver (kv_transfer/: NIXL or the gRPC stream, head slices between tensor-parallel
sizes included). The lease that pins the blocks on the prefill side and the check that it
held throughout are the receiver's and the prefill engine's (leases.py), unchanged.

A pull is all or nothing: a receiver's SUCCESS includes the lease check, and bytes read
without it may be another request's, so a failed pull keeps none of its blocks (the pool
hits in front of it stay).
"""

from __future__ import annotations

import time

from baton.kv_transfer.base import KVReceiver, TransferState

from ..request import Request
from .base import KVConnector, LoadResult


class PDConnector(KVConnector):
    name = "pd"

    def __init__(self, receiver: KVReceiver, block_size: int):
        self.receiver = receiver
        self.block_size = block_size
        self._settled: dict[str, LoadResult] = {}  # decided without the receiver
        self.num_blocks_pulled = 0  # remote blocks copied in
        self.num_blocks_local = 0  # remote blocks found in our own prefix cache instead

    def match(self, req: Request, num_hit_blocks: int) -> int | None:
        if req.remote is None:
            return None
        return req.remote.num_tokens - num_hit_blocks * self.block_size

    def publishable(self, req: Request) -> bool:
        # Only a peer that proved it belongs to the cluster may feed the shared cache; an
        # unverified one's bytes serve their own request alone.
        return req.remote is not None and req.remote.verified

    def start_load(self, load_id: str, req: Request, first_block: int,
                   block_ids: list[int]) -> None:
        handle = req.remote
        assert handle is not None  # match() takes only requests with a handle
        self.num_blocks_local += first_block
        if time.monotonic() > handle.deadline:  # the prefill engine may have reused them
            self._settled[load_id] = LoadResult(
                0, "the prefill worker's lease ended before the pull could start")
        elif not block_ids:  # every block was in our own prefix cache
            self._settled[load_id] = LoadResult(0)
        else:
            self.num_blocks_pulled += len(block_ids)
            self.receiver.start_load(load_id, handle, list(handle.block_ids[first_block:]),
                                     block_ids)

    def poll(self, load_id: str) -> LoadResult | None:
        if load_id in self._settled:
            return self._settled.pop(load_id)
        state, error = self.receiver.poll(load_id)
        if not state.done:
            return None
        if state is TransferState.SUCCESS:
            return LoadResult(0)
        return LoadResult(0, error or "transfer failed")

    def stats(self) -> dict[str, int]:
        return {"blocks_pulled": self.num_blocks_pulled,
                "blocks_local": self.num_blocks_local}
