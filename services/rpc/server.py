"""The aio gRPC server every Baton service runs: standard health and reflection, message
limits, one interceptor that turns exceptions into status codes (services/rpc/
errors.py), and a drain on SIGINT/SIGTERM:

    SIGTERM ─> health NOT_SERVING, new work refused (UNAVAILABLE "draining"), every
               other call still served (stats, lease release, KV reads, health)
            ─> wait until the service is idle (its `idle()`, and no work call in
               flight) or `grace_s` has passed
            ─> stop the server, then the service's own cleanup (`on_stop`)

"New work" is the methods a service names in `Lifecycle(work_methods)`: Generate,
Prefill, Decode. A draining prefill worker thus finishes its prompts and keeps its
leases until the decode workers have pulled them; the router keeps using its pairs.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import Executor
from contextlib import aclosing, asynccontextmanager

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from baton.kv_transfer.base import IncompatibleLayout

from ..common.capacity import RETRY_AFTER_S, AtCapacity
from ..common.errors import NotFound
from .config import DRAIN_GRACE_S
from .errors import InvalidArgument, Overloaded, ServiceError, retry_metadata

log = logging.getLogger(__name__)

# A message a service sends (a KV blocks' chunk, a snapshot of KV events), and one a
# channel between services receives. What a server receives is its own bound
# (`Lifecycle.max_receive_bytes`, from services/common/message_size.py).
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# Channels between services retry a peer that went away at least every RECONNECT_MAX_MS:
# gRPC's own backoff grows to two minutes (and every channel of a process to that address
# shares it), so a worker restarted on its address went unseen, or unpaired, that long.
RECONNECT_FIRST_MS, RECONNECT_MAX_MS = 250, 1000
CHANNEL_OPTIONS: list[tuple[str, object]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.initial_reconnect_backoff_ms", RECONNECT_FIRST_MS),
    ("grpc.max_reconnect_backoff_ms", RECONNECT_MAX_MS)]
DRAIN_POLL_S = 0.05
SERVING, NOT_SERVING = (health_pb2.HealthCheckResponse.SERVING,
                        health_pb2.HealthCheckResponse.NOT_SERVING)
# A health service name that is SERVING for as long as the server answers, ready or not,
# draining or not: for liveness probes (readiness asks for "", the overall status).
LIVENESS = "liveness"


# A health check is answered whatever the load (Watch streams, which stay open, count).
UNCOUNTED = frozenset({"/grpc.health.v1.Health/Check"})


class Lifecycle:
    """A service's state, shared by its servicers, its interceptor and its drain."""

    def __init__(self, work_methods: tuple[str, ...] = ()):
        self.work_methods = set(work_methods)  # full names: "/pkg.Service/Method"
        self.draining = False
        self.inflight = 0  # work calls in flight
        # Calls at once past which a new one is refused (RESOURCE_EXHAUSTED with the retry
        # hint, as every overload refusal; gRPC's own maximum_concurrent_rpcs gives none);
        # health checks are never counted nor refused (a prober must see a busy server up).
        self.max_calls: int | None = None
        self.calls = 0
        self.health = HealthServicer()
        self.names: list[str] = []  # the service names health advertises
        # (method, metadata) -> why the caller may not call it, or None: API keys on a
        # router, the cluster token on a worker (UNAUTHENTICATED)
        self.authorize: Callable[[str, tuple], str | None] | None = None
        # method -> a check of its raw request before protobuf parses it (a cheap count
        # that raises naming the field: the router's size limits). A checked request is
        # taken as its bytes; once the call is authorized, the check and then the parse
        # run on `parse_pool` (asyncio's default pool when None), never on the event loop.
        self.request_checks: dict[str, Callable[[bytes], None]] = {}
        self.parse_pool: Executor | None = None
        # (metadata, load, raw) -> load(raw) off the loop, instead of on `parse_pool` at
        # once: the router's, which bounds the bytes waiting and takes turns by API key.
        self.parse: Callable[[tuple, Callable[[bytes], object], bytes],
                             Awaitable[object]] | None = None
        # The largest request this service takes (router/server.py, services/worker/
        # runtime.py set theirs): gRPC refuses a bigger message (RESOURCE_EXHAUSTED)
        # before any of it reaches Python.
        self.max_receive_bytes = MAX_MESSAGE_BYTES

    async def set_serving(self, serving: bool) -> None:
        """SERVING or NOT_SERVING for every service here (never SERVING while draining);
        LIVENESS stays SERVING."""
        status = SERVING if serving and not self.draining else NOT_SERVING
        for name in ("", *self.names):
            await self.health.set(name, status)
        await self.health.set(LIVENESS, SERVING)


