"""Engine flags, shared by every worker role; torch-free so the CLI can parse them."""

from __future__ import annotations

import argparse
import os


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """Engine flags; each defaults to a BATON_<NAME> environment variable if set."""
    env = os.environ.get
    parser.add_argument("--model", default=env("BATON_MODEL"),
                        help="a .gguf file or an HF model directory (default: SmolLM2-135M)")
    parser.add_argument("--dtype", default=env("BATON_DTYPE", "bfloat16"))
    parser.add_argument("--device", default=env("BATON_DEVICE", "auto"))
    parser.add_argument("--block-size", type=int, default=int(env("BATON_BLOCK_SIZE", "16")))
    parser.add_argument("--kv-cache-gib", type=float,
                        default=float(env("BATON_KV_CACHE_GIB", "2")))
    parser.add_argument("--max-num-seqs", type=int, default=int(env("BATON_MAX_NUM_SEQS", "256")))
    parser.add_argument("--max-num-batched-tokens", type=int,
                        default=int(env("BATON_MAX_NUM_BATCHED_TOKENS", "2048")))
    parser.add_argument("--max-model-len", type=int, default=env("BATON_MAX_MODEL_LEN"))
    parser.add_argument("--max-queue", type=int, default=env("BATON_MAX_QUEUE"),
                        help="requests that may wait; past it, RESOURCE_EXHAUSTED at once "
                        "(default: 4 x max-num-seqs)")
    parser.add_argument("--gpu-memory-utilization", type=float,
                        default=float(env("BATON_GPU_MEMORY_UTILIZATION", "0.9")),
                        help="CUDA: share of device memory for weights, activations and KV")
    parser.add_argument("--enforce-eager", action="store_true",
                        default=env("BATON_ENFORCE_EAGER", "") not in ("", "0", "false"),
                        help="CUDA: no CUDA graphs for decode steps")
    parser.add_argument("--attention-backend", default=env("BATON_ATTENTION_BACKEND"),
                        choices=["flash-attn", "triton", "torch"],
                        help="default: the best that runs (CUDA: flash-attn, Triton, torch)")
    parser.add_argument("--load-format", default=env("BATON_LOAD_FORMAT", "auto"),
                        choices=["auto", "dummy"],
                        help="dummy: random weights of the model's shapes, for benchmarks")
    parser.add_argument("--threads", type=int, default=env("BATON_THREADS"),
                        help="torch intra-op threads (default: torch's choice)")
