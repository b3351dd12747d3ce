"""Gemma 2 and Gemma 3 (text): Llama's decoder with

    - embeddings multiplied by sqrt(hidden_size) (in the model dtype, as HF does);
    - RMSNorm scaling by (1 + w), and sandwich norms: each of attention and MLP is normed
      before and after (models/layers.py: DecoderLayer);
    - GELU (tanh) in the MLP; attention scaled by query_pre_attn_scalar ** -0.5;
    - Gemma 2: attention logits soft-capped (c * tanh(s / c)) in the kernel, and the
      final logits too; a sliding window on every other layer;
    - Gemma 3: q/k norms instead of the attention cap; five windowed layers to one
      global, and the windowed layers use their own RoPE base (`rope_local_base_freq`,
      or v5's per-layer-type `rope_parameters`).
Gemma 3's multimodal checkpoints (Gemma3ForConditionalGeneration, 4B and up) are not
read; the text-only Gemma3ForCausalLM (1B) is.
"""

from __future__ import annotations

import torch

from .llama import LlamaForCausalLM


class Gemma2ForCausalLM(LlamaForCausalLM):
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = super().embed(input_ids)
        return x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.config.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    pass
