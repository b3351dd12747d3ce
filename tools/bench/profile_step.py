"""Where a step's time goes: one prefill step (W3's prompts, chunked) and one decode step
(W1's batch of 64), split into matmuls, attention, KV writes (with RoPE, where the CPU
kernel does both in one pass), norms (with the residual add where fused), RoPE, the LM
head, sampling, and the rest (Python, the scheduler, residual adds, the MLP's activation,
copies), with the share of the bf16 matmul roofline each phase reaches.

    python -m baton.tools.bench.profile_step [--steps 3] [--dtype bfloat16]

The parts are timed by wrapping the model's own functions (CPU runs them synchronously,
so a call's wall time is its cost); nothing in the engine changes. The roofline is the
best of a few plain bf16 matmuls at the model's largest shapes, measured here.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from contextlib import contextmanager

import torch

from baton.kernels import cpu_ops
from baton.services.common.sampling_params import SamplingParams
from baton.services.engine.llm import LLM
from baton.services.engine.models import layers

from .workloads import make_workload

PARTS = ("matmul", "attention", "kv write", "norm", "rope", "lm head", "sampling",
         "embedding")


class Timer:
    def __init__(self):
        self.spent: dict[str, float] = defaultdict(float)
        self.flops = 0.0

    def wrap(self, part: str, fn, flops=None):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            self.spent[part] += time.perf_counter() - t0
            if flops is not None:
                self.flops += flops(*args)
            return out
        return timed


@contextmanager
def patched(obj, name: str, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def linear_flops(x, weight, *rest) -> float:
    return 2.0 * x.shape[0] * weight.shape[0] * weight.shape[1]


def roofline(mc, dtype: torch.dtype, tokens: int) -> float:
    """Best GFLOP/s of plain matmuls at the model's shapes (M = tokens)."""
    best = 0.0
    x = torch.randn(tokens, mc.hidden_size, dtype=dtype)
    for rows in (2 * mc.intermediate_size, mc.hidden_size):
        w = torch.randn(rows, mc.hidden_size, dtype=dtype)
        packed = layers.prepack(w)
        for _ in range(3):
            t0 = time.perf_counter()
            layers.linear(x, w, packed)
            best = max(best, 2.0 * tokens * rows * mc.hidden_size
                       / (time.perf_counter() - t0) / 1e9)
    return best


def measure(llm: LLM, steps: int) -> tuple[Timer, float]:
    """Time `steps` engine steps with the parts wrapped: (timer, total seconds)."""
    engine = llm.engine
    runner = engine.runner
    model = runner.model
    timer = Timer()
    backend = model.backend
    with (patched(layers, "linear", timer.wrap("matmul", layers.linear, linear_flops)),
          patched(layers.RMSNorm, "forward", timer.wrap("norm", layers.RMSNorm.forward)),
          patched(layers.RMSNorm, "add", timer.wrap("norm", layers.RMSNorm.add)),
          patched(layers, "apply_rope", timer.wrap("rope", layers.apply_rope)),
          patched(layers.RotaryEmbedding, "forward",
                  timer.wrap("rope", layers.RotaryEmbedding.forward)),
          patched(backend, "paged_attention", timer.wrap("attention", backend.paged_attention)),
          patched(backend, "reshape_and_cache",
                  timer.wrap("kv write", backend.reshape_and_cache)),
          # The CPU kernel that does both: counted as the write (rope then reads 0).
          patched(cpu_ops, "rope_and_cache", timer.wrap("kv write", cpu_ops.rope_and_cache)),
          patched(model, "compute_logits", timer.wrap("lm head", model.compute_logits)),
          patched(model, "embed", timer.wrap("embedding", model.embed)),
          patched(runner.sampler, "sample", timer.wrap("sampling", runner.sampler.sample))):
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        total = time.perf_counter() - t0
    return timer, total


def phase(llm: LLM, name: str, steps: int) -> tuple[Timer, float, int]:
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    if name == "prefill":
        wl = make_workload("w3", vocab)
        for p in wl.prompts:
            engine.add_request(p, SamplingParams(max_tokens=16, temperature=0,
                                                 ignore_eos=True))
        engine.step()  # warm-up
    else:
        wl = make_workload("w1", vocab)
        for p in wl.prompts:
            engine.add_request(p, SamplingParams(max_tokens=128, temperature=0,
                                                 ignore_eos=True))
        while engine.scheduler.waiting or any(
                r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running):
            engine.step()  # every prompt in: what follows is decode alone
        engine.step()
    tokens_before = sum(r.num_computed_tokens for r in engine.scheduler.running)
    timer, total = measure(llm, steps)
    tokens = sum(r.num_computed_tokens for r in engine.scheduler.running) - tokens_before
    for rid in list(engine.scheduler.requests):
        engine.abort_request(rid)
    return timer, total, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    llm = LLM(dtype=args.dtype, kv_cache_gib=4.0)
    dtype = getattr(torch, args.dtype)
    mc = llm.engine.model_config
    rows = {}
    for name in ("prefill", "decode"):
        timer, total, tokens = phase(llm, name, args.steps)
        m = llm.engine.config.max_num_batched_tokens if name == "prefill" else 64
        peak = roofline(mc, dtype, m)
        rows[name] = (timer, total, tokens, peak)
    print("| part | prefill step (ms) | share | decode step, batch 64 (ms) | share |")
    print("|---|---|---|---|---|")
    for part in (*PARTS, "rest (Python, scheduler, adds, activation, copies)"):
        cells = []
        for name in ("prefill", "decode"):
            timer, total, _, _ = rows[name]
            spent = (total - sum(timer.spent.values()) if part.startswith("rest")
                     else timer.spent[part])
            cells += [f"{spent / args.steps * 1e3:.1f}", f"{spent / total:.0%}"]
        print(f"| {part} | " + " | ".join(cells) + " |")
    cells = []
    for name in ("prefill", "decode"):
        timer, total, tokens, peak = rows[name]
        cells += [f"{total / args.steps * 1e3:.1f}", ""]
    print("| step | " + " | ".join(cells) + " |")
    print()
    for name in ("prefill", "decode"):
        timer, total, tokens, peak = rows[name]
        got = timer.flops / max(timer.spent["matmul"], 1e-9) / 1e9
        print(f"{name}: {tokens / args.steps:.0f} tokens a step, {tokens / total:.0f} tok/s; "
              f"matmuls {got:.0f} GFLOP/s = {got / peak:.0%} of the {peak:.0f} GFLOP/s "
              f"roofline; the whole step {timer.flops / total / 1e9:.0f} GFLOP/s of "
              f"matmul work = {timer.flops / total / 1e9 / peak:.0%}")


if __name__ == "__main__":
    main()
