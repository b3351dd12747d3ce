"""Random attention batches for kernel tests and the GPU check (scripts/gpu_check.py)."""

from __future__ import annotations

import random

import torch

from baton.kernels import kv_layout
from baton.kernels.metadata import AttentionMetadata


def make_batch(rng: random.Random, block_size: int, num_kv_heads: int, group: int,
               head_dim: int, dtype: torch.dtype, decodes: int, prefills: int, *,
               max_prefix: int = 70, max_chunk: int = 40, num_blocks: int = 1024):
    """Random requests: decodes with up to max_prefix tokens before them, then prefill
    chunks of up to max_chunk tokens, half of them after a cached prefix (often starting
    mid-block). Returns (q, k, v, kv_cache, meta), all on the CPU: kv_cache is one layer's
    (kernels/kv_layout.py), holding random values; the new K/V are not yet written."""
    cache = torch.randn(kv_layout.shape(num_blocks, num_kv_heads, block_size, head_dim),
                        dtype=dtype)
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    q_lens, seq_lens, tables = [], [], []
    for i in range(decodes + prefills):
        if i < decodes:
            q_len, prefix = 1, rng.randint(0, max_prefix)
        else:
            q_len = rng.randint(1, max_chunk)
            prefix = rng.choice([0, rng.randint(1, max_prefix * 6 // 7)])
        seq_len = prefix + q_len  # a prefix not a multiple of block_size starts mid-block
        nb = (seq_len + block_size - 1) // block_size
        tables.append([free.pop() for _ in range(nb)])
        q_lens.append(q_len)
        seq_lens.append(seq_len)
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    qsl = [0]
    slots = []
    for t, q_len, seq_len in zip(tables, q_lens, seq_lens, strict=True):
        qsl.append(qsl[-1] + q_len)
        for p in range(seq_len - q_len, seq_len):
            slots.append(t[p // block_size] * block_size + p % block_size)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=table,
        num_decodes=decodes,
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
        max_seq_len=max(seq_lens),
        max_query_len=max(q_lens),
        decode_max_seq_len=max(seq_lens[:decodes], default=0),
    )
    n = qsl[-1]
    q = torch.randn(n, num_kv_heads * group, head_dim, dtype=dtype)
    k = torch.randn(n, num_kv_heads, head_dim, dtype=dtype)
    v = torch.randn(n, num_kv_heads, head_dim, dtype=dtype)
    return q, k, v, cache, meta
