"""`baton up` (and `make serve`): the whole topology on one machine. Starts a prefill and a
decode worker, waits until both answer health checks, starts the router, waits for it,
prints how to call it, and stays in the foreground. Ctrl-C or SIGTERM stops every process
it started; if any of them dies, the rest are stopped too."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def add_parser(sub) -> None:
    p = sub.add_parser("up", help="run router + prefill + decode on this machine")
    p.add_argument("--port", type=int, default=50051, help="the router's port")
    p.add_argument("--prefill-port", type=int, default=50061)
    p.add_argument("--decode-port", type=int, default=50071)
    p.add_argument("--model", default=os.environ.get("BATON_MODEL"))
    p.add_argument("--kv-transport", choices=["nixl", "grpc"])
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="torch threads per worker (default: every core; the two workers "
                   "share them, so each can use all while the other waits)")
    p.add_argument("--kv-cache-gib", type=float, default=2.0)
    p.add_argument("--startup-timeout", type=float, default=300.0)


def wait_healthy(address: str, proc: subprocess.Popen, timeout: float) -> None:
    """Block until `address` answers SERVING, or raise if the process died or time ran out."""
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"the service for {address} exited with {proc.returncode}")
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise TimeoutError(f"{address} was not healthy after {timeout:.0f}s")


def is_serving(address: str, timeout: float = 3.0) -> bool:
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                              timeout=timeout)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def spawn(role: str, port: int, extra: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "services.serving.cli", "serve", "--role", role,
           "--address", f"127.0.0.1:{port}", *extra]
    return subprocess.Popen(cmd, start_new_session=True)


def stop_all(procs: list[subprocess.Popen], grace_s: float = 40.0) -> None:
    """SIGTERM each, then wait: a service drains its in-flight requests (up to its
    --drain-grace, 30 s by default) before it exits. SIGKILL after `grace_s`."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def up(args) -> None:
    engine = ["--threads", str(args.threads), "--kv-cache-gib", str(args.kv_cache_gib)]
    if args.model:
        engine += ["--model", args.model]
    if args.kv_transport:
        engine += ["--kv-transport", args.kv_transport]
    procs: list[subprocess.Popen] = []
    stopping = False

    def on_signal(signum, frame):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        prefill = spawn("prefill", args.prefill_port, engine)
        decode = spawn("decode", args.decode_port, engine)
        procs += [prefill, decode]
        wait_healthy(f"127.0.0.1:{args.prefill_port}", prefill, args.startup_timeout)
        wait_healthy(f"127.0.0.1:{args.decode_port}", decode, args.startup_timeout)
        router_flags = ["--prefill", f"127.0.0.1:{args.prefill_port}",
                        "--decode", f"127.0.0.1:{args.decode_port}"]
        if args.model:
            router_flags += ["--model", args.model]
        router = spawn("router", args.port, router_flags)
        procs.append(router)
        wait_healthy(f"127.0.0.1:{args.port}", router, args.startup_timeout)
        print(f"\nBaton is up: router on localhost:{args.port} (prefill :{args.prefill_port}, "
              f"decode :{args.decode_port}).\nTry:\n"
              f"  .venv/bin/baton generate --chat 'What is the capital of France?' "
              f"--address localhost:{args.port}\n"
              f"  grpcurl -plaintext -d '{{\"text\": \"Hello\"}}' localhost:{args.port} "
              "baton.v1.Generation/Generate\nCtrl-C stops everything.\n", flush=True)
        while not stopping:
            dead = [p for p in procs if p.poll() is not None]
            if dead:
                print(f"a service exited ({dead[0].args[5]}, code {dead[0].returncode}); "
                      "stopping the rest", file=sys.stderr)
                break
            time.sleep(0.5)
    except (RuntimeError, TimeoutError) as e:
        print(f"baton up: {e}", file=sys.stderr)
    finally:
        stop_all(procs)
    if not stopping:
        sys.exit(1)
