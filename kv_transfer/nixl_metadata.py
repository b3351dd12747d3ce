"""What a NIXL connector hands out of itself in the handshake, and the checks a receiver
makes of a peer's before any of it sizes anything. Torch- and NIXL-free.

    {"version": 2, "engine_id", "fingerprint", "agent": <base64 NIXL agent metadata>,
     "tp_size", "base_addrs": [rank][layer], "num_blocks", "mem_type": "DRAM" | "VRAM",
     "device_ids": [rank]}

Every count in it is bounded: tp_size by the layout's (MAX_TP_SIZE, checked with it),
num_blocks by MAX_NUM_BLOCKS, each rank's tensors by the 64-bit address space, and the
descriptors the receiver would build from it by NIXL's int32 indices (MAX_DESCRIPTORS).
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from typing import TypeGuard

import baton.kernels.kv_layout as kv_layout

from .base import MAX_NUM_BLOCKS, IncompatibleLayout, KVLayout

VERSION = 2  # 2: every rank's base addresses and device
MEM_TYPES = ("DRAM", "VRAM")
ADDRESS_SPACE = 2**64
MAX_DESCRIPTORS = 2**31  # a descriptor list is indexed by int32 (nixl_connector)
MAX_DEVICE_ID = 2**16 - 1  # a rank's device index on its host


@dataclass(frozen=True)
class PeerMemory:
    """A connector's KV memory as its metadata states it (a peer's: checked)."""

    agent: bytes  # its NIXL agent's metadata
    base_addrs: list[list[int]]  # [rank][layer]
    num_blocks: int
    mem_type: str
    device_ids: list[int]  # per rank


def encode(engine_id: str, layout: KVLayout, memory: PeerMemory) -> bytes:
    """Our own metadata, as `read` takes it."""
    return json.dumps({
        "version": VERSION, "engine_id": engine_id, "fingerprint": layout.fingerprint,
        "agent": base64.b64encode(memory.agent).decode(), "tp_size": layout.tp_size,
        "base_addrs": memory.base_addrs, "num_blocks": memory.num_blocks,
        "mem_type": memory.mem_type, "device_ids": memory.device_ids}).encode()


def _is_int(value: object, low: int, high: int) -> TypeGuard[int]:
    return type(value) is int and low <= value <= high


def read(engine_id: str, layout: KVLayout, metadata: bytes,
         descriptors_per_block: int) -> PeerMemory:
    """Peer `engine_id`'s memory from its metadata, given its layout (checked against
    ours already, so its tp_size is bounded) and the descriptors the receiver builds per
    block id: ValueError (IncompatibleLayout for another layout's) naming what is wrong."""
    who = f"peer {engine_id}"
    md = json.loads(metadata)
    if not isinstance(md, dict) or md.get("version") != VERSION:
        version = md.get("version") if isinstance(md, dict) else None
        raise ValueError(f"{who}: unknown metadata version {version}")
    if md.get("engine_id") != engine_id:
        raise ValueError(f"metadata of {md.get('engine_id')!r} given for {who}")
    if md.get("fingerprint") != layout.fingerprint:
        raise IncompatibleLayout(f"{who}: metadata is for another KV layout")
    bases, devices = md.get("base_addrs"), md.get("device_ids")
    if (md.get("tp_size") != layout.tp_size or not isinstance(bases, list)
            or len(bases) != layout.tp_size):
        ranks = len(bases) if isinstance(bases, list) else bases
        raise ValueError(f"{who}: metadata of {ranks} ranks, its layout has "
                         f"{layout.tp_size}")
    if any(not isinstance(b, list) or len(b) != layout.num_layers for b in bases):
        raise ValueError(f"{who}: a rank without {layout.num_layers} layers in metadata")
    if not isinstance(devices, list) or len(devices) != layout.tp_size or not all(
            _is_int(d, 0, MAX_DEVICE_ID) for d in devices):
        raise ValueError(f"{who}: device_ids must be {layout.tp_size} device indices "
                         f"(0..{MAX_DEVICE_ID})")
    if md.get("mem_type") not in MEM_TYPES or not isinstance(md.get("agent"), str):
        raise ValueError(f"{who}: mem_type must be one of {MEM_TYPES}, agent a string")
    n = md.get("num_blocks")
    if not _is_int(n, 1, MAX_NUM_BLOCKS):
        raise ValueError(f"{who}: num_blocks {n!r} not in 1..{MAX_NUM_BLOCKS}")
    if n * descriptors_per_block > MAX_DESCRIPTORS:
        raise ValueError(f"{who}: {n} blocks of {descriptors_per_block} descriptors each "
                         f"are more than NIXL indexes ({MAX_DESCRIPTORS})")
    for rank, layers in enumerate(bases):
        heads = len(kv_layout.rank_heads(layout.num_kv_heads, layout.tp_size, rank))
        span = n * kv_layout.block_elements(heads, layout.block_size,
                                            layout.head_dim) * layout.element_size
        if not all(_is_int(a, 0, ADDRESS_SPACE - span) for a in layers):
            raise ValueError(f"{who}: rank {rank}'s tensors of {n} blocks do not fit in "
                             "64-bit addresses")
    return PeerMemory(base64.b64decode(md["agent"]), bases, n, md["mem_type"], devices)
