"""The CLI as a process: its help, its one-line errors for bad values, and where the cluster
token goes (the flags themselves: tests/unit/test_cli_flags.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from baton.cli.flags import FLAGS, argv_for
from baton.cli.main import parse
from baton.services.rpc.config import ServiceConfig
from tests.e2e.topology import ROOT
from tests.unit.test_cli_flags import _configs


def test_help_shows_every_flags_variable_and_default():
    for role in ("router", "prefill", "decode", "colocated"):
        out = subprocess.run([sys.executable, "-m", "baton.cli", "serve", "--role", role, "--help"],
                             capture_output=True, text=True, cwd=ROOT, check=True,
                             env={"COLUMNS": "300", "PATH": ""}).stdout
        for flag in FLAGS:
            if role in flag.roles and not flag.hidden:
                assert f"--{flag.name}" in out and flag.env in out, (role, flag.name)


@pytest.mark.parametrize("env, says", [
    ({"BATON_MAX_NUM_SEQS": "x"}, "BATON_MAX_NUM_SEQS='x': not an integer"),
    ({"BATON_ENFORCE_EAGER": "maybe"}, "BATON_ENFORCE_EAGER='maybe': not a boolean"),
    ({"BATON_DTYPE": "int4"}, "BATON_DTYPE='int4': not one of"),
    ({"BATON_KV_CACHE_GIB": "-1"}, "kv_cache_gib must be > 0"),
])
def test_a_bad_value_gets_one_line_naming_it(env, says):
    proc = subprocess.run([sys.executable, "-m", "baton.cli", "serve", "--role", "decode"],
                          capture_output=True, text=True, cwd=ROOT, timeout=60,
                          env={**env, "PATH": ""})
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], proc.stderr


def test_the_cluster_token_reaches_each_cluster_role_but_never_help_or_a_childs_argv(
        monkeypatch):
    from baton.cli.up import cluster_env

    token = "t0ken-" * 4
    # The colocated role too: its ranks on other hosts prove it, and the KV tiers' MAC.
    for role in ("router", "prefill", "decode", "colocated"):
        got = _configs(role, env={"BATON_CLUSTER_TOKEN": token}, monkeypatch=monkeypatch)
        assert ServiceConfig(**got["service"]).cluster_secret() == token
    out = subprocess.run([sys.executable, "-m", "baton.cli", "serve", "--role", "decode", "--help"],
                         capture_output=True, text=True, cwd=ROOT, check=True,
                         env={"COLUMNS": "300", "PATH": "", "BATON_CLUSTER_TOKEN": token}
                         ).stdout
    assert "BATON_CLUSTER_TOKEN" in out and token not in out
    # baton up: through the environment (ps shows argv), the one given or a fresh one.
    monkeypatch.delenv("BATON_CLUSTER_TOKEN")
    args, flags = parse(["up", "--cluster-token", token])
    assert all(token not in argv_for(args, flags, r) for r in ("prefill", "decode", "router"))
    assert cluster_env(args)["BATON_CLUSTER_TOKEN"] == token
    args, _ = parse(["up"])
    made = [cluster_env(args)["BATON_CLUSTER_TOKEN"] for _ in range(2)]
    assert made[0] != made[1] and ServiceConfig(cluster_token=made[0]).cluster_secret()
