"""The groups tests/xdist_groups.py gives the modules at their paths in the three folders
(that the scheduler keeps each group on one process: tests/integration/test_xdist_groups.py)."""

from __future__ import annotations

from pathlib import Path

from tests.xdist_groups import SHARED, group

ROOT = Path(__file__).resolve().parents[2]


def test_the_modules_sharing_a_fixture_group_together_and_the_rest_alone():
    groups = {str(p.relative_to(ROOT)): group(ROOT, str(p.relative_to(ROOT)))
              for p in sorted((ROOT / "tests").glob("*/test_*.py"))}
    assert {"tests/unit", "tests/integration", "tests/e2e"} <= {
        str(Path(m).parent) for m in groups}
    shared = {name: sorted(m for m, g in groups.items() if g == name) for name in SHARED}
    assert shared["hf_model"] and all(m.startswith("tests/integration/")
                                      for m in shared["hf_model"]), shared
    assert shared["topology"] and all(m.startswith("tests/e2e/")
                                      for m in shared["topology"]), shared
    assert all(g == m for m, g in groups.items() if g not in SHARED)
