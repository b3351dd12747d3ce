"""The suite's time per kind of test beside its budget (`make test` passes the budgets in
BATON_TEST_BUDGET, e.g. "unit=60 integration=150 e2e=150", seconds), and a warning line
for a kind over its own: the issue that adds 100 s sees it the day it does. Never a
failure: a slow or loaded machine must not turn CI red.

A kind's time is the sum of its tests' set-up, call and tear-down durations, over both
test processes (so about twice the wall time it adds on two cores)."""

from __future__ import annotations

import os
from collections import defaultdict

KINDS = ("unit", "integration", "e2e")
_spent: dict[str, float] = defaultdict(float)


def budgets(text: str | None) -> dict[str, float]:
    """"unit=60 integration=150" -> {"unit": 60.0, ...}; ValueError naming a bad part."""
    out: dict[str, float] = {}
    for part in (text or "").split():
        kind, _, seconds = part.partition("=")
        if kind not in KINDS or not seconds.replace(".", "", 1).isdigit():
            raise ValueError(f"BATON_TEST_BUDGET: {part!r} is not <{'|'.join(KINDS)}>=<s>")
        out[kind] = float(seconds)
    return out


def kind_of(nodeid: str) -> str | None:
    parts = nodeid.split("/")
    return parts[1] if len(parts) > 2 and parts[0] == "tests" and parts[1] in KINDS else None


def summary(spent: dict[str, float], budget: dict[str, float]) -> list[str]:
    """The summary's lines: each kind's time and budget, then one warning per kind over."""
    cols = [f"{k} {spent.get(k, 0.0):.0f} s" + (f" (budget {budget[k]:.0f} s)"
                                                 if k in budget else "") for k in KINDS]
    lines = ["time per kind: " + ", ".join(cols)]
    for k in KINDS:
        if k in budget and spent.get(k, 0.0) > budget[k]:
            lines.append(f"WARNING: {k} tests took {spent[k]:.0f} s, over their budget of "
                         f"{budget[k]:.0f} s (Makefile: TEST_BUDGET): make them faster, "
                         f"or say in the issue why the budget should grow")
    return lines


def pytest_runtest_logreport(report) -> None:
    kind = kind_of(report.nodeid)
    if kind is not None and not os.environ.get("PYTEST_XDIST_WORKER"):
        _spent[kind] += report.duration  # on the controller: every process's reports


def pytest_terminal_summary(terminalreporter) -> None:
    if not _spent:
        return
    try:
        budget = budgets(os.environ.get("BATON_TEST_BUDGET"))
    except ValueError as e:
        budget = {}
        terminalreporter.write_line(f"WARNING: {e}", yellow=True)
    for line in summary(_spent, budget):
        terminalreporter.write_line(line, yellow=line.startswith("WARNING"))
