"""The goodput benchmark's requests and their open-loop arrivals: each request is sent at
its own time, whatever the server has answered (vLLM's `bench serve` with a request
rate), through the OpenAI API (streamed completions) or Baton's gRPC `Generate`.

Workloads (docs/workloads.md), random token ids from `random.Random(seed)`:

    chat     prompt ~ lognormal, median 400 tokens, in [100, 1500]; output ~ lognormal,
             median 120, in [50, 300]
    longdoc  prompt uniform in [2048, 8192]; output ~ lognormal, median 32, in [16, 64]
             (a tiny long-context model: the default model holds 2,048 tokens)
    w1, w3   W1's and W3's lengths (docs/benchmarks.md) at a rate

Arrivals: gaps drawn from a gamma distribution of shape `burstiness` and mean 1 / rate
(burstiness 1: a Poisson process; below 1, burstier), as vLLM draws them.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass

import numpy as np

from .goodput_stats import Timing

WORKLOADS = ("chat", "longdoc", "w1", "w3")


@dataclass(frozen=True)
class Job:
    prompt: list[int]
    output_len: int


def jobs(name: str, n: int, seed: int, vocab_size: int) -> list[Job]:
    rng = random.Random(f"{name}-{seed}")

    def ids(k: int) -> list[int]:
        return [rng.randint(100, vocab_size - 1) for _ in range(k)]

    def lognormal(median: float, sigma: float, low: int, high: int) -> int:
        return min(high, max(low, round(rng.lognormvariate(math.log(median), sigma))))

    out = []
    for _ in range(n):
        if name == "chat":
            prompt, output = lognormal(400, 0.7, 100, 1500), lognormal(120, 0.5, 50, 300)
        elif name == "longdoc":
            prompt, output = rng.randint(2048, 8192), lognormal(32, 0.4, 16, 64)
        elif name == "w1":
            prompt, output = rng.randint(64, 256), 128
        elif name == "w3":
            prompt, output = rng.randint(512, 1024), 16
        else:
            raise ValueError(f"workload {name!r}: one of {WORKLOADS}")
        out.append(Job(ids(prompt), output))
    return out


def arrivals(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds from the start at which each of `n` requests is sent."""
    if math.isinf(rate):
        return [0.0] * n
    gaps = np.random.default_rng(seed).gamma(burstiness, 1.0 / (rate * burstiness), n)
    return [0.0, *np.cumsum(gaps[:-1]).tolist()]


async def run(work: list[Job], times: list[float], api: str, target: str,
              progress=None, timeout_s: float = 3600.0) -> list[Timing]:
    """Send each job at its time to `target` (an HTTP base URL for "openai", a gRPC
    address for "grpc"); every request's Timing, in `work`'s order."""
    send = _openai if api == "openai" else _grpc
    async with _Client(api, target) as client:
        start = time.perf_counter()
        tasks = []
        for job, at in zip(work, times, strict=True):
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(send(client, job, progress, timeout_s)))
        return list(await asyncio.gather(*tasks))


class _Client:
    def __init__(self, api: str, target: str):
        self.api, self.target = api, target
        self.model = ""

    async def __aenter__(self):
        if self.api == "openai":
            import httpx

            # A pooled connection is dropped here before the server may close it idle
            # (uvicorn's 5 s, the router's and vLLM's): with httpx's own 5 s the two can
            # close it at once, and a request sent into it gets no answer (ReadError).
            self.http = httpx.AsyncClient(
                base_url=self.target, timeout=None,
                limits=httpx.Limits(max_connections=None, keepalive_expiry=2.0))
            self.model = (await self.http.get("/v1/models")).json()["data"][0]["id"]
        else:
            import grpc

            from baton.v1 import generation_pb2_grpc as gen_grpc

            self.channel = grpc.aio.insecure_channel(self.target)
            self.stub = gen_grpc.GenerationStub(self.channel)
        return self

    async def __aexit__(self, *exc):
        if self.api == "openai":
            await self.http.aclose()
        else:
            await self.channel.close()


async def _openai(client: _Client, job: Job, progress, timeout_s: float) -> Timing:
    body = {"model": client.model, "prompt": job.prompt, "max_tokens": job.output_len,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    t = Timing(sent=time.perf_counter(), input_len=len(job.prompt))
    try:
        async with asyncio.timeout(timeout_s):
            async with client.http.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    t.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("choices") and chunk["choices"][0].get("text"):
                        t.token_times.append(time.perf_counter())
                    if chunk.get("usage"):
                        t.output_len = chunk["usage"]["completion_tokens"]
    except Exception as e:  # noqa: BLE001 - a failed request is a finding, counted
        t.error = f"{type(e).__name__}: {e}"
    if progress is not None:
        progress.update(1)
    return t


async def _grpc(client: _Client, job: Job, progress, timeout_s: float) -> Timing:
    from baton.v1 import generation_pb2 as gen

    req = gen.GenerateRequest(token_ids=gen.TokenIds(ids=job.prompt),
                              sampling=gen.SamplingParams(max_tokens=job.output_len,
                                                          temperature=0.0, ignore_eos=True))
    t = Timing(sent=time.perf_counter(), input_len=len(job.prompt))
    try:
        async for msg in client.stub.Generate(req, timeout=timeout_s):
            if msg.delta.token_ids:
                t.token_times.append(time.perf_counter())
                t.output_len += len(msg.delta.token_ids)
            if msg.HasField("timings"):  # the latest figures of each part
                d = msg.timings
                t.queue_s = d.queue_s or t.queue_s
                t.prefill_s = d.prefill_s or t.prefill_s
                t.kv_transfer_s = d.kv_transfer_s or t.kv_transfer_s
    except Exception as e:  # noqa: BLE001
        t.error = f"{type(e).__name__}: {e}"
    if progress is not None:
        progress.update(1)
    return t
