"""W6 (docs/benchmarks.md): 48 tenants' 1,024-token prefixes, about 4.2x a 0.25 GiB
pool, with the KV offload tiers and without, in the same run.

    python -m baton.tools.bench.tiers [--modes offline served] [--host-gib 2]
        [--disk-gib 4] [--concurrency 16]

offline: one LLM per setting, every prompt at once. served: a prefill and a decode
worker behind a router (what `baton up` runs), concurrency 16; with the tiers, both
workers share one host tier (one host). Prints per setting: output throughput, the
prompt tokens found per tier (pool, host, disk) over the prompt tokens, and TTFT p50;
then the ratios tiers/none. Every run prints the CPU and its measured roofline.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import tempfile
import time

import torch

from baton.services.common.sampling_params import SamplingParams
from baton.services.engine.llm import LLM

from .machine import machine_line
from .workloads import Workload, make_workload

POOL_GIB = 0.25


def tier_flags(tiers: bool, root: str, host_gib: float, disk_gib: float) -> dict:
    if not tiers:
        return {}
    return {"kv_offload_gib": host_gib, "kv_offload_host_path": os.path.join(root, "host"),
            "kv_offload_disk_path": os.path.join(root, "disk"),
            "kv_offload_disk_gib": disk_gib}


def hit_rates(queries: int, pool: int, tiers: dict[str, int], block_size: int) -> str:
    """Prompt tokens found in each medium, over the prompt tokens looked up."""
    host, disk = (tiers.get(f"{m}_hits", 0) * block_size for m in ("host", "disk"))
    return (f"hit rate pool {100 * pool / queries:5.1f}% host {100 * host / queries:5.1f}% "
            f"disk {100 * disk / queries:5.1f}%")


def offline(wl: Workload, tiers: bool, args, root: str) -> dict:
    llm = LLM(kv_cache_gib=POOL_GIB, max_num_seqs=args.concurrency,
              **tier_flags(tiers, root, args.host_gib, args.disk_gib))
    try:
        params = SamplingParams(max_tokens=wl.output_len, temperature=0, ignore_eos=True)
        t0 = time.perf_counter()
        outs = llm.generate(wl.prompts, params)
        seconds = time.perf_counter() - t0
        engine = llm.engine
        conn = {c.name: c for c in engine.connectors}.get("offload")
        stats = conn.stats() if conn is not None else {}
        ttft = [o.queue_time + o.prefill_time for o in outs
                if o.queue_time is not None and o.prefill_time is not None]
        return {"mode": f"offline {'tiers' if tiers else 'none '}",
                "tok_s": wl.num_output_tokens / seconds,
                "hits": hit_rates(engine.kv.num_queries, engine.kv.num_hits, stats,
                                  engine.config.block_size),
                "ttft_p50_ms": 1000 * statistics.median(ttft)}
    finally:
        llm.engine.close()


def served(wl: Workload, tiers: bool, args, root: str) -> dict:
    from baton.services.rpc.processes import spawn, stop_all, wait_healthy

    from .serve import ENV, pct, run_load, warm_up, worker_stats

    prefill, decode, router = "127.0.0.1:50461", "127.0.0.1:50471", "127.0.0.1:50451"
    flags = ["--log-level", "WARNING", "--threads", str(args.threads), "--kv-cache-gib",
             str(POOL_GIB), "--max-num-seqs", str(args.concurrency)]
    for k, v in tier_flags(tiers, root, args.host_gib, args.disk_gib).items():
        flags += ["--" + k.replace("_", "-"), str(v)]
    procs = []
    try:
        procs = [spawn("prefill", prefill, flags, env=ENV), spawn("decode", decode, flags,
                                                                   env=ENV)]
        for address, p in zip((prefill, decode), procs, strict=True):
            wait_healthy(address, p, 300)
        procs.append(spawn("router", router, ["--log-level", "WARNING", "--http-port", "0",
                                              "--prefill", prefill, "--decode", decode],
                           env=ENV))
        wait_healthy(router, procs[-1], 60)
        asyncio.run(warm_up(router))
        before = {w: worker_stats(w) for w in (prefill, decode)}
        r = asyncio.run(run_load(router, wl.prompts, wl.output_len, args.concurrency))
        after = {w: worker_stats(w) for w in (prefill, decode)}
    finally:
        stop_all(procs)
    # The prefill worker computes every prompt (the decode worker pulls it): its hits.
    a, b = after[prefill], before[prefill]
    tier_hits = {k: a.kv_offload.get(k, 0) - b.kv_offload.get(k, 0)
                 for k in ("host_hits", "disk_hits")}
    return {"mode": f"served  {'tiers' if tiers else 'none '}", "tok_s": r.tokens / r.seconds,
            "hits": hit_rates(a.prefix_cache_queries - b.prefix_cache_queries,
                              a.prefix_cache_hits - b.prefix_cache_hits, tier_hits, 16),
            "ttft_p50_ms": 1000 * pct(r.ttft, 50)}


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--modes", nargs="+", default=["offline", "served"])
    ap.add_argument("--host-gib", type=float, default=2.0)
    ap.add_argument("--disk-gib", type=float, default=4.0)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    args = ap.parse_args()
    from baton.services.engine.loader import load_checkpoint, resolve_model_path

    mc = load_checkpoint(resolve_model_path(None))[0]
    print(machine_line(mc, torch.bfloat16), flush=True)
    wl = make_workload("w6", mc.vocab_size)
    for mode in args.modes:
        rows = []
        for tiers in (False, True):
            root = tempfile.mkdtemp(prefix="baton-w6-")
            try:
                rows.append((offline if mode == "offline" else served)(wl, tiers, args, root))
            finally:
                shutil.rmtree(root, ignore_errors=True)
            x = rows[-1]
            print(f"{x['mode']}: {x['tok_s']:6.1f} output tok/s  {x['hits']}  TTFT p50 "
                  f"{x['ttft_p50_ms']:7.0f} ms", flush=True)
        none, on = rows
        print(f"{mode} tiers/none: throughput {on['tok_s'] / none['tok_s']:.2f}x, TTFT p50 "
              f"{on['ttft_p50_ms'] / none['ttft_p50_ms']:.2f}x", flush=True)


if __name__ == "__main__":
    main()
