"""`baton up --plan`: the workers a plan from `baton plan --out` asks for, each role on
consecutive ports from its first, with the role's flags, each on cores of its own when
the machine has enough; the router gets every worker and the plan's router flags."""

from __future__ import annotations

import argparse
import json

import pytest

from baton.cli import up as up_module


def args_for(plan_path, **kw) -> argparse.Namespace:
    base = dict(plan=str(plan_path), prefill_port=50061, decode_port=50071,
                prefill_metrics_port=8061, decode_metrics_port=8071, http_port=8000,
                prefill_tensor_parallel_size=None, decode_tensor_parallel_size=None,
                api_key=None)
    return argparse.Namespace(**{**base, **kw})


PLAN = {"roles": {
    "prefill": {"replicas": 2, "threads": 2, "tensor_parallel": 1,
                "flags": ["--threads", "2", "--max-num-batched-tokens", "1024"]},
    "decode": {"replicas": 3, "threads": 1, "tensor_parallel": 1,
               "flags": ["--threads", "1"]}},
    "router": {"flags": ["--disaggregation", "always"]}}


def test_each_worker_gets_its_ports_flags_and_cores(tmp_path, monkeypatch):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(PLAN))
    monkeypatch.setattr(up_module.os, "sched_getaffinity", lambda _: set(range(8)))
    got = up_module.planned_workers(args_for(path))
    assert [(r, p, m) for r, p, m, _ in got] == [
        ("prefill", 50061, 8061), ("prefill", 50062, 8062),
        ("decode", 50071, 8071), ("decode", 50072, 8072), ("decode", 50073, 8073)]
    cpus = [own[own.index("--cpus") + 1] for *_, own in got]
    assert cpus == ["0,1", "2,3", "4", "5", "6"]  # 2 + 2 + 1 + 1 + 1 of the 8 cores
    assert got[0][3][:4] == ["--threads", "2", "--max-num-batched-tokens", "1024"]
    argv, _ = up_module.router_launch(args_for(path), [], ["a:1", "a:2"], ["b:1"], {})
    assert argv == ["--prefill", "a:1", "--prefill", "a:2", "--decode", "b:1",
                    "--disaggregation", "always", "--http-port", "8000"]


def test_too_few_cores_share_them_with_a_warning(tmp_path, monkeypatch, capsys):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(PLAN))
    monkeypatch.setattr(up_module.os, "sched_getaffinity", lambda _: {0, 1})
    got = up_module.planned_workers(args_for(path))
    assert len(got) == 5 and not any("--cpus" in own for *_, own in got)
    assert "need 7 cores" in capsys.readouterr().err


def test_a_plan_whose_prefill_ports_run_into_the_decode_ports_is_refused(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"roles": {**PLAN["roles"], "prefill": {
        **PLAN["roles"]["prefill"], "replicas": 11}}}))
    with pytest.raises(RuntimeError, match="set --decode-port"):
        up_module.planned_workers(args_for(path))
    path.write_text("{not json")
    with pytest.raises(RuntimeError, match="--plan"):
        up_module.planned_workers(args_for(path))
