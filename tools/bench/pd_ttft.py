"""P/D against colocated TTFT at 1K, 4K and 8K-token prompts, on a tiny model with a
16K context (the default model's 2,048 is too short; random weights: the timing of the
shapes, not of the outputs).

    python -m baton.tools.bench.pd_ttft [--lengths 1024 4096 8192] [--requests 10]

Both systems are up at once (an idle worker takes no CPU): a router with one prefill and
one decode worker, and one colocated worker. Requests go one at a time, alternating
P/D and colocated, each a fresh random prompt (no prefix hits), 2 output tokens. Prints
per length the TTFT medians and their ratio, and the medians of the prefill worker's
prefill and of the decode worker's wait for the KV after it (its pull).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import tempfile

from baton.services.rpc.processes import spawn, stop_all, wait_healthy

from .serve import ENV, run_load, warm_up

ROUTER, PREFILL, DECODE, COLOCATED = ("127.0.0.1:50551", "127.0.0.1:50561",
                                      "127.0.0.1:50571", "127.0.0.1:50581")


TINY_LONG = {"hidden_size": 256, "intermediate_size": 768}  # the long-context model's


def tiny_long_model(folder: str, layers: int = 12) -> list[str]:
    """Worker flags for a `layers`-layer, 256-wide Llama with a 16K context."""
    from transformers import LlamaConfig

    from baton.services.common.default_model import default_model_path

    shape: dict = dict(**TINY_LONG, num_hidden_layers=layers, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=49152,
                       max_position_embeddings=16384, rope_theta=100000.0,
                       tie_word_embeddings=True, torch_dtype="bfloat16")
    LlamaConfig(**shape).save_pretrained(folder)
    return ["--model", folder, "--tokenizer", str(default_model_path()),
            "--load-format", "dummy", "--max-model-len", "16384"]


def start(model_flags: list[str], threads: int) -> list:
    flags = [*model_flags, "--log-level", "WARNING", "--threads", str(threads),
             "--kv-cache-gib", "1", "--max-num-batched-tokens", "2048"]
    procs = []
    try:
        procs += [spawn("prefill", PREFILL, flags, env=ENV),
                  spawn("decode", DECODE, flags, env=ENV),
                  spawn("colocated", COLOCATED, [*flags, "--http-port", "0"], env=ENV)]
        for address, p in zip((PREFILL, DECODE, COLOCATED), procs, strict=True):
            wait_healthy(address, p, 300)
        procs.append(spawn("router", ROUTER, ["--log-level", "WARNING", "--http-port", "0",
                                              "--prefill", PREFILL, "--decode", DECODE,
                                              "--tokenizer", model_flags[3]], env=ENV))
        wait_healthy(ROUTER, procs[-1], 60)
        return procs
    except BaseException:
        stop_all(procs)
        raise


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 8192])
    ap.add_argument("--requests", type=int, default=10)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    args = ap.parse_args()
    from .machine import cpu_line

    print(cpu_line(), flush=True)
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as folder:
        procs = start(tiny_long_model(folder), args.threads)
        try:
            for address in (ROUTER, COLOCATED):
                asyncio.run(warm_up(address))
            for n in args.lengths:
                got: dict[str, list] = {"pd": [], "colocated": []}
                for _ in range(args.requests):
                    for mode, address in (("pd", ROUTER), ("colocated", COLOCATED)):
                        prompt = [rng.randint(100, 49000) for _ in range(n)]
                        got[mode].append(asyncio.run(run_load(address, [prompt], 2, 1)))
                pd, co = got["pd"], got["colocated"]
                med = statistics.median
                ttft_pd, ttft_co = (med(r.ttft[0] for r in rs) * 1000 for rs in (pd, co))
                wait = med(r.transfer[0] if r.transfer else 0.0 for r in pd) * 1000
                prefill = med(r.prefill[0] for r in pd) * 1000
                local = sum(r.local_prefills for r in pd)
                print(f"{n:5d} tokens: TTFT p50 P/D {ttft_pd:7.1f} ms, colocated "
                      f"{ttft_co:7.1f} ms, P/D/colocated {ttft_pd / ttft_co:.3f}x; prefill "
                      f"{prefill:7.1f} ms, decode worker's KV wait after it {wait:6.1f} ms"
                      f" ({100 * wait / ttft_pd:.1f}% of TTFT); {local} of "
                      f"{len(pd)} prefilled on the decode worker", flush=True)
        finally:
            stop_all(procs)


if __name__ == "__main__":
    main()
