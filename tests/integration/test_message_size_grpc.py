"""Each gRPC server takes every message up to the largest legal request and none past it
(services/common/message_size.py): the router's bound from its Limits, a worker's from
its engine's max_model_len and ceilings. A message past the bound is refused by gRPC
itself (RESOURCE_EXHAUSTED) before Python sees a byte of it: the router's raw check,
the first thing to read a Generate's bytes, never runs. (The largest requests are built
in tests/unit/test_message_size.py; a 64 MB one while health is polled:
test_abuse_wire.py.)"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc

from baton.services.common.limits import Limits
from baton.services.common.message_size import request_bytes, worker_request_bytes
from baton.services.rpc.config import ServiceConfig
from baton.services.rpc.errors import InvalidArgument
from baton.services.rpc.security import Security
from baton.services.rpc.server import make_server, service_name
from baton.services.worker.runtime import worker_lifecycle
from baton.v1 import generation_pb2 as gen
from baton.worker.v1 import worker_pb2 as wk
from baton.worker.v1 import worker_pb2_grpc as wk_grpc
from tests.integration.test_abuse import GENERATE
from tests.router_fakes import cluster
from tests.unit.test_message_size import largest_decode, largest_generate

UNLIMITED = [("grpc.max_send_message_length", -1)]


def _sized(message_type, field: str, size: int) -> bytes:
    """A message of `message_type` exactly `size` bytes long: one string field (its tag
    is a byte, its length a varint of a few)."""
    for head in range(2, 7):
        raw = message_type(**{field: "a" * (size - head)}).SerializeToString()
        if len(raw) == size:
            return raw
    raise AssertionError(f"no {message_type.__name__} of {size} bytes")


async def _call(channel, method: str, raw: bytes, streaming: bool = True) -> str:
    """The status a call of `raw` bytes ends with, and its details."""
    call = (channel.unary_stream if streaming else channel.unary_unary)(method)
    try:
        await (call(raw, timeout=30).read() if streaming else call(raw, timeout=30))
    except grpc.aio.AioRpcError as e:
        return f"{e.code().name}: {e.details()}"
    return "OK"


def test_the_router_takes_every_message_up_to_its_largest_request_and_none_past_it(tok):
    largest = largest_generate(Limits()).SerializeToString()
    bound = request_bytes(Limits())

    async def main():
        async with cluster(tok, worker_timeout=30) as c:
            assert c.lifecycle.max_receive_bytes == bound
            seen: list[int] = []

            def check(raw: bytes) -> None:  # the first to read a Generate's bytes
                seen.append(len(raw))
                raise InvalidArgument("request: seen")

            c.lifecycle.request_checks[GENERATE] = check
            async with grpc.aio.insecure_channel(c.address, options=UNLIMITED) as channel:
                got = [await _call(channel, GENERATE, raw) for raw in (
                    largest, _sized(gen.GenerateRequest, "text", bound),
                    _sized(gen.GenerateRequest, "text", bound + 1), b"\x05" * (64 << 20))]
            return got, seen

    got, seen = asyncio.run(main())
    assert got[:2] == ["INVALID_ARGUMENT: request: seen"] * 2, got
    for status in got[2:]:
        assert status.startswith("RESOURCE_EXHAUSTED") and "larger than max" in status, got
    assert seen == [len(largest), bound]  # nothing past the bound reached Python


class Worker(wk_grpc.PrefillServiceServicer, wk_grpc.DecodeServiceServicer):
    """Answers every Prefill and Decode it gets; counts them."""

    def __init__(self):
        self.calls = 0

    async def Prefill(self, request, context):
        self.calls += 1
        return wk.PrefillResponse()

    async def Decode(self, request, context):
        self.calls += 1
        yield wk.DecodeResponse()


def test_a_worker_takes_every_request_its_engine_takes_and_none_past_it():
    max_model_len, block_size = 8192, 16
    engine = SimpleNamespace(max_model_len=max_model_len,
                             kv_layout=SimpleNamespace(block_size=block_size))
    bound = worker_request_bytes(max_model_len, block_size)
    largest = largest_decode(max_model_len, block_size).SerializeToString()
    prefill = wk.PrefillRequest(prompt_token_ids=[5] * max_model_len,
                                sampling=largest_decode(1, 1).sampling).SerializeToString()

    async def main():
        servicer, got = Worker(), []
        for service in ("DecodeService", "PrefillService"):
            lifecycle = worker_lifecycle(service, engine, Security(ServiceConfig()))
            assert lifecycle.max_receive_bytes == bound

            def register(server, service=service):
                getattr(wk_grpc, f"add_{service}Servicer_to_server")(servicer, server)
                return [service_name(wk, service)]

            server = make_server(register, lifecycle)
            address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
            await server.start()
            name = f"/baton.worker.v1.{service}/{service.removesuffix('Service')}"
            streaming = service == "DecodeService"
            try:
                async with grpc.aio.insecure_channel(address, options=UNLIMITED) as channel:
                    for raw in ((largest, _sized(wk.DecodeRequest, "request_id", bound))
                                if streaming else (prefill,)):
                        got.append(await _call(channel, name, raw, streaming))
                    over = _sized(wk.DecodeRequest, "request_id", bound + 1)
                    got.append(await _call(channel, name, over, streaming))
            finally:
                await server.stop(0)
        return got, servicer.calls

    got, calls = asyncio.run(main())
    assert got[:2] == ["OK", "OK"] and got[3] == "OK", got
    for status in (got[2], got[4]):
        assert status.startswith("RESOURCE_EXHAUSTED") and "larger than max" in status, got
    assert calls == 3
