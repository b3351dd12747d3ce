"""Serving benchmark: W1 through the public API, disaggregated (router -> prefill worker
-> NIXL -> decode worker) and colocated (one engine), at several concurrencies, in the
same run, one topology at a time on the machine.

    python -m baton.tools.bench.serve [--concurrency 16 64] [--rounds 1] [--json]
    python -m baton.tools.bench.serve --compare-apis --concurrency 64 --rounds 2

Prints, per mode and concurrency: output throughput, TTFT p50/p99, ITL p50/p99, and for
the disaggregated mode the KV transfer time per request, its GB/s and its share of the
prefill time. Ends with the disaggregated/colocated throughput ratio per concurrency.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import secrets
import statistics
import sys
import time
from dataclasses import dataclass, field

import grpc

from baton.services.rpc.cluster import ClusterToken
from baton.services.rpc.processes import spawn, stop_all, wait_healthy
from baton.services.worker.messages import layout_from_message
from baton.v1 import generation_pb2 as gen
from baton.v1 import generation_pb2_grpc as gen_grpc
from baton.worker.v1 import worker_pb2 as wk
from baton.worker.v1 import worker_pb2_grpc as wk_grpc

from .workloads import make_workload

PORTS = {"router": 50251, "prefill": 50261, "decode": 50271, "colocated": 50281,
         "http": 50252}
# The services started here share a cluster token, as deployed (the decode worker then
# caches the KV it pulls); it reaches them through the environment.
CLUSTER = ClusterToken(os.environ.get("BATON_CLUSTER_TOKEN") or secrets.token_urlsafe(32))
ENV = {**os.environ, "BATON_CLUSTER_TOKEN": CLUSTER.token}


@dataclass
class Result:
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    transfer: list[float] = field(default_factory=list)
    prefill: list[float] = field(default_factory=list)
    kv_bytes: list[int] = field(default_factory=list)
    tokens: int = 0
    seconds: float = 0.0
    local_prefills: int = 0  # requests whose decode worker computed the prompt itself


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(q / 100 * len(xs)) - 1))]


async def run_load(address: str, prompts: list[list[int]], output_len: int, concurrency: int,
                   block_size: int = 16, block_bytes: int = 0) -> Result:
    res = Result()
    queue: asyncio.Queue = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    params = gen.SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = gen_grpc.GenerationStub(channel)

        async def client():
            while not queue.empty():
                ids = queue.get_nowait()
                t0 = last = time.perf_counter()
                n = 0
                req = gen.GenerateRequest(token_ids=gen.TokenIds(ids=ids), sampling=params)
                async for msg in stub.Generate(req, timeout=600):
                    now = time.perf_counter()
                    if n == 0 and msg.delta.token_ids:
                        res.ttft.append(now - t0)
                    elif msg.delta.token_ids:
                        k = len(msg.delta.token_ids)
                        res.itl += [(now - last) / k] * k
                    if msg.delta.token_ids:
                        last = now
                    n += len(msg.delta.token_ids)
                    if msg.delta.finish_reason:
                        t = msg.timings
                        res.local_prefills += t.local_prefill
                        res.prefill.append(t.prefill_s)
                        if t.kv_transfer_s > 0:
                            res.transfer.append(t.kv_transfer_s)
                            blocks = (-(-len(ids) // block_size)
                                      - msg.usage.cached_tokens // block_size)
                            res.kv_bytes.append(blocks * block_bytes)
                res.tokens += n

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        res.seconds = time.perf_counter() - t0
    return res


def start(mode: str, threads: int, worker_threads: int, kv_gib: float,
          caching: bool = True) -> tuple[list, str]:
    env_flags = ["--kv-cache-gib", str(kv_gib), "--log-level", "WARNING",
                 "--enable-prefix-caching" if caching else "--no-enable-prefix-caching"]
    procs = []
    try:
        if mode == "colocated":
            procs.append(spawn("colocated", f"127.0.0.1:{PORTS['colocated']}",
                               env_flags + ["--threads", str(threads), "--http-port",
                                            str(PORTS["http"])], env=ENV))
            wait_healthy(f"127.0.0.1:{PORTS['colocated']}", procs[0], 300)
            return procs, f"127.0.0.1:{PORTS['colocated']}"
        for role in ("prefill", "decode"):
            procs.append(spawn(role, f"127.0.0.1:{PORTS[role]}",
                               env_flags + ["--threads", str(worker_threads)], env=ENV))
        for role, p in zip(("prefill", "decode"), procs, strict=True):
            wait_healthy(f"127.0.0.1:{PORTS[role]}", p, 300)
        procs.append(spawn("router", f"127.0.0.1:{PORTS['router']}",
                           ["--log-level", "WARNING", "--http-port", str(PORTS["http"]),
                            "--prefill", f"127.0.0.1:{PORTS['prefill']}", "--decode",
                            f"127.0.0.1:{PORTS['decode']}"], env=ENV))
        wait_healthy(f"127.0.0.1:{PORTS['router']}", procs[-1], 60)
        return procs, f"127.0.0.1:{PORTS['router']}"
    except BaseException:
        stop_all(procs)
        raise


async def warm_up(address: str) -> None:
    """Until the path works end to end (the router pairs workers on its first poll)."""
    deadline = time.monotonic() + 60
    while True:
        try:
            await run_load(address, [[100 + i for i in range(40)]] * 2, 4, 2)
            return
        except grpc.aio.AioRpcError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)


async def run_load_http(base: str, prompts: list[list[int]] | list[str], output_len: int,
                        concurrency: int) -> Result:
    """The same load through the OpenAI-compatible API: streamed completions of the same
    prompts (token ids, or text), tokens counted from each stream's usage."""
    import httpx

    res = Result()
    queue: asyncio.Queue = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base, timeout=600, limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]

        async def one(prompt: list[int] | str) -> None:
            body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0,
                    "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            t0 = last = time.perf_counter()
            first = True
            async with client.stream("POST", "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    now = time.perf_counter()
                    if chunk["choices"]:
                        (res.ttft if first else res.itl).append(now - (t0 if first else last))
                        first, last = False, now
                    elif chunk.get("usage"):
                        res.tokens += chunk["usage"]["completion_tokens"]

        async def client_task():
            while not queue.empty():
                await one(queue.get_nowait())

        t0 = time.perf_counter()
        await asyncio.gather(*(client_task() for _ in range(concurrency)))
        res.seconds = time.perf_counter() - t0
    return res


def compare_apis(args) -> None:
    """W1 through the same router over gRPC and over HTTP, alternating, in one run (prefix
    caching off, so every round does the same work). Prints HTTP / gRPC throughput."""
    procs, address = start("disaggregated", args.threads, args.worker_threads,
                           args.kv_cache_gib, caching=False)
    base = f"http://127.0.0.1:{PORTS['http']}"
    got: dict[str, list[float]] = {"grpc": [], "http": []}
    try:
        asyncio.run(warm_up(address))
        vocab, _, _ = kv_shape(f"127.0.0.1:{PORTS['decode']}")
        wl = make_workload("w1", vocab)
        for r in range(args.rounds):
            for api in (("grpc", "http") if r % 2 == 0 else ("http", "grpc")):
                c = args.concurrency[-1]
                res = asyncio.run(run_load(address, wl.prompts, wl.output_len, c) if api == "grpc"
                                  else run_load_http(base, wl.prompts, wl.output_len, c))
                got[api].append(res.tokens / res.seconds)
                print(json.dumps({"api": api, "concurrency": c, **summary(api, c, res)})
                      if args.json else _line(summary(api, c, res)), flush=True)
    finally:
        stop_all(procs)
    g, h = statistics.mean(got["grpc"]), statistics.mean(got["http"])
    print(f"HTTP / gRPC throughput at concurrency {args.concurrency[-1]}: {h:.1f} / {g:.1f} "
          f"tok/s = {h / g:.3f}", file=sys.stderr)


def worker_stats(worker: str) -> wk.GetStatsResponse:
    with CLUSTER.intercept(grpc.insecure_channel(worker)) as channel:
        return wk_grpc.WorkerServiceStub(channel).GetStats(wk.GetStatsRequest(), timeout=10)


def kv_shape(worker: str) -> tuple[int, int, int]:
    """(vocab size, block size, bytes per block) as the serving worker reports them."""
    st = worker_stats(worker)
    layout = layout_from_message(st.layout)
    return st.model_info.vocab_size, layout.block_size, layout.block_bytes


def model_shape(address: str) -> tuple[int, int, int]:
    """(vocab size, block size, 0) from the public API: a colocated server moves no KV,
    and its worker RPCs are not on its port."""
    with grpc.insecure_channel(address) as channel:
        info = gen_grpc.GenerationStub(channel).GetModelInfo(gen.GetModelInfoRequest(),
                                                             timeout=10).info
    return info.vocab_size, info.block_size, 0


def summary(mode: str, c: int, r: Result) -> dict:
    out = {"mode": mode, "concurrency": c, "tok_s": r.tokens / r.seconds,
           "ttft_p50_ms": 1000 * pct(r.ttft, 50), "ttft_p99_ms": 1000 * pct(r.ttft, 99),
           "itl_p50_ms": 1000 * pct(r.itl, 50), "itl_p99_ms": 1000 * pct(r.itl, 99)}
    if r.transfer:
        out["kv_transfer_ms_mean"] = 1000 * statistics.mean(r.transfer)
        out["kv_gb_s_mean"] = statistics.mean(b / t / 1e9 for b, t in
                                              zip(r.kv_bytes, r.transfer, strict=True))
        out["transfer_over_prefill"] = sum(r.transfer) / max(1e-9, sum(r.prefill))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2,
                    help="torch threads of the colocated server")
    ap.add_argument("--worker-threads", type=int, default=os.cpu_count() or 2,
                    help="torch threads of each disaggregated worker: each may use every "
                    "core while the other waits")
    ap.add_argument("--modes", nargs="+", default=["disaggregated", "colocated"])
    ap.add_argument("--kv-cache-gib", type=float, default=2.0)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--compare-apis", action="store_true",
                    help="W1 through one router over gRPC and HTTP, alternating (caching off)")
    args = ap.parse_args()
    if args.compare_apis:
        compare_apis(args)
        return
    rows = []
    for _ in range(args.rounds):
        for mode in args.modes:
            procs, address = start(mode, args.threads, args.worker_threads, args.kv_cache_gib)
            try:
                asyncio.run(warm_up(address))
                vocab, block_size, block_bytes = (
                    kv_shape(f"127.0.0.1:{PORTS['decode']}") if mode == "disaggregated"
                    else model_shape(address))
                wl = make_workload("w1", vocab)
                for c in args.concurrency:
                    r = asyncio.run(run_load(address, wl.prompts, wl.output_len, c,
                                             block_size, block_bytes))
                    rows.append(summary(mode, c, r))
                    print(json.dumps(rows[-1]) if args.json else _line(rows[-1]), flush=True)
            finally:
                stop_all(procs)
    for c in args.concurrency if len(args.modes) == 2 else []:
        d = [x["tok_s"] for x in rows if x["mode"] == "disaggregated" and x["concurrency"] == c]
        k = [x["tok_s"] for x in rows if x["mode"] == "colocated" and x["concurrency"] == c]
        print(f"concurrency {c}: disaggregated/colocated throughput "
              f"{statistics.median(d) / statistics.median(k):.2f}", file=sys.stderr)


def _line(x: dict) -> str:
    s = (f"{x['mode']:>13} c={x['concurrency']:<3} {x['tok_s']:7.1f} tok/s  TTFT p50 "
         f"{x['ttft_p50_ms']:7.0f} p99 {x['ttft_p99_ms']:7.0f} ms  ITL p50 "
         f"{x['itl_p50_ms']:6.1f} p99 {x['itl_p99_ms']:6.1f} ms")
    if "kv_transfer_ms_mean" in x:
        s += (f"  KV {x['kv_transfer_ms_mean']:.2f} ms/req, {x['kv_gb_s_mean']:.2f} GB/s, "
              f"{100 * x['transfer_over_prefill']:.1f}% of prefill")
    return s


if __name__ == "__main__":
    main()
