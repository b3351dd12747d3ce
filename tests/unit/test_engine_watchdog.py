"""A wedged engine is seen: a step that has not ended within the stall timeout (a hung
kernel, a stuck lock) turns the worker's health NOT_SERVING and says since when; once
the step ends, SERVING again."""

from __future__ import annotations

import asyncio
import threading
import time

from grpc_health.v1 import health_pb2

from baton.services.engine.outputs import EngineStats
from baton.services.rpc.server import NOT_SERVING, SERVING, Lifecycle
from baton.services.worker.async_engine import AsyncEngine
from baton.services.worker.watchdog import watch

STALL_S = 0.2


class GatedEngine:
    """What AsyncEngine touches of an engine, with work always pending; each step waits
    for `gate` (cleared: the step hangs)."""

    def __init__(self):
        self.gate = threading.Event()
        self.gate.set()

    def stats(self) -> EngineStats:
        return EngineStats()

    def has_unfinished_requests(self) -> bool:
        return True

    def expire_leases(self) -> None:
        pass

    def step(self) -> list:
        self.gate.wait()
        return []


async def _health(lifecycle: Lifecycle) -> int:
    reply = await lifecycle.health.Check(health_pb2.HealthCheckRequest(service=""), None)
    return reply.status


async def _health_is(lifecycle: Lifecycle, status: int) -> bool:
    return await _health(lifecycle) == status


async def _until(check, timeout: float = 5.0) -> None:
    """Until `check()` (a bool, or a coroutine of one) holds."""
    deadline = time.monotonic() + timeout
    while True:
        ok = check()
        if asyncio.iscoroutine(ok):
            ok = await ok
        if ok:
            return
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def _watched(body) -> None:
    """Runs `body(engine, aengine, lifecycle)` while the watchdog watches a GatedEngine."""
    engine = GatedEngine()
    aengine = AsyncEngine(engine, stall_timeout_s=STALL_S)
    lifecycle = Lifecycle()

    async def main():
        watchdog = asyncio.get_running_loop().create_task(watch(aengine, lifecycle))
        try:
            await body(engine, aengine, lifecycle)
        finally:
            watchdog.cancel()
            engine.gate.set()

    try:
        asyncio.run(main())
    finally:
        aengine.stop()


def test_a_hung_step_turns_health_not_serving_until_it_ends():
    async def body(engine, aengine, lifecycle):
        await lifecycle.set_serving(True)
        await asyncio.sleep(3 * STALL_S)  # steps go on: nothing to see
        assert aengine.stalled_since() is None
        assert await _health(lifecycle) == SERVING
        engine.gate.clear()
        hung_at = time.time()
        await _until(lambda: _health_is(lifecycle, NOT_SERVING))
        since = aengine.stalled_since()
        assert since is not None and abs(since - hung_at) < 0.1
        assert time.time() - hung_at >= STALL_S
        engine.gate.set()  # the step ends after all
        await _until(lambda: _health_is(lifecycle, SERVING))
        assert aengine.stalled_since() is None

    _watched(body)


def test_a_stalled_engine_never_makes_a_draining_worker_serving():
    async def body(engine, aengine, lifecycle):
        engine.gate.clear()
        await _until(lambda: aengine.stalled_since() is not None)
        lifecycle.draining = True
        await lifecycle.set_serving(False)
        engine.gate.set()
        await _until(lambda: aengine.stalled_since() is None)
        await asyncio.sleep(0.3)  # the watchdog has looked again
        assert await _health(lifecycle) == NOT_SERVING

    _watched(body)
