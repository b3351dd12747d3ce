"""The Shepherd Model Gateway's own routing over two Baton colocated workers (the tiny
model): its cache-aware policy sends a series of prompts that share a long prefix to
one worker, whose prefix cache then serves most of each prompt; its load-based policy
reads Baton's GetLoads (the gateway's /get_loads shows each worker's KV capacity as
Baton's stats give it)."""

from __future__ import annotations

import time

import httpx
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as vllm
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vllm_grpc

from baton.tools.bench.smg_gateway import gateway
from tests.e2e.helpers import colocated_http, metric_value, scrape
from tests.e2e.topology import Topology, channel


@pytest.fixture(scope="module")
def two(tmp_path_factory, tiny_model):
    topo = Topology(tmp_path_factory.mktemp("smg-routing"), tiny_model)
    try:
        a = topo.worker("colocated", wait=False)
        b = topo.worker("colocated")
        yield topo, [a, b]
    finally:
        topo.stop()


def prefix_counts(url: str) -> tuple[float, float]:
    text = scrape(url)
    return (metric_value(text, "baton:prefix_cache_queries_total"),
            metric_value(text, "baton:prefix_cache_hits_total"))


def test_cache_aware_routing_sends_a_shared_prefix_to_one_worker(two, tmp_path):
    topo, workers = two
    urls = [colocated_http(topo, w) for w in workers]
    doc = " ".join(f"Section {i}: the quick brown fox jumps over the lazy dog {i}."
                   for i in range(30))
    with gateway(workers, tmp_path / "smg.log", "--policy", "cache_aware") as gw:
        smg = gw.url
        model = httpx.get(f"{smg}/v1/models", timeout=10).json()["data"][0]["id"]
        before = [prefix_counts(u) for u in urls]
        for q in range(8):
            reply = httpx.post(f"{smg}/v1/completions", timeout=60, json={
                "model": model, "prompt": f"{doc}\nQuestion {q}:", "max_tokens": 2,
                "temperature": 0})
            assert reply.status_code == 200, reply.text
        after = [prefix_counts(u) for u in urls]
    queries = [a[0] - b[0] for a, b in zip(after, before, strict=True)]
    hits = [a[1] - b[1] for a, b in zip(after, before, strict=True)]
    (used,) = [i for i, q in enumerate(queries) if q]  # one worker took them all
    assert hits[used] / queries[used] > 0.8, (queries, hits)


def test_the_load_based_policy_reads_batons_get_loads(two, tmp_path):
    topo, workers = two
    with gateway(workers, tmp_path / "smg.log", "--policy", "power_of_two",
                 "--load-monitor-interval", "1") as gw:
        smg = gw.url
        deadline = time.monotonic() + 30
        while True:
            loads = httpx.get(f"{smg}/get_loads", timeout=10).json()["loads"]
            if len(loads) == len(workers) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    assert sorted(x["worker"] for x in loads) == sorted(f"grpc://{w}" for w in workers)
    for x in loads:
        with channel(x["worker"].removeprefix("grpc://")) as ch:
            (own,) = vllm_grpc.VllmEngineStub(ch).GetLoads(vllm.GetLoadsRequest()).loads
        # What Baton's GetLoads says, as the gateway shows it (the KV capacity: static).
        assert x["max_total_num_tokens"] == own.max_total_num_tokens > 0
        assert x["max_running_requests"] == own.max_running_requests > 0
