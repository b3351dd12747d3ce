"""The torch backend: the fast path on CPU and the fallback on CUDA. Vectorized cache
writes and SDPA over K/V gathered through block tables.

Decodes (one new token each) are batched into one SDPA call over K/V padded to the longest
sequence, with a length mask. Each prefill chunk gets its own call, with a causal mask
shifted by the length of its cached prefix. Cache layout: kernels/kv_layout.py.

A sliding window (a token at p sees keys p - window < k <= p) is a mask, plus gathering
only the blocks the window touches; it skips the shared-prefix paths. Soft-capping
(softcap * tanh(scores / softcap), before the mask) runs everywhere but SDPA, which cannot
do it: such chunks take explicit matmuls.

An fp8 cache (kernels/kv_quant.py) is written quantized and read back dequantized to the
query's dtype; the C++ kernels do not read it, so its layers take the torch paths.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import cpu_ops, kv_layout, kv_quant
from .metadata import AttentionMetadata


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    _, kv_heads, block_size, d = kv_layout.dims(kv_cache)
    # Token t's K and V rows, every head, all inside its slot's block: one index_copy_ into
    # the layer tensor as [rows, d] (row numbers from kernels/kv_layout.py).
    block = (slot_mapping // block_size)[:, None]
    pos = (slot_mapping % block_size)[:, None]
    heads = torch.arange(kv_heads, device=slot_mapping.device)[None, :]
    where = dict(kv_heads=kv_heads, block_size=block_size, head_dim=1)
    rows = torch.stack((kv_layout.offset(block, kv_layout.K, heads, pos, **where),
                        kv_layout.offset(block, kv_layout.V, heads, pos, **where)), 1)
    rows = rows.reshape(-1)
    if kv_quant.is_fp8(kv_cache.dtype):
        new = torch.stack((kv_quant.quantize(key, k_scale, kv_cache.dtype),
                           kv_quant.quantize(value, v_scale, kv_cache.dtype)), 1)
        kv_quant.as_bytes(kv_cache).view(-1, d).index_copy_(
            0, rows, kv_quant.as_bytes(new).reshape(-1, d))
        return
    kv_cache.view(-1, d).index_copy_(0, rows, torch.stack((key, value), 1).reshape(-1, d))


# How an fp8 cache reads back: (k_scale, v_scale, the query's dtype); None for the others.
Dequant = tuple[float, float, torch.dtype] | None


def _gather(kv_cache: torch.Tensor, block_tables: torch.Tensor,
            num_blocks: int, dq: Dequant = None) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, num_blocks] block ids -> K and V, each [kv_heads, B, num_blocks * bs, head_dim].

    One index_select of whole (block, K|V, head) chunks (each contiguous in the cache, and
    a block's chunks side by side): each head's tokens come out contiguous, as the matmuls
    inside SDPA want them.
    """
    _, kv_heads, block_size, d = kv_layout.dims(kv_cache)
    b = block_tables.shape[0]
    ids = block_tables[:, :num_blocks].reshape(-1).long()
    heads = torch.arange(kv_heads, device=ids.device)[:, None]
    rows = torch.stack((kv_layout.chunk(ids[None, :], kv_layout.K, heads, kv_heads),
                        kv_layout.chunk(ids[None, :], kv_layout.V, heads, kv_heads)))
    g = torch.index_select(kv_layout.chunks(kv_cache), 0, rows.reshape(-1))
    g = g.view(2, kv_heads, b, -1, d)
    if dq is not None:
        k_scale, v_scale, dtype = dq
        return (kv_quant.dequantize(g[0], k_scale, dtype),
                kv_quant.dequantize(g[1], v_scale, dtype))
    return g[0], g[1]


# Decodes are padded to the longest sequence of their group; groups of this many rows keep
# the padding small when the runner sorts decodes by length.
DECODE_GROUP = 32

# Decodes that share a prefix take the cascade below, not the C++ kernel, on CPU: it
# measured faster (docs/benchmarks.md). Tests turn it off to run the kernel on them.
CASCADE_ON_CPU = True


def _softcap_(scores: torch.Tensor, softcap: float) -> torch.Tensor:
    """Gemma 2's logit soft-capping, in place: softcap * tanh(scores / softcap)."""
    return scores.div_(softcap).tanh_().mul_(softcap)


