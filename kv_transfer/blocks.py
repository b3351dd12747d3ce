"""The block byte codec: blocks as bytes, for transports that move bytes rather than memory
(the gRPC fallback, the fake, and tests that compare KV exactly).

Wire order of one block: layer-major, then K|V, then kv head, then [offset, head_dim]:

    block b bytes = concat over l of  kv_caches[l][b]   (shape [2, kv_heads, bs, d])

so n blocks are `n * layout.block_bytes` bytes, block i at offset i * block_bytes. The
cache is block-major (kernels/kv_layout.py): in each layer a block is already one
contiguous run in that order, so reading or writing one is a single slice per layer.

Under tensor parallelism a reader may ask for a range of heads [a, a + c) (global head
numbers; ReadKvBlocksRequest's head_start and head_count): the same order, with only
those heads, whichever of the source's ranks hold them (read_heads):

    block b bytes = concat over l of ( K ha .. K ha+c-1  V ha .. V ha+c-1 )

which is exactly the block of a rank holding those heads (kv_layout.rank_heads), so a
decode rank writes it into its own caches with write_blocks. Every head is the whole
range for a worker of one rank: the bytes above, unchanged.
"""

from __future__ import annotations

import torch

from .head_map import sources


def read_blocks(kv_caches: list[torch.Tensor], block_ids: list[int]) -> bytes:
    if not block_ids:
        return b""
    idx = torch.tensor(block_ids, dtype=torch.long, device=kv_caches[0].device)
    # [n, layers, 2, kv_heads, bs, d]: each (block, layer) one contiguous run of the cache
    stacked = torch.stack([kv.index_select(0, idx) for kv in kv_caches], dim=1).cpu()
    return stacked.view(torch.uint8).numpy().tobytes()


def read_heads(rank_caches: list[list[torch.Tensor]], kv_heads: int, block_ids: list[int],
               heads: range) -> bytes:
    """The blocks' bytes for global heads `heads` only, gathered from the tensor-parallel
    ranks holding them (`rank_caches[rank][layer]`, rank_heads' split of kv_heads over
    len(rank_caches) ranks; a replicated head is read from its first holder)."""
    if not block_ids:
        return b""
    runs = sources(kv_heads, len(rank_caches), heads)
    if len(runs) == 1:
        rank, offset, count = runs[0]
        if count == rank_caches[rank][0].shape[2]:  # the rank's heads, all of them
            return read_blocks(rank_caches[rank], block_ids)
    ids = torch.tensor(block_ids, dtype=torch.long)
    layers = []
    for layer in range(len(rank_caches[0])):
        # As bytes (exact, and CPU cat has no fp8): [n, 2, count, bs, d * element size]
        # per run, heads joined in order.
        parts = []
        for rank, offset, count in runs:
            kv = rank_caches[rank][layer].view(torch.uint8)
            parts.append(kv.index_select(0, ids.to(kv.device))[:, :, offset:offset + count]
                         .cpu())
        layers.append(torch.cat(parts, dim=2))
    return torch.stack(layers, dim=1).numpy().tobytes()


def write_blocks(kv_caches: list[torch.Tensor], block_ids: list[int],
                 data: bytes | bytearray) -> None:
    """Inverse of read_blocks: raise ValueError (writing nothing) if the size is wrong. A
    bytearray is read in place; bytes are copied once (torch wants a writable buffer)."""
    if not block_ids:
        return
    ref = kv_caches[0]
    per_block = len(kv_caches) * ref[0].numel() * ref.element_size()
    if len(data) != per_block * len(block_ids):
        raise ValueError(f"got {len(data)} bytes for {len(block_ids)} blocks of "
                         f"{per_block} bytes")
    buffer = data if isinstance(data, bytearray) else bytearray(data)
    flat = torch.frombuffer(buffer, dtype=torch.uint8)
    blocks = flat.view(len(block_ids), len(kv_caches), -1).to(ref.device)
    idx = torch.tensor(block_ids, dtype=torch.long, device=ref.device)
    # Copied as bytes, whatever the dtype: exact, and torch's CPU index_copy_ has no fp8.
    for layer, kv in enumerate(kv_caches):
        kv.view(torch.uint8).view(kv.shape[0], -1).index_copy_(0, idx, blocks[:, layer])
