"""An in-memory connector for tests only (production code never imports it): peers are
engines in the same process, found by engine id, and a load copies blocks when polled,
unless `hold` keeps it in flight. `fail` makes the next loads fail, to test the error
paths. Each local tensor-parallel rank takes its heads from whichever of the peer's ranks
hold them (blocks.read_heads), as the gRPC stream does."""

from __future__ import annotations

import threading

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
from .blocks import read_heads, write_blocks
from .head_map import head_runs

_registry: dict[str, list[list[torch.Tensor]]] = {}  # engine id -> its [rank][layer] caches
_lock = threading.Lock()


class FakeConnector(KVSender, KVReceiver):
    def __init__(self, engine_id: str, layout: KVLayout,
                 rank_caches: list[list[torch.Tensor]]):
        self.engine_id = engine_id
        self.layout = layout
        self.rank_caches = rank_caches
        self.num_blocks = check_caches(layout, rank_caches)
        self.pulled_bytes = [0] * layout.tp_size  # per local rank, over every load
        self.fail: str | None = None  # set to a reason to fail every load from now on
        self.hold = False  # while True, every load stays in flight
        self._peers: set[str] = set()
        self._pending: dict[str, tuple[str, list[int], list[int]]] = {}
        with _lock:
            _registry[engine_id] = rank_caches

    def metadata(self) -> bytes:
        return self.engine_id.encode()

    def add_peer(self, engine_id: str, layout: KVLayout, metadata: bytes) -> None:
        head_runs(self.layout, layout)  # IncompatibleLayout unless the heads map
        self._peers.add(engine_id)

    def start_load(self, transfer_id: str, handle: KVHandle, remote_block_ids: list[int],
                   local_block_ids: list[int]) -> None:
        self._pending[transfer_id] = (handle.engine_id, list(remote_block_ids),
                                      list(local_block_ids))

    def poll(self, transfer_id: str) -> tuple[TransferState, str | None]:
        entry = self._pending.get(transfer_id)
        if entry is None:
            return TransferState.FAILED, f"unknown transfer {transfer_id!r}"
        if self.hold:
            return TransferState.TRANSFERRING, None
        del self._pending[transfer_id]
        engine_id, remote, local = entry
        if self.fail is not None:
            return TransferState.FAILED, self.fail
        with _lock:
            src = _registry.get(engine_id)
        if engine_id not in self._peers or src is None:
            return TransferState.FAILED, f"unknown peer {engine_id!r}"
        if len(remote) != len(local):
            return TransferState.FAILED, "remote and local block lists differ in length"
        heads = self.layout.num_kv_heads
        for rank, caches in enumerate(self.rank_caches):
            data = read_heads(src, heads, remote,
                              kv_layout.rank_heads(heads, self.layout.tp_size, rank))
            write_blocks(caches, local, data)
            self.pulled_bytes[rank] += len(data)
        return TransferState.SUCCESS, None

    def close(self) -> None:
        with _lock:
            _registry.pop(self.engine_id, None)
