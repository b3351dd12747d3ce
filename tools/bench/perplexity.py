"""Teacher-forced perplexity of the engine on a fixed English text, through the paged KV
cache: what weight quantization or an fp8 KV cache costs in fidelity.

    python -m baton.tools.bench.perplexity [--dtype bfloat16] [--quantization Q]
        [--kv-cache-dtype D] [--chunk 256] [--baseline] [--model M]

The text (tools/bench/data/perplexity.txt: the Declaration of Independence, the
Gettysburg Address and Lincoln's second inaugural address, all public domain) runs
through the engine's normal prefill path `--chunk` tokens at a time, so every chunk after
the first attends over K/V read back from the cache (LLMEngine.prompt_logprobs). The
figure is exp of the mean negative log-likelihood of every token after the first.
`--quantization` and `--kv-cache-dtype` reach the engine only when given. `--baseline`
runs the same text on a bf16 engine (no quantization, the default KV dtype) in the same
process and prints the ratio.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

TEXT = Path(__file__).resolve().parent / "data" / "perplexity.txt"


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The LLM(...) arguments of the run under test: the options given, and no others."""
    kw: dict = {"dtype": args.dtype, "kv_cache_gib": args.kv_cache_gib}
    if args.model:
        kw["model"] = args.model
    if args.quantization is not None:
        kw["quantization"] = args.quantization
    if args.kv_cache_dtype is not None:
        kw["kv_cache_dtype"] = args.kv_cache_dtype
    return kw


def baseline_kwargs(args: argparse.Namespace) -> dict:
    kw: dict = {"dtype": "bfloat16", "kv_cache_gib": args.kv_cache_gib}
    if args.model:
        kw["model"] = args.model
    return kw


def perplexity(logprobs) -> float:
    """exp(-mean log p) over the scored tokens (a sequence or a 1-d tensor of floats)."""
    values = [float(x) for x in logprobs]
    if not values:
        raise ValueError("no token was scored")
    return math.exp(-sum(values) / len(values))


def score(llm, token_ids: list[int], chunk: int) -> float:
    return perplexity(llm.engine.prompt_logprobs(token_ids, chunk_tokens=chunk))


def measure(kwargs: dict, text: str, chunk: int) -> tuple[float, int, float]:
    """(perplexity, tokens, seconds) of one engine built with `kwargs` on `text`."""
    import gc

    from baton.services.engine.llm import LLM

    llm = LLM(**kwargs)
    ids = llm.tokenizer.encode(text, add_special_tokens=False)
    t0 = time.perf_counter()
    ppl = score(llm, ids, chunk)
    seconds = time.perf_counter() - t0
    del llm
    gc.collect()
    return ppl, len(ids), seconds


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    ap.add_argument("--model", help="a .gguf, HF directory or hub id (default: Baton's)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantization", help="passed to the engine only when given")
    ap.add_argument("--kv-cache-dtype", help="passed to the engine only when given")
    ap.add_argument("--chunk", type=int, default=256, help="tokens per prefill step")
    ap.add_argument("--kv-cache-gib", type=float, default=0.5)
    ap.add_argument("--text", default=str(TEXT), help="a UTF-8 text file to score")
    ap.add_argument("--baseline", action="store_true",
                    help="also run a bf16 engine on the same text and print the ratio")
    args = ap.parse_args(argv)
    if args.chunk < 1:
        ap.error(f"--chunk must be >= 1, got {args.chunk}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    text = Path(args.text).read_text(encoding="utf-8")
    label = " ".join(f"{k}={v}" for k, v in engine_kwargs(args).items() if k != "kv_cache_gib")
    ppl, n, s = measure(engine_kwargs(args), text, args.chunk)
    print(f"perplexity {ppl:.4f} ({label}; {n} tokens, {args.chunk} per step, {s:.1f} s)",
          flush=True)
    if args.baseline:
        base, _, s = measure(baseline_kwargs(args), text, args.chunk)
        print(f"baseline perplexity {base:.4f} (dtype=bfloat16; {s:.1f} s)")
        print(f"ratio {ppl / base:.4f} ({100 * (ppl / base - 1):+.2f}%)")


if __name__ == "__main__":
    main()
