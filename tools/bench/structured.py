"""Structured output's cost: a W1-sized batch (64 requests, W1's prompts, 128 tokens)
constrained by a JSON schema against the same batch unconstrained, in one run.

    python -m baton.tools.bench.structured [--dtype bfloat16] [--rounds 2]

Greedy; the unconstrained side ignores EOS, and the schema cannot end within 128 tokens,
so both sides produce the same number of tokens. The rounds alternate; each side keeps
its best. Every constrained output must be a prefix of a document the schema accepts.
"""

from __future__ import annotations

import argparse
import json
import logging
import time

import torch

from baton.services.common.sampling_params import SamplingParams, StructuredOutput
from baton.services.engine.llm import LLM

from .workloads import make_workload

# At least 64 strings: no row can complete it within its 128 tokens, so both sides
# produce exactly 128 tokens a row and the ratio is the mask's cost alone.
SCHEMA = {"type": "object", "properties": {
    "items": {"type": "array", "items": {"type": "string"}, "minItems": 64}},
    "required": ["items"]}


def run(llm: LLM, prompts, params: SamplingParams) -> tuple[float, list]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    return sum(len(o.token_ids) for o in outs) / elapsed, outs


def main() -> None:
    ap = argparse.ArgumentParser(description="structured output on vs off, batch 64")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    llm = LLM(dtype=args.dtype, kv_cache_gib=2.0)
    wl = make_workload("w1", llm.engine.model_config.vocab_size)
    free = SamplingParams(temperature=0, max_tokens=wl.output_len, ignore_eos=True)
    so = StructuredOutput("json", json.dumps(SCHEMA))
    constrained = SamplingParams(temperature=0, max_tokens=wl.output_len, structured=so)
    llm.generate([wl.prompts[0][:16]], constrained)  # warm-up (and the compile)
    print(f"W1-sized batch of {len(wl.prompts)}, {args.dtype}, "
          f"{torch.get_num_threads()} threads", flush=True)
    best_free = best_con = 0.0
    mask = llm.engine.runner.mask
    for r in range(args.rounds):
        f, _ = run(llm, wl.prompts, free)
        fill, apply = mask.fill_s, mask.apply_s
        start = time.perf_counter()
        c, outs = run(llm, wl.prompts, constrained)
        elapsed = time.perf_counter() - start
        # Applying the mask is on the step's critical path; filling it runs in a thread
        # beside the forward pass (its share is what it would cost were it not hidden).
        print(f"round {r + 1}: unconstrained {f:7.1f} tok/s, constrained {c:7.1f} tok/s, "
              f"ratio {c / f:.3f}; of the constrained run's time, applying the mask "
              f"{(mask.apply_s - apply) / elapsed:.1%}, filling it (overlapped) "
              f"{(mask.fill_s - fill) / elapsed:.1%}", flush=True)
        best_free, best_con = max(best_free, f), max(best_con, c)
    assert all(len(o.token_ids) == wl.output_len for o in outs)
    assert all(o.text.startswith('{"items": ["') for o in outs), "not the schema's prefix"
    print(f"unconstrained: {best_free:8.1f} tok/s (best of {args.rounds})")
    print(f"constrained:   {best_con:8.1f} tok/s (best of {args.rounds})")
    print(f"ratio:         {best_con / best_free:8.3f} (the mask costs "
          f"{1 - best_con / best_free:.1%})", flush=True)


if __name__ == "__main__":
    main()
