"""Triton path of the batched multi-adapter LoRA delta (the maths and weight layout are in
kernels/lora.py): two launches for the whole flat batch, whatever its mix of adapters.

    shrink:  y[t]    = a[slot[t]] @ x[t]        a [S, R, in]   ->  y fp32 [T, R]
    expand:  out[t] += b[slot[t]] @ y[t]        b [S, out, R]      rows with slot -1 untouched

On CPU these run under Triton's interpreter (TRITON_INTERPRET=1, set before triton is
imported); that is how CI tests them.

Both kernels take BLOCK_T consecutive tokens per program. A tile's tokens may use several
adapters (decodes of different requests), so a program walks the distinct slots of its
tile in increasing order (the smallest slot above the last one done, until none is left):
for slot s it multiplies all the tile's rows by s's weights with one tl.dot, and keeps the
result only in the rows whose slot is s. Prefill chunks are runs of one request, so their
tiles mostly hold one slot; a tile of base-model tokens (-1) does no work.

R is small (parts * max rank), so both kernels hold it whole, padded to R_PAD, a power of
two of at least 16 (tl.dot's minimum), with the rows r >= R masked to zero.

Shrink grid: (token tile, K split). in_dim is read BLOCK_K columns at a time; split k of
SPLIT_K takes the chunks k, k + SPLIT_K, ... and writes its partial sums to its own plane
of the scratch y [SPLIT_K, T, R_PAD] (fp32), so that a few decode tokens still spread a
long in_dim over many programs, and without atomics the sum is the same on every run.

Expand grid: (token tile, tile of BLOCK_N output columns). A program sums the SPLIT_K
planes of y for its tokens, then per slot of the tile forms y @ b[s][n-tile].T; it adds
the result in fp32 to out's rows and stores them rounded once to out's dtype, masked to
the rows with a slot (so base-model rows are never written).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

from .lora import LoraBatch

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

BLOCK_K = 32  # in_dim columns per shrink step
BLOCK_N = 64  # output columns per expand program
_NO_SLOT = 2**62  # above any slot: "no slot left" in a tile's walk over its slots


def _on(device: torch.device):
    """Triton launches on the current CUDA device: make it the tensors' device."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _launch(kernel: triton.KernelInterface[Any], grid: tuple[int, ...]) -> Callable[..., object]:
    """kernel[grid]. Triton types a kernel's tl.constexpr parameters as `constexpr`, but a
    launch passes them plain ints, bools and strings: this launcher takes any arguments."""
    return kernel[grid]


