"""What one forward pass tells the attention kernels about its flat batch.

The batch is every scheduled token of every request, flattened into one sequence with no
padding. Requests are ordered decodes first, then prefill chunks:

    tokens:          | d0 | d1 | d2 | p0 p0 p0 p0 | p1 p1 |
    query_start_loc: 0    1    2    3             7       9
    seq_lens:        [L_d0, L_d1, L_d2, L_p0, L_p1]   (cached prefix + new tokens)

Request i's new tokens sit at positions seq_lens[i] - q_len_i ... seq_lens[i] - 1, and
token j of them attends to every cached or new token at a position <= its own.
Token t's K/V is written to slot_mapping[t] = block_id * block_size + offset.
block_tables[i] lists request i's blocks, padded with the null block 0.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


def count_shared_blocks(block_tables: torch.Tensor, seq_lens: list[int],
                        block_size: int) -> int:
    """How many leading blocks all rows of a (host) block table share, counting only
    blocks that every row fills completely."""
    n = len(seq_lens)
    full = min(seq_lens, default=0) // block_size
    if n < 2 or full == 0:
        return 0
    tables = block_tables[:n, :full]
    return int((tables == tables[:1]).all(0).int().cumprod(0).sum())


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32 (device)
    seq_lens: torch.Tensor  # [num_seqs] int32 (device)
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32 (device)
    num_decodes: int  # the first num_decodes requests have exactly one new token
    # Host copies, so CPU kernels can slice without a device sync.
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    max_seq_len: int
    max_query_len: int
    # Longest sequence among the decodes. A CUDA graph is captured once for all lengths, so
    # it passes the block table's full width instead.
    decode_max_seq_len: int
    # Leading blocks that every decode's table has in common (a shared cached prefix):
    # the kernel reads them once for all decodes. Counted on the host by the runner;
    # 0 in a CUDA graph, whose tables change under it.
    num_shared_blocks: int = 0
    # Likewise for the prefill chunks that have a cached prefix: leading blocks inside
    # every such chunk's prefix that all of them share.
    num_shared_prefill_blocks: int = 0

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    def to(self, device: torch.device | str) -> AttentionMetadata:
        """A copy whose tensors are on `device` (host copies stay as they are)."""
        return replace(self, slot_mapping=self.slot_mapping.to(device),
                       query_start_loc=self.query_start_loc.to(device),
                       seq_lens=self.seq_lens.to(device),
                       block_tables=self.block_tables.to(device))
