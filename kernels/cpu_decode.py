"""A C++ decode-attention kernel for CPU: each decode row reads its K and V straight from
the paged cache, through its block table, once each.

The torch path (kernels/torch_attn.py) gathers a row's blocks into a contiguous copy and
then runs batched matmuls of 3-row queries over it: the cache is read, written and read
again, and matmuls that small run far below the machine's rate. Decoding is bound by
memory, so this is where the time goes. Here, per (row, KV head), on one thread:

    pass 1, over the row's keys p (the window's, with one):  s[g, p] = scale * q_g . k_p
            (soft-capped where asked), in fp32, for the `group` query heads of that KV head
    softmax over p, in fp32
    pass 2, over the same positions:                          o_g = sum_p w[g, p] v_p

K and V are each read once, and converted to fp32 as they are read. The source is
kernels/cpu_decode.cpp, an op registered as torch.ops.baton_cpu.decode. It is compiled at
first use with torch's C++ extension builder (cached under TORCH_EXTENSIONS_DIR, and
built by `make install`). Where it cannot build (no C++ compiler), `load()` returns None,
says why once, and the torch path serves. Tested against kernels/reference.py.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("cpu_decode.cpp")

_module = None
_failed: str | None = None


def load():
    """The compiled module, or None (with the reason logged once) where it cannot build.
    BATON_CPU_KERNELS=0 turns it off."""
    global _module, _failed
    if _module is not None or _failed is not None:
        return _module
    if os.environ.get("BATON_CPU_KERNELS", "1") == "0":
        _failed = "BATON_CPU_KERNELS=0"
        return None
    try:
        from torch.utils.cpp_extension import load as build

        # Not a Python module: the library registers its op with torch's dispatcher.
        build(name="baton_cpu_decode", sources=[str(_SOURCE)], is_python_module=False,
              extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"],
              extra_ldflags=["-fopenmp"], verbose=False)
        _module = torch.ops.baton_cpu
    except Exception as e:  # no compiler, no headers: the torch path serves
        _failed = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        log.warning("CPU decode kernel unavailable, using the torch path (%s)", _failed)
    return _module


def decode(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
           block_tables: torch.Tensor, seq_lens: torch.Tensor, out: torch.Tensor,
           scale: float, window: int | None, softcap: float | None) -> None:
    """out[:n] for the first n = seq_lens.numel() rows of `query`, one token each.
    key_cache and value_cache are one layer's per-head views (kernels/kv_layout.py's
    `head_views`); the kernel follows their strides."""
    module = load()
    if module is None:  # callers check load() first
        raise RuntimeError(f"the CPU decode kernel is unavailable ({_failed})")
    n = seq_lens.shape[0]
    module.decode(query[:n], key_cache, value_cache, block_tables[:n], seq_lens,
                  out[:n], scale, window or 0, softcap or 0.0)


if __name__ == "__main__":  # `make install` builds it once, ahead of the first engine
    print("CPU decode kernel:", "built" if load() is not None else f"unavailable ({_failed})")
