"""`baton up` (what `make serve` runs): it comes up healthy, says how to call it, serves,
and SIGTERM stops every process it started."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import grpc

from baton.v1 import generation_pb2 as gen
from baton.v1 import generation_pb2_grpc as gen_grpc
from services.serving.processes import is_serving
from tests.e2e.topology import ROOT, free_port


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True,
                         text=True).stdout
    return [int(x) for x in out.split()]


def test_up_serves_and_sigterm_stops_everything(model_path):
    ports = [free_port() for _ in range(3)]
    cmd = [sys.executable, "-m", "cli", "up", "--port", str(ports[0]),
           "--prefill-port", str(ports[1]), "--decode-port", str(ports[2]), "--threads", "1",
           "--kv-cache-gib", "0.25"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True, env=dict(os.environ, NIXL_LOG_LEVEL="WARN"))
    try:
        banner = []
        deadline = time.monotonic() + 180
        for line in proc.stdout:
            banner.append(line)
            if "baton generate" in line or time.monotonic() > deadline:
                break
        assert any("baton generate" in line for line in banner), "".join(banner)
        children = _children(proc.pid)
        assert len(children) == 3
        router = f"127.0.0.1:{ports[0]}"
        with grpc.insecure_channel(router) as ch:
            stub = gen_grpc.GenerationStub(ch)
            for _ in range(100):  # the router pairs the workers on its first poll
                try:
                    msgs = list(stub.Generate(gen.GenerateRequest(
                        text="Hello", sampling=gen.SamplingParams(max_tokens=4)), timeout=60))
                    break
                except grpc.RpcError:
                    time.sleep(0.2)
            assert sum(len(m.delta.token_ids) for m in msgs) >= 1
            info = stub.GetModelInfo(gen.GetModelInfoRequest(), timeout=5).info
            assert info.vocab_size > 0 and info.max_model_len > 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        for pid in children:
            assert not os.path.exists(f"/proc/{pid}") or _is_zombie(pid), f"{pid} still runs"
        assert not any(is_serving(f"127.0.0.1:{p}", timeout=1) for p in ports)
    finally:
        if proc.poll() is None:
            proc.kill()


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] == "Z"
    except FileNotFoundError:
        return True
