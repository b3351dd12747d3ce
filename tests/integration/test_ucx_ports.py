"""The Kubernetes NetworkPolicy opens NIXL's ports by number (deploy/kubernetes): that only
works if UCX, as NIXL ships it, listens where the workers' UCX_TCP_PORT_RANGE says."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
LISTENING = """
import os
from nixl_cu12 import nixl_agent, nixl_agent_config
agent = nixl_agent("probe", nixl_agent_config(backends=["UCX"]))
mine = set()
for fd in os.listdir("/proc/self/fd"):
    try:
        link = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:  # the listing's own descriptor, closed by now
        continue
    if link.startswith("socket:["):
        mine.add(link[8:-1])
for table in ("/proc/net/tcp", "/proc/net/tcp6"):
    for row in open(table).read().splitlines()[1:]:
        cols = row.split()
        if cols[3] == "0A" and cols[9] in mine:  # LISTEN, one of ours
            print(int(cols[1].rsplit(":", 1)[1], 16))
"""


def _port_ranges() -> set[str]:
    ranges = set()
    for role in ("prefill", "decode"):
        for doc in yaml.safe_load_all((ROOT / "deploy/kubernetes" / f"{role}.yaml").read_text()):
            if doc["kind"] == "Deployment":
                for c in doc["spec"]["template"]["spec"]["containers"]:
                    ranges |= {e["value"] for e in c["env"] if e["name"] == "UCX_TCP_PORT_RANGE"}
    return ranges


def test_ucx_listens_only_in_the_port_range_the_workers_set():
    pytest.importorskip("nixl_cu12")
    if not Path("/proc/net/tcp").exists():
        pytest.skip("needs Linux /proc")
    (span,) = _port_ranges()
    low, high = map(int, span.split("-"))
    env = {**os.environ, "UCX_TLS": "tcp,self", "UCX_TCP_PORT_RANGE": span,
           "UCX_WARN_UNUSED_ENV_VARS": "y", "NIXL_LOG_LEVEL": "WARN"}
    out = subprocess.run([sys.executable, "-c", LISTENING], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "unused environment variable" not in out.stderr  # UCX knows the name
    ports = [int(p) for p in out.stdout.split()]
    assert ports and all(low <= p <= high for p in ports), ports
