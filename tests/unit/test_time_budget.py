"""`make test`'s time per kind beside its budget (tests/time_budget.py): every kind
summed apart, a warning line only for a kind over its own budget, never a failure."""

from __future__ import annotations

import pytest

from tests.time_budget import budgets, kind_of, summary


def test_budgets_parse_and_a_bad_one_is_named():
    assert budgets("unit=60 integration=150.5 e2e=150") == {
        "unit": 60.0, "integration": 150.5, "e2e": 150.0}
    assert budgets(None) == {} == budgets("")
    for bad in ("unit", "gpu=5", "e2e=-1", "unit=1s"):
        with pytest.raises(ValueError, match="BATON_TEST_BUDGET"):
            budgets(bad)


def test_each_test_counts_for_its_folder_only():
    assert kind_of("tests/unit/test_x.py::test_a") == "unit"
    assert kind_of("tests/e2e/test_y.py::test_b[p]") == "e2e"
    assert kind_of("tests/test_top.py::test_c") is None
    assert kind_of("other/unit/test_z.py::t") is None


def test_only_a_kind_over_its_budget_warns():
    spent = {"unit": 61.2, "integration": 100.0, "e2e": 151.0}
    lines = summary(spent, {"unit": 60, "integration": 150})
    assert lines[0] == ("time per kind: unit 61 s (budget 60 s), integration 100 s "
                        "(budget 150 s), e2e 151 s")
    assert len(lines) == 2 and lines[1].startswith("WARNING: unit tests took 61 s")
    assert summary(spent, {}) == [lines[0].replace(" (budget 60 s)", "").replace(
        " (budget 150 s)", "")]
