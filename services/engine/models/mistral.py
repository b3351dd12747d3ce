"""Mistral: Llama's decoder with a sliding window where the config sets `sliding_window`
(Mistral 7B v0.1: 4096; v0.2 and later: none).

What Baton does with the window: attention applies it exactly (a token sees the last
`sliding_window` positions, itself included; see kernels/), so outputs match the model
at any length. The KV of older positions is kept, not freed: memory per request grows
with its length as for full attention, and the prefix cache works unchanged.
"""

from __future__ import annotations

from .llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    pass  # the window is read from the config by every layer (models/layers.py)
