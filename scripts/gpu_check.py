"""The GPU check: kernels against the reference, CUDA graphs against eager and HF, decode
step times, W1 throughput. A few minutes on one GPU; prints a report for
docs/benchmarks.md. Run it through scripts/gpu_check.sh.

    python scripts/gpu_check.py            # on a CUDA machine
    python scripts/gpu_check.py --smoke    # tiny sizes on CPU: checks the script runs
    python scripts/gpu_check.py --smoke --tiny   # the same, on a model of a few MB

Models need no download. The default model is used when its GGUF is in the cache (and
gguf imports); otherwise a random-weight model of its shapes stands in, and the report
says so. The 1B-class model is Llama-3.2-1B's shapes with random weights (load format
"dummy"). Each section catches its own failure, prints it, and the next one runs.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import random
import tempfile
import time
import traceback
from pathlib import Path

import torch

import baton.kernels.backend as kernels
from baton.kernels import reference
from baton.services.common.default_model import default_model_path
from baton.services.engine import LLM, SamplingParams
from baton.tools.bench.offline import run_baton, run_hf
from baton.tools.bench.workloads import make_workload
from tests.kernel_batch import make_batch

SMOLLM2_SHAPES = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                      vocab_size=49152, rope_theta=100000.0, tie_word_embeddings=True,
                      max_position_embeddings=8192, rms_norm_eps=1e-5)
LLAMA_1B_SHAPES = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                       vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=True,
                       max_position_embeddings=8192, rms_norm_eps=1e-5)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---- models --------------------------------------------------------------------------


def write_tokenizer(path: Path, vocab_size: int) -> None:
    """A word-level tokenizer of `vocab_size` tokens <t0>, <t1>, ...: prompts here are
    token ids, so any tokenizer of the right size serves."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<t{i}>": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<t0>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<t0>", bos_token="<t1>",
                            eos_token="<t2>").save_pretrained(str(path))


