"""Pure-torch reference kernels: slow, obvious, and the ground truth for every other path.

KV cache layout: one tensor per layer, block-major (kernels/kv_layout.py). These kernels
index it through its per-head views, `[kv_head, block_id, offset_in_block, head_dim]`.
"""

from __future__ import annotations

import torch

from . import kv_layout, kv_quant
from .metadata import AttentionMetadata


def reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    kv_cache: torch.Tensor,  # one layer's, kernels/kv_layout.py
    slot_mapping: torch.Tensor,  # [num_tokens]
    k_scale: float = 1.0,  # an fp8 cache stores key / k_scale (kernels/kv_quant.py)
    v_scale: float = 1.0,
) -> None:
    key_cache, value_cache = kv_layout.head_views(kv_cache)
    if kv_quant.is_fp8(kv_cache.dtype):
        key = kv_quant.quantize(key, k_scale, kv_cache.dtype)
        value = kv_quant.quantize(value, v_scale, kv_cache.dtype)
    block_size = key_cache.shape[2]
    for t, slot in enumerate(slot_mapping.tolist()):
        block, offset = divmod(slot, block_size)
        key_cache[:, block, offset] = key[t]
        value_cache[:, block, offset] = value[t]


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]: this step's K/V, already
    value: torch.Tensor,  # in the cache; a backend may use them to skip a gather
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    k_scale: float = 1.0,  # what an fp8 cache's elements are multiplied by when read
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal attention of each request's new tokens over its cached prefix plus themselves.

    window: a token at position p sees only keys at p - window < k <= p (HF's
    sliding_window). softcap: scores = softcap * tanh(scale * QK^T / softcap) before the
    mask (Gemma 2). None = off; softcap 0 is off too, as in flash-attn.
    Reads everything from the cache (after reshape_and_cache), ignoring `key`/`value`.
    """
    del key, value
    if not kv_quant.is_fp8(kv_cache.dtype):
        k_scale = v_scale = 1.0
    key_cache, value_cache = kv_layout.head_views(kv_cache)
    block_size = key_cache.shape[2]
    num_heads = query.shape[1]
    group = num_heads // key_cache.shape[0]
    out = torch.empty_like(query)
    for i in range(meta.num_seqs):
        start, end = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1]
        seq_len = meta.seq_lens_cpu[i]
        positions = torch.arange(seq_len, device=key_cache.device)
        blocks = meta.block_tables[i].to(key_cache.device).long()[positions // block_size]
        k = key_cache[:, blocks, positions % block_size].float() * k_scale  # [kv_heads, L, d]
        v = value_cache[:, blocks, positions % block_size].float() * v_scale
        k = k.repeat_interleave(group, dim=0)  # query head h reads kv head h // group
        v = v.repeat_interleave(group, dim=0)
        q = query[start:end].float()
        scores = torch.einsum("qhd,hkd->hqk", q, k) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos = torch.arange(seq_len - (end - start), seq_len, device=key_cache.device)
        allowed = positions[None, :] <= q_pos[:, None]  # [q, k]
        if window is not None:
            allowed &= positions[None, :] > q_pos[:, None] - window
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start:end] = torch.einsum("hqk,hkd->qhd", probs, v).to(query.dtype)
    return out
