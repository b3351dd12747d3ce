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

# Far above any pause a loaded machine gives the engine thread between two turns (a
# millisecond idle): a turn that outlasts it is a hang, not a slow scheduler.
STALL_S = 1.0


class GatedEngine:
    """What AsyncEngine touches of an engine, with work always pending; each step waits
    for `gate` (cleared: the step hangs). `steps`: [entered, left] (Unix times) each."""

    def __init__(self):
        self.gate = threading.Event()
        self.gate.set()
        self.steps: list[list[float | None]] = []

    def stats(self) -> EngineStats:
        return EngineStats()

    def has_unfinished_requests(self) -> bool:
        return True

    def expire_leases(self) -> None:
        pass

    def step(self) -> list:
        times = [time.time(), None]
        self.steps.append(times)
        self.gate.wait()
        times[1] = time.time()
        return []


async def _health(lifecycle: Lifecycle) -> int:
    reply = await lifecycle.health.Check(health_pb2.HealthCheckRequest(service=""), None)
    return reply.status


async def _health_is(lifecycle: Lifecycle, status: int) -> bool:
    return await _health(lifecycle) == status


async def _until(check, timeout: float = 60.0) -> None:
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


class Looks:
    """The AsyncEngine as the watchdog sees it, counting its looks (`count`): the test's
    own calls of `stalled_since` are not counted."""

    def __init__(self, aengine: AsyncEngine):
        self.aengine, self.count = aengine, 0

    def __getattr__(self, name: str):
        return getattr(self.aengine, name)

    def stalled_since(self) -> float | None:
        self.count += 1
        return self.aengine.stalled_since()


def _watched(body) -> None:
    """Runs `body(engine, aengine, lifecycle, looks)` while the watchdog watches a
    GatedEngine (through `looks`, a Looks)."""
    engine = GatedEngine()
    aengine = AsyncEngine(engine, stall_timeout_s=STALL_S)
    lifecycle = Lifecycle()
    looks = Looks(aengine)

    async def main():
        watchdog = asyncio.get_running_loop().create_task(watch(looks, lifecycle))
        try:
            await body(engine, aengine, lifecycle, looks)
        finally:
            watchdog.cancel()
            engine.gate.set()

    try:
        asyncio.run(main())
    finally:
        aengine.stop()


def test_a_hung_step_turns_health_not_serving_until_it_ends():
    async def body(engine, aengine, lifecycle, looks):
        await lifecycle.set_serving(True)
        # Steps go on while the watchdog looks for longer than the stall timeout (it looks
        # every quarter of it): nothing to see.
        steps = len(engine.steps)
        await _until(lambda: looks.count >= 6 and len(engine.steps) > steps + 6)
        assert aengine.stalled_since() is None
        assert await _health(lifecycle) == SERVING
        engine.gate.clear()
        await _until(lambda: _health_is(lifecycle, NOT_SERVING))
        since = aengine.stalled_since()
        # Since the turn of the step that hangs began: after the step before it ended, by
        # the time the hung one entered (not when the hang was found, STALL_S later).
        (_, before_left), (hung_entered, hung_left) = engine.steps[-2:]
        assert hung_left is None and since is not None
        assert before_left - 0.01 <= since <= hung_entered + STALL_S / 2, (
            before_left, since, hung_entered)
        engine.gate.set()  # the step ends after all
        await _until(lambda: _health_is(lifecycle, SERVING))
        assert aengine.stalled_since() is None

    _watched(body)


def test_a_stalled_engine_never_makes_a_draining_worker_serving():
    async def body(engine, aengine, lifecycle, looks):
        engine.gate.clear()
        await _until(lambda: aengine.stalled_since() is not None)
        lifecycle.draining = True
        await lifecycle.set_serving(False)
        engine.gate.set()
        await _until(lambda: aengine.stalled_since() is None)
        seen = looks.count
        await _until(lambda: looks.count >= seen + 2)  # the watchdog has seen it turn again
        assert await _health(lifecycle) == NOT_SERVING

    _watched(body)
