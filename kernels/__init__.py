"""Attention and cache-write kernels, chosen once per platform.

Every backend offers the same two functions as `kernels.reference`, and is tested
against it:
    reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    paged_attention(query, key, value, key_cache, value_cache, meta, scale) -> output
"""

from __future__ import annotations

from types import ModuleType

import torch

from kernels import cpu, reference
from kernels.metadata import AttentionMetadata

__all__ = ["AttentionMetadata", "select_backend", "cpu", "reference"]


def select_backend(device: torch.device, name: str | None = None) -> ModuleType:
    """The attention backend for a device: `name` forces one of "torch", "reference".

    The torch SDPA path (`kernels.cpu`) is pure torch and runs on any device; faster GPU
    backends (Triton, flash-attn) plug in here first when they exist.
    """
    if name == "reference":
        return reference
    if name not in (None, "torch"):
        raise ValueError(f"unknown attention backend {name!r}")
    return cpu
