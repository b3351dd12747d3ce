"""flash-attn backend: FlashAttention-2's varlen kernel, reading K/V through block tables.

Two builds are looked for, in this order:
  * vLLM's fork (`vllm.vllm_flash_attn`, or standalone `vllm_flash_attn`): pages of any
    multiple of 16 tokens;
  * upstream `flash_attn` >= 2.6 (`block_table=` support): pages a multiple of 256
    (`--block-size 256`).
`unsupported()` says why a build cannot serve a given layout; the backend is then not
chosen (see kernels/backend.py).

flash-attn wants a paged cache as [num_blocks, block_size, kv_heads, head_dim]. Ours is
block-major, [num_blocks, K|V, kv_heads, block_size, head_dim] (kernels/kv_layout.py);
`kv_layout.flash_views` gives K and V in flash-attn's shape as views of the same memory
(the head and offset strides swapped), and flash-attn takes any strides so long as
head_dim is contiguous. Nothing is copied.

Sliding windows and soft-capping are flash-attn's `window_size=(window - 1, 0)` and
`softcap=` (flash-attn >= 2.6 and vLLM's fork); a build without them raises when a layer
asks for them.

The cache write is the Triton one where Triton imports, else the torch one (both tested
against the reference).
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import torch
import torch.nn.functional as F

from . import kv_layout
from .metadata import AttentionMetadata


def _load():
    """(varlen function, build name, page multiple); ImportError if no usable build."""
    for module in ("vllm.vllm_flash_attn", "vllm_flash_attn"):  # vLLM's build: small pages
        try:
            fn = importlib.import_module(module).flash_attn_varlen_func
        except (ImportError, AttributeError):
            continue
        if "seqused_k" in inspect.signature(fn).parameters:
            return fn, "vllm_flash_attn", 16
    from flash_attn import flash_attn_varlen_func  # pyright: ignore[reportMissingImports] GPU-only

    if "block_table" not in inspect.signature(flash_attn_varlen_func).parameters:
        raise ImportError("flash_attn older than 2.6 has no block_table (paged KV)")
    return flash_attn_varlen_func, "flash_attn", 256


_varlen, BUILD, PAGE_MULTIPLE = _load()
_PARAMS = inspect.signature(_varlen).parameters

try:
    from .triton_attn import reshape_and_cache
except ImportError:
    from .torch_attn import reshape_and_cache

__all__ = ["BUILD", "paged_attention", "reshape_and_cache", "unsupported"]


def unsupported(block_size: int, head_dim: int, dtype: torch.dtype) -> str | None:
    """Why this build cannot run a layout, or None if it can."""
    if dtype not in (torch.float16, torch.bfloat16):
        return f"{BUILD} runs fp16/bf16 only, not {dtype}"
    if head_dim % 8 or head_dim > 256:
        return f"{BUILD} needs head_dim a multiple of 8 and <= 256, not {head_dim}"
    if block_size % PAGE_MULTIPLE:
        return f"{BUILD} needs block_size a multiple of {PAGE_MULTIPLE}, not {block_size}"
    return None


def _needs(param: str, what: str) -> None:
    if param not in _PARAMS:
        raise NotImplementedError(
            f"this {BUILD} build has no {param}= argument, needed for {what}: install "
            "flash-attn >= 2.6 or vLLM's build, or choose another attention backend")


def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                    window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """Causal attention of each request's new tokens over its cached prefix and itself.

    flash-attn aligns the causal mask to the bottom right: new token j of a request with
    seq_len keys sees keys 0 .. seq_len - q_len + j, as our metadata means. Its
    window_size=(left, 0) lets position p see keys p - left .. p: left = window - 1 gives
    p - window < k <= p.
    """
    del key, value
    k, v = kv_layout.flash_views(kv_cache)
    common: dict[str, Any] = dict(
        cu_seqlens_q=meta.query_start_loc, max_seqlen_q=meta.max_query_len,
        max_seqlen_k=max(meta.max_seq_len, meta.decode_max_seq_len),
        softmax_scale=scale, causal=True, block_table=meta.block_tables)
    if window is not None:
        _needs("window_size", "a sliding window")
        common["window_size"] = (window - 1, 0)
    if softcap:
        _needs("softcap", "soft-capping")
        common["softcap"] = softcap
    if BUILD == "vllm_flash_attn":
        return _varlen(query, k, v, seqused_k=meta.seq_lens, **common)
    # Upstream counts keys per request by cumulative offsets; computed on the device, so
    # this works inside a CUDA graph too.
    cu_seqlens_k = F.pad(meta.seq_lens.cumsum(0, dtype=torch.int32), (1, 0))
    return _varlen(query, k, v, cu_seqlens_k=cu_seqlens_k, **common)
