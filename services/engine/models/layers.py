"""The pieces every family shares: linear layers (prepacked on CPU), RMSNorm, RoPE,
attention over the paged cache, the gated MLP.

There is no batch dimension: activations are [num_tokens, ...] for every scheduled token
of every request, and attention reads and writes the paged KV cache through
`AttentionMetadata` (see kernels/metadata.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from baton.kernels import cpu_ops, kv_layout, kv_quant, quant, torch_attn
from baton.kernels.metadata import AttentionMetadata

from ..model_config import ModelConfig, Rope

# What serves a linear besides its dense weight: oneDNN's packed copy, or the weight kept
# quantized (services/engine/quantization.py), which then replaces the dense one.
Packed = torch.Tensor | quant.QuantWeight | None


def linear(x: torch.Tensor, weight: torch.Tensor, packed: Packed = None,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias), through oneDNN's prepacked copy of the weight when there is
    one (CPU, bf16/fp16: the same result, without repacking the weight on every call), or
    through the quantized weight."""
    if isinstance(packed, quant.QuantWeight):
        out = quant.matmul(x.contiguous(), packed)
        return out if bias is None else out + bias
    if packed is not None:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return F.linear(x, weight, bias)


def prepack(weight: torch.Tensor, batch_hint: int = 64) -> torch.Tensor | None:
    """A oneDNN-packed copy of a linear weight, or None where that path does not apply."""
    if (weight.device.type != "cpu" or weight.dtype not in (torch.bfloat16, torch.float16)
            or not torch.backends.mkldnn.is_available()):
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint)
    except (RuntimeError, AttributeError):
        return None


def param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    # Uninitialized: every parameter is overwritten by load_weights.
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


# LoRA's hook on a layer's linears (services/lora/slots.py): (which linear, its
# input, its output) -> the output with the adapters' deltas added.
LoraHook = Callable[[str, torch.Tensor, torch.Tensor], torch.Tensor]
# The tensor-parallel group (services/engine/parallel.py), or None: one rank.
TP = Any


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * w, in fp32, as HF computes it per family:

        offset 0 (Llama, Qwen):  w * (normed cast to the model dtype)
        offset 1 (Gemma):        (normed * (1 + w) in fp32) cast to the model dtype
    """

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device,
                 offset: float = 0.0):
        super().__init__()
        self.weight = param(size, dtype=dtype, device=device)
        self.eps, self.offset = eps, offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = cpu_ops.serves("rms_norm", x.device)
        if ops is not None and x.is_contiguous():
            return cpu_ops.rms_norm(x, self.weight, self.eps, self.offset, None, ops)
        return self._torch(x)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(s), s) for s = x + residual, rounded to the model dtype as HF's add is.
        May write s into `residual` (the CPU kernel does: one pass over the row)."""
        ops = cpu_ops.serves("rms_norm", x.device)
        if ops is not None and x.is_contiguous() and residual.is_contiguous():
            return cpu_ops.rms_norm(x, self.weight, self.eps, self.offset, residual, ops), residual
        s = x + residual
        return self._torch(s), s

    def _torch(self, x: torch.Tensor) -> torch.Tensor:
        if self.offset:
            xf = x.float()
            xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
            return (xf * (self.offset + self.weight.float())).to(x.dtype)
        # One fused op for the normed value (fp32 inside, rounded once to x's dtype, as
        # HF's `.to(dtype)`), then the weight in x's dtype: HF's numerics, in 2 ops not 6.
        return self.weight * F.rms_norm(x, (x.shape[-1],), eps=self.eps)


