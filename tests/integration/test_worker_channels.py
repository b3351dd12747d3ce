"""Channels between services (the router's to its workers, a decode worker's to its
prefill workers): they keep trying a peer that went away at least about every second, so
a worker restarted on its address is seen and paired again at once (gRPC's own backoff
grows 1.6x per failed attempt, to two minutes); and over TLS, a worker dialed by IP (as
DNS discovery finds it) is checked against --tls-server-name."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from baton.services.rpc.config import ServiceConfig
from baton.services.rpc.security import Security
from tests.e2e.certs import CA

# Attempts come 0.25, 0.4, 0.64, then 1 s apart (RECONNECT_FIRST_MS, 1.6x, RECONNECT_MAX_MS,
# 20% jitter): the seventh at about 4.3 s. gRPC's own backoff (1 s, 1.6x, to two minutes)
# makes its seventh wait 26 s (21 s at the least, with its jitter). A loaded machine
# only delays attempts, so waiting for seven, at most 4.6 times what that takes idle,
# tells the two apart either way.
ATTEMPTS = 7
BOUND_S = 20.0


def _attempts(listener: socket.socket, done: threading.Event, seen: list[float]) -> None:
    """Accept each connection attempt and hang up at once (a peer that is not there)."""
    listener.settimeout(0.05)
    while not done.is_set():
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            continue
        seen.append(time.monotonic())
        conn.close()


def test_a_channel_to_a_peer_that_went_away_tries_it_every_second():
    security = Security(ServiceConfig("127.0.0.1:0"))
    listeners = [socket.create_server(("127.0.0.1", 0)) for _ in range(2)]
    aio_addr, sync_addr = (f"127.0.0.1:{s.getsockname()[1]}" for s in listeners)
    done = threading.Event()
    seen: list[list[float]] = [[], []]
    threads = [threading.Thread(target=_attempts, args=(s, done, t))
               for s, t in zip(listeners, seen, strict=True)]
    for t in threads:
        t.start()
    start = time.monotonic()

    async def aio_channel() -> None:  # the router's clients, a decode worker's handshakes
        channel = security.aio_channel(aio_addr)
        channel.get_state(try_to_connect=True)
        while min(map(len, seen)) < ATTEMPTS and time.monotonic() - start < BOUND_S:
            await asyncio.sleep(0.05)
        await channel.close()

    sync = security.channel(sync_addr)  # a decode worker's block reads (gRPC transport)
    sync.subscribe(lambda _: None, try_to_connect=True)
    try:
        asyncio.run(aio_channel())
    finally:
        done.set()
        for t in threads:
            t.join()
        sync.close()
        for s in listeners:
            s.close()
    for times in seen:
        assert len(times) >= ATTEMPTS, [round(t - start, 2) for t in times]


def test_a_worker_dialed_by_ip_is_checked_against_the_tls_server_name(tmp_path):
    ca = CA(tmp_path, "ca")
    name = "worker.baton.test"
    worker_cert, worker_key = ca.issue("worker", dns_names=(name,))  # no IP in it
    router_cert, router_key = ca.issue("router")
    worker = Security(ServiceConfig("127.0.0.1:0", tls_cert=str(worker_cert),
                                    tls_key=str(worker_key), tls_ca=str(ca.path)))

    def caller(server_name: str | None) -> Security:
        return Security(ServiceConfig("127.0.0.1:0", tls_cert=str(router_cert),
                                      tls_key=str(router_key), tls_ca=str(ca.path),
                                      tls_server_name=server_name))

    async def main():
        server = grpc.aio.server()
        health = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
        port = server.add_secure_port("127.0.0.1:0", worker.server_credentials(public=False))
        await server.start()
        address = f"127.0.0.1:{port}"
        try:
            async with caller(name).aio_channel(address) as channel:
                reply = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=10)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
            sync = caller(name).channel(address)  # a decode worker's block reads
            try:
                await asyncio.to_thread(health_pb2_grpc.HealthStub(sync).Check,
                                        health_pb2.HealthCheckRequest(), timeout=10)
            finally:
                sync.close()
            async with caller(None).aio_channel(address) as channel:  # 127.0.0.1: not in it
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await health_pb2_grpc.HealthStub(channel).Check(
                        health_pb2.HealthCheckRequest(), timeout=10)
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        finally:
            await server.stop(0)

    asyncio.run(main())


def test_a_tls_server_name_needs_tls():
    with pytest.raises(ValueError, match="tls_server_name"):
        ServiceConfig("127.0.0.1:0", tls_server_name="worker.baton.test")
