"""Triton kernels: the cache write and one paged attention kernel for decodes and prefill
chunks alike (a decode is a chunk of one new token). Cache layout: kernels/kv_layout.py;
the kernels take its per-head K and V views and address them by their strides.

On CPU these run under Triton's interpreter (TRITON_INTERPRET=1, set before triton is
imported); that is how CI tests them.

Attention grid: (tile of BLOCK_Q new tokens, request, KV head); the tiles go first, as
only the first grid axis may exceed 65,535. One program serves the
GROUP query heads that read the same KV head, so each K/V tile is loaded once for all of
them. Its rows are (token, head) pairs, token-major:

    row r  ->  new token  q_tile * BLOCK_Q + r // GROUP_PAD,  query head  kv_head * GROUP
                                                                          + r % GROUP_PAD
    rows with r % GROUP_PAD >= GROUP, or past the request's new tokens, are padding.

Keys are visited TILE_N at a time; key j's K/V row is found through the block table, in
the per-head view: K[kv_head, block_tables[req, j // BLOCK_SIZE], j % BLOCK_SIZE]. A new
token at position p sees keys at positions <= p (its cached prefix, then causal), and
with a sliding window only those > p - window; the key loop then starts at the first key
the tile's first token sees. Soft-capping maps scores to softcap * tanh(scores / softcap)
before the mask. Softmax is the online (flash) form in fp32: a running max m, a running
sum l, and the unnormalized output, rescaled by exp(m_old - m_new) whenever the max grows.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

from . import kv_layout
from .metadata import AttentionMetadata

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _on(device: torch.device):
    """Triton launches on the current CUDA device: make it the tensors' device."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _launch(kernel: triton.KernelInterface[Any], grid: tuple[int, ...]) -> Callable[..., object]:
    """kernel[grid]. Triton types a kernel's tl.constexpr parameters as `constexpr`, but a
    launch passes them plain ints, bools and strings: this launcher takes any arguments."""
    return kernel[grid]