def _decode(query, kv_cache, meta: AttentionMetadata, scale, out, window,
            softcap, dq: Dequant) -> None:
    n = meta.num_decodes
    graph_width = meta.decode_max_seq_len > max(meta.seq_lens_cpu[:n])
    # Cascade attention: K/V of blocks that every row shares are gathered once, and every
    # query meets them in one large matmul, instead of once per row. Not with a window:
    # the shared prefix is mostly outside it.
    shared = meta.num_shared_blocks if window is None else 0
    ops = cpu_ops.serves("decode", query.device)
    if ops is not None and dq is None and not (shared and CASCADE_ON_CPU):
        # Each row reads its blocks in place, once (kernels/cpu/attention.h).
        ops.decode(query[:n], *kv_layout.head_views(kv_cache), meta.block_tables[:n],
                   meta.seq_lens[:n], out[:n], scale, window or 0, softcap or 0.0)
        return
    prefix = None
    if shared:
        table = meta.block_tables[:1, :shared]
        pk, pv = _gather(kv_cache, table, shared, dq)
        prefix = (pk[:, 0], pv[:, 0])
    for a in range(0, n, DECODE_GROUP):
        b = min(n, a + DECODE_GROUP)
        # A CUDA graph fixes the width for every row: decode_max_seq_len, not the group's.
        max_len = meta.decode_max_seq_len if graph_width else max(meta.seq_lens_cpu[a:b])
        _decode_group(query, kv_cache, meta, scale, out, a, b, max_len,
                      shared, prefix, window, softcap, dq)


