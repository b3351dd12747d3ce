"""The Shepherd Model Gateway (`smg`, from the development lock) in front of Baton's
VllmEngine API, for the benchmark (vs_smg.py) and the end-to-end tests:
started on free ports, ready once it lists a model and every worker (registered, the
tokenizer fetched from Baton with GetTokenizer), stopped after."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

import httpx

from baton.services.rpc.processes import free_port

SMG = Path(sys.executable).parent / "smg"


class Gateway(NamedTuple):
    url: str  # its OpenAI API's base URL
    pid: int  # its process (the gateway runs in the one process `smg launch` starts)


@contextmanager
def gateway(workers: list[str], log: Path, *flags: str, model: str | None = None):
    """`smg launch` with its vLLM gRPC backend in front of `workers` (Baton addresses);
    yields it once `model` (else any model) is listed, every worker registered, and a
    one-token completion answered: the gateway lists a model before it has fetched its
    tokenizer, and answers 503 (tokenizer_not_ready) until then."""
    port = free_port()
    cmd = [str(SMG), "launch", "--host", "127.0.0.1", "--port", str(port),
           "--prometheus-port", str(free_port()), "--log-level", "warn",
           # Stopped at once: its default grace waits out every open stream (10 s here).
           "--shutdown-grace-period-secs", "0",
           "--worker-urls", *(f"grpc://{w}" for w in workers), *flags]
    with open(log, "a") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, f"smg exited: {log.read_text()[-2000:]}"
            assert time.monotonic() < deadline, f"smg never ready: {log.read_text()[-2000:]}"
            try:
                listed = httpx.get(f"{base}/v1/models", timeout=5).json().get("data", [])
                named = [m["id"] for m in listed if model is None or m["id"] == model]
                workers_up = httpx.get(f"{base}/workers", timeout=5).json()["workers"]
                if named and len(workers_up) == len(workers) and httpx.post(
                        f"{base}/v1/completions", timeout=60, json={
                            "model": named[0], "prompt": "hi", "max_tokens": 1}
                        ).status_code == 200:
                    break
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.2)
        yield Gateway(base, proc.pid)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
