"""What every benchmark prints beside its figures: the CPU, its matmul flags and the
roofline measured now (docs/workloads.md: figures from different CPUs never compare),
and a workload cut short for quick checks."""

from __future__ import annotations

import os
import time

import torch

from .workloads import Workload

# The CPU flags the bf16 matmul speed (and so every ratio) hinges on.
MATMUL_FLAGS = ("amx_bf16", "amx_tile", "amx_int8", "avx512_bf16", "avx512_vnni", "avx512f",
                "avx2")


def cpu_line(wanted: tuple[str, ...] = MATMUL_FLAGS) -> str:
    """The CPU's model name, its logical CPUs and which of the `wanted` flags it has
    (default: the matmul flags)."""
    name, flags = "unknown CPU", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    name = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    has = [f for f in wanted if f in flags] or ["none of " + " ".join(wanted)]
    return f"cpu: {name} ({os.cpu_count()} logical CPUs); flags {' '.join(has)}"


def machine_line(mc, dtype: torch.dtype) -> str:
    """The CPU, its matmul flags, and the best matmul GFLOP/s measured now at the model's
    shapes: M = 64 (a decode batch) and M = 2048 (a prefill)."""
    from .profile_step import roofline

    dt = str(dtype).removeprefix("torch.")
    return (f"{cpu_line()}; {dt} matmul roofline "
            f"{roofline(mc, dtype, 64):.0f} GFLOP/s at M=64, "
            f"{roofline(mc, dtype, 2048):.0f} at M=2048")


def read_seconds(nbytes: int, repeat: int = 10) -> float:
    """The best time, on this machine now, to read a buffer of `nbytes` once: a sum over
    it as fp32, on torch's threads (read-bound, not compute-bound, at any CPU's FMA rate).
    The buffer is read once before timing: what a cache holds of it, it holds then too,
    as it would hold a model's weights from one decode step to the next."""
    buf = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
    buf.sum()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
    return best


def trim(wl: Workload, requests: int | None) -> Workload:
    """The workload's first `requests` requests (all when None)."""
    if requests is None or requests >= len(wl.prompts):
        return wl
    return Workload(f"{wl.name} (first {requests} of {len(wl.prompts)})",
                    wl.prompts[:requests], wl.output_len)
