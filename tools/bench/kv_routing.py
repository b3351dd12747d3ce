"""W4 through the router: routing on the KV cache against load-only routing, in the same
run, each on fresh workers (one prefill, two decode workers with 0.25 GiB of KV each,
less than the 16 tenants' prefixes need), at concurrency 16.

    python -m baton.tools.bench.kv_routing [--rounds 1] [--plot docs/w4_ttft.png]

Prints per mode: the decode workers' prefix hit rate (prompt tokens found in their
caches, pulled requests included), the share of requests prefilled on the decode worker
(conditional disaggregation), the KV bytes pulled, output throughput and TTFT p50/p99;
then the ratios kv/load. With --plot, the TTFT distributions of both as a PNG.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys

from baton.services.rpc.processes import spawn, stop_all, wait_healthy

from .serve import ENV, kv_shape, pct, run_load, warm_up, worker_stats
from .workloads import make_workload

PREFILL, DECODES, ROUTER = "127.0.0.1:50361", ("127.0.0.1:50371", "127.0.0.1:50372"), \
    "127.0.0.1:50351"
COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "num_blocks_pulled")


def start(routing: str, threads: int, router_flags: list[str]) -> list:
    quiet = ["--log-level", "WARNING", "--threads", str(threads)]
    procs = [spawn("prefill", PREFILL, quiet + ["--kv-cache-gib", "2"], env=ENV)]
    try:
        procs += [spawn("decode", d, quiet + ["--kv-cache-gib", "0.25"], env=ENV)
                  for d in DECODES]
        for address, p in zip((PREFILL, *DECODES), procs, strict=True):
            wait_healthy(address, p, 300)
        procs.append(spawn("router", ROUTER, ["--log-level", "WARNING", "--http-port", "0",
                                              "--prefill", PREFILL, "--decode",
                                              ",".join(DECODES), "--routing", routing,
                                              *router_flags], env=ENV))
        wait_healthy(ROUTER, procs[-1], 60)
        return procs
    except BaseException:
        stop_all(procs)
        raise


def measure(routing: str, args) -> dict:
    procs = start(routing, args.threads, args.router_flags)
    try:
        asyncio.run(warm_up(ROUTER))
        vocab, _, block_bytes = kv_shape(DECODES[0])
        wl = make_workload("w4", vocab)
        before = [worker_stats(d) for d in DECODES]
        r = asyncio.run(run_load(ROUTER, wl.prompts, wl.output_len, args.concurrency))
        after = [worker_stats(d) for d in DECODES]
    finally:
        stop_all(procs)
    delta = {k: sum(getattr(a, k) - getattr(b, k) for a, b in zip(after, before, strict=True))
             for k in COUNTERS}
    return {"mode": routing, "ttft": r.ttft, "tok_s": r.tokens / r.seconds,
            "hit_rate": delta["prefix_cache_hits"] / max(1, delta["prefix_cache_queries"]),
            "local_share": r.local_prefills / len(wl.prompts),
            "kv_gb": delta["num_blocks_pulled"] * block_bytes / 1e9,
            "ttft_p50_ms": 1000 * pct(r.ttft, 50), "ttft_p99_ms": 1000 * pct(r.ttft, 99)}


def line(x: dict) -> str:
    return (f"{x['mode']:>4}: prefix hit rate {100 * x['hit_rate']:5.1f}%  local prefill "
            f"{100 * x['local_share']:5.1f}%  KV pulled {x['kv_gb']:6.2f} GB  "
            f"{x['tok_s']:6.1f} tok/s  TTFT p50 {x['ttft_p50_ms']:6.0f} p99 "
            f"{x['ttft_p99_ms']:6.0f} ms")


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for mode, label in (("load", "load-only routing"), ("kv", "routing on the KV cache")):
        xs = sorted(1000 * t for x in rows if x["mode"] == mode for t in x["ttft"])
        ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=label)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms, log scale)")
    ax.set_ylabel("share of requests")
    ax.set_title("W4: 1 prefill + 2 decode workers, concurrency 16")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2,
                    help="torch threads of each worker")
    ap.add_argument("--modes", nargs="+", default=["load", "kv"])
    ap.add_argument("--plot", help="write the TTFT distributions here (PNG)")
    ap.add_argument("--router-flags", nargs=argparse.REMAINDER, default=[],
                    help="more flags for the router (last on the line)")
    args = ap.parse_args()
    rows = []
    for _ in range(args.rounds):
        for mode in args.modes:
            rows.append(measure(mode, args))
            print(line(rows[-1]), flush=True)
    if args.plot:
        plot(rows, args.plot)
    if set(args.modes) == {"kv", "load"}:
        def med(mode, key):
            return statistics.median(x[key] for x in rows if x["mode"] == mode)
        print(f"kv/load: hit rate {med('kv', 'hit_rate') / max(1e-9, med('load', 'hit_rate')):.2f}x"
              f", KV moved {med('kv', 'kv_gb') / max(1e-9, med('load', 'kv_gb')):.2f}x"
              f", throughput {med('kv', 'tok_s') / med('load', 'tok_s'):.2f}x, TTFT p50 "
              f"{med('kv', 'ttft_p50_ms') / med('load', 'ttft_p50_ms'):.2f}x, p99 "
              f"{med('kv', 'ttft_p99_ms') / med('load', 'ttft_p99_ms'):.2f}x", file=sys.stderr)


if __name__ == "__main__":
    main()