def status_of(e: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(e, ServiceError):
        return e.code, str(e)
    if isinstance(e, AtCapacity):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)
    if isinstance(e, IncompatibleLayout):
        return grpc.StatusCode.FAILED_PRECONDITION, str(e)
    if isinstance(e, NotFound):
        return grpc.StatusCode.NOT_FOUND, str(e)
    if isinstance(e, (ValueError, TypeError)):
        return grpc.StatusCode.INVALID_ARGUMENT, str(e)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}: {e}"


class Undecodable:
    """A request whose bytes were refused before any handler ran (not valid protobuf,
    invalid UTF-8 in a string field, or over a size limit): the handler's wrapper aborts
    with `error`'s status, where gRPC itself would answer UNKNOWN."""

    def __init__(self, error: Exception):
        self.error = error


def _loader(deserialize: Callable[[bytes], object] | None,
            check: Callable[[bytes], None] | None) -> Callable[[bytes], object]:
    """raw -> the request, or Undecodable: `check`'s refusal (its own status), or
    INVALID_ARGUMENT for bytes protobuf cannot parse."""
    def load(raw: bytes):
        if check is not None:
            try:
                check(raw)
            except Exception as e:  # noqa: BLE001 - the check's refusal, with its status
                return Undecodable(e)
        try:
            return raw if deserialize is None else deserialize(raw)
        except Exception:  # noqa: BLE001 - protobuf's DecodeError, whatever its class
            return Undecodable(InvalidArgument(
                "request: not valid protobuf / invalid UTF-8 in a string field"))

    return load


