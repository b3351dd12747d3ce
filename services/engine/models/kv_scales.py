"""An fp8 KV cache's per-layer scales as checkpoints name them, read as vLLM reads them:
`...self_attn.k_scale` and `v_scale`, the older `kv_scale` (one for both), and the
`k_proj.k_scale` / `v_proj.v_scale` of compressed-tensors checkpoints. A layer whose
checkpoint has none keeps 1.0 (layers.Attention)."""

from __future__ import annotations

import torch

# Name after "model.layers.<i>." -> which of the layer's attention scales it sets.
_NAMES = {
    "self_attn.k_scale": ("k_scale",), "self_attn.v_scale": ("v_scale",),
    "self_attn.kv_scale": ("k_scale", "v_scale"),
    "self_attn.k_proj.k_scale": ("k_scale",), "self_attn.v_proj.v_scale": ("v_scale",),
}


def kv_scale_of(name: str) -> tuple[int, tuple[str, ...]] | None:
    """(layer, the attributes it sets) if `name` is a KV-cache scale, else None."""
    if not name.startswith("model.layers."):
        return None
    _, _, idx, rest = name.split(".", 3)
    attrs = _NAMES.get(rest)
    return None if attrs is None else (int(idx), attrs)


def set_kv_scale(attention, attrs: tuple[str, ...], name: str, w: torch.Tensor) -> None:
    """Store a one-element scale tensor as a float on the layer's attention."""
    if w.numel() != 1:
        raise ValueError(f"{name}: a per-tensor KV scale has one element, got "
                         f"{tuple(w.shape)}")
    value = float(w.float().reshape(()))
    if not value > 0 or value == float("inf"):
        raise ValueError(f"{name}: a KV scale must be finite and > 0, got {value}")
    for attr in attrs:
        setattr(attention, attr, value)
