"""Llama (Llama 2, Llama 3.x with its RoPE scaling, SmolLM2, TinyLlama): the decoder every
other family here extends, written for the flat paged batch (see layers.py).

    tokens -> embed -> [DecoderLayer] x N -> norm -> lm_head -> logits
"""

from __future__ import annotations

from collections.abc import Iterable
from types import ModuleType
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from baton.kernels import quant
from baton.kernels.metadata import AttentionMetadata

from ..model_config import ModelConfig
from .kv_scales import kv_scale_of, set_kv_scale
from .layers import (
    TP,
    DecoderLayer,
    Packed,
    RMSNorm,
    RotaryEmbedding,
    linear,
    param,
    prepack,
)
from .sharding import Shard

# HF module -> (our fused parameter, which block of its rows: 0 = the first, ...).
FUSED = {
    "self_attn.q_proj": ("self_attn.qkv", 0), "self_attn.k_proj": ("self_attn.qkv", 1),
    "self_attn.v_proj": ("self_attn.qkv", 2), "self_attn.o_proj": ("self_attn.o", 0),
    "mlp.gate_proj": ("mlp.gate_up", 0), "mlp.up_proj": ("mlp.gate_up", 1),
    "mlp.down_proj": ("mlp.down", 0),
}


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int, dtype: torch.dtype,
                 device: torch.device, backend: ModuleType, shard: Shard | None = None,
                 tp: TP = None):
        """`config` the whole model's; with `shard` (and its group `tp`), this rank's part
        of it (models/sharding.py), its own config in self.config."""
        super().__init__()
        self.shard, self.tp = shard, tp
        self.vocab_size = config.vocab_size  # the whole vocabulary's, sharded or not
        c = self.config = shard.local_config() if shard is not None else config
        self.backend = backend
        self.dtype = dtype
        vocab = shard.vocab_rows if shard is not None else c.vocab_size
        self.embed_tokens = param(vocab, c.hidden_size, dtype=dtype, device=device)
        self.rope = RotaryEmbedding(c.rope, c.head_dim, max_positions, dtype, device)
        # Sliding layers use their own RoPE table where the config has one (Gemma 3).
        self.sliding_rope = (RotaryEmbedding(c.sliding_rope, c.head_dim, max_positions, dtype,
                                             device) if c.sliding_rope else None)
        self.rope_of_layer = [int(self.sliding_rope is not None and i in c.sliding_layers)
                              for i in range(c.num_layers)]
        self.layers = nn.ModuleList(DecoderLayer(c, i, dtype, device, tp)
                                    for i in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, device, c.norm_offset)
        self.lm_head = (self.embed_tokens if c.tie_word_embeddings
                        else param(vocab, c.hidden_size, dtype=dtype, device=device))
        self.lm_head_packed: Packed = None
        # The embedding kept quantized (services/engine/quantization.py): rows are
        # dequantized as they are looked up, and embed_tokens is empty.
        self.embed_quant: quant.QuantWeight | None = None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return self._rows(input_ids)
        # Vocab-parallel: each rank looks up the ids in its rows, zeros for the others,
        # and the sum over ranks is every token's row.
        assert self.shard is not None
        local = input_ids - self.shard.vocab_start
        outside = (local < 0) | (local >= self.shard.vocab_rows)
        x = self._rows(local.masked_fill(outside, 0)).masked_fill(outside[:, None], 0)
        return self.tp.all_reduce(x.contiguous())

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        if self.embed_quant is not None:
            return quant.dequantize_rows(self.embed_quant, ids).to(self.dtype)
        return F.embedding(ids, self.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        """Final hidden states [num_tokens, hidden] (normed) for the flat batch."""
        x = self.embed(input_ids)
        ropes = [self.rope(positions)]  # looked up once per pass, not per layer
        if self.sliding_rope is not None:
            ropes.append(self.sliding_rope(positions))
        residual = None  # the stream travels as (x, residual): layers.DecoderLayer
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=False)):
            x, residual = layer(ropes[self.rope_of_layer[i]], x, residual, kv_cache, meta,
                                self.backend)
        return self.norm(x) if residual is None else self.norm.add(x, residual)[0]

    @property
    def decoder_layers(self) -> list[DecoderLayer]:
        """`layers`, typed: an nn.ModuleList holds nn.Modules as far as a checker knows."""
        return cast(list[DecoderLayer], list(self.layers))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = linear(hidden, self.lm_head, self.lm_head_packed)
        if self.tp is not None:  # this rank's rows of the vocabulary -> all of them
            logits = self.tp.gather_vocab(logits, self.vocab_size)
        return logits.float()

    def prepack_weights(self) -> None:
        """Keep oneDNN-packed copies of every linear weight, where that path applies.
        Costs a second copy of those weights in memory; call after load_weights. A weight
        kept quantized stays as it is."""
        for layer in self.decoder_layers:
            for module, names in ((layer.self_attn, ("qkv", "o")),
                                  (layer.mlp, ("gate_up", "down"))):
                for name in names:
                    if not isinstance(module.packed.get(name), quant.QuantWeight):
                        module.packed[name] = prepack(getattr(module, f"{name}_weight"))
        if not isinstance(self.lm_head_packed, quant.QuantWeight):
            self.lm_head_packed = prepack(self.lm_head)

    _TOP_LEVEL = {"model.embed_tokens.weight": "embed_tokens", "lm_head.weight": "lm_head"}

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in, fusing q/k/v and gate/up. Raises on a tensor with no
        place here, and if any row of any parameter (a part of a fused one included) was
        not loaded."""
        c = self.config
        q, kv, inter = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
        offsets = {"self_attn.qkv": (0, q, q + kv), "mlp.gate_up": (0, inter)}
        params = dict(self.named_parameters(remove_duplicate=False))
        rows: dict[str, int] = dict.fromkeys(params, 0)  # rows loaded per parameter
        for name, w in weights:
            if (name == "lm_head.weight" and c.tie_word_embeddings) or "rotary_emb" in name:
                continue
            if (kv_scale := kv_scale_of(name)) is not None:  # no parameter: a float
                set_kv_scale(self.decoder_layers[kv_scale[0]].self_attn, kv_scale[1], name, w)
                continue
            if self.shard is not None:  # this rank's part of the tensor
                w = self.shard.take(name.rsplit(".", 2)[-2], name.rsplit(".", 1)[-1], w)
            if name.startswith("model.layers."):
                _, _, idx, rest = name.split(".", 3)
                module, kind = rest.rsplit(".", 1)
                if module in FUSED:
                    attr, part = FUSED[module]
                    target = f"layers.{idx}.{attr}_{kind}"
                    offset = offsets.get(attr, (0,))[part]
                    dst = params[target].narrow(0, offset, w.shape[0]) if target in params \
                        else None
                else:
                    target = f"layers.{idx}.{rest}"
                    dst = params.get(target)
            else:
                target = self._TOP_LEVEL.get(name, name.removeprefix("model."))
                dst = params.get(target)
            if dst is None:
                raise ValueError(f"weight {name} has no place in {c.architecture} as "
                                 "configured (a bias or norm the config does not declare?)")
            if dst.shape != w.shape:
                raise ValueError(f"weight {name}: shape {tuple(w.shape)} != {tuple(dst.shape)}")
            dst.copy_(w)
            rows[target] += w.shape[0]
        if c.tie_word_embeddings:
            rows["lm_head"] = rows["embed_tokens"]
        missing = [n for n, p in params.items() if rows[n] != p.shape[0]]
        if missing:
            raise ValueError(f"checkpoint is missing weights: {sorted(missing)[:5]}")