def _window_tables(meta: AttentionMetadata, a, b, num_blocks, block_size, window):
    """Rows a..b's blocks from the first one their window touches, and the mask of keys
    outside the window or past the row's end: ([n, width] block ids, [n, width * bs]).

    Row r's token at L_r - 1 sees keys L_r - window .. L_r - 1: blocks from
    (L_r - window) // bs, at most (window + 2 * bs - 2) // bs of them. Computed on the
    device (no sync: a CUDA graph may run this); ids past a row's table are clamped, and
    their keys, at >= L_r, are masked.
    """
    width = min(num_blocks, (window + 2 * block_size - 2) // block_size)
    seq = meta.seq_lens[a:b, None].long()
    first = (seq - window).clamp_(min=0) // block_size  # [n, 1]
    idx = first + torch.arange(width, device=seq.device)
    tables = meta.block_tables[a:b].gather(1, idx.clamp_(max=meta.block_tables.shape[1] - 1))
    pos = first * block_size + torch.arange(width * block_size, device=seq.device)
    return tables, (pos >= seq) | (pos < seq - window)


def _decode_group(query, kv_cache, meta, scale, out, a, b, max_len, shared,
                  prefix, window, softcap, dq: Dequant) -> None:
    """Rows a..b attend over `shared` common blocks (K/V in `prefix`) and then each over its
    own remaining blocks, padded to the group's longest row:

        keys:  | shared blocks, one copy for all rows | own blocks, gathered per row |

    With a window (and shared = 0), each row's own blocks start where its window does.
    """
    n = b - a
    _, kv_heads, block_size, d = kv_layout.dims(kv_cache)
    num_blocks = (max_len + block_size - 1) // block_size
    if window is None:
        tables, width = meta.block_tables[a:b, shared:], num_blocks - shared
        pos = torch.arange(shared * block_size, num_blocks * block_size, device=query.device)
        pad = pos[None, :] >= meta.seq_lens[a:b, None]
    else:
        tables, pad = _window_tables(meta, a, b, num_blocks, block_size, window)
        width = tables.shape[1]
    k, v = _gather(kv_cache, tables, width, dq)  # each [kv_heads, n, L_own, d]
    pad = pad.view(1, n, 1, -1)
    # GQA without repeating K/V: the `group` query heads that share a KV head become that
    # head's query rows: [kv_heads, n, group, d], batched over (kv head, request).
    q = query[a:b].view(n, kv_heads, -1, d).transpose(0, 1)
    group = q.shape[2]
    # Plain batched matmuls beat SDPA's flash kernel for a handful of query rows. Numerics
    # as HF's eager attention: QK^T in the model dtype, softmax in fp32.
    own = torch.matmul(q, k.transpose(-1, -2))
    if prefix is None:
        scores = own.float().mul_(scale)
        if softcap:
            _softcap_(scores, softcap)
        probs = torch.softmax(scores.masked_fill_(pad, float("-inf")), dim=-1).to(v.dtype)
        o = torch.matmul(probs, v)
    else:
        pk, pv = prefix  # [kv_heads, L_shared, d]
        common = torch.matmul(q.reshape(kv_heads, n * group, d), pk.transpose(-1, -2))
        common = common.view(kv_heads, n, group, -1).float().mul_(scale)
        own = own.float().mul_(scale)
        if softcap:
            _softcap_(common, softcap)
            _softcap_(own, softcap)
        scores = torch.cat((common, own.masked_fill_(pad, float("-inf"))), dim=-1)
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        p_common, p_own = probs.split([common.shape[-1], own.shape[-1]], dim=-1)
        o = torch.matmul(p_common.reshape(kv_heads, n * group, -1), pv).view_as(q)
        o = o + torch.matmul(p_own, v)
    out[a:b] = o.transpose(0, 1).reshape(n, -1, d)


def _prefix_len(meta: AttentionMetadata, i: int) -> int:
    return meta.seq_lens_cpu[i] - (meta.query_start_loc_cpu[i + 1] - meta.query_start_loc_cpu[i])


def _prefill(query, key, value, kv_cache, meta: AttentionMetadata, scale, out, window,
             softcap, dq: Dequant) -> None:
    ops = cpu_ops.serves("prefill", query.device)
    if (ops is not None and dq is None and query.shape[-1] in cpu_ops.PREFILL_HEAD_DIMS
            and query.dtype in cpu_ops.PREFILL_DTYPES):
        # Every chunk in one call, keys read through the block tables (kernels/cpu/prefill.h).
        ops.prefill(query, *kv_layout.head_views(kv_cache), meta.block_tables, meta.seq_lens,
                    meta.query_start_loc, meta.num_decodes, out, scale, window or 0,
                    softcap or 0.0)
        return
    block_size = kv_layout.block_size(kv_cache)
    # Chunks with at least one cached block share meta.num_shared_prefill_blocks leading
    # blocks (the runner counted them); those are gathered once for all of them. Not with
    # a window: the shared prefix is mostly outside it.
    shared = meta.num_shared_prefill_blocks if window is None else 0
    prefix = None
    rows = range(meta.num_decodes, meta.num_seqs)
    first = next((i for i in rows if _prefix_len(meta, i) >= block_size), None)
    if shared and first is not None:
        table = meta.block_tables[first:first + 1, :shared]
        pk, pv = _gather(kv_cache, table, shared, dq)
        prefix = (pk[:, 0], pv[:, 0])
    for i in rows:
        start, end = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1]
        seq_len, q_len = meta.seq_lens_cpu[i], end - start
        q = query[start:end].transpose(0, 1).unsqueeze(0)  # [1, H, q_len, d]
        if q_len == seq_len and window is None and not softcap:
            # Nothing cached before: the new K/V are the whole sequence.
            k = key[start:end].transpose(0, 1).unsqueeze(0)
            v = value[start:end].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                               enable_gqa=True)
        elif prefix is not None and seq_len - q_len >= block_size:
            out[start:end] = _prefill_after_shared(query[start:end], kv_cache,
                                                   meta.block_tables[i], seq_len, shared,
                                                   prefix, scale, softcap, dq)
            continue
        else:
            # Keys from `lo` on: 0, or with a window the start of the block holding the
            # first key that the first new token (position seq_len - q_len) sees.
            lo = 0
            if window is not None:
                lo = max(0, seq_len - q_len - window + 1) // block_size * block_size
            if q_len == seq_len:  # nothing cached (so lo = 0): the new K/V are all keys
                k = key[start:end].transpose(0, 1).unsqueeze(0)
                v = value[start:end].transpose(0, 1).unsqueeze(0)
            else:
                num_blocks = (seq_len + block_size - 1) // block_size
                table = meta.block_tables[i : i + 1, lo // block_size:]
                own = num_blocks - lo // block_size
                k, v = _gather(kv_cache, table, own, dq)
                k = k[:, :, :seq_len - lo].transpose(0, 1)
                v = v[:, :, :seq_len - lo].transpose(0, 1)
            # New token j sits at position seq_len - q_len + j; it sees keys at <= that
            # (and, with a window, at > that - window).
            q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
            k_pos = torch.arange(lo, seq_len, device=query.device)
            mask = k_pos[None, :] <= q_pos[:, None]
            if window is not None:
                mask &= k_pos[None, :] > q_pos[:, None] - window
            if softcap:
                o = _capped_attention(q, k, v, mask, scale, softcap)
            else:
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                                   enable_gqa=True)
        out[start:end] = o[0].transpose(0, 1)


