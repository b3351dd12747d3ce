"""llama.cpp's side of the batch-1 comparison in tools/bench/vs_llamacpp.py, which runs it
in llama.cpp's own venv (`make llamacpp`); it imports llama_cpp and the standard library,
nothing of Baton's:

    LLAMA_VENV/bin/python -P scripts/llamacpp_bench.py MODEL.gguf --threads 2 \
        --tokens 128 --prompt-ids 1,2,3

Loads the model, prints one JSON line {"ready": true, ...}, then for every line read on
stdin runs the prompt once, greedy, and prints {"tok_s", "tokens"}: the decode's tokens
per second, timed from the first generated token to the last (as tools/bench/latency.py
times Baton), EOS not stopping it. Ends at the end of stdin.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main() -> None:
    import llama_cpp

    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompt-ids", required=True, help="comma-separated token ids")
    args = ap.parse_args()
    prompt = [int(t) for t in args.prompt_ids.split(",")]
    llm = llama_cpp.Llama(model_path=args.model, n_threads=args.threads,
                          n_threads_batch=args.threads, n_ctx=len(prompt) + args.tokens + 16,
                          seed=0, verbose=False)
    print(json.dumps({"ready": True, "version": llama_cpp.__version__,
                      "system_info": llama_cpp.llama_print_system_info().decode().strip()}),
          flush=True)
    for _ in sys.stdin:
        llm.reset()  # no prompt reuse from the last run: every run does the same work
        stamps, tokens = [], []
        for tok in llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, min_p=0.0,
                                repeat_penalty=1.0, reset=True):
            stamps.append(time.perf_counter())
            tokens.append(int(tok))
            if len(tokens) == args.tokens:
                break
        tok_s = (len(tokens) - 1) / (stamps[-1] - stamps[0])
        print(json.dumps({"tok_s": tok_s, "tokens": tokens}), flush=True)


if __name__ == "__main__":
    main()
