"""`baton serve MODEL` as a vLLM user types it: one colocated process on the HTTP --port,
behind --api-key, that answers /v1/completions, round-trips /tokenize and /detokenize,
and whose `vllm:` metrics move under load (the gauges while a stream runs, the counters
and histograms by exactly the requests and tokens it served)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time

import httpx

from baton.services.common.tokenizer import load_tokenizer
from tests.e2e.helpers import metric_value
from tests.e2e.topology import ROOT, WORKER_FLAGS, ZYGOTE, free_port

KEY = "a-key-for-the-vllm-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
LOAD, TOKENS = 4, 8  # concurrent requests, tokens each


def _read_stream(client: httpx.Client, body: dict, tail: list,
                 stop: threading.Event) -> None:
    """POST `body` as a stream on a client of its own and read it until its end or `stop`
    (then it closes it); its last lines go in `tail` (how it ended, for a failure's
    message)."""
    with httpx.Client(base_url=client.base_url, headers=AUTH, timeout=120) as own, \
            own.stream("POST", "/v1/completions", json=body) as stream:
        for line in stream.iter_lines():
            if line:
                tail[:] = [*tail[-2:], line]
            if stop.is_set():
                break


def _start(cmd: list[str], log) -> subprocess.Popen:
    env = dict(os.environ, NIXL_LOG_LEVEL="WARN")
    if ZYGOTE is not None:
        return ZYGOTE.spawn(cmd, log, env)
    with open(log, "a") as out:
        return subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)


def _wait_ready(base: str, proc, log, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"baton serve exited: {open(log).read()[-3000:]}"
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"baton serve did not come up: {open(log).read()[-3000:]}")


def test_baton_serve_model_answers_like_vllm(tiny_model, tmp_path):
    http, grpc_port = free_port(), free_port()
    log = tmp_path / "serve.log"
    proc = _start([sys.executable, "-m", "baton.cli", "serve", str(tiny_model),
                   "--host", "127.0.0.1", "--address", f"127.0.0.1:{grpc_port}",
                   "--port", str(http), "--api-key", KEY, *WORKER_FLAGS], log)
    base = f"http://127.0.0.1:{http}"
    try:
        _wait_ready(base, proc, log)
        with httpx.Client(base_url=base, headers=AUTH, timeout=60) as client:
            model = client.get("/v1/models").json()["data"][0]["id"]
            assert model == tiny_model.name
            refused = client.post("/v1/completions", headers={"Authorization": ""},
                                  json={"model": model, "prompt": "Hi", "max_tokens": 2})
            assert refused.status_code == 401
            done = client.post("/v1/completions", headers={"X-Request-Id": "e2e-1"}, json={
                "model": model, "prompt": "The capital of France is", "max_tokens": 4,
                "temperature": 0, "ignore_eos": True})
            assert done.status_code == 200, done.text
            assert done.headers["x-request-id"] == "e2e-1" and done.json()["id"] == "cmpl-e2e-1"
            assert done.json()["usage"]["completion_tokens"] == 4

            text = "Baton serves what vLLM serves."
            ids = client.post("/tokenize", json={"model": model, "prompt": text}).json()
            assert ids["tokens"] == load_tokenizer(tiny_model).encode(text)
            assert ids["count"] == len(ids["tokens"]) and ids["max_model_len"] > 0
            back = client.post("/detokenize", json={"model": model, "tokens": ids["tokens"]})
            assert back.json() == {"prompt": text}
            assert client.get("/version").json()["version"]

            _metrics_move_under_load(client, model)
    except httpx.TransportError as e:  # the server went away: say whether it died, and how
        raise AssertionError(f"{e!r}; baton serve's exit status {proc.poll()}, its log: "
                             f"{open(log).read()[-3000:]}") from e
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def _metrics_move_under_load(client: httpx.Client, model: str) -> None:
    def scrape() -> str:
        return client.get("/metrics").text

    def figure(text: str, name: str, **labels) -> float:
        return metric_value(text, name, model_name=model, **labels)

    # A stream holds a running request and its KV while it runs. The gauges and the token
    # counter of a scrape come from one snapshot of the engine's stats (taken after each
    # step): one that counts some of the stream's tokens, not all, was taken while it ran.
    # The stream is read to its end on a thread of its own, so no back-pressure or stall
    # cut ever touches it. The tiny model decodes 4,000 tokens in seconds; a loaded
    # machine may scrape only after the end of one: then another stream.
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": 4000,
            "ignore_eos": True, "stream": True}
    deadline, during, tail = time.monotonic() + 60, None, []
    while during is None:
        assert time.monotonic() < deadline, "no scrape came while a stream ran"
        start = figure(scrape(), "vllm:generation_tokens_total")
        stop = threading.Event()
        reader = threading.Thread(target=_read_stream, args=(client, body, tail, stop))
        reader.start()
        try:
            while time.monotonic() < deadline and reader.is_alive():
                text = scrape()
                done = figure(text, "vllm:generation_tokens_total") - start
                if 0 < done < 4000:
                    during = text
                    break
                if done >= 4000:  # it ended before this scrape
                    break
                time.sleep(0.02)  # a snapshot from before its first step: again
        finally:
            stop.set()
            reader.join(timeout=120)
    assert figure(during, "vllm:num_requests_running") >= 1, (tail, [
        line for line in during.splitlines() if line.startswith("vllm:num_requests")])
    assert figure(during, "vllm:kv_cache_usage_perc") > 0
    deadline = time.monotonic() + 60
    while True:  # the closed stream's request ends on the engine
        before = scrape()
        if figure(before, "vllm:num_requests_running") == 0:
            break
        assert time.monotonic() < deadline, "the closed stream's request never ended"
        time.sleep(0.02)

    async def load():
        async with httpx.AsyncClient(base_url=str(client.base_url), headers=AUTH,
                                     timeout=60) as c:
            return await asyncio.gather(*(c.post("/v1/completions", json={
                "model": model, "prompt": f"Request {i} says", "max_tokens": TOKENS,
                "ignore_eos": True}) for i in range(LOAD)))

    assert [r.status_code for r in asyncio.run(load())] == [200] * LOAD
    after = scrape()

    def moved(name: str, **labels) -> float:
        return figure(after, name, **labels) - figure(before, name, **labels)

    assert moved("vllm:request_success_total", finished_reason="length") == LOAD
    assert moved("vllm:time_to_first_token_seconds_count") == LOAD
    assert moved("vllm:e2e_request_latency_seconds_count") == LOAD
    assert moved("vllm:inter_token_latency_seconds_count") == LOAD * (TOKENS - 1)
    assert moved("vllm:time_per_output_token_seconds_count") == LOAD * (TOKENS - 1)
    assert moved("vllm:generation_tokens_total") == LOAD * TOKENS
    assert moved("vllm:prompt_tokens_total") > 0
    assert moved("vllm:e2e_request_latency_seconds_sum") > 0
    assert figure(after, "vllm:num_requests_running") == 0
    assert figure(after, "vllm:num_requests_waiting") == 0
    # Baton's own names are still there, beside vLLM's.
    assert figure(after, "baton:request_success_total", finished_reason="length") >= LOAD
