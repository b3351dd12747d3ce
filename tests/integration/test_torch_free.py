"""The torch-free code (the client, the router, services/common, the CLI's flags) is
tested without torch: these unit modules, run alone in a fresh process, never import it
, so a torch import creeping into that code, or into the test fixtures (tests/conftest.py,
tests/engine_fixtures.py), fails here."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# The unit modules that run torch-free product code. Those that only read the repository's
# files (test_docs, test_layering, test_lock, test_packaging, test_proto_comments: a
# third of this run's time) import no product module, so they cannot pull torch in.
TORCH_FREE = [
    "test_before_admission", "test_cli_flags", "test_constraint_limits", "test_deploy",
    "test_deploy_compose", "test_json_stream", "test_kv_store", "test_kv_tier_files",
    "test_limits", "test_openai_errors", "test_openai_protocol", "test_reasoning_parsers",
    "test_render", "test_sampling_fields_api", "test_sampling_params", "test_tool_parsers",
]

# Runs pytest in this process, then names the first test after which torch was loaded.
RUN = """
import sys, pytest
class Watch:
    first = None
    def pytest_runtest_teardown(self, item):
        if "torch" in sys.modules and self.first is None:
            self.first = item.nodeid
watch = Watch()
code = pytest.main(["-q", "-n", "0", "-p", "no:cacheprovider", *sys.argv[1:]], plugins=[watch])
print("FIRST:", watch.first)
sys.exit(int(code))
"""


def run_without_torch(modules: list[str]) -> subprocess.CompletedProcess:
    paths = [str(ROOT / "tests" / "unit" / f"{m}.py") for m in modules]
    return subprocess.run([sys.executable, "-c", RUN, *paths], cwd=ROOT, text=True,
                          capture_output=True, timeout=600,
                          env={**os.environ, "PYTEST_ADDOPTS": ""})


def test_the_torch_free_tests_run_without_importing_torch():
    out = run_without_torch(TORCH_FREE)
    tail = out.stdout[-3000:] + out.stderr[-2000:]
    assert out.returncode == 0, tail
    assert "FIRST: None" in out.stdout, tail
