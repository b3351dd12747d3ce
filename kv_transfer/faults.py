"""Fault injection for real deployments: `baton serve --role decode --inject-kv-failure
REASON` wraps the worker's receiver in FailingReceiver, so every pull fails with REASON
and the load-failure policy can be exercised end to end (a hidden flag, for tests)."""

from __future__ import annotations

from .base import KVHandle, KVLayout, KVReceiver, TransferState


class FailingReceiver(KVReceiver):
    def __init__(self, inner: KVReceiver, reason: str):
        self.inner = inner
        self.reason = reason
        self._ids: set[str] = set()

    def add_peer(self, engine_id: str, layout: KVLayout, metadata: bytes) -> None:
        self.inner.add_peer(engine_id, layout, metadata)

    def start_load(self, transfer_id: str, handle: KVHandle, remote_block_ids: list[int],
                   local_block_ids: list[int]) -> None:
        self._ids.add(transfer_id)

    def poll(self, transfer_id: str) -> tuple[TransferState, str | None]:
        if transfer_id in self._ids:
            self._ids.discard(transfer_id)
            return TransferState.FAILED, f"injected: {self.reason}"
        return TransferState.FAILED, f"unknown transfer {transfer_id!r}"

    def close(self) -> None:
        self.inner.close()