def llama_dir(path: Path, shapes: dict, with_weights: bool, init_std: float = 0.02):
    """An HF Llama directory: config.json and a tokenizer, plus random weights when asked
    (returns the HF model on the GPU then, else None)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(architectures=["LlamaForCausalLM"], bos_token_id=1, eos_token_id=2,
                      pad_token_id=0,
                      initializer_range=init_std, **shapes)
    path.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(path)
    write_tokenizer(path, cfg.vocab_size)
    if not with_weights:
        return None
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        hf = LlamaForCausalLM(cfg).float().eval()
    hf.save_pretrained(path)
    return hf


def default_model(tmp: Path, shapes: dict, smoke: bool):
    """(model path, label, HF fp32 model). The real default model when its GGUF is cached
    (and not a smoke run), else random weights of the given shapes."""
    from baton.tools.bench.offline import build_hf_model

    gguf = default_model_path()
    try:
        import gguf as _  # noqa: F401

        have_gguf = gguf.exists() and not smoke
    except ImportError:
        have_gguf = False
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if have_gguf:
        hf = build_hf_model(str(gguf), torch.float32).to(device)
        return str(gguf), "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized)", hf
    # Wider init than training's 0.02, so greedy choices are not near-ties.
    hf = llama_dir(tmp / "smollm2-random", shapes, with_weights=True, init_std=0.1)
    shapes_of = "SmolLM2-135M" if shapes["hidden_size"] == 576 else "tiny"
    return str(tmp / "smollm2-random"), f"random weights, {shapes_of} shapes", hf


# ---- sections ------------------------------------------------------------------------


def kernel_errors(device: str, smoke: bool) -> None:
    """Max |error| of each backend's attention and cache write against the reference."""
    backends = {"torch": kernels.torch_attn}
    try:
        from baton.kernels import triton_attn

        backends["triton"] = triton_attn
    except ImportError as e:
        print(f"triton: does not import ({e})")
    try:
        from baton.kernels import flash

        backends["flash-attn"] = flash
    except ImportError as e:
        print(f"flash-attn: does not import ({e}); not checked")
    kv_heads, group = (2, 4) if smoke else (8, 4)
    decodes, prefills = (3, 2) if smoke else (32, 4)
    long = dict(max_prefix=70, max_chunk=40) if smoke else dict(max_prefix=1024,
                                                                 max_chunk=256)
    # The smoke batch takes under 30 blocks; each cache is filled, cloned and compared.
    num_blocks = 256 if smoke else 2048
    print(f"GQA {kv_heads * group}/{kv_heads} heads, {decodes} decodes and {prefills} "
          f"prefill chunks over cached prefixes, up to {long['max_prefix']} tokens")
    print("dtype     head_dim  block  " + "  ".join(f"{n:>12}" for n in backends)
          + "  cache write")
    for dtype in (torch.bfloat16, torch.float16):
        for head_dim in (64, 128):
            for block_size in (16, 32):
                rng = random.Random(head_dim + block_size)
                torch.manual_seed(head_dim + block_size)
                q, k, v, cache, meta = make_batch(rng, block_size, kv_heads, group,
                                                  head_dim, dtype, decodes, prefills,
                                                  num_blocks=num_blocks, **long)
                q, k, v, cache = (t.to(device) for t in (q, k, v, cache))
                meta = meta.to(device)
                want_cache = cache.clone()
                kernels.torch_attn.reshape_and_cache(k, v, want_cache, meta.slot_mapping)
                want = reference.paged_attention(q.float(), None, None, want_cache.float(),
                                                 meta, head_dim**-0.5)
                cells, write_ok = [], True
                for name, backend in backends.items():
                    if name == "flash-attn" and backend.unsupported(block_size, head_dim,
                                                                     dtype):
                        cells.append(f"{'n/a':>12}")
                        continue
                    got_cache = cache.clone()
                    backend.reshape_and_cache(k, v, got_cache, meta.slot_mapping)
                    write_ok &= torch.equal(got_cache, want_cache)
                    got = backend.paged_attention(q, k, v, got_cache, meta, head_dim**-0.5)
                    cells.append(f"{(got.float() - want).abs().max().item():12.2e}")
                print(f"{str(dtype)[6:]:9} {head_dim:8}  {block_size:5}  "
                      + "  ".join(cells) + f"  {'exact' if write_ok else 'DIFFERS'}")
    if device == "cuda":
        decode_kernel_times(backends)


def decode_kernel_times(backends: dict) -> None:
    """Time of one attention call for a decode batch: 64 requests x 1024 tokens of context,
    bf16, 32/8 heads of 128, blocks of 16."""
    from triton.testing import do_bench

    rng = random.Random(0)
    q, k, v, cache, meta = make_batch(rng, 16, 8, 4, 128, torch.bfloat16, 64, 0,
                                      max_prefix=1024, num_blocks=8192)
    q, cache, meta = q.cuda(), cache.cuda(), meta.to("cuda")
    line = []
    for name, backend in backends.items():
        if name == "flash-attn" and backend.unsupported(16, 128, torch.bfloat16):
            continue
        ms = do_bench(lambda b=backend: b.paged_attention(q, None, None, cache, meta, 0.088))
        line.append(f"{name} {ms * 1000:.1f} us")
    print("decode attention, 64 x ~512 tokens avg, bf16, d=128: " + ", ".join(line))


def first_mismatch(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)))


