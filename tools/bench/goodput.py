"""Goodput at an SLO: open-loop load through Baton's public API at a sweep of request
rates, for topologies it starts on the same cores (goodput_topology.py) or a server it is
given, with vLLM's `bench serve --goodput` arithmetic (goodput_stats.py).

    python -m baton.tools.bench.goodput --workload chat --topology pd decode2 colocated \\
        --goodput ttft:3000 tpot:100 --request-rate 0.5 1 2 [--seeds 0 1]
    python -m baton.tools.bench.goodput ... --find-max-rate [--attainment 0.9]
    python -m baton.tools.bench.goodput --base-url http://host:8000 ...   (a running server)
    baton bench goodput ...                                               (the same)

Per topology and rate it prints P50/P90/P99 of TTFT, TPOT, ITL and E2EL, the request
throughput, goodput and SLO attainment (over every seed's requests); with
--find-max-rate, the highest rate whose attainment is at least --attainment (doubling from
--rate-start until a rate fails, then bisecting). With --result-dir: one JSON file per
run (vLLM's field names) and PNG plots (goodput_plots.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path

from .goodput_load import WORKLOADS, Job, arrivals, jobs, run
from .goodput_stats import PERCENTILES, parse_slos, rescore, summarize
from .goodput_topology import (
    TOPOLOGIES,
    cpu_seconds,
    exit_on_sigterm,
    local_prefills,
    process_cpu_seconds,
    started,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="baton bench goodput",
                                 description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--workload", choices=WORKLOADS, default="chat")
    ap.add_argument("--topology", nargs="+", choices=TOPOLOGIES, default=["pd"])
    ap.add_argument("--base-url", help="a running server's OpenAI API (no topology started)")
    ap.add_argument("--address", help="a running router's gRPC address (with --api grpc)")
    ap.add_argument("--api", choices=("openai", "grpc"), default="openai")
    ap.add_argument("--request-rate", type=float, nargs="+", default=[1.0])
    ap.add_argument("--find-max-rate", action="store_true")
    ap.add_argument("--attainment", type=float, default=0.9)
    ap.add_argument("--rate-start", type=float, default=0.5)
    ap.add_argument("--bisections", type=int, default=3)
    ap.add_argument("--burstiness", type=float, default=1.0)
    ap.add_argument("--num-prompts", type=int, default=100)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--num-warmups", type=int, default=32,
                    help="requests of the workload sent at once before measuring")
    ap.add_argument("--goodput", nargs="+", metavar="METRIC:MS",
                    help="SLOs, vLLM's form: ttft:MS tpot:MS e2el:MS")
    ap.add_argument("--result-dir", type=Path)
    ap.add_argument("--model", help="for every worker and the router (default: the "
                    "default model; longdoc: a tiny long-context one)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kv-cache-gib", default="1")
    ap.add_argument("--max-num-batched-tokens", help="the workers' step budget (default: "
                    "the engine's)")
    ap.add_argument("--prefix-caching", action="store_true",
                    help="keep the workers' prefix caches on (off by default: the "
                    "workloads' random prompts share no prefix, and a cache would only "
                    "hit on this run's own repeats, as the same seed at another rate)")
    ap.add_argument("--worker-flag", action="append", default=[],
                    help="one more flag for every worker (repeat), e.g. --worker-flag=--x=1")
    ap.add_argument("--router-flag", action="append", default=[])
    ap.add_argument("--plot", type=Path, nargs="+", metavar="JSON",
                    help="no run: draw these result files' points as one run's plots, "
                    "in --result-dir (runs of one workload at one SLO, e.g. topologies "
                    "measured apart)")
    ap.add_argument("--machine-only", action="store_true",
                    help="no run: print the CPU's flags and the bf16 matmul roofline at "
                    "the workload's model's shapes (what every run prints first)")
    ap.add_argument("--rescore", type=Path, nargs="+", metavar="JSON",
                    help="no run: score these result files' requests at --goodput, and "
                    "each topology's highest rate at --attainment among their points")
    args = ap.parse_args(argv)
    args.slos = parse_slos(args.goodput)
    args.stamp = time.strftime("%Y%m%d-%H%M%S")  # names the run's files
    if (args.find_max_rate or args.rescore or args.plot) and not args.slos:
        ap.error("--find-max-rate, --rescore and --plot need --goodput")
    if args.plot and not args.result_dir:
        ap.error("--plot needs --result-dir")
    return args


def measure(target: str, api: str, args, rate: float, vocab: int, progress,
            router_pid: int | None = None, http: str | None = None,
            pids: tuple[tuple[str, int], ...] = ()) -> dict:
    """One rate: every seed's requests (each its own open-loop run), pooled; the
    router's CPU time per output token, where it runs apart; each process's CPU seconds
    over the point (`pids`, and this client's own: what the planner's check sets beside
    its simulated steps); and the prompts its decode workers computed themselves, by
    reason (`http`: its OpenAI API, which serves /metrics)."""
    timings = []
    cpu0 = cpu_seconds(router_pid) if router_pid else 0.0
    each0 = {name: cpu_seconds(pid) for name, pid in pids}
    client0, wall0 = process_cpu_seconds(), time.monotonic()
    local0 = local_prefills(http) if http else {}
    for seed in args.seeds:
        work = jobs(args.workload, args.num_prompts, seed, vocab)
        times = arrivals(len(work), rate, args.burstiness, seed)
        timings += asyncio.run(run(work, times, api, target, progress))
    result = summarize(timings, args.slos)
    if router_pid:
        result["router_cpu_ms_per_token"] = 1000 * (cpu_seconds(router_pid) - cpu0) / max(
            1, result["total_output_tokens"])
    if pids:
        result["cpu_s"] = {name: round(cpu_seconds(pid) - each0[name], 3)
                           for name, pid in pids}
        result["cpu_s"]["client"] = round(process_cpu_seconds() - client0, 3)
        result["wall_s"] = round(time.monotonic() - wall0, 3)
    if http:
        after = local_prefills(http)
        result["local_prefills"] = {k: v - local0.get(k, 0.0) for k, v in after.items()
                                    if v > local0.get(k, 0.0)}
    result.update(request_rate=rate, burstiness=args.burstiness, seeds=args.seeds,
                  num_prompts=args.num_prompts * len(args.seeds), workload=args.workload)
    return result


def line(topology: str, r: dict) -> str:
    cols = [f"{topology:<10} rate {r['request_rate']:5.2f}/s",
            f"done {r['completed']:4d}/{r['num_prompts']}",
            f"thru {r['request_throughput']:5.2f}/s"]
    if r["request_goodput"] is not None:
        cols += [f"goodput {r['request_goodput']:5.2f}/s",
                 f"attain {100 * r['slo_attainment']:5.1f}%"]
    for name in ("ttft", "tpot", "itl"):
        cols.append(f"{name.upper()} " + "/".join(
            f"{r[f'p{p}_{name}_ms']:.0f}" for p in PERCENTILES) + " ms")
    cols.append(f"1st ITL {r['mean_first_itl_ms']:.0f} ms")
    if r.get("mean_kv_transfer_ms"):
        cols.append(f"KV pull {r['mean_kv_transfer_ms']:.1f} ms")
    if r.get("local_prefills"):
        share = sum(r["local_prefills"].values()) / max(1, r["completed"])
        cols.append(f"local {100 * share:.0f}% (" + ", ".join(
            f"{k} {v:.0f}" for k, v in sorted(r["local_prefills"].items())) + ")")
    if "router_cpu_ms_per_token" in r:
        cols.append(f"router {r['router_cpu_ms_per_token']:.2f} ms/token")
    if not steady(r):
        cols.append(f"RAMP (a seed's arrivals span {window_s(r):.0f} s, under twice a "
                    f"request's mean life of {r['mean_e2el_ms'] / 1000:.1f} s)")
    return "  ".join(cols)


def window_s(r: dict) -> float:
    """How long one seed's arrivals last at the point's rate."""
    return r["num_prompts"] / len(r["seeds"]) / r["request_rate"]


def steady(r: dict) -> bool:
    """Whether the load had time to settle: a seed's arrivals last at least twice a
    request's mean life. Below that, the run is a ramp up to a burst, and its rate says
    less than its throughput of what the server sustains."""
    return window_s(r) >= 2 * r["mean_e2el_ms"] / 1000


def sweep(topology: str, target: str, api: str, args, vocab: int, out: list,
          router_pid: int | None = None, http: str | None = None,
          pids: tuple[tuple[str, int], ...] = ()) -> dict | None:
    """Each rate given, or the search for the highest rate at the attainment; the
    best passing result (with --find-max-rate)."""
    from tqdm import tqdm

    def point(rate: float) -> dict:
        with tqdm(total=args.num_prompts * len(args.seeds), leave=False,
                  desc=f"{topology} @ {rate:.2f}/s") as bar:
            r = measure(target, api, args, rate, vocab, bar, router_pid, http, pids)
        r["topology"] = topology
        out.append(r)
        print(line(topology, r), flush=True)
        if args.result_dir:  # after every point: a long sweep cut short keeps its points
            save(args, out, {}, plots=False)
        return r

    # Every decode batch size and many prompt shapes seen once before measuring, through
    # the API measured (oneDNN builds a kernel per new shape): a burst, seeded apart.
    warm = [Job(j.prompt, 16) for j in jobs(args.workload, args.num_warmups, 10_000, vocab)]
    asyncio.run(run(warm, [0.0] * len(warm), api, target))
    if not args.find_max_rate:
        for rate in args.request_rate:
            point(rate)
        return None
    passes = lambda r: r["slo_attainment"] >= args.attainment  # noqa: E731
    good, bad, rate = None, None, args.rate_start
    while bad is None:
        r = point(rate)
        if passes(r):
            good, rate = r, rate * 2
        else:
            bad = rate
            if good is None:  # fails at the start: halve down to a pass (or give up)
                bad, rate = None, rate / 2
                if rate < args.rate_start / 16:
                    return None
    for _ in range(args.bisections):
        rate = (good["request_rate"] + bad) / 2 if good is not None else bad / 2
        r = point(rate)
        if passes(r):
            good = r
        else:
            bad = rate
    print(f"{topology}: highest rate at {100 * args.attainment:.0f}% attainment: "
          f"{good['request_rate']:.2f}/s" if good else f"{topology}: no rate passed",
          flush=True)
    return good


def rescored(args) -> None:
    """Each stored point judged again at --goodput: a target's choice can reverse which
    topology wins, and the requests' times say so without running them again."""
    best: dict[str, float] = {}
    for path in args.rescore:
        for point in json.loads(path.read_text())["runs"]:
            r = rescore(point, args.slos)
            topology, rate = point["topology"], point["request_rate"]
            print(f"{topology:<10} rate {rate:5.2f}/s  goodput {r['request_goodput']:5.2f}/s"
                  f"  attain {100 * r['slo_attainment']:5.1f}%")
            if r["slo_attainment"] >= args.attainment:
                best[topology] = max(best.get(topology, 0.0), rate)
    for topology, rate in best.items():
        print(f"best {topology:<10}: {rate:.2f}/s (the highest measured rate at "
              f"{100 * args.attainment:.0f}% attainment)")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    exit_on_sigterm()  # a stopped run stops the topologies it started
    if args.rescore:
        rescored(args)
        return
    if args.plot:
        from .goodput_plots import plot

        runs = [r for path in args.plot for r in json.loads(path.read_text())["runs"]]
        args.result_dir.mkdir(parents=True, exist_ok=True)
        stem = args.result_dir / f"goodput-{args.workload}-merged"
        for png in plot(runs, args, stem):
            print(f"wrote {png}")
        return
    print(machine(args), flush=True)
    if args.machine_only:
        return
    print(f"workload {args.workload}, {args.num_prompts} requests x seeds {args.seeds}, "
          f"burstiness {args.burstiness}, SLOs {args.goodput}", flush=True)
    vocab, worker_flags, router_flags, scratch = model_flags(args)
    results: list[dict] = []
    best: dict[str, dict | None] = {}
    try:
        if args.base_url or args.address:
            target = args.base_url if args.api == "openai" else args.address
            best["given"] = sweep("given", target, args.api, args, vocab, results)
        for topology in ([] if args.base_url or args.address else args.topology):
            with started(topology, worker_flags, router_flags) as served:
                target = served.http if args.api == "openai" else served.grpc
                best[topology] = sweep(topology, target, args.api, args, vocab, results,
                                       served.router_pid, served.http, served.pids)
    finally:
        if scratch is not None:
            scratch.cleanup()
    if args.find_max_rate:
        for topology, r in best.items():
            print(f"best {topology:<10}: " + (line(topology, r) if r else "none"))
    if args.result_dir:
        save(args, results, best)


