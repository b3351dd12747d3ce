"""Fast CPU path: vectorized cache writes and SDPA over K/V gathered through block tables.

Decodes (one new token each) are batched into one SDPA call over K/V padded to the longest
sequence, with a length mask. Each prefill chunk gets its own call, with a causal mask
shifted by the length of its cached prefix.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.metadata import AttentionMetadata


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


def _gather(cache: torch.Tensor, block_tables: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """[B, num_blocks] block ids -> [B, kv_heads, num_blocks * block_size, head_dim].

    index_select on dim 0 copies whole blocks (contiguous rows): several times faster on
    CPU than advanced indexing with a 2-D index.
    """
    b = block_tables.shape[0]
    ids = block_tables[:, :num_blocks].reshape(-1)
    g = torch.index_select(cache, 0, ids)  # [B * nb, bs, kvh, d]
    return g.view(b, -1, cache.shape[2], cache.shape[3]).transpose(1, 2)


def _decode(query, key_cache, value_cache, meta: AttentionMetadata, scale, out) -> None:
    n = meta.num_decodes
    block_size = key_cache.shape[1]
    max_len = meta.decode_max_seq_len
    num_blocks = (max_len + block_size - 1) // block_size
    tables = meta.block_tables[:n]
    k = _gather(key_cache, tables, num_blocks)
    v = _gather(value_cache, tables, num_blocks)
    pos = torch.arange(num_blocks * block_size, device=query.device)
    mask = (pos[None, :] < meta.seq_lens[:n, None]).view(n, 1, 1, -1)
    # GQA without repeating K/V: the `group` query heads that share a KV head become that
    # head's query rows, [n, kv_heads, group, d]; they all see the same keys.
    kv_heads, d = key_cache.shape[2], key_cache.shape[3]
    q = query[:n].view(n, kv_heads, -1, d)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    out[:n] = o.reshape(n, -1, d)


def _prefill(query, key_cache, value_cache, meta: AttentionMetadata, scale, out) -> None:
    block_size = key_cache.shape[1]
    for i in range(meta.num_decodes, meta.num_seqs):
        start, end = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1]
        seq_len, q_len = meta.seq_lens_cpu[i], end - start
        num_blocks = (seq_len + block_size - 1) // block_size
        table = meta.block_tables[i : i + 1]
        k = _gather(key_cache, table, num_blocks)[:, :, :seq_len]
        v = _gather(value_cache, table, num_blocks)[:, :, :seq_len]
        q = query[start:end].transpose(0, 1).unsqueeze(0)  # [1, H, q_len, d]
        if q_len == seq_len:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                               enable_gqa=True)
        else:
            # New token j sits at position seq_len - q_len + j; it sees keys at <= that.
            q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
            k_pos = torch.arange(seq_len, device=query.device)
            mask = k_pos[None, :] <= q_pos[:, None]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                               enable_gqa=True)
        out[start:end] = o[0].transpose(0, 1)


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    out = torch.empty_like(query)
    if meta.num_decodes:
        _decode(query, key_cache, value_cache, meta, scale, out)
    if meta.num_seqs > meta.num_decodes:
        _prefill(query, key_cache, value_cache, meta, scale, out)
    return out
