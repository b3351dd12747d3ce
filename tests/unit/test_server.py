"""The one gRPC edge every service runs (services/serving/server.py): exceptions become
status codes in one place, RESOURCE_EXHAUSTED carries both retry hints, a drain refuses
new work but serves everything else with health NOT_SERVING, and the standard health
service (Check and Watch) works through the interceptor."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from baton.v1 import worker_pb2 as wk
from baton.v1 import worker_pb2_grpc as wk_grpc
from kv_transfer.base import IncompatibleLayout
from services.serving.errors import InvalidArgument, Overloaded, Unavailable
from services.serving.server import (
    LIVENESS,
    Lifecycle,
    drain,
    make_server,
    method_name,
    service_name,
)


class Toy(wk_grpc.PrefillServiceServicer, wk_grpc.WorkerServiceServicer):
    """Prefill raises what the test asks for; ReleaseKv and GetStats just answer."""

    def __init__(self):
        self.raise_ = None
        self.started = asyncio.Event()
        self.finish = asyncio.Event()

    async def Prefill(self, request, context):
        if self.raise_ is not None:
            raise self.raise_
        self.started.set()
        await self.finish.wait()
        return wk.PrefillResponse()

    async def ReleaseKv(self, request, context):
        return wk.ReleaseKvResponse(released=True)

    async def GetStats(self, request, context):
        return wk.GetStatsResponse(engine_id="toy")


async def _serve(toy: Toy, state: Lifecycle):
    def register(server):
        wk_grpc.add_PrefillServiceServicer_to_server(toy, server)
        wk_grpc.add_WorkerServiceServicer_to_server(toy, server)
        return [service_name(wk, "PrefillService")]

    server = make_server(register, state)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await state.set_serving(True)
    return server, f"127.0.0.1:{port}"


@pytest.mark.parametrize("error, code", [
    (ValueError("prompt: empty"), grpc.StatusCode.INVALID_ARGUMENT),
    (IncompatibleLayout("KV layout mismatch (block_size)"),
     grpc.StatusCode.FAILED_PRECONDITION),
    (Unavailable("no decode worker"), grpc.StatusCode.UNAVAILABLE),
    (Overloaded("queue full", retry_after_s=2.5), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (KeyError("a bug"), grpc.StatusCode.INTERNAL),
])
def test_exceptions_become_status_codes_and_overload_carries_both_hints(error, code):
    async def main():
        toy, state = Toy(), Lifecycle()
        toy.raise_ = error
        server, address = await _serve(toy, state)
        try:
            async with grpc.aio.insecure_channel(address) as ch:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await wk_grpc.PrefillServiceStub(ch).Prefill(wk.PrefillRequest())
            assert e.value.code() == code
            assert str(error).strip("'") in e.value.details()
            hints = dict(e.value.trailing_metadata() or ())
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                assert hints["retry-after-ms"] == hints["grpc-retry-pushback-ms"] == "2500"
            else:
                assert "retry-after-ms" not in hints
        finally:
            await server.stop(0)

    asyncio.run(main())


def _string_field(message, name: str, value: bytes) -> bytes:
    """One length-delimited field of `message`'s type, as raw wire bytes."""
    number = message.DESCRIPTOR.fields_by_name[name].number
    return bytes([number << 3 | 2, len(value)]) + value


def test_undecodable_bytes_and_refused_sizes_are_invalid_argument_before_the_handler():
    prefill = method_name(wk, "PrefillService", "Prefill")

    def too_big(raw: bytes) -> None:
        if len(raw) > 64:
            raise InvalidArgument("prompt_token_ids: over the limit")

    async def main():
        toy, state = Toy(), Lifecycle()
        toy.raise_ = AssertionError("the handler must not run")
        state.request_checks[prefill] = too_big
        server, address = await _serve(toy, state)
        try:
            async with grpc.aio.insecure_channel(address) as ch:
                call = ch.unary_unary(prefill)  # no serializers: raw bytes both ways
                for raw, says in [
                    (_string_field(wk.PrefillRequest, "request_id", b"\xff\xfe"), "UTF-8"),
                    (b"\xff\xff\xff", "not valid protobuf"),
                    (wk.PrefillRequest(prompt_token_ids=range(100)).SerializeToString(),
                     "prompt_token_ids: over the limit")]:
                    with pytest.raises(grpc.aio.AioRpcError) as e:
                        await call(raw)
                    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, raw
                    assert says in e.value.details()
                assert not toy.started.is_set()
        finally:
            await server.stop(0)

    asyncio.run(main())


def test_a_drain_refuses_new_work_serves_the_rest_and_waits_for_what_runs():
    async def main():
        toy = Toy()
        state = Lifecycle((method_name(wk, "PrefillService", "Prefill"),))
        server, address = await _serve(toy, state)
        try:
            async with grpc.aio.insecure_channel(address) as ch:
                prefill = wk_grpc.PrefillServiceStub(ch)
                health = health_pb2_grpc.HealthStub(ch)
                watch = health.Watch(health_pb2.HealthCheckRequest())
                assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
                running = asyncio.ensure_future(prefill.Prefill(wk.PrefillRequest()))
                await toy.started.wait()
                drained = asyncio.ensure_future(drain(state, idle=None, grace_s=10))
                await asyncio.sleep(0.1)
                assert (await watch.read()).status == (
                    health_pb2.HealthCheckResponse.NOT_SERVING)
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await prefill.Prefill(wk.PrefillRequest())
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "draining" in e.value.details()
                assert (await prefill.ReleaseKv(wk.ReleaseKvRequest())).released
                stats = await wk_grpc.WorkerServiceStub(ch).GetStats(wk.GetStatsRequest())
                assert stats.engine_id == "toy"
                assert not drained.done()  # the call in flight holds the drain
                toy.finish.set()
                await running
                await asyncio.wait_for(drained, 5)
                watch.cancel()
        finally:
            await server.stop(0)

    asyncio.run(main())


def test_liveness_stays_serving_while_not_ready_and_while_draining():
    """Kubernetes probes: readiness asks for "", liveness for LIVENESS, which must not fail
    on a router with no worker yet or on a worker that drains."""
    async def check(health, name):
        reply = await health.Check(health_pb2.HealthCheckRequest(service=name))
        return reply.status

    async def main():
        state = Lifecycle()
        server, address = await _serve(Toy(), state)
        try:
            async with grpc.aio.insecure_channel(address) as ch:
                health = health_pb2_grpc.HealthStub(ch)
                assert await check(health, LIVENESS) == health_pb2.HealthCheckResponse.SERVING
                await state.set_serving(False)  # e.g. a router with no decode worker
                assert await check(health, "") == health_pb2.HealthCheckResponse.NOT_SERVING
                assert await check(health, LIVENESS) == health_pb2.HealthCheckResponse.SERVING
                await state.set_serving(True)
                await drain(state, idle=None, grace_s=1)
                assert await check(health, "") == health_pb2.HealthCheckResponse.NOT_SERVING
                assert await check(health, LIVENESS) == health_pb2.HealthCheckResponse.SERVING
        finally:
            await server.stop(0)

    asyncio.run(main())
