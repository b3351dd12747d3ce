"""Qwen2 / Qwen2.5 and Qwen3: Llama's decoder with

    Qwen2: a bias on the q, k and v projections (not on o); embeddings tied or not;
           `use_sliding_window` configs get their windowed layers (`layer_types`).
    Qwen3: no biases; an RMSNorm over each head of q and of k before RoPE (`q_norm`,
           `k_norm`), and head_dim set apart from hidden_size / heads.

Both switches live in the shared Attention (models/layers.py), read from the config.
"""

from __future__ import annotations

from .llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    pass


class Qwen3ForCausalLM(LlamaForCausalLM):
    pass
