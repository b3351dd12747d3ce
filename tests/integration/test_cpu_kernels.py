"""Baton's C++ CPU kernels (kernels/cpu_ops.py), built by a compiler (so here, not in
unit), through every ISA this CPU runs, whether or not the kernel serves there by default:
the attention tests of tests/unit/test_kernels.py again with decode rows through the
kernel, and the fused norm, SiLU and RoPE + cache write against the torch ops they
replace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from baton.kernels import cpu_ops, kv_layout, torch_attn
from baton.services.engine.models.layers import RMSNorm, apply_rope
from tests.unit.test_kernels import (  # noqa: F401 (collected here with this decode_path)
    test_attention_bf16_close_to_fp32_reference,
    test_attention_matches_reference,
    test_cache_write_lands_in_the_right_slot,
    test_decodes_sharing_prefix_blocks_match_reference,
    test_prefill_chunks_after_a_shared_prefix_match_reference,
    test_reference_window_and_softcap_match_dense_attention,
    test_window_and_softcap_bf16_close_to_fp32_reference,
    test_window_and_softcap_match_reference,
    test_window_reads_only_the_blocks_it_touches,
)

ISAS = cpu_ops.supported()


def _built(isa: str):
    module = cpu_ops.ops(isa)
    if module is None:
        pytest.skip(f"the CPU kernels for {isa} do not build here: {cpu_ops.failure(isa)}")
    return module


@pytest.fixture(autouse=True, params=ISAS)
def decode_path(request, monkeypatch):
    """Every kernel serves, on this ISA, for every dtype and for shared prefixes too."""
    _built(request.param)
    monkeypatch.setattr(torch_attn, "CASCADE_ON_CPU", False)
    with cpu_ops.using(request.param, every_kernel=True):
        yield f"c++ decode ({request.param})"


def _rows(dtype, n, width, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, width, generator=g) * 3).to(dtype)


def _at_most_one_ulp_apart(got, want, dtype):
    """bf16/fp16: equal but for rare last-bit differences (the kernel's fp32 sums run in
    another order than torch's); fp32: close."""
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
        return
    ulp = torch.finfo(dtype).eps * want.float().abs().clamp(min=torch.finfo(dtype).tiny)
    assert ((got.float() - want.float()).abs() <= ulp * 1.01).all()
    assert (got != want).float().mean() < 0.01


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("width", [576, 40])  # the default model's, and one with a tail
@pytest.mark.parametrize("offset", [0.0, 1.0])  # Llama's w * normed; Gemma's (1 + w)
def test_rms_norm_with_the_residual_add_matches_torch(decode_path, dtype, width, offset):
    norm = RMSNorm(width, 1e-5, dtype, torch.device("cpu"), offset)
    norm.weight.data = _rows(dtype, 1, width, 1)[0]
    x, residual = _rows(dtype, 37, width, 2), _rows(dtype, 37, width, 3)
    want_sum = x + residual
    want = norm._torch(want_sum)
    got, got_sum = norm.add(x, residual.clone())
    assert torch.equal(got_sum, want_sum)  # the add rounds as torch's does
    _at_most_one_ulp_apart(got, want, dtype)
    _at_most_one_ulp_apart(norm(want_sum), want, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("width", [1536, 40])
def test_silu_and_mul_matches_torch(decode_path, dtype, width):
    gate_up = _rows(dtype, 23, 2 * width, 4)
    gate_up[0, :4] = torch.tensor([0.0, -30.0, 30.0, float("nan")])
    want = F.silu(gate_up[:, :width]) * gate_up[:, width:]
    got = cpu_ops.silu_and_mul(gate_up, cpu_ops.ops())
    assert torch.isnan(got[0, 3])  # NaN stays NaN (no -ffast-math)
    got[0, 3] = want[0, 3] = 0
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    else:
        _at_most_one_ulp_apart(got, want, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 24])  # the default model's, and one with a tail
def test_rope_and_cache_matches_the_torch_path(decode_path, dtype, head_dim):
    """q and k rotated as apply_rope rotates them, and the cache holding exactly what the
    torch write puts there (every other slot untouched)."""
    heads, kv_heads, tokens, bs = 6, 2, 21, 8
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    qk = qkv[:, :(heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim:].view(tokens, kv_heads, head_dim)
    angles = torch.randn(tokens, 1, head_dim // 2, generator=g)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    slots = torch.randperm(8 * bs, generator=g)[:tokens]
    want_cache = torch.randn(kv_layout.shape(8, kv_heads, bs, head_dim), generator=g).to(dtype)
    got_cache = want_cache.clone()
    want_qk = apply_rope(qk, cos, sin)
    torch_attn.reshape_and_cache(want_qk[:, heads:], v, want_cache, slots)
    got_qk = qk.clone()  # a strided view in the model: here a copy, rotated in place
    cpu_ops.ops().rope_and_cache(got_qk, v, cos[:, 0], sin[:, 0],
                                 *kv_layout.head_views(got_cache), slots, kv_heads)
    _at_most_one_ulp_apart(got_qk, want_qk, dtype)
    _at_most_one_ulp_apart(got_cache, want_cache, dtype)
    kept = torch.ones(8 * bs, dtype=torch.bool)
    kept[slots] = False
    untouched = want_cache.view(8, 2, kv_heads, bs, head_dim).permute(0, 3, 1, 2, 4)
    untouched = untouched.reshape(8 * bs, -1)[kept]
    assert torch.equal(got_cache.view(8, 2, kv_heads, bs, head_dim).permute(0, 3, 1, 2, 4)
                       .reshape(8 * bs, -1)[kept], untouched)
