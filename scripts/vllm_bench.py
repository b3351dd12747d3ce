"""One benchmark workload through vLLM's CPU backend; `tools/bench/vs_vllm.py` runs it
beside Baton, alternating. Runs in vLLM's own venv (see `make vllm`), on an HF directory
of the same weights (scripts/export_hf_dir.py):

    VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0,1 VLLM_CPU_NUM_OF_RESERVED_CPU=0 \
        PYTHONPATH=.:protos VENV/bin/python scripts/vllm_bench.py HF_DIR w3
    ... HF_DIR w2 --no-prefix-caching

(the binding: every core, none kept for vLLM's scheduler, as vs_vllm.py sets it.)
Prints one JSON line: {"system": "vllm", "workload", "prefix_caching", "tok_s"}.
baton.tools.bench.workloads needs only the standard library, so this venv imports it too.
The body sits under __main__: vLLM spawns processes.
"""

from __future__ import annotations

import argparse
import json
import time

from baton.tools.bench.workloads import make_workload


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("workload")
    ap.add_argument("--no-prefix-caching", action="store_true")
    args = ap.parse_args()
    caching = not args.no_prefix_caching
    llm = LLM(model=args.model, dtype="bfloat16", enable_prefix_caching=caching)
    wl = make_workload(args.workload, llm.get_tokenizer().vocab_size)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in wl.prompts]
    params = SamplingParams(temperature=0, max_tokens=wl.output_len, ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=wl.prompts[0][:16])],
                 SamplingParams(max_tokens=4))  # warm-up
    llm.reset_prefix_cache()  # the warm-up must not seed the cache
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    assert produced == wl.num_output_tokens, (produced, wl.num_output_tokens)
    print(json.dumps({"system": "vllm", "workload": wl.name, "prefix_caching": caching,
                      "tok_s": produced / elapsed}), flush=True)


if __name__ == "__main__":
    main()
