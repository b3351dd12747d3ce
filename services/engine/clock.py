"""The clock the scheduler and its KV loads read (arrival, first scheduled, first token,
lease grants, load timeouts) and sleep on (waiting a moment for a load to land).

The engine runs on real time (`WALL`). The planner's simulator (tools/plan/) runs the
same scheduler on a clock of its own, whose `sleep` advances simulated time: the
scheduler's decisions are then the ones it would take on real time, at no real cost.
"""

from __future__ import annotations

import time


class Clock:
    """Monotonic seconds."""

    def now(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


WALL = Clock()
