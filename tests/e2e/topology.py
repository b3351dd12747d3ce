"""Start Baton services as real processes on loopback, as `baton serve` starts them."""

from __future__ import annotations

import atexit
import os
import random
import secrets
import signal
import socket
import subprocess
from pathlib import Path

import grpc

from baton.services.rpc.cluster import ClusterToken
from baton.services.rpc.processes import serve_command, stop_all, wait_healthy
from tests.e2e.zygote import Zygote

ROOT = Path(__file__).resolve().parents[2]
# Small and exact: fp32 (so greedy text matches an offline engine batch for batch), one
# torch thread each (two cores, three processes), a small KV budget.
WORKER_FLAGS = ["--dtype", "float32", "--threads", "1", "--kv-cache-gib", "0.25",
                "--max-num-batched-tokens", "256", "--log-level", "WARNING"]
# Every service started here shares it (a test may pass env={"BATON_CLUSTER_TOKEN": ""}
# for none), and `channel` sends it: the workers trust one another, as deployed.
CLUSTER_TOKEN = secrets.token_urlsafe(32)
# Services are forked from one zygote per test process (tests/e2e/zygote.py: the imports
# done once); BATON_TEST_NO_ZYGOTE=1 starts each as a fresh process instead.
ZYGOTE = None if os.environ.get("BATON_TEST_NO_ZYGOTE") == "1" else Zygote()
if ZYGOTE is not None:
    atexit.register(ZYGOTE.close)


# Each test process takes ports from its own slice of 20000-31999 (pytest-xdist's gw0,
# gw1, ...), below the kernel's ephemeral range (32768 and up here): no other test process
# and no outgoing connection's local port can take one between the check and the bind.
_worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
_SLICE = 3000
_LOW = 20000 + (int(_worker) if _worker.isdigit() else 0) % 4 * _SLICE
_given: set[int] = set()


def free_port() -> int:
    """A port free now, never handed out before by this process."""
    while True:
        port = random.randrange(_LOW, _LOW + _SLICE)
        if port in _given:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _given.add(port)
        return port


class Topology:
    """Processes started here, stopped together. Every service runs `model` (an HF
    directory or GGUF file; the router reads its tokenizer) unless its flags name one."""

    def __init__(self, log_dir: Path, model: Path | str):
        self.log_dir = log_dir
        self.model = str(model)
        self.procs: list[subprocess.Popen] = []
        self.pending: list[tuple] = []  # (address, process, credentials): not yet healthy
        self.http: dict[str, str] = {}  # a router's gRPC address -> its HTTP address
        self.metrics: dict[str, str] = {}  # a worker's gRPC address -> its metrics address

    def start(self, role: str, *flags: str, wait: bool = True, port: int | None = None,
              healthy: bool = True, credentials=None, env: dict | None = None,
              host: str = "127.0.0.1") -> str:
        """Start a service; wait until it is healthy (with `healthy` False: never wait for
        it, it is not meant to become SERVING; `credentials`: TLS to reach it)."""
        port = port or free_port()
        address = f"{host}:{port}"
        if "--model" not in flags:
            flags = (*flags, "--model", self.model)
        if role == "router":
            # These tests check the mechanics of disaggregation: every request goes
            # through a prefill worker. Conditional disaggregation has its own tests
            # (each sets the rule it checks).
            for rule in ("--local-prefill-hit", "--local-prefill-tokens",
                         "--local-prefill-queue"):
                if rule not in flags:
                    flags = (*flags, rule, "0")
        if role in ("router", "colocated") and "--http-port" not in flags:
            http = free_port()
            flags = (*flags, "--http-port", str(http))
            self.http[address] = f"127.0.0.1:{http}"
        log = self.log_dir / f"{role}-{host}-{port}.log"
        env = {**os.environ, "NIXL_LOG_LEVEL": "WARN", "BATON_CLUSTER_TOKEN": CLUSTER_TOKEN,
               **(env or {})}
        cmd = serve_command(role, address, *flags)
        if ZYGOTE is not None:
            proc = ZYGOTE.spawn(cmd, log, env)
        else:
            with open(log, "a") as out:
                proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                        env=env)
        self.procs.append(proc)
        if healthy:
            self.pending.append((address, proc, credentials))
        if wait:
            self.wait()
        return address

    def wait(self) -> None:
        """Until every service started so far answers health checks."""
        for address, proc, credentials in self.pending:
            wait_healthy(address, proc, timeout=240, credentials=credentials)
        self.pending.clear()

    def worker(self, role: str, *flags: str, port: int | None = None, wait: bool = True,
               **kw) -> str:
        metrics = free_port()
        address = self.start(role, *WORKER_FLAGS, *flags, "--metrics-port", str(metrics),
                             port=port, wait=wait, **kw)
        self.metrics[address] = f"{kw.get('host', '127.0.0.1')}:{metrics}"  # the worker's host
        return address

    def process(self, address: str) -> subprocess.Popen:
        """The process serving `address` (the last started there)."""
        return next(p for p in reversed(self.procs)
                    if p.args[p.args.index("--address") + 1] == address)

    def kill(self, address: str, sig: int = signal.SIGKILL) -> subprocess.Popen | None:
        """Signal the process serving `address`: SIGKILL (no goodbye to its peers) waits
        for it; SIGTERM (a drain), SIGSTOP and SIGCONT return it."""
        for proc in self.procs:
            own = proc.args[proc.args.index("--address") + 1]
            if proc.poll() is None and own == address:
                proc.send_signal(sig)
                if sig == signal.SIGKILL:
                    proc.wait()
                return proc
        return None

    def disaggregated(self, transport: str) -> dict[str, str]:
        """A prefill and a decode worker over `transport`, and a router in front."""
        prefill = self.worker("prefill", "--kv-transport", transport, wait=False)
        decode = self.worker("decode", "--kv-transport", transport, wait=False)
        router = self.start("router", "--prefill", prefill, "--decode", decode)
        return {"router": router, "prefill": prefill, "decode": decode}

    def stop(self) -> None:
        stop_all(self.procs)


def channel(address: str) -> grpc.Channel:
    """A channel to any service here: the cluster token on every call (a router ignores
    it)."""
    return ClusterToken(CLUSTER_TOKEN).intercept(grpc.insecure_channel(address))
