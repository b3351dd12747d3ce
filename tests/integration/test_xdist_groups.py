"""The test scheduler (tests/xdist_groups.py) under the locked pytest-xdist: every module
runs on one process, and all the modules that take a shared fixture run on one process."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CONFTEST = '''
import os
import pytest
from tests.xdist_groups import pytest_xdist_make_scheduler  # noqa: F401

@pytest.fixture(scope="session")
def hf_model():
    return None

@pytest.fixture(autouse=True)
def record(request):
    with open(os.environ["RECORD"], "a") as f:
        f.write(f"{request.node.module.__name__} {os.environ['PYTEST_XDIST_WORKER']}\\n")
'''


def test_modules_and_shared_fixtures_each_stay_on_one_process(tmp_path):
    (tmp_path / "conftest.py").write_text(CONFTEST)
    # Six modules share hf_model and four do not: left to xdist's own per-module scopes,
    # the six would be spread over both processes.
    for i in range(6):
        (tmp_path / f"test_shared{i}.py").write_text(
            "".join(f"def test_{j}(hf_model):\n    pass\n" for j in range(3)))
    for i in range(4):
        (tmp_path / f"test_plain{i}.py").write_text(
            "".join(f"def test_{j}():\n    pass\n" for j in range(5)))
    record = tmp_path / "record.txt"
    env = dict(os.environ, RECORD=str(record),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "-n", "2", "--dist", "loadgroup", "--rootdir", str(tmp_path),
                          str(tmp_path)], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    where: dict[str, set[str]] = defaultdict(set)
    for line in record.read_text().splitlines():
        module, worker = line.split()
        where[module].add(worker)
    assert len(where) == 10 and sum(1 for _ in record.read_text().splitlines()) == 38
    assert all(len(workers) == 1 for workers in where.values()), dict(where)
    shared = set().union(*(where[f"test_shared{i}"] for i in range(6)))
    assert len(shared) == 1, dict(where)
    # ... and the two processes both worked: the plain modules went to the other one too.
    assert len(set().union(*where.values())) == 2, dict(where)
