"""One chat prompt through the offline engine, with the text streamed to the terminal as it
is sampled: the engine alone, without any service.

    python -m baton.tools.demo [--prompt "..."] [--max-tokens N] [--dtype float32]
"""

from __future__ import annotations

import argparse
import sys
import time

from baton.services.common.sampling_params import SamplingParams
from baton.services.engine.config import EngineConfig
from baton.services.engine.engine import LLMEngine


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    ap.add_argument("--model", default=None, help="a .gguf file or HF model directory")
    ap.add_argument("--prompt", default="Explain in three sentences why the sky is blue.")
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()

    print("loading the model ...", file=sys.stderr)
    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, kv_cache_gib=1.0))
    prompt = engine.apply_chat_template([{"role": "user", "content": args.prompt}])
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    engine.add_request(prompt, params)
    print(f"> {args.prompt}\n", flush=True)
    start, first, n = time.monotonic(), None, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if first is None and out.new_token_ids:
                first = time.monotonic() - start
            n += len(out.new_token_ids)
            print(out.new_text, end="", flush=True)
            if out.finished:
                print(f"\n\n[{out.finish_reason}] {n} tokens, first token after "
                      f"{first:.2f}s, {n / (time.monotonic() - start):.1f} tok/s",
                      file=sys.stderr)


if __name__ == "__main__":
    main()
