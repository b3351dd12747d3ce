"""Which attention and cache-write kernels serve, chosen once per platform.

Every backend offers the same two functions as `kernels.reference`, and is tested
against it:
    reshape_and_cache(key, value, kv_cache, slot_mapping)
    paged_attention(query, key, value, kv_cache, meta, scale, window=None,
                    softcap=None) -> output

kv_cache is one layer's cache tensor, laid out as kernels/kv_layout.py defines; each
backend takes the views of it that it wants from there.

window and softcap are per-layer constants (so fine inside a CUDA graph): a token at
position p sees only keys p - window < k <= p (HF's sliding_window; Mistral, Gemma 2/3),
and scores become softcap * tanh(scale * QK^T / softcap) before the mask (Gemma 2).
None turns either off (softcap 0 too, as in flash-attn); with both off every backend runs
its plain path, unchanged.

An fp8 KV cache (kernels/kv_quant.py) is read by "torch" and "reference" alone, which take
its per-layer scales as k_scale and v_scale on both calls; flash-attn and Triton refuse it.

Backends: "flash-attn" (kernels/flash.py), "triton" (kernels/triton_attn.py), "torch"
(kernels/torch_attn.py: torch ops, any device; the CUDA fallback) and "reference" (slow, for tests).
"""

from __future__ import annotations

import logging
import os
from types import ModuleType

import torch

from . import kv_quant, reference, torch_attn

BACKENDS = ("flash-attn", "triton", "torch", "reference")
log = logging.getLogger(__name__)


def _flash(block_size: int, head_dim: int, dtype: torch.dtype) -> tuple[ModuleType | None, str]:
    try:
        from . import flash
    except ImportError as e:
        return None, f"flash-attn does not import ({e})"
    why = flash.unsupported(block_size, head_dim, dtype)
    return (None, why) if why else (flash, f"flash-attn ({flash.BUILD})")


def _triton(device: torch.device) -> tuple[ModuleType | None, str]:
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return None, "Triton needs CUDA (or TRITON_INTERPRET=1 to interpret it on CPU)"
    try:
        from . import triton_attn
    except ImportError as e:
        return None, f"triton does not import ({e})"
    return triton_attn, "triton"


def select_backend(device: torch.device, name: str | None = None, *, block_size: int = 16,
                   head_dim: int = 64, dtype: torch.dtype = torch.bfloat16,
                   kv_dtype: torch.dtype | None = None) -> ModuleType:
    """The attention backend for a device and KV layout.

    name None picks the best that works: on CUDA flash-attn, then Triton, then torch;
    elsewhere torch. A name forces that backend, and raises ValueError, saying why, if it
    cannot run here. kv_dtype: the cache's dtype (None: `dtype`); an fp8 one is served by
    torch and the reference only.
    """
    if kv_dtype is not None and kv_quant.is_fp8(kv_dtype):
        if name in ("flash-attn", "triton"):
            raise ValueError(f"attention backend {name!r} does not read an fp8 KV cache "
                             f"({kv_dtype}); use --attention-backend torch or "
                             "--kv-cache-dtype auto")
        if name is None and device.type == "cuda":
            log.warning("attention backend: torch (flash-attn and Triton do not read an "
                        "fp8 KV cache)")
        name = name or "torch"
    if name == "reference":
        return reference
    if name == "torch":
        return torch_attn
    if name not in (None, "flash-attn", "triton"):
        raise ValueError(f"unknown attention backend {name!r}; choose from {BACKENDS}")
    if name is None and device.type != "cuda":
        return torch_attn
    reasons = []
    if name in (None, "flash-attn"):
        backend, why = _flash(block_size, head_dim, dtype)
        if backend is not None:
            log.info("attention backend: %s", why)
            return backend
        reasons.append(why)
    if name in (None, "triton"):
        backend, why = _triton(device)
        if backend is not None:
            log.info("attention backend: triton (%s)", "; ".join(reasons) or "asked for")
            return backend
        reasons.append(why)
    if name is not None:
        raise ValueError(f"attention backend {name!r} cannot run here: {'; '.join(reasons)}")
    log.warning("attention backend: torch (%s)", "; ".join(reasons))
    return torch_attn
