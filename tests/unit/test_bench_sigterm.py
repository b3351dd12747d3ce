"""`baton bench goodput` and `baton profile` start services in sessions of their own and
stop them in a `finally`; SIGTERM's default action would skip it and leave them running
(seen when a search was stopped by hand). `exit_on_sigterm` turns SIGTERM into an exit
that runs it."""

from __future__ import annotations

import os
import signal
import time

import pytest

from baton.tools.bench.goodput_topology import exit_on_sigterm


def test_sigterm_exits_through_the_finally_that_stops_the_topology():
    old = signal.getsignal(signal.SIGTERM)
    stopped = []
    try:
        exit_on_sigterm()
        with pytest.raises(SystemExit) as e:
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)  # the handler raises here, at once
            finally:
                stopped.append(True)  # where `started` calls stop_all
        assert e.value.code == 128 + signal.SIGTERM
        assert stopped
    finally:
        signal.signal(signal.SIGTERM, old)