def greedy_equality(model: str, label: str, hf, smoke: bool) -> None:
    """Greedy tokens: CUDA graphs == eager (same engine, graphs switched off), and both
    == HF transformers on the same weights, in fp32; graphs == eager in bf16."""
    n_new = 8 if smoke else 32
    lengths = [7, 33, 64] if smoke else [7, 33, 64, 100, 129, 200, 257, 300]
    rng = random.Random(0)
    vocab = hf.config.vocab_size
    prompts = [[rng.randint(100, vocab - 1) for _ in range(n)] for n in lengths]
    params = SamplingParams(max_tokens=n_new, temperature=0, ignore_eos=True)
    want = []
    for p in prompts:
        ids = torch.tensor([p], device=hf.device)
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new,
                              min_new_tokens=n_new, do_sample=False, pad_token_id=0)
        want.append(out[0, len(p):].tolist())
    print(f"model: {label}; {len(prompts)} prompts of {lengths} tokens, {n_new} new tokens")
    for dtype in ("float32", "bfloat16"):
        llm = LLM(model=model, dtype=dtype, max_num_seqs=16, gpu_memory_utilization=0.3,
                  kv_cache_gib=0.05 if smoke else 0.5)
        runner = llm.engine.runner
        graphs = runner.graphs
        print(f"{dtype}: attention backend {runner.backend.__name__}, CUDA graphs "
              f"{'captured for ' + str(graphs.buckets) if graphs else 'off'}")
        got_graph = [o.token_ids for o in llm.generate(prompts, params)]
        runner.graphs = None
        llm.reset_prefix_cache()
        got_eager = [o.token_ids for o in llm.generate(prompts, params)]
        runner.graphs = graphs
        same = sum(a == b for a, b in zip(got_graph, got_eager, strict=True))
        print(f"  graphs == eager: {same}/{len(prompts)}")
        if dtype == "float32":
            for name, got in (("eager", got_eager), ("graphs", got_graph)):
                same = sum(a == b for a, b in zip(got, want, strict=True))
                print(f"  {name} == HF: {same}/{len(prompts)}")
            for i, (a, b) in enumerate(zip(got_eager, want, strict=True)):
                if a != b:
                    j = first_mismatch(a, b)
                    print(f"    prompt {i}: first differs at token {j} (ours {a[j:j + 3]}, "
                          f"HF {b[j:j + 3]})")
        del llm, runner, graphs
        free_memory()


def decode_step_times(model: str, smoke: bool) -> None:
    """ms per engine step (schedule, forward, sample) while every request decodes: the
    same engine and the same requests, with CUDA graphs and with them switched off."""
    batches = (1, 8) if smoke else (1, 8, 64)
    llm = LLM(model=model, dtype="bfloat16", max_num_seqs=max(batches),
              gpu_memory_utilization=0.3, kv_cache_gib=0.05 if smoke else 0.5)
    engine, runner = llm.engine, llm.engine.runner
    graphs = runner.graphs
    vocab = engine.model_config.vocab_size
    reps = 3 if smoke else 40
    print(f"bf16, 128-token prompts; the better of two {reps}-step runs; "
          f"backend {runner.backend.__name__}")
    print("batch  eager ms/step  graphs ms/step  speed-up")
    for b in batches:
        rng = random.Random(b)
        ids = [engine.add_request([rng.randint(100, vocab - 1) for _ in range(128)],
                                  SamplingParams(max_tokens=10_000, ignore_eos=True,
                                                 temperature=0))
               for _ in range(b)]
        while engine.scheduler.waiting or any(
                r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running):
            engine.step()
        times = {"eager": [], "graphs": []}
        for _ in range(2):
            for mode in ("graphs", "eager"):
                runner.graphs = graphs if mode == "graphs" else None
                engine.step()  # the first step after a switch is not timed
                sync()
                t0 = time.perf_counter()
                for _ in range(reps):
                    engine.step()
                sync()
                times[mode].append((time.perf_counter() - t0) / reps * 1000)
        runner.graphs = graphs
        for rid in ids:
            engine.abort_request(rid)
        eager, graphed = min(times["eager"]), min(times["graphs"])
        print(f"{b:5}  {eager:13.2f}  {graphed:14.2f}  {eager / graphed:7.2f}x"
              + ("" if graphs else "  (no graphs on this device)"))
    del llm, engine, runner, graphs
    free_memory()


