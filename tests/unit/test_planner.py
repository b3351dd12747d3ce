"""`baton plan` on a hand-made profile where the answer can be worked out: W3's long
prompts (0.26-0.53 s of prefill each at 0.5 ms a token) stall every decode that shares
an engine with them, so at a TPOT target of 30 ms (a decode step is 20 ms) only the
disaggregated topologies keep their decodes on time; at a loose target colocated engines
serve as well. Its first choice has the most goodput of every candidate, the colocated
alternative is printed beside it, and the plan file carries the chosen roles' flags."""

from __future__ import annotations

import json

from baton.tools.plan import planner
from tests.unit.test_plan_simulator import profile


def plan(tmp_path, capsys, itl_ms: int) -> tuple[dict, str]:
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile()))
    out = tmp_path / "plan.json"
    planner.main(["--profile", str(path), "--workload", "w3", "--rate", "1",
                  "--slo-ttft-ms", "5000", "--slo-itl-ms", str(itl_ms), "--cores", "2",
                  "--num-prompts", "30", "--seeds", "0", "--out", str(out)])
    return json.loads(out.read_text()), capsys.readouterr().out


def test_a_tight_itl_target_chooses_disaggregation_and_says_why(tmp_path, capsys):
    chosen, text = plan(tmp_path, capsys, 30)
    assert chosen["roles"]["prefill"]["replicas"] == 1, text
    assert chosen["roles"]["decode"]["replicas"] == 1
    assert chosen["router"]["flags"][1] in ("always", "auto")
    assert "colocated misses TPOT P90" in text, text  # why, against the colocated one
    assert "beside them: colocated" in text, text
    # The first choice has the most goodput of any candidate printed.
    goodputs = [float(line.split("goodput")[1].split("/s")[0])
                for line in text.splitlines() if " goodput " in line]
    assert round(chosen["predicted"]["request_goodput"], 2) == max(goodputs)


def test_a_loose_itl_target_needs_no_prefill_worker(tmp_path, capsys):
    chosen, text = plan(tmp_path, capsys, 200)
    assert "prefill" not in chosen["roles"], text  # every candidate meets it: fewest engines
    assert chosen["predicted"]["slo_attainment"] == 1.0


def test_the_check_replays_the_benchmarks_own_requests(tmp_path, capsys):
    """A result file written as the benchmark writes one (its runs' fields), here from
    the simulator itself: the check must replay exactly those requests, so each of its
    predictions equals the 'measured' figure, and its highest-rate search agrees with
    the best passing rate among them."""
    from baton.tools.bench.goodput_stats import parse_slos
    from baton.tools.plan.check import check, requests_of
    from baton.tools.plan.scoring import score
    from baton.tools.plan.simulator import named

    slos_ms = ["ttft:5000", "tpot:30"]
    runs = []
    for rate in (1.0, 3.0):
        run = {"topology": "pd", "workload": "w3", "request_rate": rate, "seeds": [0, 1],
               "num_prompts": 20, "burstiness": 1.0}
        run.update(score(named("pd"), profile(), requests_of(run), parse_slos(slos_ms), 1.0))
        runs.append(run)
    path = tmp_path / "goodput-w3.json"
    path.write_text(json.dumps({"workload": "w3", "slos_ms": slos_ms, "runs": runs}))
    rows = check(profile(), [path], 0.9)
    for row in rows[:2]:
        for key in ("slo_attainment", "p90_ttft_ms", "p90_itl_ms", "p90_tpot_ms"):
            assert row["predicted"][key] == row["measured"][key]
    assert "(measured / predicted)" in capsys.readouterr().out
    (top,) = rows[2:]
    passing = [r["request_rate"] for r in runs if r["slo_attainment"] >= 0.9]
    assert passing == [1.0]  # 3/s does not hold
    # The search starts at the best measured rate, which holds on the same requests.
    assert top["max_rate_predicted"] >= 1.0


def test_the_checks_cpu_line_names_each_workers_cores():
    """A colocated engine computes on both cores: each second of its steps may cost two
    of CPU, so its measured CPU is set beside that range; one-core workers beside their
    steps alone. The names are the benchmark's (prefill-0, decode-0, decode-1)."""
    from baton.tools.plan.check import cpu_line, threads
    from baton.tools.plan.simulator import named

    assert threads(named("colocated")) == {"decode-0": 2}
    assert threads(named("pd")) == {"prefill-0": 1, "decode-0": 1}
    assert threads(named("decode2")) == {"decode-0": 1, "decode-1": 1}
    line = cpu_line({"decode-0": 96.8, "client": 2.6}, {"decode-0": 83.3},
                    threads(named("colocated")))
    assert line.endswith("decode-0 96.8 / 83.3-166.6 (2 cores), client 2.6")
    line = cpu_line({"prefill-0": 16.4, "decode-0": 73.6, "router": 5.0},
                    {"prefill-0": 13.7, "decode-0": 80.1}, threads(named("pd")))
    assert line.endswith("prefill-0 16.4 / 13.7, decode-0 73.6 / 80.1, router 5.0")


