"""The fp8 KV cache (kernels/kv_quant.py): what a write stores (x / scale, saturated to
the format's finite range), what a read gives (fp8 * scale), e4m3 against e5m2, and the
torch backend's attention over such a cache against the reference's."""

from __future__ import annotations

import random

import pytest
import torch

import baton.kernels.backend as kernels
from baton.kernels import cpu_ops, kv_layout, kv_quant, reference, torch_attn
from tests.kernel_batch import make_batch

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
WRITERS = [reference.reshape_and_cache, torch_attn.reshape_and_cache]


@pytest.fixture(autouse=True)
def torch_paths(monkeypatch):
    """The torch paths alone, whether or not the C++ kernels build here."""
    monkeypatch.setattr(cpu_ops, "serves", lambda kernel, device: None)


def _one_token_cache(dtype, kv_heads=2, head_dim=8):
    return torch.zeros(kv_layout.shape(3, kv_heads, 4, head_dim), dtype=dtype)


@pytest.mark.parametrize("write", WRITERS)
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_a_large_value_saturates_to_the_largest_finite_one(write, dtype):
    top = torch.finfo(dtype).max
    key = torch.tensor([1e9, -1e9, 3 * top, -3 * top, 0.5, 1.0, -2.0, 0.0]).view(1, 1, 8)
    key = key.expand(1, 2, 8).contiguous()
    cache = _one_token_cache(dtype)
    write(key, -key, cache, torch.tensor([5]), k_scale=1.0, v_scale=1.0)
    k, v = kv_layout.head_views(cache)
    stored = k[:, 1, 1].float()  # slot 5: block 1, offset 1
    assert torch.isfinite(stored).all() and torch.isfinite(v[:, 1, 1].float()).all()
    assert stored[0].tolist()[:4] == [top, -top, top, -top]
    assert stored[0].tolist()[4:] == [0.5, 1.0, -2.0, 0.0]  # exact in both formats
    assert torch.equal(v[:, 1, 1].float(), -stored)


@pytest.mark.parametrize("write", WRITERS)
def test_a_write_stores_x_over_its_scale_and_a_read_multiplies_it_back(write):
    g = torch.Generator().manual_seed(3)
    key, value = torch.randn(5, 2, 8, generator=g), torch.randn(5, 2, 8, generator=g)
    cache = _one_token_cache(E4M3)
    slots = torch.tensor([0, 1, 2, 3, 4])
    write(key, value, cache, slots, k_scale=0.25, v_scale=4.0)
    k, v = kv_layout.head_views(cache)
    k, v = k[:, :2].reshape(2, 8, 8)[:, :5], v[:, :2].reshape(2, 8, 8)[:, :5]
    assert torch.equal(k.float(), (key / 0.25).to(E4M3).float().transpose(0, 1))
    assert torch.equal(v.float(), (value / 4.0).to(E4M3).float().transpose(0, 1))
    read = kv_quant.dequantize(k, 0.25, torch.float32).transpose(0, 1)
    assert torch.equal(read, kv_quant.round_trip(key, 0.25, E4M3))
    torch.testing.assert_close(read, key, rtol=0.07, atol=0.25 * 2**-9)


def test_e4m3_keeps_more_precision_and_e5m2_more_range():
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0))
    err = {d: (kv_quant.round_trip(x, 1.0, d) - x).abs().mean() for d in (E4M3, E5M2)}
    assert err[E4M3] < err[E5M2] / 1.5
    big = torch.tensor([1000.0, 20000.0])
    assert kv_quant.round_trip(big, 1.0, E4M3).tolist() == [448.0, 448.0]
    torch.testing.assert_close(kv_quant.round_trip(big, 1.0, E5M2), big, rtol=0.13, atol=0)
    # A scale brings a large range into e4m3's: stored x / 64, read back times 64.
    torch.testing.assert_close(kv_quant.round_trip(big, 64.0, E4M3), big, rtol=0.07, atol=0)


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("decodes,prefills", [(5, 0), (0, 4), (3, 3)])
def test_fp8_attention_matches_the_reference(dtype, decodes, prefills):
    """Both write the same bytes, and read them the same way; the torch backend's prefill
    of a chunk with nothing cached uses its new K/V as the cache gives them back."""
    rng = random.Random(f"{dtype}-{decodes}-{prefills}")  # str's hash() varies by process
    torch.manual_seed(rng.randint(0, 1 << 30))
    q, k, v, cache, meta = make_batch(rng, 8, 2, 3, 32, torch.float32, decodes, prefills)
    cache = kv_quant.quantize(cache, 1.0, dtype)
    cache2 = cache.clone()
    scales = dict(k_scale=0.5, v_scale=2.0)
    reference.reshape_and_cache(k, v, cache, meta.slot_mapping, **scales)
    torch_attn.reshape_and_cache(k, v, cache2, meta.slot_mapping, **scales)
    assert torch.equal(kv_quant.as_bytes(cache), kv_quant.as_bytes(cache2))
    want = reference.paged_attention(q, k, v, cache, meta, 0.2, **scales)
    got = torch_attn.paged_attention(q, k, v, cache2, meta, 0.2, **scales)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # The scales are applied on the read: other ones give another result wherever a token
    # reads K/V written before this step (a chunk's own new K/V round-trip at either scale).
    starts = meta.query_start_loc_cpu
    cached = any(seq > end - start for seq, start, end
                 in zip(meta.seq_lens_cpu, starts, starts[1:], strict=False))
    assert cached or decodes == 0
    if cached:
        other = torch_attn.paged_attention(q, k, v, cache2, meta, 0.2, k_scale=0.5,
                                           v_scale=1.0)
        assert not torch.allclose(other, want, rtol=1e-2, atol=1e-2)


def test_fp8_attention_is_close_to_a_bf16_cache():
    rng = random.Random(11)
    q, k, v, cache, meta = make_batch(rng, 16, 3, 3, 64, torch.bfloat16, 6, 3)
    fp8 = kv_quant.quantize(cache, 1.0, E4M3)
    torch_attn.reshape_and_cache(k, v, cache, meta.slot_mapping)
    torch_attn.reshape_and_cache(k, v, fp8, meta.slot_mapping, k_scale=1.0, v_scale=1.0)
    want = torch_attn.paged_attention(q, k, v, cache, meta, 0.125)
    got = torch_attn.paged_attention(q, k, v, fp8, meta, 0.125, k_scale=1.0, v_scale=1.0)
    err = (got.float() - want.float()).abs()
    assert err.mean() < 0.01 and err.max() < 0.25, (err.mean(), err.max())


def test_flash_attn_and_triton_refuse_an_fp8_cache_and_auto_picks_torch():
    cuda = torch.device("cuda")  # a device object only
    for name in ("flash-attn", "triton"):
        with pytest.raises(ValueError, match=f"{name}.*fp8 KV cache"):
            kernels.select_backend(cuda, name, kv_dtype=E4M3)
    assert kernels.select_backend(cuda, None, kv_dtype=E5M2) is torch_attn
    assert kernels.select_backend(torch.device("cpu"), "reference",
                                  kv_dtype=E4M3) is reference
