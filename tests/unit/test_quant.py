"""Quantized weights (kernels/quant.py, services/engine/quantization.py): the GGUF
formats read as gguf's own dequantizer reads them, int8 per channel, the torch path of the
matmul, the W8A8 path against fp32, and the methods refused by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from baton.kernels import quant
from baton.services.engine.config import check_quantization


def _gguf_rows(fmt: str, n: int, k: int, seed: int = 0) -> tuple[quant.QuantWeight, torch.Tensor]:
    """A random [n, k] matrix quantized by gguf's quantizer, and gguf's dequantization."""
    import gguf
    from gguf.quants import dequantize, quantize

    a = np.random.RandomState(seed).randn(n, k).astype(np.float32)
    kind = gguf.GGMLQuantizationType[fmt.upper()]
    raw = quantize(a, kind)
    return (quant.from_gguf(fmt, torch.from_numpy(raw), k),
            torch.from_numpy(np.asarray(dequantize(raw, kind), dtype=np.float32)))


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1"])
def test_gguf_blocks_dequantize_as_gguf_does(fmt):
    w, want = _gguf_rows(fmt, 6, 96)
    assert torch.equal(w.dequantize(), want)
    rows = torch.tensor([4, 0, 4])
    assert torch.equal(quant.dequantize_rows(w, rows), want[rows])
    assert w.nbytes == 6 * 3 * quant.BLOCK_BYTES[fmt]


def test_a_row_of_the_wrong_width_is_refused():
    with pytest.raises(ValueError, match="do not hold"):
        quant.from_gguf("q4_1", torch.zeros(2, 20, dtype=torch.uint8), 64)


def test_int8_is_per_channel_and_within_half_a_step():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(5, 40, generator=g) * torch.tensor([[1e-3], [1.0], [30.0], [0.5], [2.0]])
    q = quant.quantize_int8(w)
    assert torch.equal(q.scale, w.abs().amax(1) / 127)
    assert q.data.abs().amax(1).eq(127).all()  # each row's largest weight uses the range
    err = (q.dequantize() - w).abs()
    assert (err <= q.scale[:, None] / 2 * (1 + 1e-5)).all()


@pytest.mark.parametrize("fmt", ["int8", "q8_0", "q4_1"])
def test_the_torch_path_multiplies_by_the_dequantized_weights(fmt, monkeypatch):
    monkeypatch.setenv("BATON_CPU_KERNELS", "0")  # no C++ kernel: dequantize, then F.linear
    w = quant.quantize_int8(torch.randn(7, 64)) if fmt == "int8" else _gguf_rows(fmt, 7, 64)[0]
    x = torch.randn(3, 64)
    torch.testing.assert_close(quant.matmul(x, w), x @ w.dequantize().T)


def test_w8a8_is_close_to_fp32_and_only_for_many_bf16_rows(monkeypatch):
    g = torch.Generator().manual_seed(1)
    w = quant.quantize_int8(torch.randn(48, 128, generator=g), act_int8=True)
    x = torch.randn(quant.ACT_QUANT_ROWS, 128, generator=g)
    want = x @ w.dequantize().T
    got = quant._w8a8(x.bfloat16(), w).float()
    assert (got - want).norm() / want.norm() < 0.02
    monkeypatch.setenv("BATON_CPU_KERNELS", "0")  # torch's passes around the int8 matmul
    assert torch.equal(quant._w8a8(x.bfloat16(), w).float(), got)
    monkeypatch.delenv("BATON_CPU_KERNELS")
    called = []
    monkeypatch.setattr(quant, "_w8a8", lambda x, w: called.append(x.shape[0]) or x[:, :1])
    quant.matmul(x.bfloat16(), w)
    quant.matmul(x[:-1].bfloat16(), w)  # one row fewer: weight-only
    quant.matmul(x, w)  # fp32 activations: weight-only, whatever the rows
    quant.matmul(x.bfloat16(), quant.quantize_int8(w.dequantize()))  # int8: weight-only
    assert called == [quant.ACT_QUANT_ROWS]


def test_methods_served_later_are_refused_by_name():
    check_quantization(None)
    check_quantization("int8")
    for method in ("awq", "gptq"):
        with pytest.raises(ValueError, match=f"{method.upper()} checkpoints are not served"):
            check_quantization(method)
    with pytest.raises(ValueError, match="must be one of"):
        check_quantization("int3")
