"""Which attention backend runs where, and the flash-attn wrapper's calling convention.

flash-attn itself needs a GPU; here a stand-in with flash-attn's documented semantics
(paged K/V as [num_blocks, block_size, kv_heads, head_dim], bottom-right causal mask)
checks that the wrapper hands it the right view of our cache and the right lengths.
"""

from __future__ import annotations

import importlib
import random
import sys
import types

import pytest
import torch

import baton.kernels.backend as kernels
from baton.kernels import reference, torch_attn
from tests.kernel_batch import make_batch as _make_batch

CUDA = torch.device("cuda")  # only a device object: select_backend does not touch it


def _fake_varlen(q, k, v, cu_seqlens_q, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                 block_table, seqused_k=None, cu_seqlens_k=None, window_size=(-1, -1),
                 softcap=0.0):
    """flash_attn_varlen_func over a paged cache, written from its documentation: with
    window_size (left, right) != (-1, -1), query i (bottom-right aligned, at q_pos) sees
    keys q_pos - left .. q_pos + right; softcap > 0 caps scale * QK^T."""
    assert causal and k.stride(-1) == 1
    if seqused_k is None:
        seqused_k = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
    out = torch.empty_like(q)
    kv_heads, bs = k.shape[2], k.shape[1]
    for i in range(len(seqused_k)):
        s, e, n = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1]), int(seqused_k[i])
        pos = torch.arange(n)
        ks = k[block_table[i, pos // bs].long(), pos % bs]  # [n, kv_heads, d]
        vs = v[block_table[i, pos // bs].long(), pos % bs]
        group = q.shape[1] // kv_heads
        ks, vs = ks.repeat_interleave(group, 1), vs.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q[s:e], ks) * softmax_scale
        if softcap > 0:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(n - (e - s), n)  # bottom-right aligned
        scores = scores.masked_fill(pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        if window_size[0] >= 0:
            too_old = pos[None, None, :] < q_pos[None, :, None] - window_size[0]
            scores = scores.masked_fill(too_old, float("-inf"))
        out[s:e] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vs)
    return out


@pytest.fixture
def fake_flash(monkeypatch):
    """Install a stand-in flash-attn build; yields a function to (re)load kernels.flash."""
    def install(module_name: str):
        mod = types.ModuleType(module_name)
        if module_name == "flash_attn":
            def varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                       softmax_scale=None, causal=False, block_table=None):
                return _fake_varlen(q, k, v, cu_seqlens_q, max_seqlen_q, max_seqlen_k,
                                    softmax_scale, causal, block_table,
                                    cu_seqlens_k=cu_seqlens_k)
            mod.flash_attn_varlen_func = varlen
        else:
            mod.flash_attn_varlen_func = _fake_varlen
        monkeypatch.setitem(sys.modules, module_name, mod)
        monkeypatch.delitem(sys.modules, "baton.kernels.flash", raising=False)
        return importlib.import_module("baton.kernels.flash")

    yield install
    sys.modules.pop("baton.kernels.flash", None)


def test_cpu_takes_torch_and_forced_names_say_why_they_cannot_run(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert kernels.select_backend(torch.device("cpu")) is torch_attn
    assert kernels.select_backend(torch.device("cpu"), "reference") is reference
    with pytest.raises(ValueError, match="Triton needs CUDA"):
        kernels.select_backend(torch.device("cpu"), "triton")
    with pytest.raises(ValueError, match="unknown attention backend 'sdpa'"):
        kernels.select_backend(torch.device("cpu"), "sdpa")


def test_cuda_prefers_flash_attn_then_triton_then_torch(fake_flash, monkeypatch):
    pytest.importorskip("baton.kernels.triton_attn", reason="triton is not installed")
    monkeypatch.setitem(sys.modules, "vllm_flash_attn", None)  # import fails
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    monkeypatch.delitem(sys.modules, "baton.kernels.flash", raising=False)
    triton_attn = sys.modules["baton.kernels.triton_attn"]
    assert kernels.select_backend(CUDA) is triton_attn  # no flash-attn: Triton
    old_fork = types.ModuleType("vllm_flash_attn")  # a 2.5-era build: no seqused_k
    old_fork.flash_attn_varlen_func = lambda q, k, v, cu_seqlens_q, block_table=None: q
    monkeypatch.setitem(sys.modules, "vllm_flash_attn", old_fork)
    assert kernels.select_backend(CUDA) is triton_attn
    monkeypatch.delitem(sys.modules, "baton.kernels.flash", raising=False)
    flash = fake_flash("vllm_flash_attn")
    assert kernels.select_backend(CUDA, block_size=16) is flash
    # fp32 is not a flash-attn dtype: Triton, which runs it.
    assert kernels.select_backend(CUDA, dtype=torch.float32) is triton_attn
    monkeypatch.setitem(sys.modules, "vllm_flash_attn", None)
    flash = fake_flash("flash_attn")  # upstream: pages must be multiples of 256
    assert kernels.select_backend(CUDA, block_size=16) is triton_attn
    assert kernels.select_backend(CUDA, block_size=256) is flash
    with pytest.raises(ValueError, match="block_size a multiple of 256"):
        kernels.select_backend(CUDA, "flash-attn", block_size=16)
    monkeypatch.setitem(sys.modules, "baton.kernels.triton_attn", None)  # no Triton either
    monkeypatch.delattr(sys.modules["baton.kernels"], "triton_attn", raising=False)
    assert kernels.select_backend(CUDA, block_size=16) is torch_attn


@pytest.mark.parametrize("build,block_size", [("vllm_flash_attn", 16), ("flash_attn", 32)])
def test_flash_wrapper_passes_our_paged_layout(fake_flash, monkeypatch, build, block_size):
    """Our block-major cache, seen by flash-attn as [blocks, block_size, kv_heads, d]
    without a copy: same outputs as the reference."""
    if build == "flash_attn":
        monkeypatch.setitem(sys.modules, "vllm_flash_attn", None)  # only upstream imports
    flash = fake_flash(build)
    assert flash.BUILD == build
    rng = random.Random(block_size)
    torch.manual_seed(block_size)
    q, k, v, cache, meta = _make_batch(rng, block_size, 2, 3, 64, torch.float32, 3, 3)
    torch_attn.reshape_and_cache(k, v, cache, meta.slot_mapping)
    want = reference.paged_attention(q, k, v, cache, meta, 0.125)
    got = flash.paged_attention(q, k, v, cache, meta, 0.125)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_flash_wrapper_passes_window_and_softcap(fake_flash, monkeypatch):
    """A build with window_size= and softcap= (vLLM's) gets window - 1 as the left window
    and the softcap: same outputs as the reference. One without them (the upstream
    stand-in here) raises, naming what is missing, instead of ignoring the layer's mask."""
    flash = fake_flash("vllm_flash_attn")
    rng = random.Random(4)
    torch.manual_seed(4)
    q, k, v, cache, meta = _make_batch(rng, 16, 2, 3, 64, torch.float32, 3, 3)
    torch_attn.reshape_and_cache(k, v, cache, meta.slot_mapping)
    for window, softcap in [(5, None), (37, 2.0), (None, 2.0)]:
        want = reference.paged_attention(q, k, v, cache, meta, 0.125, window, softcap)
        got = flash.paged_attention(q, k, v, cache, meta, 0.125, window=window,
                                    softcap=softcap)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    monkeypatch.setitem(sys.modules, "vllm_flash_attn", None)
    flash = fake_flash("flash_attn")
    with pytest.raises(NotImplementedError, match="no window_size= argument"):
        flash.paged_attention(q, k, v, cache, meta, 0.125, window=5)
    with pytest.raises(NotImplementedError, match="no softcap= argument"):
        flash.paged_attention(q, k, v, cache, meta, 0.125, softcap=2.0)
