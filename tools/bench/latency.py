"""Batch-1 decode latency against the weight-read bound, in one run.

    python -m baton.tools.bench.latency [--tokens 128] [--prompt 256] [--dtype bfloat16]

One request at a time, greedy: a random prompt, then `tokens` tokens. The figure is the
time per token after the first. The bound is what a decode step cannot beat at batch 1:
reading every weight once (and the request's KV), timed on this machine as reading a
buffer of that many bytes once (tools/bench/machine.py), since a CPU's caches may hold a
small model whole and a datasheet's bandwidth says nothing of that.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from baton.kernels import cpu_ops
from baton.services.common.sampling_params import SamplingParams
from baton.services.engine.llm import LLM

from .machine import machine_line, read_seconds


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters a decode step reads, each tensor once (tied ones too)."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rounds", type=int, default=3, help="requests; the best is kept")
    args = ap.parse_args()
    llm = LLM(dtype=args.dtype, kv_cache_gib=1.0)
    engine = llm.engine
    mc = engine.model_config
    print(machine_line(mc, getattr(torch, args.dtype)))
    print(f"CPU kernels: {cpu_ops.isa}" + (f" (unavailable: {cpu_ops.failure()})"
                                           if cpu_ops.ops() is None else ""))
    rng = random.Random(0)
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    llm.generate([[rng.randint(100, mc.vocab_size - 1) for _ in range(16)]],
                 SamplingParams(max_tokens=4))  # warm-up
    best = float("inf")
    for _ in range(args.rounds):
        prompt = [rng.randint(100, mc.vocab_size - 1) for _ in range(args.prompt)]
        rid = engine.add_request(prompt, params)
        first = None
        while engine.has_unfinished_requests():
            outs = engine.step()
            if first is None and any(o.request_id == rid for o in outs):
                first = time.perf_counter()
        end = time.perf_counter()
        if first is not None:
            best = min(best, (end - first) / (args.tokens - 1))
    weights = weight_bytes(engine.runner.model)
    kv = (args.prompt + args.tokens // 2) * mc.num_layers * 2 * mc.num_kv_heads * \
        mc.head_dim * torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    bound = read_seconds(weights + kv)
    print(f"batch-1 decode: {best * 1e3:.2f} ms/token; weights {weights / 2**20:.0f} MiB + "
          f"KV {kv / 2**20:.1f} MiB read once: {bound * 1e3:.2f} ms on this machine "
          f"({(weights + kv) / bound / 1e9:.1f} GB/s); {best / bound:.2f}x the bound")


if __name__ == "__main__":
    main()
