"""`--cpus`: a worker pins every thread of its process (and what it starts later) to the
cores given, and takes that many torch threads; a list that does not parse, or a core
the process may not use, is refused naming it."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

from baton.services.worker.config import WorkerConfig, parse_cpus
from tests.e2e.topology import ROOT

PROBE = """
import os, sys, threading, time
started = threading.Event()
threading.Thread(target=lambda: (started.set(), time.sleep(5)), daemon=True).start()
started.wait()  # a thread that runs before the pin: it is moved too
from baton.services.worker.runtime import pin
pin({int(c) for c in sys.argv[1].split(",")})
later = []
t = threading.Thread(target=lambda: later.append(os.sched_getaffinity(0)))
t.start(); t.join()
def affinity(tid):
    try:
        return sorted(os.sched_getaffinity(tid))
    except ProcessLookupError:  # a thread that ended after the listing (a joined thread's
        return None             # task can outlive join() by a moment)
tasks = [a for a in map(affinity, map(int, os.listdir("/proc/self/task"))) if a is not None]
print(sorted(later[0]), tasks)
"""


def test_a_cpu_list_parses_as_taskset_writes_it():
    assert parse_cpus("0") == {0} and parse_cpus("2-3") == {2, 3}
    assert parse_cpus("0, 4-6") == {0, 4, 5, 6}
    for bad in ("", "a", "3-1", "1-", "-1", "0;1"):
        with pytest.raises(ValueError, match="cpus"):
            parse_cpus(bad)
    with pytest.raises(ValueError, match="cpus"):
        WorkerConfig(cpus="1-x")
    assert WorkerConfig(cpus="0-1").cpu_set == {0, 1}


def test_pinning_moves_every_thread_and_those_started_after():
    core = min(os.sched_getaffinity(0))
    out = subprocess.run([sys.executable, "-c", PROBE, str(core)], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    later, tasks = out.stdout.strip().split(" ", 1)
    assert later == f"[{core}]"
    threads = ast.literal_eval(tasks)
    assert len(threads) >= 2 and all(t == [core] for t in threads), tasks


def test_a_core_the_process_may_not_use_is_refused():
    out = subprocess.run([sys.executable, "-c", PROBE, "4095"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "this process may run on" in out.stderr, out.stderr
