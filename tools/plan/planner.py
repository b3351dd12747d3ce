"""`baton plan`: the topology that serves a workload at a rate with the most goodput at
an SLO on N cores, found by simulating each candidate (simulator.py) on a profile of
this machine (profile.py).

    baton plan --profile profile.json --workload w3 --rate 0.75 \\
        --slo-ttft-ms 2000 --slo-itl-ms 70 --cores 2 [--max-rate] [--out plan.json]

Candidates on N cores: colocated (k engines of t threads behind the router, computing
their own prompts) and disaggregated (p prefill + d decode engines, each role's threads
and tensor-parallel size among those profiled, the router's `--disaggregation` auto or
always, its local-prefill thresholds), each with the step budget (chunk size) and batch
limits given. Each is simulated on the same requests (every seed's), scored as the
goodput benchmark scores a run (ITL's SLO is judged on TPOT, each request's mean gap,
as vLLM's `--goodput tpot:`), and ranked by goodput, then attainment, then fewer
engines. It prints the best few with their predicted percentiles, the best colocated
one beside them, and why the first won; `--max-rate` then finds the highest rate each of
those holds at `--attainment`. `--out` writes the first choice as a plan file: each
role's replicas and flags, the router's flags, the prediction.
"""

from __future__ import annotations

import argparse
import itertools
import json
from dataclasses import asdict, replace
from pathlib import Path

from baton.router.policy import Policy
from baton.tools.bench.goodput_load import WORKLOADS

from .scaling import targets
from .scoring import max_rate, requests, score
from .simulator import Topology, named


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="baton plan", description=(__doc__ or "").split(
        "\n\n")[0])
    ap.add_argument("--profile", type=Path, required=True, help="from `baton profile`")
    ap.add_argument("--check", type=Path, nargs="+", metavar="JSON",
                    help="no search: the goodput benchmark's result files, each run beside "
                    "the simulator's prediction for it (check.py)")
    ap.add_argument("--workload", choices=WORKLOADS, default="chat")
    ap.add_argument("--trace", type=Path, help="JSON lines of {t, input_len, output_len} "
                    "(seconds from the start): replayed instead of --workload at --rate")
    ap.add_argument("--rate", type=float, default=1.0, help="requests per second")
    ap.add_argument("--slo-ttft-ms", type=float)
    ap.add_argument("--slo-itl-ms", type=float)
    ap.add_argument("--cores", type=int)
    ap.add_argument("--topology", nargs="+", metavar="NAME",
                    help="no search: only these of the goodput benchmark's topologies "
                    "(pd, pd-always, pd-never, decode2, colocated), e.g. with --max-rate")
    ap.add_argument("--num-prompts", type=int, default=100)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--chunk", type=int, nargs="+", default=[2048],
                    help="max_num_batched_tokens values to try")
    ap.add_argument("--max-num-seqs", type=int, nargs="+", default=[256])
    ap.add_argument("--kv-cache-gib", type=float, default=1.0)
    ap.add_argument("--max-rate", action="store_true")
    ap.add_argument("--attainment", type=float, default=0.9)
    ap.add_argument("--top", type=int, default=3)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--kustomize", type=Path, metavar="DIR",
                    help="also write the choice as a kustomize overlay (kustomize.py)")
    ap.add_argument("--kustomize-base", default="../../deploy/kubernetes",
                    help="the overlay's base, relative to DIR")
    args = ap.parse_args(argv)
    if args.kustomize and not args.out:
        ap.error("--kustomize needs --out")
    if not args.check and None in (args.slo_ttft_ms, args.slo_itl_ms):
        ap.error("--slo-ttft-ms and --slo-itl-ms are required (or --check)")
    if not args.check and not args.topology and args.cores is None:
        ap.error("--cores is required (or --topology, or --check)")
    return args


def engines(profile: dict) -> list[tuple[int, int]]:
    """The (threads, TP) engines the profile measured."""
    return sorted({(e["threads"], e.get("tensor_parallel", 1)) for e in profile["engines"]})


def candidates(profile: dict, cores: int, chunks: list[int], seqs: list[int]
               ) -> list[Topology]:
    """Every way to fill the cores with engines the profile measured: colocated (as many
    engines of one kind as fit), and p prefill engines with as many decode engines as
    the remaining cores hold, for each p, each role's kind, and three router policies.
    Cores left idle never help, so only full (or nearly full) machines are tried."""
    out = []
    kinds = engines(profile)
    for (t, tp), chunk, n in itertools.product(kinds, chunks, seqs):
        k = cores // (t * tp)
        if k:
            out.append(Topology(f"colocated x{k} ({t}t" + (f" tp{tp}" if tp > 1 else "") + ")",
                                prefill=0, decode=k, decode_threads=t, decode_tp=tp,
                                policy=Policy(disaggregation="never"),
                                max_num_batched_tokens=chunk, max_num_seqs=n))
    for (pt, ptp), (dt, dtp), chunk, n in itertools.product(kinds, kinds, chunks, seqs):
        for p in range(1, cores):
            d = (cores - p * pt * ptp) // (dt * dtp)
            if d < 1:
                break
            for policy, mode in ((Policy(disaggregation="always"), "always"),
                                 (Policy(), "auto"),
                                 (Policy(local_prefill_queue=0.0), "auto, no queue rule")):
                out.append(Topology(
                    f"{p}P({pt}t{'' if ptp == 1 else f' tp{ptp}'}) + "
                    f"{d}D({dt}t{'' if dtp == 1 else f' tp{dtp}'}) {mode}",
                    prefill=p, decode=d, prefill_threads=pt, decode_threads=dt,
                    prefill_tp=ptp, decode_tp=dtp, policy=policy,
                    max_num_batched_tokens=chunk, max_num_seqs=n))
    return out


