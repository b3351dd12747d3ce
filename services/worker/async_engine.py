"""The engine behind asyncio: one thread owns the LLMEngine and steps it; gRPC handlers
talk to it through calls queued between steps and per-request output queues.

    handler (event loop)            engine thread
    ------------------------        ----------------------------------------------
    generate(rid, add) ---call---> admit: add(engine)     (ValueError goes back)
        await queue.get()  <------ step() outputs, via loop.call_soon_threadsafe
    (caller leaves) -----call---> abort, if the admit ran (calls run in order)
    stats  <---------------------- a snapshot, replaced after every loop turn

The engine is not thread-safe, so every touch of it happens on the engine thread; the
event loop reads only the snapshot. A turn (the queued calls, then a step) that has not
ended within `stall_timeout_s` (a hung kernel, a stuck lock, a dead thread) makes the
engine *stalled*: `stalled_since` says since when, for health and GetStats (watchdog.py).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from typing import Any

from ..common.finish import FinishReason
from ..engine.engine import LLMEngine
from ..engine.outputs import EngineStats, RequestOutput
from ..rpc.errors import Overloaded

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.5  # an idle engine thread still wakes this often (lease expiry)
LOAD_WAIT_S = 0.001  # while only remote KV loads are pending: poll this often


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_waiting: int | None = None,
                 stall_timeout_s: float | None = None):
        self.engine = engine
        self.max_waiting = max_waiting  # bound on the waiting queue; None: unbounded
        self.stall_timeout_s = stall_timeout_s  # None: never called stalled
        self._turn_since: float | None = None  # monotonic start of the turn under way
        self.dead_since: float | None = None  # when a tensor-parallel rank was lost
        self.stats: EngineStats = engine.stats()
        self._calls: list[tuple[Callable[[LLMEngine], Any], Future]] = []
        self._wake = threading.Event()
        self._lock = threading.Lock()
        # request id -> (its loop, its output queue, set once the engine holds it)
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue,
                                      threading.Event]] = {}
        self._stopped = False
        self._admitting = 0  # admits queued for the engine thread, not yet answered
        # Called as each request arrives; what it returns sees each of its outputs
        # (metrics: vllm_metrics.py). None: nothing watches.
        self.observer: Callable[[], Callable[[RequestOutput], None]] | None = None
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

    async def compile(self, params):
        """A request's structured-output constraint compiled on the compiler's own
        threads (None without one), for `add` to hand to the engine: a slow schema never
        stalls a step, and a cache eviction before the admit cannot make the engine
        thread compile. Before anything is queued, raises ValueError (INVALID_ARGUMENT:
        it cannot compile, or not within the time limit) or AtCapacity
        (RESOURCE_EXHAUSTED: the compile queue is full)."""
        if params.structured is None:
            return None
        return await asyncio.wrap_future(self.engine.grammars.submit(params.structured))

    async def generate(self, request_id: str,
                       add: Callable[[LLMEngine], Any]) -> AsyncIterator[RequestOutput]:
        """Add a request with `add(engine)` and yield its outputs until it finishes (or, on
        a prefill worker, is handed off). If the consumer stops early (cancellation, even
        while the request is being admitted), the request is aborted in the engine."""
        if request_id in self._queues:
            raise ValueError(f"request_id {request_id!r} is already in use")
        watch = self.observer() if self.observer is not None else None
        queue: asyncio.Queue = asyncio.Queue()
        admitted = threading.Event()  # set on the engine thread once the engine holds it
        entry = (asyncio.get_running_loop(), queue, admitted)
        self._queues[request_id] = entry
        finished = False

        def admit(engine: LLMEngine):
            # Checked on the engine thread, so the count cannot change under us.
            if self.max_waiting is not None and engine.num_waiting >= self.max_waiting:
                raise Overloaded(f"worker at capacity: {engine.num_waiting} requests "
                                 f"waiting (limit {self.max_waiting})")
            result = add(engine)
            admitted.set()
            return result

        def abort_if_admitted(engine: LLMEngine) -> None:
            # Runs after `admit` (calls run in order), or instead of it if that was
            # skipped: only a request this generator added is aborted, never another
            # request that happens to share its id.
            if admitted.is_set():
                engine.abort_request(request_id)

        queued = False  # False: refused before the engine thread saw it
        try:
            self._reserve()
            queued = True
            try:
                await self.call(admit)
            finally:
                with self._lock:
                    self._admitting -= 1
            while True:
                out = await queue.get()
                if watch is not None:
                    watch(out)
                yield out
                if out.finished or out.handed_off:
                    finished = True
                    return
        finally:
            if self._queues.get(request_id) is entry:
                del self._queues[request_id]
            if not finished and queued:
                try:
                    await asyncio.shield(self.call(abort_if_admitted))
                except RuntimeError:  # the engine stopped: nothing left to abort
                    pass

    def _reserve(self) -> None:
        """A place for one more admit, or Overloaded at once when the queue is full: its
        waiting requests as of the last step (or admit) plus the admits queued since.
        The engine thread checks again when it admits (the bound holds whatever the race),
        but a step can take seconds, and a full queue must not wait for it to say so. A
        request counts twice between its admit and its answer: refused, never let in."""
        with self._lock:
            if self.max_waiting is not None and \
                    self.stats.num_waiting + self._admitting >= self.max_waiting:
                raise Overloaded(f"worker at capacity: {self.stats.num_waiting} requests "
                                 f"waiting and {self._admitting} arriving "
                                 f"(limit {self.max_waiting})")
            self._admitting += 1

    def release_lease(self, request_id: str, lease_id: int | None = None) -> bool:
        """End a lease at once, without waiting for the step in progress (the decode
        worker's lease check waits on it); the engine thread frees the blocks."""
        released = self.engine.revoke_lease(request_id, lease_id)
        self._wake.set()
        return released

    def lease_blocks(self, request_id: str, lease_id: int) -> list[int] | None:
        return self.engine.lease_blocks(request_id, lease_id)

    def stalled_since(self) -> float | None:
        """Since when (Unix time) the engine thread has been in a turn that outlasted
        the stall timeout: stuck in a step or a call, or dead. None while it steps."""
        if self.dead_since is not None:  # a tensor-parallel rank is gone
            return self.dead_since
        since, timeout = self._turn_since, self.stall_timeout_s
        if since is None or timeout is None:
            return None
        stuck = time.monotonic() - since
        return time.time() - stuck if stuck >= timeout else None

    def die(self, why: str) -> None:
        """A tensor-parallel rank is gone (any thread): health says NOT_SERVING from now
        on, and the engine thread's next step fails every request (RankDied)."""
        log.error("the engine cannot run: %s", why)
        self.dead_since = time.time()
        self._wake.set()

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
        self._wake.set()
        self._thread.join(timeout=10)

    # ---- the engine thread ------------------------------------------------------------

    def _fail_all(self) -> list[RequestOutput]:
        """After a failed step: end every request with an error, so no stream waits for
        outputs the step lost (the engine also drops its prefix cache)."""
        try:
            self.engine.fail_all()
        except Exception:  # noqa: BLE001 - keep the thread alive whatever happens
            log.exception("recovery from the failed step failed")
        # Only requests the engine held: one whose admit call is still queued is added
        # after this, and its stream goes on normally.
        return [RequestOutput(request_id=rid, prompt_token_ids=[], token_ids=[], text="",
                              finish_reason=FinishReason.ABORT, error="internal engine error",
                              engine_failed=True)
                for rid, (_, _, admitted) in list(self._queues.items()) if admitted.is_set()]

    def _run(self) -> None:
        engine = self.engine
        while True:
            self._turn_since = time.monotonic()  # cleared only while it waits
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
                self._turn_since = None
                return
            if calls:  # e.g. a request admitted: the loop sees it waiting at once
                self.stats = engine.stats()
            if not engine.has_unfinished_requests():
                engine.expire_leases()
                ranks = getattr(engine, "ranks", None)
                if ranks is not None:  # a rank on another host, gone while idle
                    ranks.heartbeat()
                self.stats = engine.stats()
                self._wait(IDLE_WAIT_S)
                continue
            try:
                outputs = engine.step()
            except Exception:
                log.exception("engine step failed; ending every request")
                outputs = self._fail_all()
            self.stats = engine.stats()
            for out in outputs:
                entry = self._queues.get(out.request_id)
                if entry is not None:
                    loop, queue, _ = entry
                    loop.call_soon_threadsafe(queue.put_nowait, out)
            if not outputs and not self.stats.num_running:
                self._wait(LOAD_WAIT_S)  # only transfers in flight: don't spin

    def _wait(self, seconds: float) -> None:
        self._turn_since = None  # waiting is not stalling
        self._wake.wait(seconds)
        self._wake.clear()
