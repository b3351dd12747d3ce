"""The engine watchdog, a task on the worker's event loop: while the engine thread is
stalled (AsyncEngine.stalled_since: a step or call past --engine-stall-timeout), health
says NOT_SERVING; once it turns again, SERVING (unless the worker drains). GetStats says
since when, and the router then treats the worker as down (router/registry.py)."""

from __future__ import annotations

import asyncio
import logging
import time

from ..rpc.server import Lifecycle
from .async_engine import AsyncEngine

log = logging.getLogger(__name__)

MAX_CHECK_S = 1.0  # how often it looks, at most (a quarter of the timeout when shorter)


async def watch(aengine: AsyncEngine, lifecycle: Lifecycle) -> None:
    """Until cancelled: flip health as the engine stalls and recovers."""
    every = min(MAX_CHECK_S, (aengine.stall_timeout_s or 4 * MAX_CHECK_S) / 4)
    stalled = False
    while True:
        await asyncio.sleep(every)
        since = aengine.stalled_since()
        if (since is not None) == stalled:
            continue
        stalled = since is not None
        if since is not None:
            log.error("the engine thread has not finished a step or call for %.0f s "
                      "(a hung kernel or a stuck lock?): NOT_SERVING until it does",
                      time.time() - since)
        else:
            log.warning("the engine thread turns again: SERVING")
        await lifecycle.set_serving(not stalled)