def test_the_autoscaling_example_is_valid_and_carries_the_plans_targets(tmp_path, capsys):
    """deploy/kubernetes/examples/autoscaling.yaml: valid for the Kubernetes API, scaling
    the two worker Deployments, with the targets its comment's `baton plan` command
    writes from the profile it names."""
    import shlex
    from pathlib import Path

    import kubernetes_validate
    import yaml

    root = Path(__file__).resolve().parents[2]
    path = root / "deploy" / "kubernetes" / "examples" / "autoscaling.yaml"
    text = path.read_text()
    docs = [d for d in yaml.safe_load_all(text) if d]
    for doc in docs:
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)
    lines = [line.removeprefix("#").strip().removesuffix("\\").strip()
             for line in text.splitlines()[2:4]]  # the command, over two comment lines
    command = " ".join(lines)
    argv = shlex.split(command)
    assert argv[:2] == ["baton", "plan"], command
    out = tmp_path / "plan.json"
    argv[argv.index("--out") + 1] = str(out)
    argv[argv.index("--profile") + 1] = str(root / argv[argv.index("--profile") + 1])
    planner.main(argv[2:])
    scaling = json.loads(out.read_text())["scaling"]
    by_name = {d["spec"]["scaleTargetRef"]["name"]: d["spec"]["metrics"][0]["pods"]
               for d in docs}
    for role in ("prefill", "decode"):
        pods = by_name[f"baton-{role}"]
        assert pods["metric"]["name"] == scaling[role]["metric"].replace(":", "_")
        assert int(pods["target"]["averageValue"]) == scaling[role]["average"]


def test_the_kustomize_overlay_sets_replicas_and_flags_on_the_base(tmp_path, capsys):
    """`--kustomize`: each worker Deployment's replicas and every plan flag as its BATON_*
    variable, merged into the base's containers by name (as kustomize's strategic merge
    does); the result is still valid for the Kubernetes API, and reading the variables
    back through the CLI's own flag table gives the plan's values."""
    from pathlib import Path

    import kubernetes_validate
    import pytest
    import yaml

    from baton.cli.flag_table import FLAGS
    from baton.tools.plan.kustomize import env_of

    chosen, _ = plan(tmp_path, capsys, 30)  # a P/D choice (the first test's)
    folder = tmp_path / "overlay"
    argv = ["--profile", str(tmp_path / "profile.json"), "--workload", "w3",
                    "--rate", "1", "--slo-ttft-ms", "5000", "--slo-itl-ms", "30",
                    "--cores", "2", "--num-prompts", "30", "--seeds", "0",
                    "--out", str(tmp_path / "p.json"), "--kustomize", str(folder)]
    planner.main(argv)
    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
    base = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
    deployments = {d["metadata"]["name"]: d for p in base.glob("*.yaml")
                   if p.name != "kustomization.yaml"
                   for d in yaml.safe_load_all(p.read_text()) if d and d["kind"] == "Deployment"}
    envs = {f.env: f for f in FLAGS}
    for entry in kustomization["patches"]:
        patch = yaml.safe_load((folder / entry["path"]).read_text())
        target = deployments[patch["metadata"]["name"]]
        if "replicas" in patch["spec"]:
            target["spec"]["replicas"] = patch["spec"]["replicas"]
        (pc,) = patch["spec"]["template"]["spec"]["containers"]
        container = next(c for c in target["spec"]["template"]["spec"]["containers"]
                         if c["name"] == pc["name"])
        merged = {e["name"]: e for e in container.get("env", [])}
        merged.update({e["name"]: e for e in pc["env"]})
        container["env"] = list(merged.values())
        kubernetes_validate.validate(target, kubernetes_validate.latest_version(), strict=True)
        assert all(e["name"] in envs for e in pc["env"])
    replicas = deployments["baton-prefill"]["spec"]["replicas"]
    assert replicas == chosen["roles"]["prefill"]["replicas"]
    decode_env = {e["name"]: e["value"] for e in
                  deployments["baton-decode"]["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert decode_env["BATON_THREADS"] == "1"
    with pytest.raises(ValueError, match="not a flag of the decode role"):
        env_of(["--disaggregation", "always"], "decode")
