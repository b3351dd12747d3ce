"""The KV-transfer contract, owned here: what peers must share (the layout and its
fingerprint), what a prefill engine hands out (a handle on blocks held under a lease),
and the connector interface (a sender exposes blocks, a receiver pulls them, and each
pull has one poll state). Torch-free: the engine imports this module, the router may too.

Both sides hold one tensor per layer, block-major, as kernels/kv_layout.py defines it:
`[block, K|V, kv_head, offset, head_dim]`. In each layer a block is one contiguous range
of `layer_block_bytes`: K of every KV head, then V, each `[block_size, head_dim]`:

    layer l tensor:  [ blk0: K h0 .. K hH-1 V h0 .. V hH-1 | blk1: ... | ... | blkN-1 ]
    block b of layer l starts at  b * layer_block_bytes

Peers must agree on the layout (the fingerprint; `cache_layout` names the order above, so
a peer that lays its cache out otherwise is refused, the field named), not on
num_blocks: each side indexes its own tensors with its own block count.
"""

from __future__ import annotations

import enum
import hashlib
import json
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass

import baton.kernels.kv_layout as kv_layout

# The most a peer may state of its cache, checked before anything is sized by it.
MAX_TP_SIZE = 1024  # ranks of one worker
MAX_NUM_BLOCKS = 2**31  # blocks of one pool: their ids are int32 on the wire (KvHandle)
# The KV cache's element types: the model's dtype, or an fp8 one (--kv-cache-dtype).
ELEMENT_SIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1,
                "float8_e5m2": 1}


