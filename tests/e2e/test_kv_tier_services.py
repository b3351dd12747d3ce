"""Two colocated worker processes on one host sharing the host KV tier: a prefix one of
them computed is a host-tier hit for the other, never across tenants (cache_salt), and
the text is the offline engine's."""

from __future__ import annotations

import time

import pytest

from baton.services.engine import SamplingParams
from baton.v1 import generation_pb2 as gen
from tests.e2e.helpers import colocated_http, greedy, joined, metric_value, run, scrape
from tests.e2e.topology import Topology

PROMPT = "Blocks of KV leave the pool for a tier every worker on the host reads. " * 6


@pytest.fixture(scope="module")
def workers(tmp_path_factory, tiny_model):
    root = tmp_path_factory.mktemp("tiers")
    topo = Topology(root, tiny_model)
    tier = ["--kv-offload-gib", "0.05", "--kv-offload-host-path", str(root / "shm")]
    try:
        a = topo.worker("colocated", *tier, wait=False)
        b = topo.worker("colocated", *tier)
        yield topo, a, b
    finally:
        topo.stop()


def _tier(topo, address: str, what: str) -> float:
    return metric_value(scrape(colocated_http(topo, address)),
                        f"baton:kv_offload_{what}_total",
                        medium="host")


def test_a_prefix_computed_on_one_worker_is_a_hit_on_the_other(workers, offline):
    topo, a, b = workers
    want = offline.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0.0))[0]
    full = (len(want.prompt_token_ids) - 1) // 16  # the blocks a hit can cover

    def ask(address: str, tenant: str):
        msgs = run(address, gen.GenerateRequest(text=PROMPT, sampling=greedy(8),
                                                cache_salt=tenant))
        assert joined(msgs) == (want.token_ids, want.text)

    ask(a, "tenant-1")
    deadline = time.monotonic() + 30  # the saves are written behind the steps
    while _tier(topo, a, "saves") < full and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _tier(topo, a, "saves") >= full
    ask(b, "tenant-2")  # another tenant: the same tokens, another hash, no hit
    assert _tier(topo, b, "hits") == 0
    ask(b, "tenant-1")
    assert _tier(topo, b, "hits") == full