def rope_inv_freq(rope: Rope, head_dim: int) -> torch.Tensor:
    """Inverse frequencies theta^(-2i/d), scaled as the config asks.

    linear: every frequency divided by `factor` (positions interpolated).
    llama3: wavelengths longer than original_ctx / low_freq_factor are slowed by `factor`,
    shorter than original_ctx / high_freq_factor are kept, and those in between are
    interpolated linearly in 1/wavelength.
    """
    d = head_dim
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    p = dict(rope.params)
    if rope.kind == "linear":
        return inv_freq / p["factor"]
    if rope.kind != "llama3":
        return inv_freq
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_ctx = p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Neox-style RoPE on the two halves of each head: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s)."""

    cos: torch.Tensor  # [max_positions, d/2], buffers (register_buffer below)
    sin: torch.Tensor

    def __init__(self, rope: Rope, head_dim: int, max_positions: int, dtype: torch.dtype,
                 device: torch.device):
        super().__init__()
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32),
                            rope_inv_freq(rope, head_dim))
        self.register_buffer("cos", freqs.cos().to(dtype=dtype, device=device), persistent=False)
        self.register_buffer("sin", freqs.sin().to(dtype=dtype, device=device), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for each token, [T, 1, d/2]: looked up once per forward pass."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (x1 c - x2 s, x2 c + x1 s) on the halves of the last dim, into a new
    tensor: two multiplies and two fused multiply-adds, no concatenation."""
    x1, x2 = x.chunk(2, dim=-1)
    out = torch.empty_like(x)
    o1, o2 = out.chunk(2, dim=-1)
    torch.mul(x1, cos, out=o1)
    o1.addcmul_(x2, sin, value=-1)
    torch.mul(x2, cos, out=o2)
    o2.addcmul_(x1, sin)
    return out


class Attention(nn.Module):
    """q, k, v from one fused projection; optional per-head RMSNorm of q and k before RoPE
    (Qwen3, Gemma 3); the kernel applies this layer's sliding window and soft-cap."""

    def __init__(self, c: ModelConfig, layer: int, dtype, device, tp: TP = None):
        super().__init__()
        self.tp = tp  # the tensor-parallel group: c holds this rank's heads (sharding.py)
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_size, self.kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        qkv = self.q_size + 2 * self.kv_size
        self.qkv_weight = param(qkv, c.hidden_size, dtype=dtype, device=device)
        self.qkv_bias = param(qkv, dtype=dtype, device=device) if c.qkv_bias else None
        self.o_weight = param(c.hidden_size, self.q_size, dtype=dtype, device=device)
        self.o_bias = param(c.hidden_size, dtype=dtype, device=device) if c.o_bias else None
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype, device, c.norm_offset)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype, device, c.norm_offset)
        self.qk_norm = c.qk_norm
        self.scale = c.scale
        self.window = c.window(layer)
        self.softcap = c.attn_softcap
        # Only the features a layer uses reach the kernel, so plain layers keep the
        # kernels' default signature.
        self.features = {k: v for k, v in (("window", self.window), ("softcap", self.softcap))
                         if v is not None}
        self.packed: dict[str, Packed] = {}
        self.lora: LoraHook | None = None  # set where adapters are on
        # An fp8 KV cache's per-tensor scales (vLLM's k_scale, v_scale): the checkpoint's
        # where it has them (models/kv_scales.py), else 1.0. Unused by other caches.
        self.k_scale = self.v_scale = 1.0

    def forward(self, rope, x, kv_cache, meta: AttentionMetadata, backend: ModuleType):
        t = x.shape[0]
        qkv = linear(x, self.qkv_weight, self.packed.get("qkv"), self.qkv_bias)
        if self.lora is not None:
            qkv = self.lora("qkv", x, qkv)
        qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        heads = self.num_heads + self.num_kv_heads
        qk = qk.reshape(t, heads, self.head_dim)
        if self.qk_norm:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        fp8 = kv_quant.is_fp8(kv_cache.dtype)
        scales = {"k_scale": self.k_scale, "v_scale": self.v_scale} if fp8 else {}
        ops = cpu_ops.serves("rope_and_cache", x.device) if backend is torch_attn else None
        if ops is not None and not fp8:
            # One pass per token: q and k rotated in place, k and v into the cache.
            cos, sin = rope
            cpu_ops.rope_and_cache(qk, v, cos.squeeze(1), sin.squeeze(1),
                                   kv_layout.head_views(kv_cache), meta.slot_mapping,
                                   self.num_kv_heads, ops)
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        else:
            # q and k heads side by side: one RoPE pass for both.
            q, k = apply_rope(qk, *rope).split([self.num_heads, self.num_kv_heads], dim=1)
            backend.reshape_and_cache(k, v, kv_cache, meta.slot_mapping, **scales)
        o = backend.paged_attention(q, k, v, kv_cache, meta, self.scale, **self.features,
                                    **scales)
        o = o.reshape(t, self.q_size)
        out = linear(o, self.o_weight, self.packed.get("o"), self.o_bias)
        if self.lora is not None:
            out = self.lora("o", o, out)
        return out if self.tp is None else self.tp.all_reduce(out)  # row-parallel


