"""Llama-family decoder (Llama 2/3, Mistral, SmolLM2, TinyLlama) over one flat paged batch.

There is no batch dimension: `input_ids` and `positions` are [num_tokens] for every
scheduled token of every request, and attention reads and writes the paged KV cache
through `AttentionMetadata` (see kernels/metadata.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from kernels.metadata import AttentionMetadata
from services.engine.model_config import ModelConfig


def linear(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None = None,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias), through oneDNN's prepacked copy of the weight when there is
    one (CPU, bf16/fp16: the same result, without repacking the weight on every call)."""
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


def _param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    # Uninitialized: every parameter is overwritten by load_weights.
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class RMSNorm(nn.Module):
    """y = w * x / sqrt(mean(x^2) + eps), computed in fp32 and cast back, as HF does."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.weight = _param(size, dtype=dtype, device=device)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies theta^(-2i/d), with llama3 scaling when the config asks for it.

    llama3: wavelengths longer than original_ctx / low_freq_factor are slowed by `factor`,
    shorter than original_ctx / high_freq_factor are kept, and those in between are
    interpolated linearly in 1/wavelength.
    """
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    if config.rope_llama3 is None:
        return inv_freq
    p = dict(config.rope_llama3)
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

    def __init__(self, config: ModelConfig, max_positions: int, dtype: torch.dtype,
                 device: torch.device):
        super().__init__()
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32),
                            rope_inv_freq(config))
        self.register_buffer("cos", freqs.cos().to(dtype=dtype, device=device), persistent=False)
        self.register_buffer("sin", freqs.sin().to(dtype=dtype, device=device), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for each token, [T, 1, d/2]: looked up once per forward pass."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Attention(nn.Module):
    def __init__(self, c: ModelConfig, dtype, device):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_size, self.kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.qkv_weight = _param(self.q_size + 2 * self.kv_size, c.hidden_size, dtype=dtype,
                                 device=device)
        self.qkv_bias = (_param(self.q_size + 2 * self.kv_size, dtype=dtype, device=device)
                         if c.attention_bias else None)
        self.o_weight = _param(c.hidden_size, self.q_size, dtype=dtype, device=device)
        self.scale = c.head_dim**-0.5
        self.packed: dict[str, torch.Tensor | None] = {}

    def forward(self, rope, x, kv_cache, meta: AttentionMetadata, backend: ModuleType):
        t = x.shape[0]
        qkv = linear(x, self.qkv_weight, self.packed.get("qkv"), self.qkv_bias)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rope(q.view(t, self.num_heads, self.head_dim), *rope)
        k = apply_rope(k.view(t, self.num_kv_heads, self.head_dim), *rope)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        backend.reshape_and_cache(k, v, key_cache, value_cache, meta.slot_mapping)
        o = backend.paged_attention(q, k, v, key_cache, value_cache, meta, self.scale)
        return linear(o.reshape(t, self.q_size), self.o_weight, self.packed.get("o"))


class MLP(nn.Module):
    def __init__(self, c: ModelConfig, dtype, device):
        super().__init__()
        self.gate_up_weight = _param(2 * c.intermediate_size, c.hidden_size, dtype=dtype,
                                     device=device)
        self.down_weight = _param(c.hidden_size, c.intermediate_size, dtype=dtype, device=device)
        self.packed: dict[str, torch.Tensor | None] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = linear(x, self.gate_up_weight, self.packed.get("gate_up")).chunk(2, dim=-1)
        return linear(F.silu(gate) * up, self.down_weight, self.packed.get("down"))


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig, dtype, device):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, device)
        self.self_attn = Attention(c, dtype, device)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, device)
        self.mlp = MLP(c, dtype, device)

    def forward(self, rope, x, kv_cache, meta, backend):
        x = x + self.self_attn(rope, self.input_layernorm(x), kv_cache, meta, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int, dtype: torch.dtype,
                 device: torch.device, backend: ModuleType):
        super().__init__()
        self.config = config
        self.backend = backend
        self.embed_tokens = _param(config.vocab_size, config.hidden_size, dtype=dtype,
                                   device=device)
        self.rope = RotaryEmbedding(config, max_positions, dtype, device)
        self.layers = nn.ModuleList(
            DecoderLayer(config, dtype, device) for _ in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.lm_head = (self.embed_tokens if config.tie_word_embeddings
                        else _param(config.vocab_size, config.hidden_size, dtype=dtype,
                                    device=device))
        self.lm_head_packed: torch.Tensor | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        """Final hidden states [num_tokens, hidden] (normed) for the flat batch."""
        x = F.embedding(input_ids, self.embed_tokens)
        rope = self.rope(positions)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=False):
            x = layer(rope, x, kv_cache, meta, self.backend)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden, self.lm_head, self.lm_head_packed).float()

    def prepack_weights(self) -> None:
        """Keep oneDNN-packed copies of every linear weight, where that path applies.
        Costs a second copy of those weights in memory; call after load_weights."""
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn.packed = {"qkv": prepack(attn.qkv_weight), "o": prepack(attn.o_weight)}
            mlp.packed = {"gate_up": prepack(mlp.gate_up_weight), "down": prepack(mlp.down_weight)}
        self.lm_head_packed = prepack(self.lm_head)

    _TOP_LEVEL = {"model.embed_tokens.weight": "embed_tokens", "lm_head.weight": "lm_head"}

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in, fusing q/k/v and gate/up. Raises if any row of any
        parameter (a part of a fused one included) was not loaded."""
        c = self.config
        q, kv, inter = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
        fused = {  # HF suffix -> (our attribute, row offset)
            "self_attn.q_proj": ("self_attn.qkv", 0), "self_attn.k_proj": ("self_attn.qkv", q),
            "self_attn.v_proj": ("self_attn.qkv", q + kv), "self_attn.o_proj": ("self_attn.o", 0),
            "mlp.gate_proj": ("mlp.gate_up", 0), "mlp.up_proj": ("mlp.gate_up", inter),
            "mlp.down_proj": ("mlp.down", 0),
        }
        params = dict(self.named_parameters(remove_duplicate=False))
        rows: dict[str, int] = dict.fromkeys(params, 0)  # rows loaded per parameter
        for name, w in weights:
            if (name == "lm_head.weight" and c.tie_word_embeddings) or "rotary_emb" in name:
                continue
            if name.startswith("model.layers."):
                _, _, idx, rest = name.split(".", 3)
                module, kind = rest.rsplit(".", 1)
                if module in fused:
                    attr, offset = fused[module]
                    target = f"layers.{idx}.{attr}_{kind}"
                    dst = params[target].narrow(0, offset, w.shape[0])
                else:
                    target = f"layers.{idx}.{rest}"
                    dst = params[target]
            else:
                target = self._TOP_LEVEL.get(name, name.removeprefix("model."))
                dst = params[target]
            if dst.shape != w.shape:
                raise ValueError(f"weight {name}: shape {tuple(w.shape)} != {tuple(dst.shape)}")
            dst.copy_(w)
            rows[target] += w.shape[0]
        if c.tie_word_embeddings:
            rows["lm_head"] = rows["embed_tokens"]
        missing = [n for n, p in params.items() if rows[n] != p.shape[0]]
        if missing:
            raise ValueError(f"checkpoint is missing weights: {sorted(missing)[:5]}")


MODELS = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
}
