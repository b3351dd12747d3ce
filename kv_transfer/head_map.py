"""Which peer rank supplies each KV head a rank holds, when two workers split the heads
over different tensor-parallel sizes. Torch-free: pure arithmetic on kv_layout.rank_heads.

A run is a stretch of consecutive heads one local rank takes from one remote rank, at
consecutive offsets on both sides. With 4 KV heads, a prefill worker of TP 2 and a decode
worker of TP 1:

    prefill rank 0: h0 h1   prefill rank 1: h2 h3
    decode rank 0:  h0 h1 h2 h3
    runs: (local 0, offset 0) <- (remote 0, offset 0) x 2
          (local 0, offset 2) <- (remote 1, offset 0) x 2

A head replicated on several remote ranks (fewer KV heads than ranks) is taken from the
first rank that holds it.
"""

from __future__ import annotations

from dataclasses import dataclass

import baton.kernels.kv_layout as kv_layout

from .base import KVLayout


@dataclass(frozen=True)
class HeadRun:
    """`count` heads: local rank `local_rank`'s heads from offset `local_head` (in its
    own cache) come from remote rank `remote_rank`'s, from offset `remote_head`."""

    local_rank: int
    local_head: int
    remote_rank: int
    remote_head: int
    count: int


def sources(kv_heads: int, tp_size: int, heads: range) -> list[tuple[int, int, int]]:
    """The ranks of a TP size that hold `heads` (global, consecutive), in order, as
    (rank, offset of the first head in that rank's cache, count): the first holder of each
    head, consecutive heads of one rank in one entry. ValueError if the split is impossible
    or a head is out of range."""
    if heads.step != 1 or heads.start < 0 or heads.stop > kv_heads:
        raise ValueError(f"heads {heads.start}..{heads.stop - 1} of {kv_heads}")
    held = [kv_layout.rank_heads(kv_heads, tp_size, r) for r in range(tp_size)]
    out: list[tuple[int, int, int]] = []
    for h in heads:
        rank = next(r for r, rh in enumerate(held) if h in rh)
        offset = h - held[rank].start
        if out and out[-1][0] == rank and out[-1][1] + out[-1][2] == offset:
            out[-1] = (rank, out[-1][1], out[-1][2] + 1)
        else:
            out.append((rank, offset, 1))
    return out


def head_runs(local: KVLayout, peer: KVLayout) -> list[HeadRun]:
    """For each local rank in order, the runs that fill its heads from the peer's ranks.
    IncompatibleLayout (naming the field) unless the layouts differ at most in tp_size and
    both splits are possible."""
    local.check_compatible(peer)
    runs: list[HeadRun] = []
    heads = local.num_kv_heads
    for rank in range(local.tp_size):
        offset = 0
        for remote, remote_head, count in sources(
                heads, peer.tp_size, kv_layout.rank_heads(heads, local.tp_size, rank)):
            runs.append(HeadRun(rank, offset, remote, remote_head, count))
            offset += count
    return runs


def rank_block_bytes(layout: KVLayout, rank: int) -> int:
    """Bytes of one block of one rank over all its layers, K and V: what it pulls per
    block (the whole block_bytes where the rank holds every head)."""
    heads = len(kv_layout.rank_heads(layout.num_kv_heads, layout.tp_size, rank))
    return (layout.num_layers * kv_layout.block_elements(heads, layout.block_size,
                                                         layout.head_dim)
            * layout.element_size)
