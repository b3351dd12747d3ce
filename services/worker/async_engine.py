"""The engine behind asyncio: one thread owns the LLMEngine and steps it; gRPC handlers
talk to it through calls queued between steps and per-request output queues.

    handler (event loop)            engine thread
    ------------------------        ----------------------------------------------
    generate(rid, add) ---call---> add(engine)            (ValueError goes back)
        await queue.get()  <------ step() outputs, via loop.call_soon_threadsafe
    abort(rid) ----------call---> engine.abort_request(rid)

The engine is not thread-safe, so every touch of it happens on the engine thread.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from typing import Any

from services.engine.engine import LLMEngine
from services.engine.outputs import RequestOutput

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.5  # an idle engine thread still wakes this often (lease expiry)
LOAD_WAIT_S = 0.001  # while only remote KV loads are pending: poll this often
RETRY_AFTER_S = 1.0  # the hint given with RESOURCE_EXHAUSTED


class Overloaded(Exception):
    """The engine's waiting queue is full: the caller should come back later."""

    def __init__(self, waiting: int, limit: int, retry_after_s: float):
        super().__init__(f"worker at capacity: {waiting} requests waiting (limit {limit}); "
                         f"retry after {retry_after_s:.1f}s")
        self.retry_after_s = retry_after_s


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_waiting: int | None = None):
        self.engine = engine
        self.max_waiting = max_waiting  # bound on the waiting queue; None: unbounded
        self._calls: list[tuple[Callable[[LLMEngine], Any], Future]] = []
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    # ---- called from the event loop ---------------------------------------------------

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run fn(engine) on the engine thread between steps; return or raise its result."""
        fut: Future = Future()
        with self._lock:
            if self._stopped:
                raise RuntimeError("the engine is stopped")
            self._calls.append((fn, fut))
        self._wake.set()
        return await asyncio.wrap_future(fut)

    async def generate(self, request_id: str,
                       add: Callable[[LLMEngine], Any]) -> AsyncIterator[RequestOutput]:
        """Add a request with `add(engine)` and yield its outputs until it finishes. If the
        consumer stops early (cancellation), the request is aborted in the engine."""
        if request_id in self._queues:
            raise ValueError(f"request_id {request_id!r} is already in use")
        queue: asyncio.Queue = asyncio.Queue()
        entry = (asyncio.get_running_loop(), queue)
        self._queues[request_id] = entry
        added = finished = False

        def admit(engine: LLMEngine):
            # Checked on the engine thread, so the count cannot change under us.
            waiting = len(engine.scheduler.waiting)
            if self.max_waiting is not None and waiting >= self.max_waiting:
                raise Overloaded(waiting, self.max_waiting, RETRY_AFTER_S)
            return add(engine)

        try:
            await self.call(admit)
            added = True
            while True:
                out = await queue.get()
                yield out
                if out.finished or out.kv_block_ids is not None:
                    finished = True
                    return
        finally:
            if self._queues.get(request_id) is entry:
                del self._queues[request_id]
            if added and not finished:
                await asyncio.shield(self.call(lambda e: e.abort_request(request_id)))

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
        self._wake.set()
        self._thread.join(timeout=10)

    # ---- the engine thread ------------------------------------------------------------

    def _fail_all(self) -> list[RequestOutput]:
        """After a failed step: end every request with an error, so no stream waits for
        outputs the step lost, and drop the prefix cache (the step's blocks were published
        but maybe never written)."""
        engine = self.engine
        for rid in list(engine.scheduler.requests) + list(engine.scheduler.leases):
            try:
                engine.abort_request(rid)
            except Exception:  # noqa: BLE001 - keep the thread alive whatever happens
                log.exception("abort of %s failed", rid)
        try:
            engine.reset_prefix_cache()
        except Exception:  # noqa: BLE001
            log.exception("prefix cache reset failed")
        return [RequestOutput(request_id=rid, prompt_token_ids=[], token_ids=[], text="",
                              finish_reason="abort", error="internal engine error")
                for rid in list(self._queues)]

    def _run(self) -> None:
        engine = self.engine
        while True:
            with self._lock:
                calls, self._calls = self._calls, []
                stopped = self._stopped
            for fn, fut in calls:
                # A caller that gave up (cancelled) before its turn: skip its call. Once
                # running, a future can no longer be cancelled, so the set_* below are safe.
                if not fut.set_running_or_notify_cancel():
                    continue
                try:
                    fut.set_result(fn(engine))
                except BaseException as e:  # noqa: BLE001 - handed to the caller
                    fut.set_exception(e)
            if stopped:
                return
            if not engine.has_unfinished_requests():
                engine.scheduler.expire_leases(time.monotonic())
                self._wake.wait(IDLE_WAIT_S)
                self._wake.clear()
                continue
            try:
                outputs = engine.step()
            except Exception:
                log.exception("engine step failed; ending every request")
                outputs = self._fail_all()
            for out in outputs:
                entry = self._queues.get(out.request_id)
                if entry is not None:
                    loop, queue = entry
                    loop.call_soon_threadsafe(queue.put_nowait, out)
            if not outputs and not engine.scheduler.running:
                self._wake.wait(LOAD_WAIT_S)  # only transfers in flight: don't spin
                self._wake.clear()
