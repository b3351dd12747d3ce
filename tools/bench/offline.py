"""Offline throughput: Baton against HF transformers' static-batch generate, in one run.

    python -m baton.tools.bench.offline [--workload w1] [--dtype bfloat16] [--json]
    python -m baton.tools.bench.offline --workload w2     # prefix caching off, then on
    python -m baton.tools.bench.offline --loras 0,1,4 --rank 16   # LoRA cost (lora.py)
    python -m baton.tools.bench.offline --quantization none,int8,gguf   # Baton only

Both run the same weights (Baton's loader feeds HF's LlamaForCausalLM too), greedy, with
every request producing exactly its output length. HF runs static batches of 16,
left-padded, as in docs/workloads.md. Throughput is output tokens per second of
generation (model loading excluded). With --json the last line is one JSON object.

The machines are noisy on the scale of tens of seconds, so the two systems run in
alternating rounds (Baton, HF, Baton, HF, ...) and each keeps its best round.
Every run prints the CPU's matmul flags and the measured matmul roofline beside its
figures, as the ratios depend on them (docs/workloads.md). --requests N runs only the
workload's first N requests (quick checks; quote figures of the full workload).
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from typing import Any, cast

import torch

from baton.services.common.sampling_params import SamplingParams
from baton.services.engine.llm import LLM
from baton.services.engine.loader import load_checkpoint, resolve_model_path
from baton.services.engine.model_config import Rope

from .machine import machine_line, trim
from .workloads import Workload, make_workload


def run_baton(llm: LLM, wl: Workload) -> float:
    params = SamplingParams(max_tokens=wl.output_len, temperature=0, ignore_eos=True)
    llm.generate([wl.prompts[0][:16]], SamplingParams(max_tokens=4))  # warm-up
    llm.reset_prefix_cache()  # the warm-up must not seed the cache
    start = time.perf_counter()
    outs = llm.generate(wl.prompts, params)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.token_ids) for o in outs)
    if produced != wl.num_output_tokens:
        raise RuntimeError(f"Baton produced {produced} tokens, expected {wl.num_output_tokens}")
    return produced / elapsed


def run_prefix_caching(args) -> None:
    """W2 through Baton with prefix caching off, then on, in the same run."""
    results = {}
    for enabled in (False, True):
        llm = LLM(model=args.model, dtype=args.dtype, kv_cache_gib=args.kv_cache_gib,
                  enable_prefix_caching=enabled)
        wl = trim(make_workload(args.workload, llm.engine.model_config.vocab_size),
                  args.requests)
        if not enabled:
            print(machine_line(llm.engine.model_config, getattr(torch, args.dtype)),
                  flush=True)
        tok_s = run_baton(llm, wl)
        stats = llm.engine.prefix_cache_stats()
        results[enabled] = (tok_s, stats["hit_rate"])
        print(f"caching {'on ' if enabled else 'off'}: {tok_s:8.1f} output tok/s, "
              f"hit rate {stats['hit_rate']:.1%}", flush=True)
        del llm
    (off, _), (on, hit_rate) = results[False], results[True]
    print(f"ratio: {on / off:8.2f}x", flush=True)
    if args.json:
        print(json.dumps({"workload": "W2", "dtype": args.dtype, "caching_off_tok_s": off,
                          "caching_on_tok_s": on, "ratio": on / off, "hit_rate": hit_rate}))


def run_quantizations(args) -> None:
    """The workload through Baton with each --quantization (none: the dtype's weights),
    in alternating rounds, each keeping its best; ratios against the first."""
    methods = args.quantization.split(",")
    llms = {m: LLM(model=args.model, dtype=args.dtype, kv_cache_gib=args.kv_cache_gib,
                   quantization=None if m == "none" else m) for m in methods}
    first = llms[methods[0]]
    wl = trim(make_workload(args.workload, first.engine.model_config.vocab_size), args.requests)
    print(f"{wl.name}: {len(wl.prompts)} requests, {wl.output_len} output tokens each, "
          f"{args.dtype}, {torch.get_num_threads()} threads", flush=True)
    print(machine_line(first.engine.model_config, getattr(torch, args.dtype)), flush=True)
    best = dict.fromkeys(methods, 0.0)
    for r in range(args.rounds):
        for m, llm in llms.items():
            tok_s = run_baton(llm, wl)
            best[m] = max(best[m], tok_s)
            print(f"round {r + 1}: {m:5} {tok_s:8.1f} output tok/s", flush=True)
    for m in methods:
        print(f"{m:5} {best[m]:8.1f} output tok/s (best of {args.rounds}), "
              f"{best[m] / best[methods[0]]:.2f}x {methods[0]}", flush=True)
    if args.json:
        print(json.dumps({"workload": wl.name, "dtype": args.dtype, "tok_s": best}))


def build_hf_model(model: str | None, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    config, weights = load_checkpoint(resolve_model_path(model))
    hf_config = LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size, num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads, num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim, rms_norm_eps=config.rms_norm_eps,
        rope_parameters=hf_rope(config.rope),
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=config.tie_word_embeddings, eos_token_id=list(config.eos_token_ids),
        pad_token_id=config.eos_token_ids[0],
    )
    hf = LlamaForCausalLM(hf_config)
    missing, _ = hf.load_state_dict(dict(weights), strict=False)
    if set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"HF model did not get weights for {missing[:5]}")
    if config.tie_word_embeddings:
        hf.tie_weights()
    # transformers types LlamaForCausalLM.to as the unbound Module.to (functools.wraps).
    cast(torch.nn.Module, hf).to(dtype).eval()  # both in place
    return hf


def hf_rope(rope: Rope) -> dict[str, Any]:
    """transformers' rope_parameters for Baton's Rope: its scaling kind and numbers too."""
    params: dict[str, Any] = {"rope_type": rope.kind, "rope_theta": rope.theta}
    for name, value in rope.params:
        params[name] = int(value) if name == "original_max_position_embeddings" else value
    return params


def run_hf(hf, wl: Workload, batch_size: int = 16) -> float:
    pad = hf.config.pad_token_id

    def batch(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(map(len, prompts))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        return ids, mask

    def generate(prompts: list[list[int]], n: int) -> int:
        ids, mask = (t.to(hf.device) for t in batch(prompts))
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, pad_token_id=pad)
        return (out.shape[1] - ids.shape[1]) * len(prompts)

    generate([wl.prompts[0][:16]], 4)  # warm-up
    start = time.perf_counter()
    produced = sum(generate(wl.prompts[i:i + batch_size], wl.output_len)
                   for i in range(0, len(wl.prompts), batch_size))
    return produced / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description="Baton vs HF transformers, offline throughput")
    ap.add_argument("--workload", default="w1")
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--kv-cache-gib", type=float, default=4.0)
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds; best is kept")
    ap.add_argument("--json", action="store_true", help="end with one JSON line")
    ap.add_argument("--requests", type=int, default=None,
                    help="run only the workload's first N requests (quick checks)")
    ap.add_argument("--loras", default=None, metavar="COUNTS",
                    help="LoRA cost instead of HF: requests round-robin over each count of "
                         "random adapters in turn, e.g. 0,1,4 (tools/bench/lora.py)")
    ap.add_argument("--rank", type=int, default=16, help="the --loras adapters' rank")
    ap.add_argument("--quantization", default=None, metavar="METHODS",
                    help="comma-separated (none, int8, gguf): Baton alone with each")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.manual_seed(0)

    if args.rounds < 1:
        ap.error(f"--rounds {args.rounds}: expected at least 1")
    if args.requests is not None and args.requests < 1:
        ap.error(f"--requests {args.requests}: expected at least 1")
    if args.rank < 1:
        ap.error(f"--rank {args.rank}: expected at least 1")
    if args.loras is not None:
        from .lora import parse_counts, run_loras

        try:
            parse_counts(args.loras)
        except ValueError as e:
            ap.error(str(e))
        run_loras(args)
        return
    if args.quantization is not None:
        run_quantizations(args)
        return
    if args.workload.lower() == "w2":
        run_prefix_caching(args)
        return
    llm = LLM(model=args.model, dtype=args.dtype, kv_cache_gib=args.kv_cache_gib)
    wl = trim(make_workload(args.workload, llm.engine.model_config.vocab_size), args.requests)
    print(f"{wl.name}: {len(wl.prompts)} requests, {wl.output_len} output tokens each, "
          f"{args.dtype}, {torch.get_num_threads()} threads", flush=True)
    print(machine_line(llm.engine.model_config, getattr(torch, args.dtype)), flush=True)
    hf = build_hf_model(args.model, getattr(torch, args.dtype))
    baton = hf_tok_s = 0.0
    for r in range(args.rounds):
        b, h = run_baton(llm, wl), run_hf(hf, wl)
        print(f"round {r + 1}: baton {b:7.1f} tok/s, hf {h:7.1f} tok/s, ratio {b / h:.2f}",
              flush=True)
        baton, hf_tok_s = max(baton, b), max(hf_tok_s, h)
    print(f"baton: {baton:8.1f} output tok/s (best of {args.rounds})")
    print(f"hf:    {hf_tok_s:8.1f} output tok/s (best of {args.rounds})")
    print(f"ratio: {baton / hf_tok_s:8.2f}x", flush=True)
    if args.json:
        print(json.dumps({"workload": wl.name, "dtype": args.dtype, "baton_tok_s": baton,
                          "hf_tok_s": hf_tok_s, "ratio": baton / hf_tok_s}))


if __name__ == "__main__":
    main()
