"""The aio gRPC server bootstrap every Baton service uses: standard health and reflection,
message limits, and a graceful stop on SIGINT/SIGTERM (health goes NOT_SERVING, in-flight
RPCs get a grace period, then the process's cleanup runs)."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]


async def run_server(address: str, register: Callable[[grpc.aio.Server], list[str]],
                     on_stop: Callable[[], Awaitable[None]] | None = None,
                     grace_s: float = 30.0, ready: asyncio.Event | None = None) -> None:
    """Serve until SIGINT/SIGTERM. `register` adds the servicers and returns their full
    service names, which health and reflection then advertise."""
    server = grpc.aio.server(options=CHANNEL_OPTIONS)
    names = register(server)
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        [*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
         reflection.SERVICE_NAME], server)
    port = server.add_insecure_port(address)
    if port == 0:
        raise RuntimeError(f"cannot listen on {address}")
    await server.start()
    for name in ("", *names):
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("serving %s on %s", ", ".join(names), address)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if ready is not None:
        ready.set()
    await stop.wait()
    log.info("stopping: draining for up to %.0fs", grace_s)
    await health.enter_graceful_shutdown()
    await server.stop(grace_s)
    if on_stop is not None:
        await on_stop()


def service_name(module, service: str) -> str:
    """Full name of a service from a generated _pb2 module."""
    return module.DESCRIPTOR.services_by_name[service].full_name
