"""The engine thread behind asyncio: outputs stream, a consumer that leaves aborts its
request, and a caller that gives up before its turn neither runs nor kills the thread."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from baton.services.engine import SamplingParams
from baton.services.worker.async_engine import AsyncEngine


@pytest.fixture(scope="module")
def llm(make_llm, tiny_model):
    """The reference engine (the tiny serving model: what is checked is the thread)."""
    return make_llm(model=str(tiny_model), dtype="float32", max_num_batched_tokens=128,
                    max_num_seqs=16)


@pytest.fixture(scope="module")
def aengine(make_llm, tiny_model):
    a = AsyncEngine(make_llm(model=str(tiny_model), dtype="float32").engine)
    yield a
    a.stop()


def test_stream_then_abort_on_early_exit(aengine, llm):
    params = SamplingParams(max_tokens=12, temperature=0.0)
    want = llm.generate(["Once upon a time"], params)[0].token_ids

    async def main():
        got = []
        async for out in aengine.generate(
                "a", lambda e: e.add_request("Once upon a time", params, request_id="a")):
            got += out.new_token_ids
        # Leave a stream after two outputs: the request is aborted in the engine.
        n = 0
        gen = aengine.generate("b", lambda e: e.add_request(
            "Once upon a time", SamplingParams(max_tokens=500, ignore_eos=True),
            request_id="b"))
        async for _ in gen:
            n += 1
            if n == 2:
                break
        await gen.aclose()
        return got, await aengine.call(lambda e: e.has_unfinished_requests())

    got, busy = asyncio.run(main())
    assert got == want
    assert not busy


def test_cancelled_call_does_not_kill_the_engine_thread(aengine):
    async def main():
        # Hold the engine thread in a call, queue a second one, give up on it.
        held, release = threading.Event(), threading.Event()
        slow = asyncio.ensure_future(aengine.call(
            lambda e: (held.set(), release.wait(60))))
        while not held.is_set():
            await asyncio.sleep(0.001)
        ran = []
        second = asyncio.ensure_future(aengine.call(lambda e: ran.append(1)))
        while not aengine._calls:  # queued behind the held call
            await asyncio.sleep(0.001)
        second.cancel()
        with pytest.raises(asyncio.CancelledError):
            await second  # given up: its queued call is cancelled by now
        release.set()
        await slow
        return ran, await aengine.call(lambda e: "alive")

    ran, alive = asyncio.run(main())
    assert ran == [] and alive == "alive"


def test_bad_request_raises_in_the_caller(aengine):
    async def main():
        async for _ in aengine.generate("c", lambda e: e.add_request("", None, "c")):
            pass

    with pytest.raises(ValueError, match="empty"):
        asyncio.run(main())


def test_duplicate_id_is_refused_and_the_first_stream_goes_on(aengine, llm):
    params = SamplingParams(max_tokens=10, temperature=0.0)
    want = llm.generate(["Hello there"], params)[0].token_ids

    async def main():
        first = aengine.generate("d", lambda e: e.add_request("Hello there", params,
                                                              request_id="d"))
        got = [t for t in (await first.__anext__()).new_token_ids]
        with pytest.raises(ValueError, match="in use"):
            async for _ in aengine.generate("d", lambda e: e.add_request("x", params, "d")):
                pass
        async for out in first:
            got += out.new_token_ids
        return got

    assert asyncio.run(main()) == want


def test_failed_step_ends_every_stream_and_the_thread_lives(aengine, monkeypatch):
    engine = aengine.engine
    real = engine.runner.execute
    calls = []

    def broken(*args, **kwargs):
        if not calls:
            calls.append(1)
            raise RuntimeError("injected")
        return real(*args, **kwargs)

    monkeypatch.setattr(engine.runner, "execute", broken)

    async def main():
        outs = []
        async for out in aengine.generate("f", lambda e: e.add_request(
                "A prompt long enough to fill a cached block or two, surely. " * 2,
                SamplingParams(max_tokens=5), request_id="f")):
            outs.append(out)
        return outs, await aengine.call(lambda e: e.prefix_cache_stats())

    outs, _ = asyncio.run(main())
    assert outs[-1].finish_reason == "abort" and outs[-1].error == "internal engine error"
    assert len(engine.pool.cached) == 0  # blocks published by the failed step are dropped


def test_full_queue_refuses_at_once(aengine):
    from baton.services.rpc.errors import Overloaded

    async def main():
        async for _ in aengine.generate("o", lambda e: e.add_request("hi", None, "o")):
            pass

    aengine.max_waiting = 0
    try:
        with pytest.raises(Overloaded, match="retry after"):
            asyncio.run(main())
    finally:
        aengine.max_waiting = None
    assert not aengine.engine.has_unfinished_requests()


def test_a_full_queue_refuses_at_once_while_a_step_runs(aengine):
    """--max-queue while the engine thread is inside a step (held open here, as a long
    prompt's step on a slow CPU holds it for seconds): a request past the bound is refused
    within 100 ms, not when the step ends; those within it are admitted after the step."""
    from baton.services.rpc.errors import Overloaded

    engine, held, release = aengine.engine, threading.Event(), threading.Event()
    real_step = engine.step

    def step():
        held.set()
        release.wait(30)
        return real_step()

    params = SamplingParams(max_tokens=3, temperature=0.0)

    async def one(rid: str) -> list:
        return [o async for o in aengine.generate(
            rid, lambda e: e.add_request("Once upon a time", params, request_id=rid))]

    async def main():
        first = asyncio.ensure_future(one("q1"))  # admitted; its step is held
        assert await asyncio.to_thread(held.wait, 30)
        second = asyncio.ensure_future(one("q2"))  # 1 waiting + 0 arriving < 2: queued
        await asyncio.sleep(0.05)
        start = time.monotonic()
        with pytest.raises(Overloaded, match="1 arriving"):  # 1 waiting + 1 arriving
            await one("q3")
        refused_after = time.monotonic() - start
        assert not second.done()  # still behind the held step
        release.set()
        return refused_after, await first, await second

    engine.step, aengine.max_waiting = step, 2
    try:
        refused_after, first, second = asyncio.run(main())
    finally:
        release.set()
        del engine.step
        aengine.max_waiting = None
    assert refused_after < 0.1
    assert first[-1].finished and second[-1].finished
    assert not aengine.engine.has_unfinished_requests()


def test_cancel_that_lands_while_the_request_is_admitted_aborts_it(aengine):
    """The caller gives up while its admit call runs on the engine thread: the engine
    already holds the request when the cancellation reaches the caller. It must still be
    aborted (a prefill request would otherwise hold its blocks until its lease expired)."""
    params = SamplingParams(max_tokens=500, ignore_eos=True)

    async def main():
        loop = asyncio.get_running_loop()
        task: asyncio.Task | None = None

        def add(engine):
            engine.add_request("Once upon a time", params, request_id="admit-cancel")
            landed = threading.Event()  # the cancel reaches the caller before we return
            loop.call_soon_threadsafe(lambda: (task.cancel(), landed.set()))
            landed.wait(60)

        async def consume():
            async for _ in aengine.generate("admit-cancel", add):
                pass

        task = asyncio.ensure_future(consume())
        with pytest.raises(asyncio.CancelledError):
            await task  # ends once its abort, queued behind the admit, has run
        return await aengine.call(lambda e: e.has_unfinished_requests())

    assert asyncio.run(main()) is False
