"""`baton bench goodput` end to end, a few seconds on the tiny model: it starts a P/D
topology pinned to the cores (the router told to disaggregate always, then never), sends
an open-loop load through the OpenAI API, and writes vLLM's result fields and the plots;
its figures agree with its own per-request data and the router's counts.

The benchmark runs in this process, its services forked from the e2e zygote (the imports
done once, tests/e2e/zygote.py) instead of spawned: the same `baton serve` command lines
without six processes' imports (alone, 29 s of CPU became 20 s, the zygote's start
included). `baton up`'s test starts real processes the way a user does, and
test_bench_sigterm.py runs the benchmark's own process."""

from __future__ import annotations

import json
import signal
import subprocess
from types import SimpleNamespace

import numpy as np
import pytest

from baton.services.rpc.processes import serve_command
from baton.tools.bench import goodput, goodput_topology
from tests.e2e.topology import ZYGOTE


def forked_from_the_zygote(logs):
    """processes.spawn's signature; the service forked by the e2e zygote."""

    def spawn(role: str, address: str, flags: list[str], **popen) -> subprocess.Popen:
        log = logs / f"{role}-{address.rpartition(':')[2]}.log"
        return ZYGOTE.spawn(serve_command(role, address, *flags), log, popen["env"])

    return spawn


def run_bench(argv: list[str], tmp_path, monkeypatch, capsys):
    if ZYGOTE is not None:
        monkeypatch.setattr(goodput_topology, "spawn", forked_from_the_zygote(tmp_path))
    handler = signal.getsignal(signal.SIGTERM)  # the benchmark sets its own
    try:
        goodput.main(argv)
    finally:
        signal.signal(signal.SIGTERM, handler)
    return SimpleNamespace(stdout=capsys.readouterr().out)


def test_the_goodput_benchmark_runs_and_its_result_adds_up(tiny_model, tmp_path, monkeypatch,
                                                           capsys):
    argv = ["--workload", "w3",
           "--topology", "pd-always", "pd-never", "--model", str(tiny_model), "--dtype", "float32",
           "--kv-cache-gib", "0.05", "--num-prompts", "6", "--seeds", "0", "1",
           "--num-warmups", "2", "--request-rate", "8", "--goodput", "ttft:60000", "e2el:1",
           "--result-dir", str(tmp_path)]
    done = run_bench(argv, tmp_path, monkeypatch, capsys)
    assert "pd-always  rate  8.00/s  done   12/12" in done.stdout, done.stdout
    (path,) = tmp_path.glob("goodput-w3-*.json")
    run, local = json.loads(path.read_text())["runs"]
    # Where each prompt was computed, from the router's own counts: every one on the
    # prefill worker, then every one on the decode worker.
    assert run["local_prefills"] == {}
    assert local["local_prefills"] == {"disaggregation_never": 12}
    assert "local 100% (disaggregation_never 12)" in done.stdout
    assert run["completed"] == 12 and run["failed"] == 0 and run["request_rate"] == 8
    # Each process's CPU over the point, by the simulator's names (the planner's check
    # sets them beside its steps): every one of them worked.
    assert set(run["cpu_s"]) == {"prefill-0", "decode-0", "router", "client"}
    assert min(run["cpu_s"].values()) > 0 and run["wall_s"] >= run["duration"]
    assert run["output_lens"] == [16] * 12  # W3: 16 tokens each, ignore_eos
    # e2el <= 1 ms is met by nobody: goodput and attainment 0, whatever the throughput.
    assert run["request_goodput"] == 0 and run["slo_attainment"] == 0
    assert run["request_throughput"] == pytest.approx(12 / run["duration"])
    ttfts = np.asarray(run["ttfts"]) * 1000
    assert run["p90_ttft_ms"] == pytest.approx(np.percentile(ttfts, 90))
    itls = np.concatenate([np.asarray(x) for x in run["itls"]]) * 1000
    assert run["median_itl_ms"] == pytest.approx(np.median(itls))
    assert sorted(p.name.rsplit("-", 1)[1] for p in tmp_path.glob("*.png")) == \
        ["cdf.png", "goodput.png"]