class MLP(nn.Module):
    """down(act(gate(x)) * up(x)), gate and up fused in one projection."""

    def __init__(self, c: ModelConfig, dtype, device, tp: TP = None):
        super().__init__()
        self.tp = tp  # as Attention's: c holds this rank's rows of the MLP
        inter = c.intermediate_size
        self.gate_up_weight = param(2 * inter, c.hidden_size, dtype=dtype, device=device)
        self.down_weight = param(c.hidden_size, inter, dtype=dtype, device=device)
        self.gate_up_bias = param(2 * inter, dtype=dtype, device=device) if c.mlp_bias else None
        self.down_bias = param(c.hidden_size, dtype=dtype, device=device) if c.mlp_bias else None
        self.act = F.silu if c.hidden_act == "silu" else _gelu_tanh
        self.packed: dict[str, Packed] = {}
        self.lora: LoraHook | None = None  # LoRA's hook, as Attention's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = linear(x, self.gate_up_weight, self.packed.get("gate_up"), self.gate_up_bias)
        if self.lora is not None:
            gate_up = self.lora("gate_up", x, gate_up)
        ops = cpu_ops.serves("silu_and_mul", gate_up.device) if self.act is F.silu else None
        if ops is not None and gate_up.dim() == 2 and gate_up.stride(-1) == 1:
            h = cpu_ops.silu_and_mul(gate_up, ops)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            h = self.act(gate) * up
        out = linear(h, self.down_weight, self.packed.get("down"), self.down_bias)
        if self.lora is not None:
            out = self.lora("down", h, out)
        return out if self.tp is None else self.tp.all_reduce(out)  # row-parallel


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


class DecoderLayer(nn.Module):
    """Pre-norm (Llama, Mistral, Qwen):
        x += attn(input_layernorm(x));  x += mlp(post_attention_layernorm(x))
    Sandwich (Gemma), every sub-block normed before and after:
        x += post_attention_layernorm(attn(input_layernorm(x)))
        x += post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x)))
    Attribute names are HF's, so checkpoints load by name.

    As in vLLM, the stream x travels as (h, residual) with x = h + residual: each add
    happens inside the norm that follows it (RMSNorm.add, one kernel on CPU). The first
    layer gets residual None and h = x; the model's final norm does the last add."""

    def __init__(self, c: ModelConfig, layer: int, dtype, device, tp: TP = None):
        super().__init__()

        def norm() -> RMSNorm:
            return RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, device, c.norm_offset)

        self.input_layernorm = norm()
        self.self_attn = Attention(c, layer, dtype, device, tp)
        self.post_attention_layernorm = norm()
        self.mlp = MLP(c, dtype, device, tp)
        self.sandwich = c.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = norm()
            self.post_feedforward_layernorm = norm()

    def forward(self, rope, h, residual, kv_cache, meta, backend):
        if residual is None:
            residual, normed = h, self.input_layernorm(h)
        else:
            normed, residual = self.input_layernorm.add(h, residual)
        a = self.self_attn(rope, normed, kv_cache, meta, backend)
        if not self.sandwich:
            normed, residual = self.post_attention_layernorm.add(a, residual)
            return self.mlp(normed), residual
        normed, residual = self.pre_feedforward_layernorm.add(
            self.post_attention_layernorm(a), residual)
        return self.post_feedforward_layernorm(self.mlp(normed)), residual
