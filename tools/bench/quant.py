"""Each path of the quantized matmul (kernels/quant.py) against bf16 oneDNN, at the
default model's linear shapes and M rows of x: where each wins sets quant.ACT_QUANT_ROWS.

    python -m baton.tools.bench.quant [--rows 1,4,8,16,32,64] [--layers 30] [--repeat 5]

Also torch's own weight-only kernels where a format fits them (_weight_int8pack_mm,
_weight_int4pack_mm_for_cpu), which the issue asks to use where they measure faster.
The weights of `layers` layers (SmolLM2-135M: qkv, o, gate_up, down) are multiplied in
turn, so they are read from memory as a decode step reads them, not from a cache that
holds one matrix. Prints ms per pass over every layer, per format and path, with the CPU
and its flags; a ratio > 1 is faster than bf16.
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from baton.kernels import cpu_ops, quant

from .kernels import HIDDEN, INTER
from .machine import machine_line

SHAPES = [(HIDDEN + 2 * 192, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER)]


def weights(fmt: str, layers: int) -> list[list]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(layers):
        row = []
        for n, k in SHAPES:
            w = torch.randn(n, k, generator=g) * 0.02
            if fmt == "bf16":
                row.append(torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), 64))
            elif fmt == "int8":
                row.append(quant.quantize_int8(w))
            else:
                raw = torch.randint(0, 256, (n, k // 32 * quant.BLOCK_BYTES[fmt]),
                                    dtype=torch.uint8, generator=g)
                raw.view(n, -1, quant.BLOCK_BYTES[fmt])[..., 0:2] = torch.tensor(
                    [0.001], dtype=torch.float16).view(torch.uint8)  # sane scales
                row.append(quant.from_gguf(fmt, raw, k))
        out.append(row)
    return out


def paths(fmt: str, ops):
    """name -> f(x, w) for every path this format has."""
    if fmt == "bf16":
        return {"oneDNN": lambda x, w: torch.ops.mkldnn._linear_pointwise(
            x, w, None, "none", [], "")}

    def kernel(act_int8: bool):
        def run(x, w):
            out = x.new_empty(x.shape[0], w.n)
            ops.qmm(x, w.data, quant._scale(w), quant.KERNEL_FORMAT[w.fmt], w.k, act_int8, out)
            return out
        return run

    def dequant(x, w):
        dense = x.new_empty(w.n, w.k)
        ops.dequant(w.data, quant._scale(w), quant.KERNEL_FORMAT[w.fmt], w.k, dense)
        return F.linear(x, dense)

    found = {"integer": kernel(True), "fp32": kernel(False), "dequant+oneDNN": dequant}
    if fmt == "int8":
        found["W8A8 oneDNN"] = quant._w8a8
    # torch's own weight-only kernels, for the formats they can hold: their operands are
    # made once per weight (the timing is what matters here, not the rounding of scales).
    packed: dict[int, tuple] = {}
    if fmt == "int8":
        def int8pack(x, w):
            if id(w) not in packed:
                packed[id(w)] = (w.data, w.scale.to(x.dtype))
            q, scale = packed[id(w)]
            return torch.ops.aten._weight_int8pack_mm(x, q, scale)
        found["torch int8pack"] = int8pack
    if fmt in ("q4_0", "q4_1"):
        def int4pack(x, w):
            if id(w) not in packed:
                nib = w.data.view(w.n, -1, quant.BLOCK_BYTES[w.fmt])[..., -quant.BLOCK // 2:]
                q = torch.cat([nib & 15, nib >> 4], dim=-1).reshape(w.n, w.k).int()
                pack = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
                sz = torch.ones(w.k // quant.BLOCK, w.n, 2, dtype=x.dtype)
                packed[id(w)] = (pack, sz)
            pack, sz = packed[id(w)]
            return torch.ops.aten._weight_int4pack_mm_for_cpu(x, pack, quant.BLOCK, sz)
        found["torch int4pack"] = int4pack
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    ap.add_argument("--rows", default="1,4,8,16,32,64")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    ops = cpu_ops.ops()
    if ops is None:
        raise SystemExit(f"no CPU kernels here: {cpu_ops.failure()}")
    rows = [int(r) for r in args.rows.split(",")]
    shapes = SimpleNamespace(hidden_size=HIDDEN, intermediate_size=INTER)
    print(machine_line(shapes, torch.bfloat16),
          f"| threads {torch.get_num_threads()} | kernels {cpu_ops.isa}")
    base: dict[int, float] = {}
    for fmt in ("bf16", *quant.FORMATS):
        ws = weights(fmt, args.layers)
        for name, fn in paths(fmt, ops).items():
            cells = []
            for m in rows:
                xs = {k: torch.randn(m, k).bfloat16() for _, k in SHAPES}

                def once(fn=fn, xs=xs, ws=ws):
                    for layer in ws:
                        for (_, k), w in zip(SHAPES, layer, strict=True):
                            fn(xs[k], w)
                once()
                t0 = time.perf_counter()
                for _ in range(args.repeat):
                    once()
                ms = (time.perf_counter() - t0) / args.repeat * 1e3
                base.setdefault(m, ms)
                cells.append(f"M={m}: {ms:7.2f} ms ({base[m] / ms:4.2f}x)")
            print(f"{fmt:5} {name:15} " + "  ".join(cells))
        del ws


if __name__ == "__main__":
    main()
