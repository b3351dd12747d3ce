"""The KV connector interface: a sender exposes an engine's paged KV blocks, a receiver
pulls chosen blocks from a peer into its own blocks, and each pull has one poll state.

Both sides hold one tensor per layer, `[K|V, kv_head, block, offset, head_dim]` (see
services/engine/model_runner.py). A block is therefore not one contiguous range: in each
layer it is 2 * kv_heads chunks of `block_size * head_dim` elements:

    layer l tensor:  [ K head0: blk0 blk1 ... blkN-1 | K head1: ... | V head0: ... | ... ]
    chunk (l, kv, h, b) starts at  ((kv * kv_heads + h) * num_blocks + b) * chunk_bytes

Peers must agree on the layout (the fingerprint), not on num_blocks: each side indexes
its own tensors with its own block count.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from services.engine.kv_layout import IncompatibleLayout, KVLayout, TransferState

# The layout and the poll state live with the engine (services may not import kv_transfer).
IncompatiblePeer = IncompatibleLayout
__all__ = ["IncompatiblePeer", "KVLayout", "KVReceiver", "KVSender", "TransferState",
           "check_caches"]


def check_caches(layout: KVLayout, kv_caches: list[torch.Tensor]) -> int:
    """Validate per-layer tensors against the layout; return their block count."""
    if len(kv_caches) != layout.num_layers:
        raise ValueError(f"expected {layout.num_layers} layer tensors, got {len(kv_caches)}")
    shape = kv_caches[0].shape
    if (len(shape) != 5 or shape[0] != 2 or shape[1] != layout.num_kv_heads
            or shape[3] != layout.block_size or shape[4] != layout.head_dim):
        raise ValueError(f"KV tensor shape {tuple(shape)} does not match {layout}")
    for t in kv_caches:
        if t.shape != shape or not t.is_contiguous():
            raise ValueError("every layer tensor must have the same, contiguous shape")
    return shape[2]


class KVSender(ABC):
    """The side that owns the blocks (the prefill worker). Blocks are pinned by the
    engine's lease while a receiver reads them; the sender itself tracks no requests."""

    @abstractmethod
    def metadata(self) -> bytes:
        """What a receiver needs to reach these blocks (agent metadata, base addresses)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        pass


class KVReceiver(ABC):
    """The side that pulls (the decode worker). `start_load` never blocks on the network;
    `poll` reports the state, and once it says SUCCESS or FAILED the transfer is forgotten.
    The destination blocks must stay allocated until then: the transport may still write.
    """

    @abstractmethod
    def add_peer(self, engine_id: str, layout: KVLayout, metadata: bytes) -> None:
        """Register a sender; raise IncompatiblePeer if its layout differs from ours."""

    @abstractmethod
    def start_load(self, transfer_id: str, engine_id: str, remote_block_ids: list[int],
                   local_block_ids: list[int]) -> None:
        """Copy remote block i into local block i, for each i."""

    @abstractmethod
    def poll(self, transfer_id: str) -> tuple[TransferState, str | None]:
        """The transfer's state, and why when it is FAILED. An unknown id is FAILED."""

    def close(self) -> None:  # noqa: B027 - optional hook
        pass
