"""The paged KV cache's layout, defined once. The cache allocation, every attention kernel,
the block byte codec, the NIXL descriptors and the layout handshake all read it from here.

One tensor per layer, block-major:

    cache[block, K|V, kv_head, offset_in_block, head_dim]

    layer tensor:  | block 0                                  | block 1 | ... | block N-1 |
                   | K h0 | K h1 | .. | K hH-1 | V h0 | .. | V hH-1 |
                     each a [block_size, head_dim] chunk

Block b of a layer is one contiguous run of 2 * kv_heads * block_size * head_dim elements:
K of every KV head, then V. A decode reads each of its blocks as one run, a token's write
lands inside one block, and a transfer moves one range per (layer, block). Inside a block,
a (K|V, head) chunk is contiguous, so code indexed by head still reads whole rows.

Torch-free: it only calls tensor methods, so the KV transfer contract may import it.
`NAME` goes into the layout two peers compare (kv_transfer/base.py): change it whenever
the order below changes, and peers of different versions refuse each other.
"""

from __future__ import annotations

from typing import Any

NAME = "block-major/v1"
K, V = 0, 1  # index of the K|V dimension


def shape(num_blocks: int, kv_heads: int, block_size: int, head_dim: int) -> tuple[int, ...]:
    """One layer's cache tensor."""
    return (num_blocks, 2, kv_heads, block_size, head_dim)


def dims(cache) -> tuple[int, int, int, int]:
    """(num_blocks, kv_heads, block_size, head_dim) of a layer tensor."""
    num_blocks, _, kv_heads, block_size_, head_dim = cache.shape
    return num_blocks, kv_heads, block_size_, head_dim


def num_blocks(cache) -> int:
    return cache.shape[0]


def block_size(cache) -> int:
    return cache.shape[3]


def head_views(cache) -> tuple[Any, Any]:
    """(K, V), each `[kv_heads, num_blocks, block_size, head_dim]`: strided views for code
    indexed by head then block (the Triton and C++ kernels, the reference)."""
    return cache[:, K].transpose(0, 1), cache[:, V].transpose(0, 1)


def flash_views(cache) -> tuple[Any, Any]:
    """(K, V), each `[num_blocks, block_size, kv_heads, head_dim]`, as flash-attn's paged
    kernels take them (any strides, head_dim contiguous)."""
    return cache[:, K].transpose(1, 2), cache[:, V].transpose(1, 2)


def chunks(cache):
    """The layer tensor as `[num_blocks * 2 * kv_heads, block_size, head_dim]`: one row per
    (block, K|V, head) chunk, numbered by `chunk`."""
    _, _, block_size_, head_dim = dims(cache)
    return cache.view(-1, block_size_, head_dim)


def chunk(block, kv, head, kv_heads: int):
    """Row of chunk (block, K|V, head) in `chunks(cache)`. Ints or tensors (broadcast)."""
    return (block * 2 + kv) * kv_heads + head


def offset(block, kv, head, pos, *, kv_heads: int, block_size: int, head_dim: int):
    """Element offset of (block, K|V, head, offset in block), head_dim element 0, from the
    start of the layer tensor. Ints or tensors (broadcast)."""
    return (chunk(block, kv, head, kv_heads) * block_size + pos) * head_dim


def block_elements(kv_heads: int, block_size: int, head_dim: int) -> int:
    """Elements of one block in one layer: the length of its contiguous run."""
    return 2 * kv_heads * block_size * head_dim


def rank_heads(kv_heads: int, tp_size: int, rank: int) -> range:
    """The KV heads tensor-parallel rank `rank` of `tp_size` holds, in order.

    With at least as many heads as ranks each rank holds kv_heads / tp_size consecutive
    heads; with fewer, each head is replicated on tp_size / kv_heads consecutive ranks:

        kv_heads 4, tp 2:  rank 0 -> h0 h1   rank 1 -> h2 h3
        kv_heads 2, tp 4:  rank 0 -> h0   rank 1 -> h0   rank 2 -> h1   rank 3 -> h1

    Query heads split evenly (num_heads / tp_size per rank), so the q heads of a rank use
    exactly the KV heads it holds. ValueError where neither count divides the other.
    """
    if tp_size < 1 or not 0 <= rank < tp_size:
        raise ValueError(f"rank {rank} of tensor-parallel size {tp_size}")
    if kv_heads % tp_size == 0:
        per = kv_heads // tp_size
        return range(rank * per, (rank + 1) * per)
    if tp_size % kv_heads == 0:
        head = rank // (tp_size // kv_heads)
        return range(head, head + 1)
    raise ValueError(f"{kv_heads} KV heads cannot be split over {tp_size} ranks: one count "
                     "must divide the other")
