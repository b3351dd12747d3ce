"""`baton up` (what `make serve` runs): it comes up healthy, says how to call it, serves,
and SIGTERM stops every process it started."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import grpc
import httpx
import openai

from baton.services.rpc.processes import is_serving
from baton.v1 import generation_pb2 as gen
from baton.v1 import generation_pb2_grpc as gen_grpc
from tests.e2e.topology import ROOT, free_port


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True,
                         text=True).stdout
    return [int(x) for x in out.split()]


def test_up_serves_both_apis_and_sigterm_stops_everything(tiny_model):
    ports = [free_port() for _ in range(6)]
    cmd = [sys.executable, "-m", "baton.cli", "up", "--model", str(tiny_model),
           "--port", str(ports[0]),
           "--prefill-port", str(ports[1]), "--decode-port", str(ports[2]), "--threads", "1",
           "--kv-cache-gib", "0.25", "--dtype", "float32", "--http-port", str(ports[3]),
           "--prefill-metrics-port", str(ports[4]), "--decode-metrics-port", str(ports[5])]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True, env=dict(os.environ, NIXL_LOG_LEVEL="WARN"))
    try:
        banner = []
        deadline = time.monotonic() + 180
        for line in proc.stdout:
            banner.append(line)
            if "Ctrl-C" in line or time.monotonic() > deadline:
                break
        text = "".join(banner)
        assert "baton generate" in text and "curl http://" in text and "openai" in text, text
        children = _children(proc.pid)
        assert len(children) == 3
        router = f"127.0.0.1:{ports[0]}"
        with grpc.insecure_channel(router) as ch:
            stub = gen_grpc.GenerationStub(ch)
            deadline = time.monotonic() + 60  # the router pairs the workers on its first poll
            while True:
                try:
                    msgs = list(stub.Generate(gen.GenerateRequest(
                        text="Hello", sampling=gen.SamplingParams(max_tokens=4)), timeout=60))
                    break
                except grpc.RpcError:
                    assert time.monotonic() < deadline, "never served"
                    time.sleep(0.2)
            assert sum(len(m.delta.token_ids) for m in msgs) >= 1
            info = stub.GetModelInfo(gen.GetModelInfoRequest(), timeout=5).info
            assert info.vocab_size > 0 and info.max_model_len > 0
            # The official OpenAI client streams the same text as the gRPC API.
            chat = gen.ChatMessages(messages=[gen.ChatMessage(role="user", content="Hi!")])
            want = "".join(m.delta.text for m in stub.Generate(gen.GenerateRequest(
                chat=chat, sampling=gen.SamplingParams(max_tokens=16, temperature=0)),
                timeout=60))
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{ports[3]}/v1", api_key="none")
        model = client.models.list().data[0].id
        stream = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Hi!"}], max_tokens=16,
            temperature=0, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream) == want
        for port in ports[3:]:  # the router's and both workers' metrics
            assert "baton:" in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
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