@triton.jit
def _shrink_kernel(y_ptr, x_ptr, a_ptr, slot_ptr, num_tokens, in_dim, rank,
                   stride_as, stride_ar, split_k,
                   BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, R_PAD: tl.constexpr,
                   PRECISION: tl.constexpr, UPCAST: tl.constexpr, NO_SLOT: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    split = tl.program_id(1)
    t_ok = t < num_tokens
    slots = tl.load(slot_ptr + t, mask=t_ok, other=-1).to(tl.int64)
    t64 = t.to(tl.int64)
    r = tl.arange(0, R_PAD)
    r_ok = r < rank
    k = tl.arange(0, BLOCK_K)
    y = tl.zeros([BLOCK_T, R_PAD], tl.float32)
    cur = tl.min(tl.where(slots >= 0, slots, NO_SLOT))
    while cur < NO_SLOT:
        acc = tl.zeros([BLOCK_T, R_PAD], tl.float32)
        a_base = a_ptr + cur * stride_as
        for k0 in range(split * BLOCK_K, in_dim, split_k * BLOCK_K):
            kk = k0 + k
            k_ok = kk < in_dim
            xt = tl.load(x_ptr + t64[:, None] * in_dim + kk[None, :],
                         mask=t_ok[:, None] & k_ok[None, :], other=0.0)
            # a[cur] read transposed: at[k, r] = a[cur, r, k].
            at = tl.load(a_base + r[None, :] * stride_ar + kk[:, None],
                         mask=k_ok[:, None] & r_ok[None, :], other=0.0)
            if UPCAST:
                xt = xt.to(tl.float32)
                at = at.to(tl.float32)
            acc += tl.dot(xt, at, input_precision=PRECISION)
        y = tl.where((slots == cur)[:, None], acc, y)
        cur = tl.min(tl.where(slots > cur, slots, NO_SLOT))
    # Every real row is written (zeros for base-model rows), so y needs no clearing.
    plane = split.to(tl.int64) * num_tokens * R_PAD
    tl.store(y_ptr + plane + t64[:, None] * R_PAD + r[None, :], y, mask=t_ok[:, None])


@triton.jit
def _expand_kernel(out_ptr, y_ptr, b_ptr, slot_ptr, num_tokens, out_dim, rank,
                   stride_bs, stride_bn, split_k,
                   BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, R_PAD: tl.constexpr,
                   PRECISION: tl.constexpr, UPCAST: tl.constexpr, NO_SLOT: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    t_ok = t < num_tokens
    n_ok = n < out_dim
    slots = tl.load(slot_ptr + t, mask=t_ok, other=-1).to(tl.int64)
    cur = tl.min(tl.where(slots >= 0, slots, NO_SLOT))
    if cur == NO_SLOT:  # only base-model tokens here
        return
    t64 = t.to(tl.int64)
    r = tl.arange(0, R_PAD)
    r_ok = r < rank
    y = tl.zeros([BLOCK_T, R_PAD], tl.float32)
    for split in range(0, split_k):
        plane = split * num_tokens * R_PAD
        y += tl.load(y_ptr + plane + t64[:, None] * R_PAD + r[None, :],
                     mask=t_ok[:, None], other=0.0)
    # Half-precision weights: y is rounded to their dtype for the tensor-core product, as
    # the torch path rounds x @ a.T; fp32 weights keep y whole (and an IEEE product).
    if UPCAST:
        y_op = y.to(b_ptr.dtype.element_ty).to(tl.float32)
    else:
        y_op = y.to(b_ptr.dtype.element_ty)
    delta = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
    while cur < NO_SLOT:
        # b[cur] read transposed: bt[r, n] = b[cur, n, r].
        bt = tl.load(b_ptr + cur * stride_bs + n[None, :] * stride_bn + r[:, None],
                     mask=r_ok[:, None] & n_ok[None, :], other=0.0)
        if UPCAST:
            bt = bt.to(tl.float32)
        part = tl.dot(y_op, bt, input_precision=PRECISION)
        delta = tl.where((slots == cur)[:, None], part, delta)
        cur = tl.min(tl.where(slots > cur, slots, NO_SLOT))
    rows = t64[:, None] * out_dim + n[None, :]
    mask = (t_ok & (slots >= 0))[:, None] & n_ok[None, :]
    old = tl.load(out_ptr + rows, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows, (old + delta).to(out_ptr.dtype.element_ty), mask=mask)


def _block_t(num_tokens: int) -> int:
    """Tokens per program: tl.dot's minimum of 16 for decode-sized batches, 64 beyond."""
    return 16 if num_tokens <= 256 else 64


def _split_k(k_chunks: int, token_tiles: int) -> int:
    """Enough K splits that the shrink has ~128 programs (about one per SM), at most one
    per BLOCK_K chunk of in_dim."""
    return max(1, min(k_chunks, 128 // token_tiles))


def add_lora(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             batch: LoraBatch, *, split_k: int | None = None) -> torch.Tensor:
    """out += each token's delta, in place (out [T, out_dim], x [T, in]); returns out.
    As kernels.lora.add_lora, in two launches. split_k (tests) overrides the shrink's K
    splits. Every slot in batch.token_slots must be -1 or below a.shape[0] (unchecked:
    checking would wait on the device)."""
    num_tokens, in_dim = x.shape
    slots_n, rank, a_in = a.shape
    out_dim = out.shape[1]
    slots = batch.token_slots
    if num_tokens == 0:
        return out
    assert x.is_contiguous() and out.is_contiguous(), "x and out must be contiguous"
    assert a.is_contiguous() and b.is_contiguous(), "a and b must be contiguous"
    assert a_in == in_dim and out.shape[0] == num_tokens, (x.shape, a.shape, out.shape)
    assert b.shape == (slots_n, out_dim, rank), (a.shape, b.shape, out.shape)
    assert x.dtype == a.dtype == b.dtype, (x.dtype, a.dtype, b.dtype)
    assert slots.shape == (num_tokens,) and slots.dtype == torch.int64, slots
    assert slots.device == x.device == out.device == a.device == b.device

    r_pad = max(16, triton.next_power_of_2(rank))
    block_t = _block_t(num_tokens)
    token_tiles = triton.cdiv(num_tokens, block_t)
    k_chunks = triton.cdiv(in_dim, BLOCK_K)
    splits = min(split_k, k_chunks) if split_k else _split_k(k_chunks, token_tiles)
    y = torch.empty(splits, num_tokens, r_pad, dtype=torch.float32, device=x.device)
    consts = dict(
        BLOCK_T=block_t, R_PAD=r_pad, NO_SLOT=_NO_SLOT,
        # fp32 weights get full fp32 dot products, not TF32.
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        # The interpreter multiplies bf16 as raw uint16 bits: it gets fp32 operands (the
        # same products a GPU forms from bf16, which are exact in fp32).
        UPCAST=_INTERPRET and x.dtype == torch.bfloat16,
    )
    with _on(x.device):
        _launch(_shrink_kernel, (token_tiles, splits))(
            y, x, a, slots, num_tokens, in_dim, rank, a.stride(0), a.stride(1), splits,
            BLOCK_K=BLOCK_K, **consts)
        _launch(_expand_kernel, (token_tiles, triton.cdiv(out_dim, BLOCK_N)))(
            out, y, b, slots, num_tokens, out_dim, rank, b.stride(0), b.stride(1), splits,
            BLOCK_N=BLOCK_N, **consts)
    return out
