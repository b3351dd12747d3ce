"""Batch-1 decode latency against the weight-read bound, in one run; with
`--quantization`, several weight formats back to back in one process.

    python -m baton.tools.bench.latency [--tokens 128] [--prompt 256] [--dtype bfloat16]
                                        [--quantization none,int8,gguf]

One request at a time, greedy: a random prompt, then `tokens` tokens. The figure is the
time per token after the first. The bound is what a decode step cannot beat at batch 1:
reading every weight once (and the request's KV), timed on this machine as reading a
buffer of that many bytes once (tools/bench/machine.py), since a CPU's caches may hold a
small model whole and a datasheet's bandwidth says nothing of that. Weights are counted
as stored: a quantized weight by its quantized bytes. With several formats, the rounds
alternate between them and each line gives its speed-up over the first.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from baton.kernels import cpu_ops
from baton.services.common.sampling_params import SamplingParams
from baton.services.engine.llm import LLM
from baton.services.engine.quantization import stored_bytes

from .machine import machine_line, read_seconds


def per_token(llm: LLM, prompt: list[int], tokens: int) -> float:
    """Seconds per decoded token of one greedy request, after its first token."""
    engine = llm.engine
    rid = engine.add_request(prompt, SamplingParams(max_tokens=tokens, temperature=0,
                                                    ignore_eos=True))
    first = None
    while engine.has_unfinished_requests():
        outs = engine.step()
        if first is None and any(o.request_id == rid for o in outs):
            first = time.perf_counter()
    assert first is not None
    return (time.perf_counter() - first) / (tokens - 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantization", default="none",
                    help="comma-separated: none, int8, gguf (the first is the baseline)")
    ap.add_argument("--rounds", type=int, default=3, help="requests each; the best is kept")
    args = ap.parse_args()
    methods = args.quantization.split(",")
    llms = {m: LLM(dtype=args.dtype, kv_cache_gib=1.0,
                   quantization=None if m == "none" else m) for m in methods}
    mc = next(iter(llms.values())).engine.model_config
    print(machine_line(mc, getattr(torch, args.dtype)))
    print(f"CPU kernels: {cpu_ops.isa}" + (f" (unavailable: {cpu_ops.failure()})"
                                           if cpu_ops.ops() is None else ""))
    rng = random.Random(0)
    for llm in llms.values():  # warm-up
        llm.generate([[rng.randint(100, mc.vocab_size - 1) for _ in range(16)]],
                     SamplingParams(max_tokens=4))
    best = dict.fromkeys(methods, float("inf"))
    for _ in range(args.rounds):
        prompt = [rng.randint(100, mc.vocab_size - 1) for _ in range(args.prompt)]
        for m, llm in llms.items():
            best[m] = min(best[m], per_token(llm, prompt, args.tokens))
    kv = (args.prompt + args.tokens // 2) * mc.num_layers * 2 * mc.num_kv_heads * \
        mc.head_dim * torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    for m, llm in llms.items():
        weights = stored_bytes(llm.engine.runner.model)
        bound = read_seconds(weights + kv)
        print(f"{m}: batch-1 decode {best[m] * 1e3:.2f} ms/token; weights "
              f"{weights / 2**20:.0f} MiB + KV {kv / 2**20:.1f} MiB read once: "
              f"{bound * 1e3:.2f} ms on this machine ({(weights + kv) / bound / 1e9:.1f} "
              f"GB/s); {best[m] / bound:.2f}x the bound; {best[methods[0]] / best[m]:.2f}x "
              f"{methods[0]}")


if __name__ == "__main__":
    main()
