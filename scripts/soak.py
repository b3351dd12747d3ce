"""`make soak`: the e2e tests again and again on a loaded machine, every failure with the
logs of the services it ran against. Not part of `.ci/run`: ten runs of tests/e2e, each
slowed by the hogs.

    python scripts/soak.py [--rounds 10] [--hogs 2] [--out .cache/soak] [pytest args...]

Each round is one `pytest tests/e2e` as `make test` runs it (two processes), with its own
--basetemp (the services' logs stay there) and a JUnit file; `--hogs` processes spin on
the CPU the whole time, as other work on a shared CI machine would. At the end: each
failure by round, the last lines of its module's service logs, and the count per test.
The exit status is 1 if any round failed.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SPIN = "while True: pass"


def failures(junit: Path) -> list[tuple[str, str]]:
    """(test id, first line of its failure or error) for each test that did not pass."""
    if not junit.is_file():
        return [("(the round)", "pytest wrote no report: it crashed or was killed")]
    out = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        for bad in (*case.iter("failure"), *case.iter("error")):
            test = f"{case.get('classname', '')}::{case.get('name', '')}"
            out.append((test, (bad.get("message") or "").splitlines()[0][:200]
                        if bad.get("message") else bad.tag))
    return out


def logs_of(basetemp: Path, test: str, lines: int = 15) -> list[str]:
    """The last lines of every service log in the round's folders made by the test's
    module (each module's topology names its folder; all of them when none matches)."""
    module = test.split("::")[0].rsplit(".", 1)[-1].removeprefix("test_")
    found = sorted(p for p in basetemp.rglob("*.log") if module in str(p.parent))
    found = found or sorted(basetemp.rglob("*.log"))
    out = []
    for path in found:
        tail = path.read_text(errors="replace").splitlines()[-lines:]
        out += [f"    --- {path}"] + [f"    {line}" for line in tail]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--hogs", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / ".cache" / "soak")
    args, pytest_args = ap.parse_known_args(argv)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = args.out / stamp
    out.mkdir(parents=True, exist_ok=True)
    hogs = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(args.hogs)]
    seen: list[tuple[int, str, str]] = []
    try:
        for n in range(1, args.rounds + 1):
            basetemp, junit = out / f"round-{n}", out / f"round-{n}.xml"
            start = time.monotonic()
            subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist",
                            "loadgroup", "-p", "no:cacheprovider", "--basetemp",
                            str(basetemp), "--junitxml", str(junit), *pytest_args,
                            "tests/e2e"], cwd=ROOT, check=False)
            bad = failures(junit)
            print(f"soak round {n}/{args.rounds}: {len(bad)} failed in "
                  f"{time.monotonic() - start:.0f} s", flush=True)
            for test, why in bad:
                seen.append((n, test, why))
                print(f"  FAILED {test}: {why}")
                print("\n".join(logs_of(basetemp, test)), flush=True)
    finally:
        for hog in hogs:
            hog.kill()
    print(f"soak: {args.rounds} rounds with {args.hogs} CPU hogs, {len(seen)} failures "
          f"(reports and logs under {out})")
    for test, count in Counter(test for _, test, _ in seen).most_common():
        rounds = [n for n, t, _ in seen if t == test]
        print(f"  {count} x {test} (rounds {', '.join(map(str, rounds))})")
    return 1 if seen else 0


if __name__ == "__main__":
    sys.exit(main())
