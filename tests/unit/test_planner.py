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
