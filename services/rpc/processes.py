"""Baton services as child processes, for `baton up`, the benchmarks and the e2e tests:
start one, wait until it answers health checks, stop them all (each drains first)."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def free_port() -> int:
    """A port the system has free now (on 127.0.0.1), for a service started here."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_command(role: str, address: str, *flags: str) -> list[str]:
    """The command line of `baton serve` for `role` on `address`."""
    return [sys.executable, "-m", "baton.cli", "serve", "--role", role, "--address", address,
            *flags]


def spawn(role: str, address: str, flags: list[str], **popen) -> subprocess.Popen:
    popen.setdefault("start_new_session", True)
    return subprocess.Popen(serve_command(role, address, *flags), **popen)


# A channel that waits for a service to start tries to connect every POLL_CONNECT_MS:
# gRPC's own backoff (1 s, then 1.6x) found a service up at 4 s only at 5.2 s, at 7 s
# only at 9.3 s.
POLL_CONNECT_MS = 100
_POLLING = [("grpc.initial_reconnect_backoff_ms", POLL_CONNECT_MS),
            ("grpc.max_reconnect_backoff_ms", 2 * POLL_CONNECT_MS)]


def dial(address: str, credentials: grpc.ChannelCredentials | None = None,
         options: list | None = None) -> grpc.Channel:
    """A tool's channel to a service: TLS with `credentials`, else plaintext."""
    return (grpc.secure_channel(address, credentials, options) if credentials is not None
            else grpc.insecure_channel(address, options))


def wait_healthy(address: str, proc: subprocess.Popen, timeout: float,
                 credentials: grpc.ChannelCredentials | None = None) -> None:
    """Block until `address` answers SERVING, or raise if the process died or time ran out
    (`credentials`: TLS to it)."""
    deadline = time.monotonic() + timeout
    with dial(address, credentials, _POLLING) as channel:
        check = _health_check(channel)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"the service for {address} exited with {proc.returncode}")
            try:
                reply = check(health_pb2.HealthCheckRequest(), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise TimeoutError(f"{address} was not healthy after {timeout:.0f}s")


def is_serving(address: str, timeout: float = 3.0,
               credentials: grpc.ChannelCredentials | None = None) -> bool:
    with dial(address, credentials) as channel:
        try:
            reply = _health_check(channel)(health_pb2.HealthCheckRequest(), timeout=timeout)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def stop_all(procs: list[subprocess.Popen], grace_s: float = 40.0) -> None:
    """SIGTERM each, then wait: a service drains its in-flight requests (up to its
    --drain-grace, 30 s by default) before it exits. SIGKILL after `grace_s`."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGCONT)  # a test may have frozen it
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _health_check(channel: grpc.Channel) -> Callable[..., health_pb2.HealthCheckResponse]:
    """The health service's Check: grpc_health's stub makes its methods in __init__,
    where a type checker does not see them."""
    stub: Any = health_pb2_grpc.HealthStub(channel)
    return stub.Check
