"""`baton profile`: what one engine step costs on this machine, and what a hand-off costs,
in one JSON file for the simulator (simulator.py) and the planner (planner.py).

    baton profile [--model M | --longdoc] [--dtype bfloat16] [--threads 1 2]
                  [--tensor-parallel 1] [--transports nixl grpc] [--out profile.json]
                  [--quick]

1. Engine steps, offline (no services), for each thread count and tensor-parallel size,
   the process pinned to that many cores: prefill steps of n tokens over c tokens of
   context (c from a prefix-cache hit: the same step as a chunk after c computed
   tokens), decode steps of B requests over c tokens each, and steps that mix decodes
   with a prefill. Every step's scheduled batch is read from the engine's own scheduler
   and its wall time measured around `engine.step()`; a StepModel is fitted to them.
2. The hand-off, through a real prefill and decode worker behind the router (one per
   transport, `--disaggregation always`): prompts of several lengths, one at a time. The
   decode worker's KV pull time (its Timings) gives the transfer's cost per block; the
   first token's wait beyond the prefill (router and RPCs) and the second token's gap
   beyond the pull and one decode step give the control plane's cost.
3. Each engine served (calibrate.py): its steps' cost there against offline, as two
   factors the simulator scales its steps by.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time
from pathlib import Path

from .calibrate import in_service
from .step_model import Entry, StepModel, fit_error

PREFILL_TOKENS = (16, 64, 128, 256, 512, 1024)
PREFILL_CONTEXTS = (0, 512, 1024)
DECODE_BATCHES = (1, 4, 8, 16, 32)
DECODE_CONTEXTS = (128, 1024)
MIXED = ((4, 128), (16, 512))  # (decodes, prefill tokens) in one step
HANDOFF_PROMPTS = (64, 256, 1024, 1536)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="baton profile", description=(__doc__ or "").split(
        "\n\n")[0])
    ap.add_argument("--model", help="an HF folder or .gguf (default: the default model)")
    ap.add_argument("--longdoc", action="store_true",
                    help="the goodput benchmark's longdoc model instead (a 2-layer Llama of "
                         "16K context, random weights), prompt steps up to 2,048 tokens "
                         "over up to 4,096 of context")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2],
                    help="the engine's threads (and cores it is pinned to), each profiled")
    ap.add_argument("--tensor-parallel", type=int, nargs="+", default=[1],
                    help="tensor-parallel sizes, each profiled (ranks share the cores)")
    ap.add_argument("--transports", nargs="*", default=["nixl", "grpc"],
                    help="KV transports whose hand-off is measured (none: skip)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--no-in-service", dest="in_service", action="store_false",
                    help="skip serving each engine to measure its steps there (calibrate.py)")
    ap.add_argument("--quick", action="store_true",
                    help="a few points of each sweep (a check that it runs, not a profile)")
    ap.add_argument("--out", type=Path, default=Path("profile.json"))
    return ap.parse_args(argv)


class Recorder:
    """Every step's batch, as the engine's scheduler scheduled it: (new tokens, context
    before them) per entry."""

    def __init__(self, engine):
        self.engine, self.batch = engine, []
        schedule = engine.scheduler.schedule

        def recorded():
            out = schedule()
            self.batch = [(n, r.num_computed_tokens) for r, n in out.scheduled]
            return out

        engine.scheduler.schedule = recorded

    def step(self) -> tuple[list[Entry], float]:
        t0 = time.perf_counter()
        self.engine.step()
        return self.batch, time.perf_counter() - t0


def sweep(llm, args) -> list[tuple[list[Entry], float]]:
    """The measured steps of one engine (module docstring, 1)."""
    from baton.services.engine import SamplingParams

    engine, rng = llm.engine, random.Random(0)
    rec = Recorder(engine)
    vocab = engine.model_config.vocab_size
    limit = engine.max_model_len - 8
    samples: list[tuple[list[Entry], float]] = []

    def ids(k: int) -> list[int]:
        return [rng.randrange(100, vocab - 1) for _ in range(k)]

    def drain() -> None:
        while engine.has_unfinished_requests():
            engine.step()

    def run_one(prompt: list[int], max_tokens: int = 1) -> None:
        engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        drain()

    quick = args.quick
    tokens = PREFILL_TOKENS[1::2] if quick else PREFILL_TOKENS
    contexts = PREFILL_CONTEXTS[:2] if quick else PREFILL_CONTEXTS
    if args.longdoc:  # its prompts run 2-8K tokens, in steps of up to 2,048
        tokens, contexts = (*tokens, 2048), (*contexts, 4096)
    run_one(ids(64))  # the first step pays one-time costs: not a sample
    for _ in range(args.repeats):
        for c in contexts:
            for n in tokens:
                if c + n > limit:
                    continue
                prefix = ids(c)
                if c:
                    run_one(prefix)  # now cached: the next prompt's first c tokens hit
                engine.add_request(prefix + ids(n), SamplingParams(max_tokens=1,
                                                                   ignore_eos=True))
                samples.append(rec.step())
                drain()
    batches = DECODE_BATCHES[::2] if quick else DECODE_BATCHES
    for c in DECODE_CONTEXTS[:1] if quick else DECODE_CONTEXTS:
        for b in batches:
            prefix = ids(c - 1)
            run_one(prefix)
            for _ in range(b):  # each computes its last block, then decodes
                engine.add_request(prefix + ids(1), SamplingParams(max_tokens=64,
                                                                   ignore_eos=True))
            engine.step()
            # The first decode at a batch size builds that shape's kernels (oneDNN, once
            # per shape: 10-26% slower than the next on a 2-core Xeon, at every size); a
            # served engine pays it once, not at every step, so it is no sample.
            engine.step()
            for _ in range(args.repeats + 1):
                samples.append(rec.step())
            for d, n in MIXED[:1] if quick else MIXED:
                if d <= b:  # a prompt joins the decodes
                    engine.add_request(ids(n), SamplingParams(max_tokens=1, ignore_eos=True))
                    samples.append(rec.step())
            for rid in list(engine.scheduler.requests):
                engine.abort_request(rid)
            drain()
    return samples


def profile_engine(args, threads: int, tp: int) -> dict:
    import torch

    from baton.services.engine import LLM

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < threads * tp:
        raise SystemExit(f"{threads} threads x TP {tp} need {threads * tp} cores; this "
                         f"process may use {len(cores)}")
    os.sched_setaffinity(0, cores[:threads * tp])
    torch.set_num_threads(threads)
    try:
        llm = LLM(dtype=args.dtype, kv_cache_gib=1.5, max_num_batched_tokens=2048,
                  enable_prefix_caching=True, tensor_parallel_size=tp, **args.engine_kw)
        t0 = time.monotonic()
        samples = sweep(llm, args)
        took = time.monotonic() - t0
        llm.engine.close()
    finally:
        os.sched_setaffinity(0, cores)
    model = StepModel.fit(samples)
    return {"threads": threads, "tensor_parallel": tp, "seconds": round(took, 1),
            "block_bytes": llm.engine.kv_layout.block_bytes,
            "max_model_len": llm.engine.max_model_len, "model": model.to_json(),
            "fit_error": fit_error(model, samples),
            "samples": [[b, t] for b, t in samples]}


def handoff(args, transport: str, engine_model: StepModel) -> dict:
    """Module docstring, 2: one P/D pair behind a router, prompts one at a time."""
    from baton.tools.bench.goodput_load import Job, run
    from baton.tools.bench.goodput_topology import started

    flags = ["--dtype", args.dtype, "--kv-cache-gib", "0.5", "--kv-transport", transport,
             "--no-enable-prefix-caching", *args.worker_model]
    router = args.router_model
    rng = random.Random(1)
    lengths = HANDOFF_PROMPTS[::2] if args.quick else HANDOFF_PROMPTS
    pulls, firsts, gaps = [], [], []
    with started("pd-always", flags, router) as served:
        for _ in range(args.repeats + 1):
            for n in lengths:
                job = Job([rng.randrange(100, 49000) for _ in range(n)], 3)
                (t,) = asyncio.run(run([job], [0.0], "grpc", served.grpc))
                if not t.ok:
                    raise RuntimeError(f"a hand-off probe failed: {t.error}")
                blocks = -(-n // 16)
                pulls.append((blocks, t.kv_transfer_s))
                firsts.append(t.ttft - t.queue_s - t.prefill_s)
                step = engine_model.predict([(1, n + 1)])
                gaps.append(t.itls[0] - t.kv_transfer_s - step)
    import numpy as np

    x = np.array([[1.0, b] for b, _ in pulls])
    (fixed, per_block), *_ = np.linalg.lstsq(x, np.array([s for _, s in pulls]), rcond=None)
    return {"pull_fixed_s": max(0.0, float(fixed)),
            "pull_per_block_s": max(0.0, float(per_block)),
            "to_prefill_s": max(0.0, statistics.median(firsts)),
            "to_decode_s": max(0.0, statistics.median(gaps)), "probes": len(pulls)}


def main(argv: list[str] | None = None) -> None:
    from baton.tools.bench.goodput_topology import exit_on_sigterm

    args = parse_args(argv)
    exit_on_sigterm()  # a stopped profile stops the services it started
    scratch = model_args(args)
    try:
        run_profile(args)
    finally:
        if scratch is not None:
            scratch.cleanup()


def model_args(args):
    """Sets the model's flags for the workers (`worker_model`), the router
    (`router_model`) and the offline engine (`engine_kw`); returns the folder to remove
    after (the longdoc model's config), or None."""
    if not args.longdoc:
        args.worker_model = args.router_model = ["--model", args.model] if args.model else []
        args.engine_kw = {"model": args.model} if args.model else {}
        return None
    from baton.tools.bench.goodput import longdoc_model

    scratch, args.worker_model, args.router_model = longdoc_model("baton-profile-")
    # The same flags as EngineConfig fields: --max-model-len 16384 -> max_model_len=16384
    flags = dict(zip(args.worker_model[::2], args.worker_model[1::2], strict=True))
    kw: dict[str, str | int] = {k.lstrip("-").replace("-", "_"): v for k, v in flags.items()}
    kw["max_model_len"] = int(kw["max_model_len"])
    args.engine_kw = kw
    args.model = "longdoc"
    return scratch


def run_profile(args) -> None:
    from baton.tools.bench.machine import cpu_line

    t0 = time.monotonic()
    print(cpu_line(), flush=True)
    engines = []
    for tp in args.tensor_parallel:
        for threads in args.threads:
            e = profile_engine(args, threads, tp)
            err = e["fit_error"]
            print(f"threads {threads} TP {tp}: {len(e['samples'])} steps in {e['seconds']} s,"
                  f" fit median error {100 * err['median']:.1f}%, p90 "
                  f"{100 * err['p90']:.1f}%", flush=True)
            engines.append(e)
    one = StepModel.from_json(engines[0]["model"])
    handoffs = {}
    for transport in args.transports:
        handoffs[transport] = h = handoff(args, transport, one)
        print(f"hand-off over {transport}: pull {1000 * h['pull_fixed_s']:.1f} ms + "
              f"{1000 * h['pull_per_block_s']:.3f} ms/block, to prefill "
              f"{1000 * h['to_prefill_s']:.1f} ms, to decode {1000 * h['to_decode_s']:.1f} ms",
              flush=True)
    hop = next(iter(handoffs.values()), {}).get("to_prefill_s", 0.0)
    for e in engines if args.in_service else []:
        if e["tensor_parallel"] == 1:
            e["service"] = f = in_service(args, e["threads"], StepModel.from_json(e["model"]),
                                          hop)
            if f:
                print(f"threads {e['threads']} served ({f['topology']}): prefill x"
                      f"{f['prefill']:.2f} the offline steps, decode +"
                      f"{1000 * f['decode_extra_s']:.1f} ms a step (x{f['decode']:.2f})",
                      flush=True)
    out = {"cpu": cpu_line(), "model": args.model or "default", "dtype": args.dtype,
           "block_size": 16, "cores": len(os.sched_getaffinity(0)), "engines": engines,
           "handoff": handoffs, "seconds": round(time.monotonic() - t0, 1)}
    args.out.write_text(json.dumps(out))
    print(f"wrote {args.out} in {out['seconds']} s", flush=True)


if __name__ == "__main__":
    main()
