"""Triton path of the quantized matmul (formats: kernels/quant.py, which calls this): out =
x @ W^T on a GPU, the weights read as they are stored, one launch per call.

Grid: (tile of BLOCK_M rows of x, tile of BLOCK_N weight rows). A program walks K one
32-weight block at a time (a GGUF block; for int8, 32 columns): it loads x's [BLOCK_M, 32]
slice and the [BLOCK_N, 32] weights of its rows' block, dequantizes them in registers

    int8  q            (the row's scale multiplies the sums at the end)
    q8_0  d * q        d: the block's leading fp16
    q4_0  d * (q - 8)  q: byte j's low nibble for weight j, its high one for j + 16
    q4_1  d * q + m

and adds their tl.dot to an fp32 accumulator, stored rounded once to x's dtype. The
weights enter the dot in x's dtype (as vLLM's GGUF kernels dequantize to the activation
dtype); fp32 takes full fp32 products, not TF32. On CPU this runs under Triton's
interpreter (TRITON_INTERPRET=1), which is how CI tests it.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch
import triton
import triton.language as tl

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
BLOCK_M = 16  # tl.dot's minimum
BLOCK_N = 64


@triton.jit
def _qmm_kernel(x_ptr, w_ptr, s_ptr, out_ptr, M, N, K, row_bytes, stride_x, stride_o,
                FMT: tl.constexpr, BLOCK_BYTES: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    j = tl.arange(0, 32)
    m_ok, n_ok = rm < M, rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    rows = w_ptr + rn.to(tl.int64)[:, None] * row_bytes  # [BLOCK_N, 1] byte pointers
    for b in range(0, tl.cdiv(K, 32)):
        col = b * 32 + j
        x = tl.load(x_ptr + rm[:, None] * stride_x + col[None, :],
                    mask=m_ok[:, None] & (col[None, :] < K), other=0.0)
        if FMT == 0:  # int8: the row's bytes, 32 columns at a time
            w = tl.load(rows + col[None, :], mask=n_ok[:, None] & (col[None, :] < K),
                        other=0).to(tl.int8, bitcast=True).to(tl.float32)
        else:
            blk = rows + b * BLOCK_BYTES
            d = tl.load(blk.to(tl.pointer_type(tl.float16)), mask=n_ok[:, None],
                        other=0.0).to(tl.float32)
            if FMT == 1:  # q8_0
                q = tl.load(blk + 2 + j[None, :], mask=n_ok[:, None], other=0)
                w = q.to(tl.int8, bitcast=True).to(tl.float32) * d
            else:
                start = 2 if FMT == 2 else 4
                byte = tl.load(blk + start + (j[None, :] % 16), mask=n_ok[:, None],
                               other=0).to(tl.int32)
                q = tl.where(j[None, :] < 16, byte & 15, byte >> 4).to(tl.float32)
                if FMT == 2:  # q4_0
                    w = (q - 8.0) * d
                else:  # q4_1
                    m = tl.load((blk + 2).to(tl.pointer_type(tl.float16)), mask=n_ok[:, None],
                                other=0.0).to(tl.float32)
                    w = q * d + m
        if UPCAST:
            acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision=PRECISION)
        else:
            acc += tl.dot(x, tl.trans(w.to(x.dtype)), input_precision=PRECISION)
    if FMT == 0:
        acc = acc * tl.load(s_ptr + rn, mask=n_ok, other=0.0)[None, :]
    tl.store(out_ptr + rm[:, None] * stride_o + rn[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def qmm(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor | None, fmt: int,
        block_bytes: int, n: int, k: int) -> torch.Tensor:
    """x [M, k] @ W^T -> [M, n] in x's dtype, for W's rows `data` in format `fmt`
    (quant.KERNEL_FORMAT; `block_bytes` per GGUF block) with int8's row `scale`."""
    assert x.dim() == 2 and x.shape[1] == k and x.stride(1) == 1, x.shape
    out = x.new_empty(x.shape[0], n)
    if x.shape[0] == 0:
        return out
    scale = scale if scale is not None else out.new_empty(0, dtype=torch.float32)
    grid = (triton.cdiv(x.shape[0], BLOCK_M), triton.cdiv(n, BLOCK_N))
    with torch.cuda.device(x.device) if x.device.type == "cuda" else contextlib.nullcontext():
        # Triton types the tl.constexpr parameters `constexpr`; a launch passes plain values.
        launch: Any = _qmm_kernel[grid]
        launch(
            x, data, scale, out, x.shape[0], n, k, data.shape[1], x.stride(0),
            out.stride(0), FMT=fmt, BLOCK_BYTES=block_bytes, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
            PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            # The interpreter multiplies bf16 as raw bits: it gets fp32 operands.
            UPCAST=_INTERPRET and x.dtype != torch.float32)
    return out

