"""`make soak`'s report (scripts/soak.py): every failed or errored test of a round's JUnit
file, and the logs of the services its module ran against."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("soak", ROOT / "scripts" / "soak.py")
soak = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(soak)
failures, logs_of = soak.failures, soak.logs_of

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.e2e.test_failures" name="test_ok" time="1.0"/>
<testcase classname="tests.e2e.test_failures" name="test_killed" time="2.0">
  <failure message="AssertionError: no prefill worker&#10;more">trace</failure></testcase>
<testcase classname="tests.e2e.test_robustness" name="test_lease" time="1.0">
  <error message="failed on setup">trace</error></testcase>
</testsuite></testsuites>"""


def test_each_failure_and_error_is_named_with_its_first_line(tmp_path):
    junit = tmp_path / "round-1.xml"
    junit.write_text(JUNIT)
    assert failures(junit) == [
        ("tests.e2e.test_failures::test_killed", "AssertionError: no prefill worker"),
        ("tests.e2e.test_robustness::test_lease", "failed on setup")]
    assert failures(tmp_path / "missing.xml")[0][0] == "(the round)"


def test_a_failure_shows_its_own_modules_logs(tmp_path):
    (tmp_path / "failures0").mkdir()
    (tmp_path / "failures0" / "router-1.log").write_text("a\nb\nrouter said why\n")
    (tmp_path / "services0").mkdir()
    (tmp_path / "services0" / "decode-2.log").write_text("unrelated\n")
    lines = logs_of(tmp_path, "tests.e2e.test_failures::test_killed", lines=2)
    assert lines[0].endswith("failures0/router-1.log")
    assert lines[1:] == ["    b", "    router said why"]
    # A module with no folder of its own: every log of the round.
    assert len(logs_of(tmp_path, "tests.e2e.test_other::t")) == 2 + 4