def rank_key(topology: Topology, r: dict) -> tuple:
    return (-(r["request_goodput"] or 0.0), -(r["slo_attainment"] or 0.0),
            topology.prefill + topology.decode)


def why(best: tuple[Topology, dict], colo: tuple[Topology, dict] | None, slos: dict) -> str:
    t, r = best
    if colo is None or colo[0] is t:
        return f"{t.name} holds the most goodput of every candidate"
    c, rc = colo
    worse = []
    for metric, key in (("TTFT", "p90_ttft_ms"), ("TPOT", "p90_tpot_ms")):
        slo = 1000 * slos["ttft" if metric == "TTFT" else "tpot"]
        if rc[key] > slo >= r[key]:
            worse.append(f"{metric} P90 {rc[key]:.0f} ms against the SLO's {slo:.0f}")
    gain = (r["request_goodput"] or 0) / max(rc["request_goodput"] or 0, 1e-9)
    return (f"{t.name}: {r['request_goodput']:.2f} good requests/s against "
            f"{rc['request_goodput']:.2f} colocated ({c.name}, {gain:.2f}x)"
            + (f"; colocated misses {', and '.join(worse)}" if worse else ""))


def line(t: Topology, r: dict) -> str:
    return (f"{t.name:<34} goodput {r['request_goodput']:6.2f}/s attain "
            f"{100 * r['slo_attainment']:5.1f}%  TTFT p50 {r['median_ttft_ms']:7.0f} p90 "
            f"{r['p90_ttft_ms']:7.0f} ms  TPOT p90 {r['p90_tpot_ms']:6.1f}  ITL p90 "
            f"{r['p90_itl_ms']:6.1f} ms")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    profile = json.loads(args.profile.read_text())
    if args.check:
        from .check import check

        print(f"profile: {profile.get('cpu', '?')}")
        check(profile, args.check, args.attainment)
        return
    slos = {"ttft": args.slo_ttft_ms / 1000, "tpot": args.slo_itl_ms / 1000}  # seconds
    runs = requests(args)
    print(f"profile: {profile.get('cpu', '?')}")
    where = f"{args.cores} cores" if args.cores else "the topologies given"
    print(f"workload {args.trace or args.workload} at {args.rate}/s on {where}, "
          f"SLO TTFT {args.slo_ttft_ms:.0f} ms, ITL (TPOT) {args.slo_itl_ms:.0f} ms "
          "(predicted by simulation, not measured)")
    tried = ([named(t) for t in args.topology] if args.topology else
             candidates(profile, args.cores, args.chunk, args.max_num_seqs))
    scored = [(t, score(t, profile, runs, slos, args.kv_cache_gib)) for t in tried]
    scored.sort(key=lambda x: rank_key(*x))
    colo = next((x for x in scored if x[0].prefill == 0), None)
    top = scored if args.topology else scored[:args.top]
    shown = top + ([colo] if colo and colo not in top else [])
    for t, r in shown:
        print(("beside them: " if colo is not None and t is colo[0]
               and colo not in top else "") + line(t, r))
    print("chose " + why(scored[0], colo, slos))
    if args.max_rate:
        for t, _ in shown:
            rate = max_rate(t, profile, args, slos, max(args.rate, 0.125))
            print(f"max rate at {100 * args.attainment:.0f}% attainment: {t.name}: "
                  f"{rate:.2f}/s")
    if args.out:
        jobs_all = [j for w, _ in runs for j in w]
        context = round(sum(len(j.prompt) + j.output_len / 2 for j in jobs_all)
                        / max(1, len(jobs_all)))
        plan = plan_file(scored[0][0], scored[0][1], args, profile, context)
        args.out.write_text(json.dumps(plan, indent=1))
        if args.kustomize:
            from .kustomize import write

            print(f"wrote {write(plan, args.kustomize, args.kustomize_base)}")
        print(f"wrote {args.out}")


def plan_file(t: Topology, r: dict, args, profile: dict, context: int) -> dict:
    """The choice: each role's replicas and flags, the router's flags, the prediction,
    and each role's autoscaling target (scaling.py) at the workload's mean context."""
    engine = ["--max-num-batched-tokens", str(t.max_num_batched_tokens),
              "--max-num-seqs", str(t.max_num_seqs), "--kv-cache-gib", str(args.kv_cache_gib)]
    p = t.policy
    router = ["--disaggregation", p.disaggregation,
              "--local-prefill-tokens", str(p.local_prefill_tokens),
              "--local-prefill-queue", str(p.local_prefill_queue)]
    roles = {"decode": {"replicas": t.decode, "threads": t.decode_threads,
                        "tensor_parallel": t.decode_tp, "flags": [
        *engine, "--threads", str(t.decode_threads),
        "--tensor-parallel-size", str(t.decode_tp)]}}
    if t.prefill:
        roles["prefill"] = {"replicas": t.prefill, "threads": t.prefill_threads,
                            "tensor_parallel": t.prefill_tp, "flags": [
            *engine, "--threads", str(t.prefill_threads),
            "--tensor-parallel-size", str(t.prefill_tp)]}
    return {"topology": {**asdict(replace(t, policy=Policy())), "policy": asdict(p)},
            "roles": roles, "router": {"flags": router},
            "predicted": {k: r[k] for k in ("request_goodput", "slo_attainment",
                                            "p90_ttft_ms", "p90_tpot_ms", "p90_itl_ms")},
            "scaling": targets(profile, t, args.slo_ttft_ms / 1000, args.slo_itl_ms / 1000,
                               context),
            "workload": str(args.trace or args.workload), "rate": args.rate,
            "slo_ms": {"ttft": args.slo_ttft_ms, "itl": args.slo_itl_ms}}


if __name__ == "__main__":
    main()
