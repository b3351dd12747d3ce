"""The fallback connector for hosts without NIXL: block bytes streamed over gRPC.

The transport is a function the decode worker passes in (kv_transfer stays free of RPC
stubs): `fetch(handle, remote_block_ids, heads)` yields the bytes of those blocks, for
the global KV heads `heads` only, in the order of kv_transfer/blocks.py. The decode
worker's fetch calls the prefill worker's ReadKvBlocks, which serves only blocks held
under the handle's lease, before and after the read, and gathers the heads from whichever
of its tensor-parallel ranks hold them. A load pulls once per local rank, that rank's
heads (kv_layout.rank_heads), into that rank's caches: one pull of every head without
tensor parallelism. Loads run on a small thread pool; the engine only polls. Each
message's whole blocks go into the cache as it arrives: a pull never sits in memory whole.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

import baton.kernels.kv_layout as kv_layout

from .base import (
    KVHandle,
    KVLayout,
    KVReceiver,
    KVSender,
    TransferState,
    check_caches,
)
from .blocks import write_blocks
from .head_map import head_runs, rank_block_bytes

Fetch = Callable[[KVHandle, list[int], range], Iterable[bytes]]


class GrpcStreamSender(KVSender):
    """Nothing to publish: the receiver reaches the blocks through the worker's RPC."""

    def metadata(self) -> bytes:
        return b""


class GrpcStreamReceiver(KVReceiver):
    def __init__(self, layout: KVLayout, rank_caches: list[list[torch.Tensor]], fetch: Fetch,
                 num_threads: int = 2):
        self.layout = layout
        self.rank_caches = rank_caches
        self.num_blocks = check_caches(layout, rank_caches)
        # Bytes pulled per local rank, over every load (counted as they land).
        self.pulled_bytes = [0] * layout.tp_size
        self._fetch = fetch
        self._peers: set[str] = set()
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="kv-grpc")
        self._loads: dict[str, Future] = {}
        self._lock = threading.Lock()

    def add_peer(self, engine_id: str, layout: KVLayout, metadata: bytes) -> None:
        head_runs(self.layout, layout)  # IncompatibleLayout unless the heads map
        self._peers.add(engine_id)

    def start_load(self, transfer_id: str, handle: KVHandle, remote_block_ids: list[int],
                   local_block_ids: list[int]) -> None:
        fut = self._pool.submit(self._load, handle, list(remote_block_ids),
                                list(local_block_ids))
        with self._lock:
            self._loads[transfer_id] = fut

    def _load(self, handle: KVHandle, remote: list[int], local: list[int]) -> None:
        if handle.engine_id not in self._peers:
            raise ValueError(f"unknown peer {handle.engine_id!r}")
        if len(remote) != len(local):
            raise ValueError("remote and local block lists differ in length")
        if any(not 0 < b < self.num_blocks for b in local):
            raise ValueError(f"local block ids out of range (1..{self.num_blocks - 1})")
        for rank in range(self.layout.tp_size):
            self._load_rank(rank, handle, remote, local)

    def _load_rank(self, rank: int, handle: KVHandle, remote: list[int],
                   local: list[int]) -> None:
        heads = kv_layout.rank_heads(self.layout.num_kv_heads, self.layout.tp_size, rank)
        caches = self.rank_caches[rank]
        size, pending, done = rank_block_bytes(self.layout, rank), bytearray(), 0
        for chunk in self._fetch(handle, remote, heads):
            pending += chunk
            whole = len(pending) // size
            if not whole:
                continue
            if done + whole > len(local):
                raise ValueError(f"more than the {len(local)} blocks asked for arrived")
            cut = whole * size
            data, pending = ((pending, bytearray()) if cut == len(pending)
                             else (pending[:cut], pending[cut:]))
            write_blocks(caches, local[done:done + whole], data)
            done += whole
            with self._lock:
                self.pulled_bytes[rank] += cut
        if pending or done != len(local):
            raise ValueError(f"rank {rank}: got {done * size + len(pending)} bytes for "
                             f"{len(local)} blocks of {size} bytes")

    def poll(self, transfer_id: str) -> tuple[TransferState, str | None]:
        with self._lock:
            fut = self._loads.get(transfer_id)
            if fut is None:
                return TransferState.FAILED, f"unknown transfer {transfer_id!r}"
            if not fut.done():
                return TransferState.TRANSFERRING, None
            del self._loads[transfer_id]
        err = fut.exception()
        if err is not None:
            return TransferState.FAILED, f"{type(err).__name__}: {err}"
        return TransferState.SUCCESS, None

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
