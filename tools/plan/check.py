"""The simulator's predictions beside what the goodput benchmark measured:

    baton plan --profile profile.json --check goodput-w3-*.json [--attainment 0.9]

For each measured run (a topology at a rate, every seed's requests) the same requests are
simulated on the same topology (the benchmark's names: pd, pd-always, decode2, colocated,
...) at the workers' settings the benchmark uses (1 GiB of KV, prefix caching off unless
the run says otherwise), and both are printed: attainment, P90 TTFT, P90 ITL, P90 TPOT.
Then, per topology, the highest measured rate at the attainment among the runs, beside
the simulator's own search for it (planner.max_rate). Each ratio is predicted over
measured.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from baton.tools.bench.goodput_stats import parse_slos

from .scoring import max_rate, score, seeded
from .simulator import named

FIELDS = (("attain", "slo_attainment", 100.0), ("P90 TTFT", "p90_ttft_ms", 1.0),
          ("P90 ITL", "p90_itl_ms", 1.0), ("P90 TPOT", "p90_tpot_ms", 1.0))


def runs_of(files: list[Path]) -> list[tuple[dict, dict]]:
    """(run, its file's header) for every run in the benchmark's result files."""
    out = []
    for path in files:
        data = json.loads(path.read_text())
        out += [(r, data) for r in data["runs"]]
    return out


def requests_of(run: dict) -> list:
    """The run's requests, seed by seed, as the benchmark sent them."""
    return seeded(run["workload"], run["num_prompts"] // len(run["seeds"]),
                  run["request_rate"], run.get("burstiness", 1.0), run["seeds"])


def check(profile: dict, files: list[Path], attainment: float) -> list[dict]:
    runs = runs_of(files)
    rows = []
    # Per topology: a run of it (its workload and seeds start the search), its file's
    # SLOs, and its best measured run at the attainment (None: none holds it).
    topologies: dict[str, tuple[dict, dict, dict | None]] = {}
    for run, header in runs:
        slos = parse_slos(header["slos_ms"])
        predicted = score(named(run["topology"]), profile, requests_of(run), slos, 1.0)
        rows.append({"topology": run["topology"], "workload": run["workload"],
                     "rate": run["request_rate"], "measured": run, "predicted": predicted})
        first, first_slos, best = topologies.get(run["topology"], (run, slos, None))
        if run["slo_attainment"] >= attainment and (
                best is None or run["request_rate"] > best["request_rate"]):
            best = run
        topologies[run["topology"]] = (first, first_slos, best)
    for row in rows:
        m, p = row["measured"], row["predicted"]
        cols = [f"{name} {scale * m[key]:7.1f} / {scale * p[key]:7.1f}"
                for name, key, scale in FIELDS]
        print(f"{row['topology']:<10} {row['workload']:<6} rate {row['rate']:5.2f}/s  "
              + "  ".join(cols) + "   (measured / predicted)")
        if "cpu_s" in m:
            print("    " + cpu_line(m["cpu_s"], p["busy_s"], threads(named(row["topology"]))))
    for name, (sample, slos, best) in topologies.items():
        args = argparse.Namespace(trace=None, workload=sample["workload"],
                                  num_prompts=sample["num_prompts"] // len(sample["seeds"]),
                                  seeds=sample["seeds"], kv_cache_gib=1.0,
                                  attainment=attainment, rate=1.0)
        start = best["request_rate"] if best else sample["request_rate"]
        rate = max_rate(named(name), profile, args, slos, start)
        measured = f"{best['request_rate']:.2f}/s" if best else "none of its rates"
        ratio = f" ({rate / best['request_rate']:.2f}x)" if best else ""
        print(f"highest rate at {100 * attainment:.0f}%: {name:<10} measured {measured}, "
              f"predicted {rate:.2f}/s{ratio}")
        rows.append({"topology": name, "max_rate_measured": best and best["request_rate"],
                     "max_rate_predicted": rate})
    return rows


def threads(topology) -> dict[str, int]:
    """The cores each of the topology's workers computes on, by the benchmark's names."""
    return {**{f"prefill-{i}": topology.prefill_threads * topology.prefill_tp
               for i in range(topology.prefill)},
            **{f"decode-{i}": topology.decode_threads * topology.decode_tp
               for i in range(topology.decode)}}


def cpu_line(measured: dict[str, float], steps: dict[str, float],
             cores: dict[str, int]) -> str:
    """Each process's CPU seconds over the run beside its simulated steps' seconds (wall
    seconds: an engine on k cores spends up to k CPU seconds in each, so its steps are
    shown as that range). A one-core worker's CPU past its steps (its server, pulls,
    the Python around the engine) is time the simulator places nowhere; the router and
    the benchmark's client have no steps and share the same cores."""
    cols = []
    for name, cpu in measured.items():
        col = f"{name} {cpu:.1f}"
        if name in steps:
            k = cores.get(name, 1)
            col += (f" / {steps[name]:.1f}" if k == 1 else
                    f" / {steps[name]:.1f}-{k * steps[name]:.1f} ({k} cores)")
        cols.append(col)
    return "CPU s (measured / in simulated steps): " + ", ".join(cols)
