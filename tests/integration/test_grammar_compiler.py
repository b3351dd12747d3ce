"""Grammar compiles are bounded: a compile past the time limit fails its request at once
(its thread runs on, still counted), a full compile queue is RESOURCE_EXHAUSTED with a
retry hint, compiles run on the compiler's own threads, one caller leaving hurts no
other, and the engine thread never compiles, even when the cache drops a grammar
between the pre-compile and the admit."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest

from baton.decode_worker.peers import Peers
from baton.decode_worker.server import DecodeServicer
from baton.router.clients import LocalContext
from baton.router.openai.app import api_error
from baton.services.common.capacity import AtCapacity
from baton.services.common.sampling_params import StructuredOutput
from baton.services.engine import grammar_compiler
from baton.services.engine.grammar_compiler import GrammarCompiler
from baton.services.rpc.config import ServiceConfig
from baton.services.rpc.security import Security
from baton.services.rpc.server import status_of
from baton.services.worker.async_engine import AsyncEngine
from baton.v1 import generation_pb2 as gen
from baton.worker.v1 import worker_pb2 as wk


def regex(text: str) -> StructuredOutput:
    return StructuredOutput("regex", text)


class SlowCompiles:
    """Stands in for xgrammar: each compile blocks until released, and says where it ran."""

    def __init__(self):
        self.release = threading.Event()
        self.threads: list[str] = []

    def __call__(self, compiler, constraint):
        self.threads.append(threading.current_thread().name)
        if constraint.spec == "bad":
            raise RuntimeError("line 1\nunbalanced parenthesis")
        self.release.wait(60)
        return ("compiled", constraint.spec)


@pytest.fixture
def slow(monkeypatch):
    fake = SlowCompiles()
    monkeypatch.setattr(grammar_compiler, "_compile", fake)
    yield fake
    fake.release.set()


def make(timeout_s=10.0, threads=1, max_pending=4) -> GrammarCompiler:
    compiler = GrammarCompiler(None, 10, (), timeout_s=timeout_s, threads=threads,
                               max_pending=max_pending)
    compiler._xgr = lambda: None  # no tokenizer: the fake compile needs none
    return compiler


def wait_until(check, timeout_s=60.0):
    end = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


def test_a_compile_past_the_time_limit_fails_at_once_and_still_holds_its_slot(slow):
    compiler = make(timeout_s=0.2, max_pending=1)
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"regex: not compiled within the time limit of 0.2s"):
        compiler.compile(regex("a+"))
    # At the limit (0.2 s idle), not at the compile's end (when released, or 60 s): the
    # latency is the contract, bounded at over ten times the idle figure.
    assert time.monotonic() - start < 3
    # xgrammar cannot be stopped: the thread is still busy, so the slot stays taken.
    with pytest.raises(AtCapacity):
        compiler.submit(regex("b+"))
    slow.release.set()
    wait_until(lambda: not compiler._pending)
    assert compiler.compile(regex("a+")) == ("compiled", "a+")  # it finished: cached
    assert compiler.compile(regex("b+")) == ("compiled", "b+")
    compiler.close()


def test_a_full_queue_is_resource_exhausted_with_a_retry_hint(slow):
    compiler = make(threads=1, max_pending=2)
    first, second = compiler.submit(regex("a")), compiler.submit(regex("b"))
    again = compiler.submit(regex("a"))  # the same constraint joins its compile
    with pytest.raises(AtCapacity) as e:
        compiler.submit(regex("c"))
    # The engine's own exception (no gRPC below the shell): the shell answers
    # RESOURCE_EXHAUSTED, the HTTP API 429, each with the retry hint.
    assert status_of(e.value)[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert e.value.retry_after_s > 0 and "limit 2" in str(e.value)
    error = api_error(e.value)
    assert error.status == 429 and error.headers["Retry-After"] == "1"
    slow.release.set()
    assert [f.result(5) for f in (first, second, again)] == [
        ("compiled", "a"), ("compiled", "b"), ("compiled", "a")]
    assert slow.threads.count("grammar-compile-0") == 2  # once per constraint, off-thread
    assert compiler.compile(regex("c")) == ("compiled", "c")
    compiler.close()


def test_a_caller_that_leaves_does_not_fail_the_others_and_errors_name_the_kind(slow):
    compiler = make()
    leaving, staying = compiler.submit(regex("a")), compiler.submit(regex("a"))
    assert leaving.cancel()
    slow.release.set()
    assert staying.result(5) == ("compiled", "a")
    with pytest.raises(ValueError, match="regex: cannot compile: unbalanced parenthesis"):
        compiler.compile(regex("bad"))
    assert not compiler._pending
    compiler.close()


def test_the_engine_thread_path_never_compiles(slow):
    compiler = make()
    with pytest.raises(ValueError, match="regex: not compiled; compile it before"):
        compiler.matcher(regex("a"))
    assert slow.threads == []


def test_an_eviction_before_the_admit_never_compiles_on_the_engine_thread(make_llm,
                                                                         monkeypatch):
    """The decode servicer's own path (colocated too): the pre-compile hands its grammar
    to the admit, so a cache that dropped it meanwhile makes no compile there."""
    engine = make_llm(dtype="float32").engine
    real = grammar_compiler._compile
    on_engine_thread = []

    def compile(compiler, constraint):
        on_engine_thread.append(threading.current_thread().name == "engine")
        return real(compiler, constraint)

    monkeypatch.setattr(grammar_compiler, "_compile", compile)
    submit = engine.grammars.submit

    def submit_then_evict(constraint):
        future = submit(constraint)
        future.add_done_callback(lambda _: engine.grammars._cache.clear())
        return future

    monkeypatch.setattr(engine.grammars, "submit", submit_then_evict)
    choices = ("yes", "no")
    request = wk.DecodeRequest(
        request_id="r", prompt_token_ids=engine.tokenizer.encode("Yes or no?"),
        sampling=gen.SamplingParams(max_tokens=8, temperature=0, structured_output=(
            gen.StructuredOutput(choice=gen.Choices(choices=choices)))))

    async def main():
        aengine = AsyncEngine(engine)
        servicer = DecodeServicer(aengine, "d", "", Peers(Security(ServiceConfig())),
                                  receiver=None)
        try:
            return [r async for r in servicer.Decode(request, LocalContext())]
        finally:
            aengine.stop()

    replies = asyncio.run(main())
    assert "".join(r.delta.text for r in replies) in choices
    assert on_engine_thread == [False]
    assert engine.grammars.cached(StructuredOutput("choice", choices=choices)) is None
