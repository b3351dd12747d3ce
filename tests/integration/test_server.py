"""The one gRPC edge every service runs (services/rpc/server.py): exceptions become
status codes in one place, RESOURCE_EXHAUSTED carries both retry hints, a drain refuses
new work but serves everything else with health NOT_SERVING, and the standard health
service (Check and Watch) works through the interceptor; every kind of method (streaming
requests too) passes the same guard, and a checked request is parsed off the event loop
once its call is authorized."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from baton.kv_transfer.base import IncompatibleLayout
from baton.services.common.capacity import AtCapacity
from baton.services.common.limits import OverLimit
from baton.services.rpc.cluster import OPEN_METHODS
from baton.services.rpc.errors import InvalidArgument, Overloaded, Unavailable
from baton.services.rpc.server import (
    LIVENESS,
    Lifecycle,
    drain,
    make_server,
    method_name,
    service_name,
)
from baton.worker.v1 import worker_pb2 as wk
from baton.worker.v1 import worker_pb2_grpc as wk_grpc


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
    (AtCapacity("compile queue full", retry_after_s=2.5), grpc.StatusCode.RESOURCE_EXHAUSTED),
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
                drained = asyncio.ensure_future(drain(state, idle=None, grace_s=60))
                assert (await watch.read()).status == (  # the next status: draining
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
                await asyncio.wait_for(drained, 60)
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


class Echo:
    """Methods of every kind on raw text, registered by hand; the deserializer says on
    which thread it ran, and "boom" raises in the handler."""

    def __init__(self):
        self.threads: list[str] = []

    def load(self, raw: bytes) -> str:
        self.threads.append(threading.current_thread().name)
        return raw.decode()

    @staticmethod
    def _answer(text: str) -> bytes:
        if text == "boom":
            raise ValueError("text: boom")
        return text.encode()

    async def say(self, request, context):
        return self._answer(request)

    async def up(self, requests, context):
        return b"".join([self._answer(r) async for r in requests])

    async def both(self, requests, context):
        async for r in requests:
            yield self._answer(r)

    def register(self, server) -> list[str]:
        handlers = {"Say": grpc.unary_unary_rpc_method_handler(self.say, self.load),
                    "Up": grpc.stream_unary_rpc_method_handler(self.up, self.load),
                    "Both": grpc.stream_stream_rpc_method_handler(self.both, self.load)}
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("toy.Echo", handlers),))
        return ["toy.Echo"]


def _token_check(method: str, metadata) -> str | None:
    return None if method.startswith(OPEN_METHODS) or ("token", "ok") in (metadata or ()) \
        else "no token"


async def _serve_echo(echo: Echo, state: Lifecycle):
    server = make_server(echo.register, state)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await state.set_serving(True)
    return server, f"127.0.0.1:{port}"


async def _code(call) -> grpc.StatusCode:
    try:
        await call
    except grpc.aio.AioRpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def test_a_checked_request_is_parsed_off_the_loop_once_its_call_is_authorized():
    checked: list[str] = []

    def check(raw: bytes) -> None:
        checked.append(threading.current_thread().name)
        if raw == b"big":
            raise OverLimit("text: more than the limit of 2 characters")

    async def main():
        echo, state = Echo(), Lifecycle()
        state.authorize = _token_check
        state.request_checks["/toy.Echo/Say"] = check
        state.parse_pool = ThreadPoolExecutor(1, thread_name_prefix="parse")
        server, address = await _serve_echo(echo, state)
        try:
            async with grpc.aio.insecure_channel(address) as ch:
                say = ch.unary_unary("/toy.Echo/Say")
                assert await _code(say(b"hi")) == grpc.StatusCode.UNAUTHENTICATED
                assert checked == echo.threads == []  # nothing parsed for a stranger
                token = (("token", "ok"),)
                assert await say(b"hi", metadata=token) == b"hi"
                assert checked == echo.threads == ["parse_0"]  # off the event loop
                for raw, says in [(b"big", "text: more than"), (b"\xff", "not valid")]:
                    with pytest.raises(grpc.aio.AioRpcError) as e:
                        await say(raw, metadata=token)
                    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                    assert says in e.value.details()
        finally:
            await server.stop(0)
            state.parse_pool.shutdown()

    asyncio.run(main())


def test_streaming_requests_pass_the_same_guard_and_reflection_stays_open():
    async def main():
        echo, state = Echo(), Lifecycle(("/toy.Echo/Both",))
        state.authorize = _token_check
        server, address = await _serve_echo(echo, state)
        try:
            async with grpc.aio.insecure_channel(address) as ch:
                up, both = ch.stream_unary("/toy.Echo/Up"), ch.stream_stream("/toy.Echo/Both")

                async def read_all(call):
                    return [reply async for reply in call]

                token = (("token", "ok"),)
                assert await _code(up(iter([b"a"]))) == grpc.StatusCode.UNAUTHENTICATED
                assert await _code(read_all(both(iter([b"a"])))) == (
                    grpc.StatusCode.UNAUTHENTICATED)
                assert await up(iter([b"a", b"b"]), metadata=token) == b"ab"
                assert await read_all(both(iter([b"a", b"b"]), metadata=token)) == [b"a", b"b"]
                for call, code in [
                        (up(iter([b"a", b"\xff"]), metadata=token), "INVALID_ARGUMENT"),
                        (up(iter([b"boom"]), metadata=token), "INVALID_ARGUMENT"),
                        (read_all(both(iter([b"boom"]), metadata=token)), "INVALID_ARGUMENT")]:
                    assert (await _code(call)).name == code
                # Reflection (bidi) is open: a tool lists the services without a token.
                reflect = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
                    iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
                names = [s.name for reply in await read_all(reflect)
                         for s in reply.list_services_response.service]
                assert "toy.Echo" in names and "grpc.health.v1.Health" in names
                await drain(state, idle=None, grace_s=0)
                assert await _code(read_all(both(iter([b"a"]), metadata=token))) == (
                    grpc.StatusCode.UNAVAILABLE)  # new work, refused while draining
                assert await up(iter([b"a"]), metadata=token) == b"a"
        finally:
            await server.stop(0)

    asyncio.run(main())
