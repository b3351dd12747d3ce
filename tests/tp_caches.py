"""Synthetic KV caches of tensor-parallel workers, for the transfer tests: a model's whole
cache (every head) filled with random bytes, and each rank's caches cut from it by
kv_layout.rank_heads alone, so what a decode rank must hold after a pull is read off the
whole cache, independently of the head map under test."""

from __future__ import annotations

import torch

from baton.kernels import kv_layout
from baton.kv_transfer.base import KVLayout

# (KV heads, prefill TP, decode TP): two ranks into one and back, and 2 KV heads over 4
# ranks (each replicated on two) into one and back.
PAIRS = [(4, 2, 1), (4, 1, 2), (2, 4, 1), (2, 1, 4)]


def layout(heads: int, tp: int, dtype: str = "float32") -> KVLayout:
    return KVLayout("m", dtype, block_size=4, num_layers=3, num_kv_heads=heads, head_dim=8,
                    tp_size=tp)


def whole(lay: KVLayout, num_blocks: int, seed: int) -> list[torch.Tensor]:
    """Every head's layer tensors, random bytes (any bit pattern is fine: bytes move)."""
    g = torch.Generator().manual_seed(seed)
    shape = kv_layout.shape(num_blocks, lay.num_kv_heads, lay.block_size, lay.head_dim)
    dtype = getattr(torch, lay.dtype)
    size = torch.empty(0, dtype=dtype).element_size()
    return [torch.randint(0, 256, (*shape[:-1], shape[-1] * size), generator=g,
                          dtype=torch.uint8).view(dtype) for _ in range(lay.num_layers)]


def heads_of(lay: KVLayout, rank: int) -> range:
    return kv_layout.rank_heads(lay.num_kv_heads, lay.tp_size, rank)


def split(lay: KVLayout, layers: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Each rank's caches: its heads of every layer, contiguous copies."""
    return [[t[:, :, heads_of(lay, r).start:heads_of(lay, r).stop].contiguous()
             for t in layers] for r in range(lay.tp_size)]


def raw(t: torch.Tensor) -> torch.Tensor:
    """A layer tensor as bytes, `[block, K|V, head, bs, d * element size]`."""
    return t.view(torch.uint8)


def assert_pulled(dest: KVLayout, got: list[list[torch.Tensor]], before: list[list[torch.Tensor]],
                  source: list[torch.Tensor], remote: list[int], local: list[int]) -> None:
    """Decode rank r's block local[i] holds exactly the source's block remote[i], r's heads;
    every other block is as it was."""
    for rank, layers in enumerate(got):
        h = heads_of(dest, rank)
        for layer, t in enumerate(layers):
            for r, d in zip(remote, local, strict=True):
                want = raw(source[layer])[r, :, h.start:h.stop]
                assert torch.equal(raw(t)[d], want), f"rank {rank} layer {layer} block {d}"
            others = [b for b in range(t.shape[0]) if b not in local]
            assert torch.equal(raw(t)[others], raw(before[rank][layer])[others]), \
                f"rank {rank} layer {layer}: a block outside {local} changed"


def slice_bytes(dest: KVLayout, rank: int, num_blocks: int) -> int:
    """blocks x layers x 2 x heads of the rank x block_size x head_dim x element size."""
    return (num_blocks * dest.num_layers * 2 * len(heads_of(dest, rank)) * dest.block_size
            * dest.head_dim * dest.element_size)