def _capped_attention(q, k, v, mask, scale, softcap):
    """SDPA's attention with soft-capping, which SDPA lacks: q [1, H, q_len, d], k and v
    [1, kv_heads, L, d], mask [q_len, L] -> [1, H, q_len, d]. QK^T in the model dtype,
    softmax in fp32, as the decode path."""
    _, num_heads, q_len, d = q.shape
    kv_heads = k.shape[1]
    # Rows (g, t) of kv head h hold query head h * group + g at new token t.
    qh = q[0].reshape(kv_heads, -1, d)
    scores = _softcap_(torch.matmul(qh, k[0].transpose(-1, -2)).float().mul_(scale), softcap)
    scores.view(kv_heads, -1, q_len, scores.shape[-1]).masked_fill_(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(probs, v[0]).view(1, num_heads, q_len, d)


def _prefill_after_shared(q, kv_cache, table, seq_len, shared, prefix, scale,
                          softcap, dq: Dequant):
    """One chunk of q_len new tokens whose first `shared` blocks are the shared prefix:

        keys:  | shared blocks (gathered once) | own cached blocks + new tokens, causal |

    The shared keys all precede every new token, so they need no mask.
    """
    _, kv_heads, block_size, d = kv_layout.dims(kv_cache)
    q_len, num_heads = q.shape[0], q.shape[1]
    group = num_heads // kv_heads
    pk, pv = prefix
    start = shared * block_size
    num_blocks = (seq_len + block_size - 1) // block_size
    own_table = table[shared:num_blocks].unsqueeze(0)
    k, v = _gather(kv_cache, own_table, num_blocks - shared, dq)
    k, v = k[:, 0, :seq_len - start], v[:, 0, :seq_len - start]
    # Rows (g, t) of kv head h hold query head h * group + g at new token t.
    qh = q.view(q_len, kv_heads, group, d).permute(1, 2, 0, 3).reshape(kv_heads, -1, d)
    common = torch.matmul(qh, pk.transpose(-1, -2)).float().mul_(scale)
    own = torch.matmul(qh, k.transpose(-1, -2)).float().mul_(scale)
    if softcap:
        _softcap_(common, softcap)
        _softcap_(own, softcap)
    q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device).repeat(group)
    k_pos = torch.arange(start, seq_len, device=q.device)
    own.masked_fill_(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
    probs = torch.softmax(torch.cat((common, own), dim=-1), dim=-1).to(v.dtype)
    p_common, p_own = probs.split([common.shape[-1], own.shape[-1]], dim=-1)
    o = torch.matmul(p_common, pv) + torch.matmul(p_own, v)  # [kv_heads, group * q_len, d]
    return o.view(kv_heads, group, q_len, d).permute(2, 0, 1, 3).reshape(q_len, num_heads, d)


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    out = torch.empty_like(query)
    dq: Dequant = None
    if kv_quant.is_fp8(kv_cache.dtype):
        # The new K/V as the cache holds them: a chunk reads its own tokens as later
        # chunks will.
        dq = (k_scale, v_scale, query.dtype)
        key = kv_quant.round_trip(key, k_scale, kv_cache.dtype)
        value = kv_quant.round_trip(value, v_scale, kv_cache.dtype)
    if meta.num_decodes:
        _decode(query, kv_cache, meta, scale, out, window, softcap, dq)
    if meta.num_seqs > meta.num_decodes:
        _prefill(query, key, value, kv_cache, meta, scale, out, window, softcap, dq)
    return out
