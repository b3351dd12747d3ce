"""The goodput benchmark's plots (matplotlib, no screen): goodput and SLO attainment
against the request rate, one line per topology; and the CDFs of TTFT and ITL at one
rate every topology was measured at (the highest such)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path


def plot(results: list[dict], args, stem: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    by_topology: dict[str, list[dict]] = defaultdict(list)
    for r in results:
        by_topology[r["topology"]].append(r)
    written = []
    if args.slos:
        fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
        for topology, rs in by_topology.items():
            rs = sorted(rs, key=lambda r: r["request_rate"])
            rates = [r["request_rate"] for r in rs]
            left.plot(rates, [r["request_goodput"] for r in rs], marker="o", label=topology)
            right.plot(rates, [100 * r["slo_attainment"] for r in rs], marker="o",
                       label=topology)
        right.axhline(100 * args.attainment, color="grey", linestyle=":")
        left.set(xlabel="request rate (req/s)", ylabel="goodput (req/s)",
                 title=f"{args.workload}: goodput at {' '.join(args.goodput)}")
        right.set(xlabel="request rate (req/s)", ylabel="SLO attainment (%)",
                  title="requests meeting every SLO")
        left.legend()
        fig.tight_layout()
        written.append(_save(fig, stem, "goodput"))
    # The CDFs: the topologies whose points carry each request's times (all of a run's).
    timed = {t: rs for t, rs in by_topology.items() if all("ttfts" in r for r in rs)}
    common = set.intersection(*({r["request_rate"] for r in rs}
                                for rs in timed.values())) if timed else set()
    if common:
        rate = max(common)
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for topology, rs in timed.items():
            r = next(r for r in rs if r["request_rate"] == rate)
            ttft = np.sort(np.asarray(r["ttfts"]) * 1000)
            itl = np.sort(np.asarray([x for xs in r["itls"] for x in xs]) * 1000)
            for ax, xs in zip(axes, (ttft, itl), strict=True):
                if len(xs):
                    ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=topology)
        axes[0].set(xlabel="TTFT (ms)", ylabel="fraction of requests",
                    title=f"{args.workload} at {rate:.2f} req/s: TTFT")
        axes[1].set(xlabel="ITL (ms)", ylabel="fraction of gaps", title="ITL",
                    xscale="log")
        axes[0].legend()
        fig.tight_layout()
        written.append(_save(fig, stem, "cdf"))
    return written


def _save(fig, stem: Path, what: str) -> Path:
    import matplotlib.pyplot as plt

    path = stem.with_name(f"{stem.name}-{what}.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
