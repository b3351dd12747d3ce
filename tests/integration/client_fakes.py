"""A scripted Generation server on loopback (sync grpc, threads) for the client's tests:
each call to Generate plays the next step of its script and is recorded."""

from __future__ import annotations

import threading
import time
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass, field

import grpc

from baton.v1 import generation_pb2 as gen
from baton.v1 import generation_pb2_grpc as gen_grpc


@dataclass
class Step:
    """What one call does: send `responses`, then fail with `error` (a status code) and
    `trailing` metadata, or say nothing more (`hang`) until the client goes away."""

    responses: list[gen.GenerateResponse] = field(default_factory=list)
    error: grpc.StatusCode | None = None
    details: str = ""
    trailing: tuple = ()
    hang: bool = False


@dataclass
class Call:
    at: float  # time.monotonic() when the call arrived
    metadata: dict
    request: object
    remaining: float | None  # its deadline, as seconds left when it arrived (None: none)


def overloaded(ms: int) -> Step:
    return Step(error=grpc.StatusCode.RESOURCE_EXHAUSTED, details="queue full",
                trailing=(("retry-after-ms", str(ms)), ("grpc-retry-pushback-ms", str(ms))))


def response(text: str, ids: list[int], finish=gen.FINISH_REASON_UNSPECIFIED,
             stop_string: str | None = None, logprobs=(), **kw) -> gen.GenerateResponse:
    delta = gen.TokenDelta(text=text, token_ids=ids, finish_reason=finish, logprobs=logprobs)
    if stop_string is not None:
        delta.stop_string = stop_string
    return gen.GenerateResponse(request_id="r1", delta=delta, **kw)


class FakeGeneration(gen_grpc.GenerationServicer):
    def __init__(self):
        self.script: list[Step] = []  # the last step repeats
        self.calls: list[Call] = []
        self.info = gen.ModelInfo(model="fake", max_model_len=2048, vocab_size=100,
                                  eos_token_ids=[2], block_size=16, dtype="float32",
                                  architecture="LlamaForCausalLM", family="llama",
                                  served_model_name="fake-model")
        self.hang_unary = False
        self.gone = threading.Event()  # set when a hanging Generate has ended

    def _record(self, request, context) -> None:
        remaining = context.time_remaining()  # before `at`: at + remaining >= its deadline
        self.calls.append(Call(time.monotonic(), dict(context.invocation_metadata()), request,
                               remaining))

    def Generate(self, request, context):
        self._record(request, context)
        n = sum(isinstance(c.request, gen.GenerateRequest) for c in self.calls)
        step = self.script[min(n, len(self.script)) - 1]
        if step.hang:
            context.add_callback(self.gone.set)  # a cancelled call's handler may never resume
        yield from step.responses
        if step.hang:
            _hang(context)
        elif step.error is not None:
            context.set_trailing_metadata(step.trailing)
            context.abort(step.error, step.details)

    def Tokenize(self, request, context):
        self._record(request, context)
        return gen.TokenizeResponse(token_ids=[ord(c) for c in request.text])

    def GetModelInfo(self, request, context):
        self._record(request, context)
        if self.hang_unary:
            _hang(context)
        return gen.GetModelInfoResponse(info=self.info)


def _hang(context, limit_s: float = 10.0) -> None:
    """Until the client goes away (or `limit_s`, so a client with no deadline fails)."""
    end = time.monotonic() + limit_s
    while context.is_active() and time.monotonic() < end:
        time.sleep(0.01)


@contextmanager
def fake_server():
    """(address, the fake) for one test."""
    fake = FakeGeneration()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    gen_grpc.add_GenerationServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}", fake
    finally:
        server.stop(0)
