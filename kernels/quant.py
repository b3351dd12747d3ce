"""Quantized linear weights, kept quantized in memory: what they hold, how they multiply.

    format  bytes per row of K weights              a weight
    int8    K int8, one fp32 scale per row (apart)   q * s
    q8_0    K/32 blocks of [d fp16 | 32 x int8]      d * q
    q4_0    K/32 blocks of [d fp16 | 16 bytes]       d * (q - 8)
    q4_1    K/32 blocks of [d fp16 | m fp16 | 16 B]  d * q + m

The GGUF formats are llama.cpp's blocks byte for byte, rows as the file holds them. In a
4-bit block, byte j holds weight j in its low nibble and weight j + 16 in its high one.

`matmul(x, w)` is x @ W^T for x [M, K] in the model dtype, by the first path that applies
(the threshold from `python -m baton.tools.bench.quant`):

    GPU                          the Triton kernel (kernels/triton_quant.py)
    w8a8, bf16/fp16, M >= 16     oneDNN's int8 matmul (torch._int_mm, VNNI/AMX) on
                                 activations quantized per token
    bf16/fp16, M >= 16           the weights dequantized to x's dtype (C++), then oneDNN
    w8a8/gguf, bf16/fp16, M < 4  the C++ kernel's integer path (kernels/cpu/qmm.h):
                                 activations quantized per 32-column block, VNNI dot
                                 products (its fp32 path on a build without VNNI)
    otherwise                    the C++ kernel's fp32 path over the dequantized weights
    no C++ build                 the weights dequantized in torch, then F.linear

`int8` is weight-only: its activations are never quantized. Only fp32 activations keep
token equality with an fp32 run over the dequantized weights; the other paths are held
to the perplexity bound.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import cpu_ops

BLOCK = 32  # weights per GGUF block
# Bytes of one block, per GGUF format.
BLOCK_BYTES = {"q8_0": 2 + BLOCK, "q4_0": 2 + BLOCK // 2, "q4_1": 4 + BLOCK // 2}
FORMATS = ("int8", *BLOCK_BYTES)
KERNEL_FORMAT = {"int8": 0, "q8_0": 1, "q4_0": 2, "q4_1": 3}  # qmm.h's `fmt`
# From this many rows on, int8 weights with bf16/fp16 activations take oneDNN's int8
# matmul (W8A8); below it the weight-only kernel, which reads the weights once and is
# bound by that (python -m baton.tools.bench.quant).
ACT_QUANT_ROWS = 16
# Below this many rows the integer path (activations per 32 columns, VNNI) beats the fp32
# one: it does not share a weight's unpacking between rows (tools/bench/quant.py).
INTEGER_ROWS = 4


@dataclass
class QuantWeight:
    """One linear's weight [n, k] in `fmt`: `data` holds the rows (int8 [n, k] for int8,
    else uint8 [n, k / 32 * block bytes]); `scale` the int8 rows' fp32 scales;
    `act_int8` whether activations may meet it quantized (--quantization w8a8, gguf)."""

    fmt: str
    n: int
    k: int
    data: torch.Tensor
    scale: torch.Tensor | None = None
    # May bf16/fp16 activations be quantized to int8 for it (the integer paths below)?
    act_int8: bool = False

    @property
    def nbytes(self) -> int:
        s = self.scale
        return self.data.numel() * self.data.element_size() + (
            0 if s is None else s.numel() * s.element_size())

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_rows(self, None).to(dtype)


def quantize_int8(w: torch.Tensor, act_int8: bool = False) -> QuantWeight:
    """Per-output-channel symmetric int8: s = max|row| / 127, q = round(w / s)."""
    wf = w.detach().float()
    scale = wf.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    q = torch.round(wf / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return QuantWeight("int8", w.shape[0], w.shape[1], q.contiguous(), scale.contiguous(),
                       act_int8)


def from_gguf(fmt: str, rows: torch.Tensor, k: int, act_int8: bool = False) -> QuantWeight:
    """The raw rows of a GGUF tensor (uint8 [n, k / 32 * block bytes]) as they are."""
    if k % BLOCK or rows.shape[1] != k // BLOCK * BLOCK_BYTES[fmt]:
        raise ValueError(f"{fmt}: rows of {rows.shape[1]} bytes do not hold {k} weights")
    return QuantWeight(fmt, rows.shape[0], k, rows.contiguous(), None, act_int8)


def concat(parts: list[QuantWeight]) -> QuantWeight:
    """Row blocks of one format stacked (q/k/v into qkv, gate/up into gate_up)."""
    fmt, k = parts[0].fmt, parts[0].k
    if any(p.fmt != fmt or p.k != k for p in parts):
        raise ValueError("fused parts differ in format or width")
    scale = None if fmt != "int8" else torch.cat([p.scale for p in parts])  # type: ignore
    return QuantWeight(fmt, sum(p.n for p in parts), k,
                       torch.cat([p.data for p in parts]).contiguous(), scale,
                       all(p.act_int8 for p in parts))


def dequantize_rows(w: QuantWeight, rows: torch.Tensor | None) -> torch.Tensor:
    """fp32 [len(rows) or n, k]: the weights of `rows` (None: every row), exactly."""
    data = w.data if rows is None else w.data.index_select(0, rows)
    if w.fmt == "int8":
        scale = w.scale if rows is None else w.scale.index_select(0, rows)  # type: ignore
        return data.float() * scale[:, None]  # type: ignore[index]
    b = data.view(data.shape[0], -1, BLOCK_BYTES[w.fmt])  # [rows, blocks, bytes]
    d = b[..., 0:2].contiguous().view(torch.float16).float()  # [rows, blocks, 1]
    if w.fmt == "q8_0":
        q = b[..., 2:].contiguous().view(torch.int8).float()
        out = d * q
    else:
        nib = b[..., -BLOCK // 2:]
        q = torch.cat([nib & 15, nib >> 4], dim=-1).float()  # weight j, then j + 16
        out = d * (q - 8) if w.fmt == "q4_0" else \
            d * q + b[..., 2:4].contiguous().view(torch.float16).float()
    return out.reshape(data.shape[0], w.k)


def matmul(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """x [M, K] @ W^T -> [M, N] in x's dtype. Activations are quantized only for a weight
    whose `act_int8` says they may be, and never in fp32."""
    rows = x.shape[0]
    act_int8 = w.act_int8 and x.dtype != torch.float32
    if act_int8 and w.fmt == "int8" and rows >= ACT_QUANT_ROWS and x.device.type == "cpu":
        return _w8a8(x, w)
    if x.device.type == "cuda":
        from . import triton_quant

        return triton_quant.qmm(x, w.data, w.scale, KERNEL_FORMAT[w.fmt],
                                BLOCK_BYTES.get(w.fmt, BLOCK), w.n, w.k)
    ops = cpu_ops.serves("qmm", x.device)
    if ops is not None and rows >= ACT_QUANT_ROWS and x.dtype != torch.float32:
        # Many rows: the weights dequantized to x's dtype once, then oneDNN's matmul.
        dense = x.new_empty(w.n, w.k)
        ops.dequant(w.data, _scale(w), KERNEL_FORMAT[w.fmt], w.k, dense)
        return F.linear(x, dense)
    if ops is not None and x.is_contiguous():
        out = x.new_empty(rows, w.n)
        ops.qmm(x, w.data, _scale(w), KERNEL_FORMAT[w.fmt], w.k,
                act_int8 and rows < INTEGER_ROWS, out)
        return out
    return F.linear(x, w.dequantize(x.dtype))


_NO_SCALE = torch.empty(0, dtype=torch.float32)  # the C++ ops' scales of a GGUF weight


def _scale(w: QuantWeight) -> torch.Tensor:
    return w.scale if w.scale is not None else _NO_SCALE


def _w8a8(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """Activations quantized per token (symmetric int8), oneDNN's int8 matmul, then both
    scales: y[m, n] = (sum_k qx[m, k] qw[n, k]) * sx[m] * sw[n]. The two passes around
    the matmul are the C++ kernel's where it is built."""
    ops = cpu_ops.serves("qmm", x.device)
    if ops is None or not x.is_contiguous():
        xf = x.float()
        sx = xf.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127.0
        qx = torch.round(xf / sx).to(torch.int8)
        acc = torch.ops.aten._int_mm(qx, w.data.t())  # the weight as [K, N]: a view
        return (acc.float() * sx * w.scale).to(x.dtype)  # type: ignore[operator]
    qx = torch.empty(x.shape, dtype=torch.int8)
    sx = torch.empty(x.shape[0], dtype=torch.float32)
    ops.per_token(x, qx, sx)
    acc = torch.ops.aten._int_mm(qx, w.data.t())
    out = x.new_empty(x.shape[0], w.n)
    ops.rescale(acc, sx, w.scale, out)
    return out