def machine(args) -> str:
    """The CPU, its matmul flags and the roofline measured now at the shapes of the model
    the run serves (machine.py): figures from different CPUs never compare."""
    import types

    import torch

    from .machine import machine_line

    config = Path(args.model or "") / "config.json"
    if args.model and config.is_file():
        c = json.loads(config.read_text())
        shape = (c["hidden_size"], c["intermediate_size"])
    elif args.model is None and args.workload == "longdoc":
        from .pd_ttft import TINY_LONG

        shape = (TINY_LONG["hidden_size"], TINY_LONG["intermediate_size"])
    else:  # a .gguf: its config, read without its weights
        from baton.services.common.default_model import default_model_path
        from baton.services.engine.loader import load_gguf

        mc = load_gguf(Path(args.model) if args.model else default_model_path())[0]
        shape = (mc.hidden_size, mc.intermediate_size)
    mc = types.SimpleNamespace(hidden_size=shape[0], intermediate_size=shape[1])
    return machine_line(mc, getattr(torch, args.dtype))


def model_flags(args) -> tuple[int, list[str], list[str], tempfile.TemporaryDirectory | None]:
    """(vocabulary, worker flags, router flags, a folder to remove): the default model,
    or for longdoc the tiny long-context one (pd_ttft.py's)."""
    budget = ["--max-num-batched-tokens", args.max_num_batched_tokens] \
        if args.max_num_batched_tokens else []
    common = ["--dtype", args.dtype, "--kv-cache-gib", args.kv_cache_gib, *budget,
              "--enable-prefix-caching" if args.prefix_caching
              else "--no-enable-prefix-caching", *args.worker_flag]
    if args.model:  # an HF folder: its config's vocabulary (a .gguf: the default's)
        config = Path(args.model) / "config.json"
        vocab = json.loads(config.read_text())["vocab_size"] if config.is_file() else 49152
        model = ["--model", args.model]
        return vocab, [*model, *common], [*model, *args.router_flag], None
    if args.workload != "longdoc":
        return 49152, common, list(args.router_flag), None
    scratch, model, router = longdoc_model("baton-goodput-")
    return 49152, [*model, *common], [*router, *args.router_flag], scratch


