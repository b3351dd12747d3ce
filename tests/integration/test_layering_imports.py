"""The layering in fresh processes: what the router, the CLI and the transfer contract load
without torch, and the engine without gRPC (the import table: tests/unit/test_layering.py)."""

from __future__ import annotations

import subprocess
import sys

from tests.unit.test_layering import ROOT


def test_router_cli_and_the_transfer_contract_load_without_torch():
    code = ("import sys\n"
            "import baton.router.server, baton.router.registry, baton.kv_transfer\n"
            "import baton.cli.main, baton.cli.flags, baton.services.rpc.server\n"
            "import baton.services.engine.config\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
    contract = ("import sys\nimport baton.kv_transfer.base\n"
                "bad = {'torch', 'transformers', 'baton.services.engine.engine'}\n"
                "bad &= set(sys.modules)\n"
                "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", contract], check=True, cwd=ROOT)


def test_the_engine_loads_without_grpc():
    # The engine raises its own errors (ValueError, services/common/capacity.AtCapacity);
    # only the gRPC shell above it turns them into status codes.
    code = ("import sys\n"
            "import baton.services.common.limits, baton.services.engine.grammar_compiler\n"
            "import baton.services.engine.engine\n"
            "bad = sorted(m for m in sys.modules if m == 'grpc' or m.startswith('grpc.'))\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
