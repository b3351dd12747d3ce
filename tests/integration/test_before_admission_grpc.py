"""The gRPC server serves at most its calls at once, refusing the rest with the retry hint
every overload refusal carries, and answers health checks whatever the load (the rest of
what comes before admission: tests/unit/test_before_admission.py)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from baton.router.config import RouterConfig
from baton.services.rpc.errors import retry_after_s
from baton.services.rpc.server import Lifecycle, make_server
from tests.integration.test_abuse_admit import HANG_S, _until


def test_the_grpc_server_serves_at_most_its_calls_at_once():
    async def main():
        go, serving = asyncio.Event(), []

        async def wait(request, context):
            serving.append(request)
            await go.wait()
            return request

        def register(server):
            server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
                "toy.Wait", {"Wait": grpc.unary_unary_rpc_method_handler(wait)}),))
            return ["toy.Wait"]

        server = make_server(register, Lifecycle(), max_calls=2)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                call = channel.unary_unary("/toy.Wait/Wait")
                held = [asyncio.ensure_future(call(b"x", timeout=HANG_S)) for _ in range(2)]
                await _until(lambda: len(serving) == 2)
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await call(b"x", timeout=HANG_S)
                assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "2 calls at once" in e.value.details()
                assert retry_after_s(e.value.trailing_metadata()) > 0
                health = health_pb2_grpc.HealthStub(channel)
                answer = await health.Check(health_pb2.HealthCheckRequest(), timeout=HANG_S)
                assert answer.status == health_pb2.HealthCheckResponse.SERVING
                go.set()
                assert await asyncio.gather(*held) == [b"x", b"x"]
        finally:
            await server.stop(0)

    asyncio.run(main())
    config = RouterConfig()
    assert config.grpc_calls() == config.http_connections() == 4 * config.max_inflight
