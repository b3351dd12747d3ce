"""A tensor-parallel engine's start (services/engine/tp_ranks.py): on one host its ranks
listen on loopback only; a rank that dies before it joins fails `LLM(tensor_parallel_size=2)`
within seconds with the rank's own error (or, where its code never ran, what to do), never
after the rendezvous' timeout."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

from tests.tp_listeners import listeners

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
QUICK_S = 60  # the rendezvous waits 120 s on one host: an answer in time is not its timeout


def test_the_ranks_of_one_host_listen_on_loopback_only(make_llm, tiny_model, forked_ranks):
    """Where a rank listens is `tp_ranks.follow`'s, after it starts: its rank is forked
    from the TP modules' fork server (the tests below spawn theirs)."""
    before = listeners(os.getpid())
    llm = make_llm(model=str(tiny_model), dtype="float32", tensor_parallel_size=2)
    rank1 = llm.engine.ranks.procs[0].pid
    mine = listeners(os.getpid()) - before
    theirs = listeners(rank1)
    assert theirs, "rank 1 was meant to listen for its gloo pairs"
    assert {host for host, _ in mine | theirs} == {"127.0.0.1"}, (mine, theirs)
    assert llm.generate(["a b c"], None)[0].token_ids  # the group works


def run(script: str, model, *, stdin: bool = False, tmp_path=None) -> tuple[str, float]:
    """Run `script` with Python (as a file, or piped on stdin) and the model's path as its
    argument; (its output, seconds). It must fail."""
    code = textwrap.dedent(script)
    cmd = [sys.executable, "-"] if stdin else [sys.executable, str(tmp_path / "job.py")]
    if not stdin:
        (tmp_path / "job.py").write_text(code)
    started = time.monotonic()
    done = subprocess.run([*cmd, str(model)], input=code if stdin else None, text=True,
                          capture_output=True, timeout=QUICK_S * 2, cwd=ROOT)
    took = time.monotonic() - started
    assert done.returncode != 0, done.stdout + done.stderr
    return done.stdout + done.stderr, took


START = """
import sys
from baton.services.engine import LLM
LLM(model=sys.argv[1], dtype="float32", tensor_parallel_size=2)
"""


def test_a_script_piped_to_python_is_told_at_once_what_to_do(tiny_model):
    out, took = run(START, tiny_model, stdin=True)
    assert "is no file" in out and "__main__" in out, out[-2000:]
    assert took < QUICK_S


def test_a_script_without_a_main_guard_fails_within_seconds_saying_why(tiny_model, tmp_path):
    out, took = run(START, tiny_model, tmp_path=tmp_path)
    assert "rank 1 exited" in out and "before its code ran" in out, out[-2000:]
    assert "__main__" in out
    assert took < QUICK_S


def test_a_rank_that_fails_as_it_starts_fails_the_engine_with_its_own_error(tiny_model,
                                                                         tmp_path):
    # The spawned rank imports the script as __mp_main__: there, its loading fails.
    script = """
    import sys
    from baton.services.engine import LLM, build

    def broken(*args, **kwargs):
        raise RuntimeError("rank weights unreadable: disk gone")

    if __name__ == "__mp_main__":
        build.load_runner = broken
    if __name__ == "__main__":
        LLM(model=sys.argv[1], dtype="float32", tensor_parallel_size=2)
    """
    out, took = run(script, tiny_model, tmp_path=tmp_path)
    assert "rank weights unreadable: disk gone" in out.split("Traceback")[-1], out[-3000:]
    assert took < QUICK_S

