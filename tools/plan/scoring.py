"""Scoring a topology on a workload by simulation, as the goodput benchmark scores a
measured run: the requests of each seed (or a trace), each seed its own run, pooled; and
the highest rate a topology holds at an attainment (the benchmark's search)."""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import replace

from baton.tools.bench.goodput_load import Job, arrivals, jobs
from baton.tools.bench.goodput_stats import Timing, summarize

from .simulator import Simulation, Topology


def requests(args, vocab: int = 49152) -> list[tuple[list[Job], list[float]]]:
    """One (jobs, send times) per seed: the workload at --rate, or the trace as it is."""
    if args.trace:
        rows = [json.loads(line) for line in args.trace.read_text().splitlines() if line]
        rng = random.Random(0)
        work = [Job([rng.randrange(100, vocab - 1) for _ in range(r["input_len"])],
                    r["output_len"]) for r in rows]
        return [(work, [float(r["t"]) for r in rows])]
    return seeded(args.workload, args.num_prompts, args.rate, 1.0, args.seeds, vocab)


def seeded(workload: str, n: int, rate: float, burstiness: float, seeds: list[int],
           vocab: int = 49152) -> list[tuple[list[Job], list[float]]]:
    """Each seed's `n` requests and send times, as the goodput benchmark draws them."""
    return [(jobs(workload, n, seed, vocab), arrivals(n, rate, burstiness, seed))
            for seed in seeds]


def score(topology: Topology, profile: dict, runs, slos: dict, kv_gib: float) -> dict:
    """The simulated result over every seed's requests, pooled as the benchmark pools
    its seeds: each seed its own run on a fresh topology, one after the other."""
    pooled: list[Timing] = []
    offset = 0.0
    busy: dict[str, float] = {}  # each worker's seconds in steps, every seed's
    for work, sent in runs:
        sim = Simulation(topology, profile, kv_cache_gib=kv_gib)
        timings = sim.run(work, sent)
        end = max([t.token_times[-1] for t in timings if t.ok] + [t.sent for t in timings])
        pooled += [shifted(t, offset) for t in timings]
        offset += end
        for address, worker in sim.sims.items():
            busy[address] = busy.get(address, 0.0) + worker.busy_s
    return {**summarize(pooled, slos), "busy_s": busy}


def shifted(t: Timing, by: float) -> Timing:
    return replace(t, sent=t.sent + by, token_times=[x + by for x in t.token_times])


def max_rate(topology: Topology, profile: dict, args, slos: dict, start: float) -> float:
    """The highest rate whose simulated attainment is at least --attainment: doubling
    from `start` until one fails, then bisecting (the benchmark's search), 0 if even
    1/16 of `start` fails."""

    def holds(rate: float) -> bool:
        runs = requests(argparse.Namespace(**{**vars(args), "rate": rate}))
        return score(topology, profile, runs, slos, args.kv_cache_gib)["slo_attainment"] \
            >= args.attainment

    lo, hi = 0.0, start
    while holds(hi):
        lo, hi = hi, hi * 2
        if hi > 1e4:
            return lo
    if lo == 0.0:
        hi2 = hi
        while hi2 > start / 16:
            hi2 /= 2
            if holds(hi2):
                lo, hi = hi2, hi2 * 2
                break
        else:
            return 0.0
    for _ in range(5):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if holds(mid) else (lo, mid)
    return lo
