"""The gRPC-stream KV fallback end to end, and the colocated server behind the same API."""

from __future__ import annotations

import time
import uuid

import httpx
import pytest

from baton.services.engine import SamplingParams
from baton.v1 import generation_pb2 as gen
from baton.v1 import generation_pb2_grpc as gen_grpc
from baton.worker.v1 import worker_pb2 as wk
from baton.worker.v1 import worker_pb2_grpc as wk_grpc
from tests.e2e.helpers import greedy, joined, metric_value, run, stats, until_served
from tests.e2e.topology import Topology, channel

# A restarted prefill worker is polled, paired and used within this: the router's poll
# interval plus a handshake, the router's and the decode worker's channels each retrying
# within about 1 s (0.3 s measured idle, 3 s at worst): seconds, where gRPC's own backoff
# takes minutes once grown (tests/integration/test_worker_channels.py checks the backoff itself).
PAIRED_WITHIN_S = 30.0
PROMPTS = ["The three primary colours are", "Paged KV blocks move between workers. " * 5]


@pytest.fixture(scope="module")
def services(tmp_path_factory, tiny_model):
    topo = Topology(tmp_path_factory.mktemp("fallback"), tiny_model)
    try:
        yield {**topo.disaggregated("grpc"), "colocated": topo.worker("colocated"),
               "topology": topo}
    finally:
        topo.stop()


def test_grpc_fallback_gives_the_same_text(services, offline):
    want = offline.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0.0))
    before = stats(services["decode"]).num_blocks_pulled
    for prompt, ref in zip(PROMPTS, want, strict=True):
        msgs = until_served(services["router"], gen.GenerateRequest(text=prompt,
                                                                    sampling=greedy(24)))
        assert joined(msgs) == (ref.token_ids, ref.text)
    pulled = stats(services["decode"]).num_blocks_pulled - before
    assert pulled == sum(-(-len(r.prompt_token_ids) // 16) for r in want)


def test_colocated_serves_the_same_api(services, offline):
    want = offline.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0.0))
    for prompt, ref in zip(PROMPTS, want, strict=True):
        msgs = run(services["colocated"], gen.GenerateRequest(text=prompt, sampling=greedy(24)))
        assert joined(msgs) == (ref.token_ids, ref.text)
        assert msgs[-1].usage.completion_tokens == len(ref.token_ids)
    with channel(services["colocated"]) as ch:
        info = gen_grpc.GenerationStub(ch).GetModelInfo(gen.GetModelInfoRequest()).info
    assert info.max_model_len > 0 and info.vocab_size == offline.engine.model_config.vocab_size


def test_a_restarted_prefill_worker_prefills_long_prompts_again(services, offline):
    """The prefill worker is killed (-9) just after granting a lease, so the decode
    worker's pull and release of it fail against the dead address. Meanwhile prompts are
    computed on the decode worker, and the router says why (a log line, and
    baton:local_prefills_total by reason). It comes back on that address under a new
    engine id: once the router's poll finds it up, a fresh ~1,000-token prompt is
    prefilled there and its KV pulled, never computed on the decode worker while the two
    shake hands (once, the prompts of the next seconds were, and nothing said why)."""
    topo, prefill, decode = services["topology"], services["prefill"], services["decode"]
    router = services["router"]

    def figure(name: str, **labels: str) -> float:  # of the router's /metrics
        text = httpx.get(f"http://{topo.http[router]}/metrics", timeout=10).text
        return metric_value(text, name, **labels)

    def fell_back() -> float:  # prompts computed on the decode worker, said to be for
        return sum(figure("baton:local_prefills_total", reason=r) for r in gone)

    gone = ("prefill_down", "prefill_failed")  # seen down already, or not yet
    before = fell_back()
    ids = offline.engine.tokenizer.encode(PROMPTS[1])
    with channel(prefill) as ch:
        granted = wk_grpc.PrefillServiceStub(ch).Prefill(wk.PrefillRequest(
            request_id="orphan", prompt_token_ids=ids, sampling=greedy(2)), timeout=60)
    topo.kill(prefill)
    with channel(decode) as ch:  # as the router does for a request in flight
        run_out = list(wk_grpc.DecodeServiceStub(ch).Decode(wk.DecodeRequest(
            request_id="orphan", prompt_token_ids=ids, sampling=greedy(2),
            first_token_id=granted.delta.token_ids[0], handle=granted.handle,
            prefill_address=prefill), timeout=60))
    assert run_out[-1].delta.finish_reason  # recomputed: the source is gone
    assert run(router, gen.GenerateRequest(text=PROMPTS[0], sampling=greedy(2))
               )[-1].timings.local_prefill
    assert fell_back() == before + 1
    said = (topo.log_dir / f"router-{router.replace(':', '-')}.log").read_text()
    assert [line for line in said.splitlines() if "local prefill of" in line
            and prefill in line and any(f"({r}): " in line for r in gone)], said[-2000:]

    topo.worker("prefill", "--kv-transport", "grpc", port=int(prefill.rsplit(":", 1)[1]))
    deadline = time.monotonic() + PAIRED_WITHIN_S
    while not figure("baton:workers", role="prefill", state="up"):
        assert time.monotonic() < deadline, "the router never found it up again"
        time.sleep(0.02)
    fresh = offline.engine.tokenizer.encode(f"{uuid.uuid4()} " + PROMPTS[1] * 40)[:1008]
    pulled = stats(decode).num_blocks_pulled
    msgs = run(router, gen.GenerateRequest(token_ids=gen.TokenIds(ids=fresh),
                                           sampling=greedy(2)))
    assert not msgs[-1].timings.local_prefill
    assert stats(decode).num_blocks_pulled - pulled == len(fresh) // 16
    assert fell_back() == before + 1  # that one alone