class TransferState(enum.Enum):
    """One pull, as a receiver's poll reports it."""

    TRANSFERRING = "transferring"  # accepted; bytes may still be landing
    SUCCESS = "success"  # every block landed (and, where checked, the lease held throughout)
    FAILED = "failed"

    @property
    def done(self) -> bool:
        return self is not TransferState.TRANSFERRING


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
    cache_layout: str = kv_layout.NAME  # the order of a layer tensor's elements
    # An fp8 cache's per-layer k_scale/v_scale, as the engine states them ("1": all 1.0,
    # else a digest); "" where the cache stores the model's dtype, unscaled.
    kv_scales: str = ""
    # Tensor-parallel ranks the cache is split over (kv_layout.rank_heads: which heads
    # each holds). Not part of the fingerprint: peers of different sizes pair, each side
    # mapping head slices between its ranks and the peer's.
    tp_size: int = 1

    @property
    def fingerprint(self) -> str:
        fields = {k: v for k, v in asdict(self).items() if k != "tp_size"}
        text = "|".join(f"{k}={v}" for k, v in sorted(fields.items()))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    @property
    def canonical(self) -> bytes:
        """Every field, tp_size too, in one encoding: what the handshake's proof covers."""
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()

    @property
    def element_size(self) -> int:
        return ELEMENT_SIZE[self.dtype]

    @property
    def layer_block_bytes(self) -> int:
        """Bytes of one block in one layer, K and V: one contiguous range."""
        return kv_layout.block_elements(self.num_kv_heads, self.block_size,
                                        self.head_dim) * self.element_size

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over all layers, K and V."""
        return self.num_layers * self.layer_block_bytes

    def check_compatible(self, other: KVLayout) -> None:
        """Raise IncompatibleLayout naming every field that differs but tp_size, or
        tp_size where either side's is past MAX_TP_SIZE or its KV heads cannot be split
        over its ranks (then no head map exists: kv_transfer/head_map.py)."""
        mine, theirs = asdict(self), asdict(other)
        diff = [f"{k}: ours {mine[k]!r}, peer {theirs[k]!r}" for k in mine
                if k != "tp_size" and mine[k] != theirs[k]]
        for side, layout in (("ours", self), ("peer", other)):
            if not 1 <= layout.tp_size <= MAX_TP_SIZE:
                diff.append(f"tp_size: {side} {layout.tp_size!r}, not in 1..{MAX_TP_SIZE}")
                continue
            try:
                kv_layout.rank_heads(layout.num_kv_heads, layout.tp_size, 0)
            except ValueError as e:
                diff.append(f"tp_size: {side} {layout.tp_size!r}, {e}")
        if diff:
            raise IncompatibleLayout("KV layout mismatch (" + "; ".join(diff) + ")")


@dataclass(frozen=True)
class KVHandle:
    """A prompt's KV held on a prefill engine: that engine's id, the request's id there,
    the lease under which the blocks are held, the blocks in order (the last may be
    partial) and the number of prompt tokens they hold.

    `lease_id` names one grant of a lease: a lease that was released or expired is never
    granted again under the same id, so "lease `lease_id` of `request_id` is still held"
    proves the blocks were not freed (nor reused) since the handle was made.
    `deadline` is the receiver's own estimate (its monotonic clock) of when the lease
    ends; a pull is not started after it. It cannot see stalls before the handle reached
    it, so correctness rests on the lease check, not on the deadline.
    `verified` is the receiver's word that the engine proved it belongs to the cluster
    (by the cluster token or mutual TLS): only then may the blocks enter the shared
    prefix cache; otherwise they serve this request alone.
    `fingerprint` is the layout the blocks were written in, as the prefill engine stated
    it ("" if it stated none).
    """

    engine_id: str
    request_id: str
    lease_id: int
    block_ids: tuple[int, ...]
    num_tokens: int
    deadline: float = float("inf")
    verified: bool = False
    fingerprint: str = ""

    def check(self, layout: KVLayout, num_prompt_tokens: int) -> None:
        """The one check of a handle a receiver was given for a prompt: ValueError if it
        names no lease or does not hold exactly that prompt's blocks, IncompatibleLayout
        if its blocks were laid out otherwise than ours. The decode worker makes it before
        it does anything with the handle; the engine again as it takes the request."""
        if self.lease_id <= 0:
            raise ValueError("handle.lease_id: required (the lease the prefill worker "
                             "granted)")
        if self.fingerprint and self.fingerprint != layout.fingerprint:
            raise IncompatibleLayout("KV handle fingerprint does not match this engine's "
                                     "layout")
        n = num_prompt_tokens
        if self.num_tokens != n:
            raise ValueError(f"remote KV holds {self.num_tokens} tokens, the prompt has {n}")
        need = -(-n // layout.block_size)
        if len(self.block_ids) != need:
            raise ValueError(f"remote KV has {len(self.block_ids)} blocks, {n} tokens need "
                             f"{need}")


def check_caches(layout: KVLayout, rank_caches: list) -> int:
    """Validate every tensor-parallel rank's per-layer tensors (`[rank][layer]`) against
    the layout: tp_size ranks, each with num_layers tensors of its heads' shape
    (kv_layout.rank_heads), one block count for all. Return that block count."""
    if len(rank_caches) != layout.tp_size:
        raise ValueError(f"expected the caches of {layout.tp_size} ranks, got "
                         f"{len(rank_caches)}")
    num_blocks = None
    for rank, kv_caches in enumerate(rank_caches):
        if len(kv_caches) != layout.num_layers:
            raise ValueError(f"rank {rank}: expected {layout.num_layers} layer tensors, got "
                             f"{len(kv_caches)}")
        shape = tuple(kv_caches[0].shape)
        if num_blocks is None:
            num_blocks = shape[0] if shape else 0
        heads = len(kv_layout.rank_heads(layout.num_kv_heads, layout.tp_size, rank))
        if layout.cache_layout != kv_layout.NAME or shape != kv_layout.shape(
                num_blocks, heads, layout.block_size, layout.head_dim):
            raise ValueError(f"rank {rank}: KV tensor shape {shape} does not match {layout}")
        for t in kv_caches:
            if tuple(t.shape) != shape or not t.is_contiguous():
                raise ValueError("every layer tensor must have the same, contiguous shape")
    return num_blocks or 0


class KVSender(ABC):
    """The side that owns the blocks (the prefill worker). Blocks are pinned by the
    engine's lease while a receiver reads them; the sender itself tracks no requests."""

    @abstractmethod
    def metadata(self) -> bytes:
        """What a receiver needs to reach these blocks (agent metadata, base addresses)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        pass


class KVReceiver(ABC):
    """The side that pulls (the decode worker).

    - `add_peer` is called once per sender (again if it restarts), before any load from it.
    - `start_load` never blocks on the network and never raises for a transfer problem:
      a load that cannot run is reported FAILED by `poll`.
    - `poll` reports the state; once it says SUCCESS or FAILED the transfer is forgotten,
      and a later poll of that id is FAILED ("unknown transfer").
    - The destination blocks must stay allocated until then: the transport may still write.
    - SUCCESS means every block landed and, for receivers that check it (LeaseChecked),
      that the source still held the handle's lease when the bytes had landed.
    """

    @abstractmethod
    def add_peer(self, engine_id: str, layout: KVLayout, metadata: bytes) -> None:
        """Register a sender; raise IncompatibleLayout if its layout differs from ours."""

    @abstractmethod
    def start_load(self, transfer_id: str, handle: KVHandle, remote_block_ids: list[int],
                   local_block_ids: list[int]) -> None:
        """Copy remote block i (one of `handle.block_ids`) into local block i, for each i."""

    @abstractmethod
    def poll(self, transfer_id: str) -> tuple[TransferState, str | None]:
        """The transfer's state, and why when it is FAILED. An unknown id is FAILED."""

    def close(self) -> None:  # noqa: B027 - optional hook
        pass
