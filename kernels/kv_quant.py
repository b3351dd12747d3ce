"""An fp8 KV cache: what is written, what is read (vLLM's `--kv-cache-dtype`).

Each layer has one scale for K and one for V (vLLM's k_scale, v_scale; 1.0 unless the
checkpoint gives them). A write stores x / scale in fp8, saturated to the format's finite
range, so a large value never becomes inf or NaN; a read is fp8 -> fp32 * scale, then the
model's dtype. Attention always sees what a read gives: a prefill chunk's own new K/V go
through the same round trip as the cached ones (`round_trip`), so a result does not depend
on how a prompt was chunked.

Torch's CPU build has no index_copy_ for fp8 dtypes: the writes copy the bytes, through
uint8 views of the same memory.
"""

from __future__ import annotations

import torch

# vLLM's --kv-cache-dtype values besides "auto" (the model's dtype); "fp8" is e4m3.
FP8_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
              "fp8_e5m2": torch.float8_e5m2}


def cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype a KV cache of that setting stores."""
    if kv_cache_dtype == "auto":
        return model_dtype
    return FP8_DTYPES[kv_cache_dtype]


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def quantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """x / scale in `dtype` (an fp8 one), saturated to its largest finite value."""
    limit = torch.finfo(dtype).max
    return (x.float() / scale).clamp_(-limit, limit).to(dtype)


def dequantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """fp8 -> fp32 * scale -> `dtype`."""
    y = x.float()
    if scale != 1.0:
        y.mul_(scale)
    return y.to(dtype)


def round_trip(x: torch.Tensor, scale: float, cache: torch.dtype) -> torch.Tensor:
    """What a cache of dtype `cache` gives back for x, in x's dtype."""
    return dequantize(quantize(x, scale, cache), scale, x.dtype)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The same memory as uint8 (one byte per fp8 element), for copies by index."""
    return t.view(torch.uint8)