@triton.jit
def _cache_write_kernel(key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_ptr,
                        num_tokens, stride_kt, stride_kh, stride_vt, stride_vh,
                        stride_ch, stride_cb, stride_cs,
                        BLOCK_T: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                        HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr):
    # One program per (BLOCK_T tokens, KV head): token t's head_dim row of K (and V) goes
    # to cache[h, slot // BLOCK_SIZE, slot % BLOCK_SIZE].
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1).to(tl.int64)  # offsets into a large cache overflow int32
    t_ok = t < num_tokens
    slot = tl.load(slot_ptr + t, mask=t_ok, other=0).to(tl.int64)
    d = tl.arange(0, HEAD_DIM_PAD)
    mask = t_ok[:, None] & (d < HEAD_DIM)[None, :]
    dst = (h * stride_ch + (slot // BLOCK_SIZE) * stride_cb
           + (slot % BLOCK_SIZE) * stride_cs)[:, None] + d[None, :]
    t64 = t.to(tl.int64)[:, None]
    k = tl.load(key_ptr + t64 * stride_kt + h * stride_kh + d[None, :], mask=mask)
    v = tl.load(value_ptr + t64 * stride_vt + h * stride_vh + d[None, :], mask=mask)
    tl.store(key_cache_ptr + dst, k, mask=mask)
    tl.store(value_cache_ptr + dst, v, mask=mask)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    num_tokens, kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    key_cache, value_cache = kv_layout.head_views(kv_cache)
    assert key.stride(-1) == 1 and value.stride(-1) == 1 and key_cache.stride(-1) == 1
    assert key_cache.stride() == value_cache.stride()
    block_t = 16
    with _on(key.device):
        _launch(_cache_write_kernel, (triton.cdiv(num_tokens, block_t), kv_heads))(
            key, value, key_cache, value_cache, slot_mapping, num_tokens,
            key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
            BLOCK_T=block_t, BLOCK_SIZE=key_cache.shape[2], HEAD_DIM=head_dim,
            HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        )


@triton.jit
def _paged_attention_kernel(
    out_ptr, q_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, seq_lens_ptr,
    query_start_loc_ptr, scale, window, softcap,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_ch, stride_cb, stride_cs, stride_bt,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
):
    q_tile = tl.program_id(0)
    req = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    prefix_len = seq_len - q_len  # tokens cached before this step's chunk

    rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
    tok = q_tile * BLOCK_Q + rows // GROUP_PAD  # index among the request's new tokens
    g = rows % GROUP_PAD
    row_ok = (tok < q_len) & (g < GROUP)
    head = kv_head * GROUP + g
    d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = d < HEAD_DIM
    q_rows = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    q_pos = prefix_len + tok
    if UPCAST:
        q = q.to(tl.float32)

    m = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
    lsum = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    # Keys up to the tile's last new token. Key 0 is visible to every row, so after the
    # first tile m is finite in every row and exp(m_old - m_new) never sees inf - inf.
    # With a window, from the first key that the tile's first token sees; a row may then
    # see nothing in a tile, and its m stays -inf (see m_sub below).
    end = tl.minimum(prefix_len + (q_tile + 1) * BLOCK_Q, seq_len)
    lo = 0
    if WINDOW:
        lo = tl.maximum(prefix_len + q_tile * BLOCK_Q - window + 1, 0)
    offs_n = tl.arange(0, TILE_N)
    table = block_tables_ptr + req.to(tl.int64) * stride_bt
    head_base = kv_head.to(tl.int64) * stride_ch
    for start in range(lo, end, TILE_N):
        k_pos = start + offs_n
        k_ok = k_pos < end
        block = tl.load(table + k_pos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
        kv_rows = head_base + block * stride_cb + (k_pos % BLOCK_SIZE) * stride_cs
        kv_mask = k_ok[:, None] & d_ok[None, :]
        k = tl.load(key_cache_ptr + kv_rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(value_cache_ptr + kv_rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        if SOFTCAP:  # softcap * tanh(s / softcap), as tanh(x) = 2 * sigmoid(2x) - 1
            s = softcap * (2.0 * tl.sigmoid(s * (2.0 / softcap)) - 1.0)
        visible = (k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :]
        if WINDOW:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        if WINDOW:
            # A row that has seen no key yet keeps m = -inf: subtract 0 instead, so that
            # exp(-inf - -inf) is not NaN (its p and alpha are then 0 and its sums stay 0).
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m - m_sub)
            p = tl.exp(s - m_sub[:, None])
        else:
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
        lsum = lsum * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    if WINDOW:  # padding rows past the chunk may have seen no key: no 0 / 0
        lsum = tl.where(lsum == 0.0, 1.0, lsum)
    acc = acc / lsum[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def _tiles(group_pad: int, max_query_len: int) -> tuple[int, int]:
    """(BLOCK_Q, TILE_N). tl.dot wants at least 16 rows; decodes use the fewest rows that
    reach 16, prefill chunks 64 rows per program."""
    rows = 16 if max_query_len == 1 else 64
    return max(1, rows // group_pad), 32


def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                    window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """Reads every key from the cache (reshape_and_cache ran first); key/value unused.
    window and softcap as in kernels/reference.py; each is a compile-time switch, so the
    plain kernel is unchanged."""
    del key, value
    out = torch.empty_like(query)
    num_tokens, num_heads, head_dim = query.shape
    key_cache, value_cache = kv_layout.head_views(kv_cache)
    kv_heads = key_cache.shape[0]
    if num_tokens == 0 or meta.num_seqs == 0:
        return out
    assert query.stride(-1) == 1 and key_cache.stride() == value_cache.stride()
    group = num_heads // kv_heads
    group_pad = triton.next_power_of_2(group)
    block_q, tile_n = _tiles(group_pad, meta.max_query_len)
    grid = (triton.cdiv(meta.max_query_len, block_q), meta.num_seqs, kv_heads)
    with _on(query.device):
        _launch(_paged_attention_kernel, grid)(
            out, query, key_cache, value_cache, meta.block_tables, meta.seq_lens,
            meta.query_start_loc, scale, window or 0, float(softcap or 0.0),
            query.stride(0), query.stride(1), out.stride(0), out.stride(1),
            key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
            meta.block_tables.stride(0),
            GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, TILE_N=tile_n,
            BLOCK_SIZE=key_cache.shape[2], HEAD_DIM=head_dim,
            HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
            # fp32 models get full fp32 dot products, not TF32.
            PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
            # The interpreter multiplies bf16 as raw uint16 bits: it gets fp32 operands (the
            # same products a GPU forms from bf16, which are exact in fp32).
            UPCAST=_INTERPRET and query.dtype == torch.bfloat16,
            WINDOW=window is not None, SOFTCAP=bool(softcap),
        )
    return out
