"""What serving LoRA adapters costs: one workload through one engine with LoRA on, its
requests spread round-robin over 0 (all on the base model), 1, 4, ... adapters.

    python -m baton.tools.bench.offline --workload w1 --loras 0,1,4 --rank 16

The adapters are random rank-r PEFT directories written into a temporary folder, adapting
every projection (q, k, v, o, gate, up, down) of every layer. All runs share the one
engine (max_loras = the largest count, so every adapter of a run fits in one step); the
0-adapter run is the baseline of the ratios. Runs alternate within each round (0, 1, 4,
0, 1, 4, ...) and each keeps its best round, as the machines are noisy; each run also
prints the share of its threads' CPU time it got (under ~90%: another process competed,
and the figure is not worth quoting).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
from collections.abc import Sequence

import torch

from baton.services.common.sampling_params import SamplingParams
from baton.services.engine.llm import LLM
from baton.services.engine.model_config import ModelConfig
from baton.services.lora.adapter import TARGETS, LoRARequest, projection_shapes

from .machine import machine_line, trim
from .workloads import Workload, make_workload


def parse_counts(text: str) -> list[int]:
    """--loras "0,1,4" -> [0, 1, 4]; ValueError naming the flag on anything else."""
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"--loras {text!r}: expected adapter counts like 0,1,4") from None
    if not counts or min(counts) < 0 or len(set(counts)) != len(counts):
        raise ValueError(f"--loras {text!r}: expected distinct counts >= 0, like 0,1,4")
    return counts


def write_adapter(folder: str, mc: ModelConfig, rank: int, seed: int) -> str:
    """A random PEFT LoRA directory for this model: A ~ N(0, 1/in), B small, so the
    deltas stay a few percent of the base projections; returns its path."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    shapes = projection_shapes(mc)
    tensors = {}
    for layer in range(mc.num_layers):
        for module, (proj, part) in TARGETS.items():
            in_size, outs = shapes[proj]
            block = "self_attn" if proj in ("qkv", "o") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{key}.lora_A.weight"] = \
                torch.randn(rank, in_size, generator=gen) / math.sqrt(in_size)
            tensors[f"{key}.lora_B.weight"] = \
                torch.randn(outs[part], rank, generator=gen) * 0.01
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
              "target_modules": sorted(TARGETS), "task_type": "CAUSAL_LM"}
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return folder


def run_mixed(llm: LLM, wl: Workload, names: Sequence[str | None]) -> tuple[float, float]:
    """(output tokens/s, share of its threads' CPU time this process got) of the workload
    with request i on adapter names[i % len(names)] (None: the base model), driven through
    the engine's add_request/step. A share well under 1 means another process competed."""
    engine = llm.engine
    params = SamplingParams(max_tokens=wl.output_len, temperature=0, ignore_eos=True)
    warm = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)

    def drain(requests: list[tuple[list[int], SamplingParams, str | None]]) -> int:
        ids = [engine.add_request(prompt, p, lora=LoRARequest(n) if n else None)
               for prompt, p, n in requests]
        produced = {}
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        produced[out.request_id] = len(out.token_ids)
        finally:  # an error or Ctrl-C mid-run must not leave requests holding blocks
            for rid in ids:
                if rid not in produced:
                    engine.abort_request(rid)
        return sum(produced.values())

    # Warm-up: one short request per adapter, so each is read into a slot before timing.
    drain([(wl.prompts[0][:16], warm, n) for n in dict.fromkeys(names)])
    llm.reset_prefix_cache()  # the warm-up must not seed the cache
    start, cpu = time.perf_counter(), time.process_time()
    produced = drain([(p, params, names[i % len(names)]) for i, p in enumerate(wl.prompts)])
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    if produced != wl.num_output_tokens:
        raise RuntimeError(f"Baton produced {produced} tokens, expected {wl.num_output_tokens}")
    return produced / elapsed, cpu / (elapsed * torch.get_num_threads())


def run_loras(args) -> None:
    """The --loras run of tools/bench/offline.py (its parsed arguments)."""
    counts = parse_counts(args.loras)
    llm = LLM(model=args.model, dtype=args.dtype, kv_cache_gib=args.kv_cache_gib,
              enable_lora=True, max_loras=max(1, *counts), max_lora_rank=args.rank)
    mc = llm.engine.model_config
    wl = trim(make_workload(args.workload, mc.vocab_size), args.requests)
    print(f"{wl.name}: {len(wl.prompts)} requests, {wl.output_len} output tokens each, "
          f"{args.dtype}, {torch.get_num_threads()} threads; LoRA rank {args.rank} on all "
          f"{len(TARGETS)} projections, requests round-robin over {args.loras} adapters",
          flush=True)
    print(machine_line(mc, getattr(torch, args.dtype)), flush=True)
    best = dict.fromkeys(counts, 0.0)
    with tempfile.TemporaryDirectory(prefix="baton-lora-bench-") as tmp:
        for i in range(max(counts)):
            name = f"bench-{i}"
            llm.engine.load_lora(name, write_adapter(os.path.join(tmp, name), mc,
                                                     args.rank, seed=i))
        for r in range(args.rounds):
            for n in counts:
                names = [f"bench-{i}" for i in range(n)] or [None]
                tok_s, share = run_mixed(llm, wl, names)
                best[n] = max(best[n], tok_s)
                print(f"round {r + 1}, {n:2d} adapters: {tok_s:8.1f} tok/s (cpu {share:.0%})",
                      flush=True)
    ref = 0 if 0 in best else counts[0]  # the baseline: all requests on the base model
    base = best[ref]
    for n, tok_s in best.items():
        print(f"{n:2d} adapters: {tok_s:8.1f} output tok/s (best of {args.rounds}), "
              f"{tok_s / base:.2f}x of {ref} adapters", flush=True)
    if args.json:
        print(json.dumps({"workload": wl.name, "dtype": args.dtype, "rank": args.rank,
                          "requests": len(wl.prompts),
                          "tok_s": {str(n): t for n, t in best.items()},
                          "ratio": {str(n): t / base for n, t in best.items()}}))
