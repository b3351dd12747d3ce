"""The layout of an engine's KV cache, as peers that copy blocks must agree on it.

One tensor per layer, `[K|V, kv_head, block, offset, head_dim]` (model_runner.py). Peers
must agree on every field here, not on the number of blocks.
"""

from __future__ import annotations

import enum
import hashlib
from dataclasses import asdict, dataclass

import torch


class TransferState(enum.Enum):
    """One remote KV pull, as a receiver's poll reports it."""

    BOOTSTRAPPING = "bootstrapping"  # accepted, not yet posted to the transport
    TRANSFERRING = "transferring"
    SUCCESS = "success"
    FAILED = "failed"

    @property
    def done(self) -> bool:
        return self in (TransferState.SUCCESS, TransferState.FAILED)


class IncompatibleLayout(ValueError):
    """The peer's KV layout differs from ours: its blocks cannot be copied into ours."""


@dataclass(frozen=True)
class KVLayout:
    """What two engines must share for a byte copy of a block to be a valid block."""

    model: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int

    @property
    def fingerprint(self) -> str:
        text = "|".join(f"{k}={v}" for k, v in sorted(asdict(self).items()))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=getattr(torch, self.dtype)).element_size()

    @property
    def chunk_bytes(self) -> int:
        return self.block_size * self.head_dim * self.element_size

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over all layers, K and V."""
        return self.num_layers * 2 * self.num_kv_heads * self.chunk_bytes

    @staticmethod
    def of_engine(engine) -> KVLayout:
        """The layout of an LLMEngine's KV cache."""
        mc = engine.model_config
        return KVLayout(model=engine.model_name, dtype=engine.config.dtype,
                        block_size=engine.config.block_size, num_layers=mc.num_layers,
                        num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim)

    def check_compatible(self, other: KVLayout) -> None:
        """Raise IncompatibleLayout naming every field that differs."""
        mine, theirs = asdict(self), asdict(other)
        diff = [f"{k}: ours {mine[k]!r}, peer {theirs[k]!r}" for k in mine
                if mine[k] != theirs[k]]
        if diff:
            raise IncompatibleLayout("KV layout mismatch (" + "; ".join(diff) + ")")