async def _abort(context, e: Exception, method: str):
    code, details = status_of(e)
    if code == grpc.StatusCode.INTERNAL and not isinstance(e, ServiceError):
        log.error("%s failed", method, exc_info=e)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        hint = getattr(e, "retry_after_s", None) or RETRY_AFTER_S
        context.set_trailing_metadata(retry_metadata(hint))
    await context.abort(code, details)


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Every method of every kind (unary or streaming, either way) goes through one guard:
    the caller authorized (`Lifecycle.authorize`), new work refused while draining and
    counted, the request decoded (INVALID_ARGUMENT, or its check's own status, for bytes
    that do not decode or fail their method's raw check; a checked method's request is
    parsed off the event loop), and exceptions mapped to status codes."""

    def __init__(self, lifecycle: Lifecycle):
        self.lifecycle = lifecycle
        # method -> (its handler, its raw check, the guarded handler): gRPC asks for every
        # call, and the guard depends on nothing else, so it is built once per method.
        self._guarded: dict[str, tuple] = {}

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:
            return None
        method = details.method
        check = self.lifecycle.request_checks.get(method)
        known = self._guarded.get(method)
        if known is None or known[0] is not handler or known[1] is not check:
            known = (handler, check, self._guard(method, handler, check))
            self._guarded[method] = known
        return known[2]

    def _guard(self, method: str, handler, check: Callable[[bytes], None] | None):
        state = self.lifecycle
        work = method in state.work_methods
        load = _loader(handler.request_deserializer, check)
        offload = check is not None and not handler.request_streaming
        # A checked request reaches `guarded` as its raw bytes: parsed there, off the loop.
        deserializer = None if offload else load

        counted = method not in UNCOUNTED

        @asynccontextmanager
        async def guarded(context, request) -> AsyncIterator[object]:
            if counted and state.max_calls is not None and state.calls >= state.max_calls:
                await _abort(context, Overloaded(
                    f"server at capacity: {state.calls} calls at once "
                    f"(limit {state.max_calls})"), method)
            if state.authorize is not None:
                refused = state.authorize(method, context.invocation_metadata())
                if refused:
                    await context.abort(grpc.StatusCode.UNAUTHENTICATED, refused)
            if work and state.draining:
                await context.abort(grpc.StatusCode.UNAVAILABLE,
                                    f"draining: this service takes no new {method} calls")
            # No await between the capacity check and here but those that raise: the
            # count cannot pass the limit.
            state.inflight += work
            state.calls += counted
            try:
                if offload and state.parse is not None:
                    request = await state.parse(context.invocation_metadata(), load, request)
                elif offload:
                    request = await asyncio.get_running_loop().run_in_executor(
                        state.parse_pool, load, request)
                if isinstance(request, Undecodable):
                    await _abort(context, request.error, method)
                yield request
            except grpc.aio.AbortError:
                raise
            except Exception as e:  # noqa: BLE001 - every error gets its status
                await _abort(context, e, method)  # raises
            finally:
                state.inflight -= work
                state.calls -= counted

        async def decoded(requests, context):  # a request stream, each message decoded
            async for request in requests:
                if isinstance(request, Undecodable):
                    await _abort(context, request.error, method)
                yield request

        streaming_in = handler.request_streaming
        inner = (handler.unary_unary or handler.unary_stream or handler.stream_unary
                 or handler.stream_stream)

        async def one(request, context):  # one response, or written with context.write
            async with guarded(context, request) as request:
                if streaming_in:
                    request = decoded(request, context)
                return await inner(request, context)

        async def many(request, context):  # an async generator of responses
            # aclosing: a cancelled call closes the handler's generator now.
            async with guarded(context, request) as request:
                if streaming_in:
                    request = decoded(request, context)
                async with aclosing(inner(request, context)) as replies:
                    async for reply in replies:
                        yield reply

        make = {(False, False): grpc.unary_unary_rpc_method_handler,
                (False, True): grpc.unary_stream_rpc_method_handler,
                (True, False): grpc.stream_unary_rpc_method_handler,
                (True, True): grpc.stream_stream_rpc_method_handler}[
            (streaming_in, handler.response_streaming)]
        behavior = many if handler.response_streaming and inspect.isasyncgenfunction(
            inner) else one
        return make(behavior, request_deserializer=deserializer,
                    response_serializer=handler.response_serializer)


async def run_server(address: str, register: Callable[[grpc.aio.Server], list[str]],
                     lifecycle: Lifecycle | None = None,
                     idle: Callable[[], bool] | None = None,
                     on_stop: Callable[[], Awaitable[None]] | None = None,
                     grace_s: float = DRAIN_GRACE_S, serving_at_start: bool = True,
                     on_start: Callable[[], Awaitable[None]] | None = None,
                     credentials: grpc.ServerCredentials | None = None,
                     max_calls: int | None = None) -> None:
    """Serve until SIGINT/SIGTERM, then drain (above). `register` adds the servicers and
    returns their full service names, which health and reflection advertise; `on_start`
    runs once the server listens; past `max_calls` calls at once (None: no bound), a
    new one gets RESOURCE_EXHAUSTED."""
    state = lifecycle or Lifecycle()
    server = make_server(register, state, max_calls)
    port = (server.add_secure_port(address, credentials) if credentials is not None
            else server.add_insecure_port(address))
    if port == 0:
        raise RuntimeError(f"cannot listen on {address}")
    await server.start()
    await state.set_serving(serving_at_start)
    log.info("serving %s on %s", ", ".join(state.names), address)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if on_start is not None:
        await on_start()
    await stop.wait()
    await drain(state, idle, grace_s)
    await server.stop(1.0)
    if on_stop is not None:
        await on_stop()


def make_server(register: Callable[[grpc.aio.Server], list[str]], state: Lifecycle,
                max_calls: int | None = None) -> grpc.aio.Server:
    """A server with the interceptor, the servicers, health and reflection (no port),
    serving at most `max_calls` calls at once (None: no bound)."""
    options = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
               ("grpc.max_receive_message_length", state.max_receive_bytes)]
    server = grpc.aio.server(options=options, interceptors=[ErrorInterceptor(state)])
    state.max_calls = max_calls
    state.names = register(server)
    health_pb2_grpc.add_HealthServicer_to_server(state.health, server)
    reflection.enable_server_reflection(
        [*state.names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
         reflection.SERVICE_NAME], server)
    return server


async def drain(state: Lifecycle, idle: Callable[[], bool] | None, grace_s: float) -> None:
    log.info("draining: up to %.0fs for the work in flight", grace_s)
    state.draining = True
    await state.set_serving(False)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if state.inflight == 0 and (idle is None or idle()):
            log.info("drained")
            return
        await asyncio.sleep(DRAIN_POLL_S)
    log.warning("drain grace of %.0fs ran out with work in flight", grace_s)


def service_name(module, service: str) -> str:
    """Full name of a service from a generated _pb2 module."""
    return module.DESCRIPTOR.services_by_name[service].full_name


def method_name(module, service: str, method: str) -> str:
    """Full name of a method, as interceptors see it: "/pkg.Service/Method"."""
    return f"/{service_name(module, service)}/{method}"
