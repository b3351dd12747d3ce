"""The Shepherd Model Gateway in front of Baton against Baton's own front door: W1
through both, in front of the same router and workers, alternating, in one run.

    python -m baton.tools.bench.vs_smg [--concurrency 16 64] [--rounds 2] [--json]

Prints each run's throughput, TTFT and ITL, and the CPU seconds the router and the
gateway used over it; then SMG / Baton throughput and TTFT per concurrency.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
from pathlib import Path
from tempfile import TemporaryDirectory

from baton.services.common.default_model import default_model_path
from baton.services.common.tokenizer import Tokenizer
from baton.services.rpc.processes import stop_all

from .goodput_topology import cpu_seconds
from .serve import PORTS, _line, kv_shape, run_load_http, start, summary, warm_up
from .smg_gateway import gateway
from .workloads import make_workload


def compare_smg(args) -> None:
    """W1 through two front doors of the same router and workers, alternating, in one run
    (prefix caching off, so every round does the same work): Baton's own OpenAI API, and
    the Shepherd Model Gateway's, which drives the router's VllmEngine API over gRPC
    (tokenizing and detokenizing itself). Prints SMG / Baton throughput and TTFT per
    concurrency."""
    procs, address = start("disaggregated", args.threads, args.worker_threads,
                           args.kv_cache_gib, caching=False)
    own = f"http://127.0.0.1:{PORTS['http']}"
    rows: list[dict] = []
    try:
        asyncio.run(warm_up(address))
        vocab, _, _ = kv_shape(f"127.0.0.1:{PORTS['decode']}")
        wl = make_workload("w1", vocab)
        # The gateway takes text prompts only: W1's ids as text, the same for both doors.
        tok = Tokenizer(default_model_path())
        texts = [tok.decode(ids, skip_special_tokens=False) for ids in wl.prompts]
        router = procs[-1].pid
        with TemporaryDirectory() as tmp, gateway([address], Path(tmp) / "smg.log") as gw:
            asyncio.run(run_load_http(gw.url, texts[:4], 4, 4))  # its first requests
            for r in range(args.rounds):
                for c in args.concurrency:
                    doors = (("baton", own), ("smg", gw.url))
                    for door, base in doors if r % 2 == 0 else doors[::-1]:
                        # Each front door's CPU over the run (on the workers' 2 cores).
                        before = cpu_seconds(router), cpu_seconds(gw.pid)
                        res = asyncio.run(run_load_http(base, texts, wl.output_len, c))
                        rows.append(summary(door, c, res))
                        rows[-1]["router_cpu_s"] = cpu_seconds(router) - before[0]
                        rows[-1]["smg_cpu_s"] = cpu_seconds(gw.pid) - before[1]
                        rows[-1]["seconds"] = res.seconds
                        print(json.dumps(rows[-1]) if args.json else (
                            f"{_line(rows[-1])}  CPU s: router {rows[-1]['router_cpu_s']:.1f}"
                            f", smg {rows[-1]['smg_cpu_s']:.1f} in {res.seconds:.1f} s"),
                            flush=True)
    finally:
        stop_all(procs)
    def mean(door: str, key: str, c: int) -> float:
        return statistics.mean(x[key] for x in rows
                               if x["mode"] == door and x["concurrency"] == c)

    for c in args.concurrency:
        print(f"concurrency {c}: SMG / Baton throughput {mean('smg', 'tok_s', c):.1f} / "
              f"{mean('baton', 'tok_s', c):.1f} tok/s = "
              f"{mean('smg', 'tok_s', c) / mean('baton', 'tok_s', c):.3f}; TTFT p50 "
              f"{mean('smg', 'ttft_p50_ms', c):.0f} / {mean('baton', 'ttft_p50_ms', c):.0f} ms, "
              f"p99 {mean('smg', 'ttft_p99_ms', c):.0f} / {mean('baton', 'ttft_p99_ms', c):.0f} ms",
              file=sys.stderr)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2,
                    help="torch threads of each worker (as serve.py's)")
    ap.add_argument("--kv-cache-gib", type=float, default=2.0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    args.worker_threads = args.threads
    compare_smg(args)


if __name__ == "__main__":
    main()