def w1_throughput(model: str, label: str, smoke: bool, load_format: str = "auto",
                  hf=None) -> None:
    """W1 output tok/s: CUDA graphs on, off (same engine), and HF static batches of 16."""
    llm = LLM(model=model, dtype="bfloat16", load_format=load_format,
              gpu_memory_utilization=0.5, kv_cache_gib=0.05 if smoke else 1.0)
    wl = make_workload("w1", llm.engine.model_config.vocab_size)
    if smoke:
        wl = type(wl)(wl.name, wl.prompts[:4], 8)
    runner = llm.engine.runner
    graphs = runner.graphs
    on = run_baton(llm, wl)
    runner.graphs = None
    off = run_baton(llm, wl)
    runner.graphs = graphs
    line = f"{label}: graphs {on:8.1f} tok/s, eager {off:8.1f} tok/s ({on / off:.2f}x)"
    del llm, runner, graphs
    free_memory()
    if hf is not None:
        h = run_hf(hf.to(torch.bfloat16), wl)
        line += f", HF {h:8.1f} tok/s (Baton {on / h:.2f}x)"
    print(line, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes; CPU is fine")
    ap.add_argument("--tiny", action="store_true",
                    help="with --smoke: the default model's stand-in at hidden 128 and "
                         "vocab 4096, not SmolLM2's widths")
    args = ap.parse_args()
    smoke = args.smoke
    if args.tiny and not smoke:
        raise SystemExit("--tiny is a size for --smoke")
    logging.basicConfig(level=logging.WARNING)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not smoke:
        raise SystemExit("no CUDA device: run with --smoke to check the script on CPU")
    if device == "cpu":  # Triton's kernels through its interpreter (before it loads)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    print(f"torch {torch.__version__}, device {device}"
          + (f" ({torch.cuda.get_device_name()})" if device == "cuda" else ""))
    with tempfile.TemporaryDirectory(prefix="baton-gpu-check-") as tmp:
        run_sections(Path(tmp), smoke, device, args.tiny)


def run_sections(tmp: Path, smoke: bool, device: str, tiny: bool = False) -> None:
    small = dict(SMOLLM2_SHAPES, num_hidden_layers=2) if smoke else SMOLLM2_SHAPES
    if tiny:
        small.update(hidden_size=128, intermediate_size=256, num_attention_heads=2,
                     num_key_value_heads=1, vocab_size=4096)
    big = dict(LLAMA_1B_SHAPES, num_hidden_layers=2, hidden_size=256,
               intermediate_size=512, num_attention_heads=8, num_key_value_heads=2,
               head_dim=32, vocab_size=1000) if smoke else LLAMA_1B_SHAPES
    model = label = hf = None

    def section(title, fn, *a, **kw):
        print(f"\n== {title} ==", flush=True)
        t0 = time.perf_counter()
        try:
            fn(*a, **kw)
        except Exception:  # noqa: BLE001 - report it and go on to the next section
            traceback.print_exc()
        print(f"({time.perf_counter() - t0:.1f} s)", flush=True)

    def load_default():
        nonlocal model, label, hf
        model, label, hf = default_model(tmp, small, smoke)
        print(f"default model: {label}")

    section("attention kernels vs the fp32 torch reference (max abs error)",
            kernel_errors, device, smoke)
    section("default model", load_default)
    if model is None:
        return
    section("greedy output: CUDA graphs vs eager vs HF transformers", greedy_equality,
            model, label, hf, smoke)
    section("decode step time, with and without CUDA graphs", decode_step_times, model,
            smoke)
    section("W1 throughput", w1_throughput, model, label, smoke, hf=hf)
    del hf
    free_memory()
    llama_dir(tmp / "llama-1b", big, with_weights=False)
    section("W1 throughput, 1B-class (Llama-3.2-1B shapes, random weights)", w1_throughput,
            str(tmp / "llama-1b"), "Llama-1B shapes", smoke, "dummy")


if __name__ == "__main__":
    main()