def longdoc_model(prefix: str) -> tuple[tempfile.TemporaryDirectory, list[str], list[str]]:
    """The longdoc workload's model, written into a temporary folder (remove it after):
    (the folder, the workers' model flags, the router's)."""
    from .pd_ttft import tiny_long_model

    scratch = tempfile.TemporaryDirectory(prefix=prefix)
    # Two layers: a prompt of 2-8K tokens takes about 0.6 s to compute on one core of
    # this kind (attention, quadratic in its length, is most of it), so that a point of
    # 100 requests takes minutes, not a quarter of an hour as with pd_ttft.py's twelve.
    model = tiny_long_model(scratch.name, layers=2)
    return scratch, model, ["--tokenizer", model[model.index("--tokenizer") + 1]]


def save(args, results: list[dict], best: dict, plots: bool = True) -> None:
    """The run's JSON (rewritten as points come) and, at the end, its plots."""
    from .goodput_plots import plot

    args.result_dir.mkdir(parents=True, exist_ok=True)
    path = args.result_dir / f"goodput-{args.workload}-{args.stamp}.json"
    path.write_text(json.dumps({"workload": args.workload, "slos_ms": args.goodput,
                                "attainment": args.attainment, "cpu": os.cpu_count(),
                                "best": {k: v and v["request_rate"] for k, v in best.items()},
                                "runs": results}))
    if not plots:
        return
    for png in plot(results, args, args.result_dir / f"goodput-{args.workload}-{args.stamp}"):
        print(f"wrote {png}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
