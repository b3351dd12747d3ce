"""The gRPC-stream KV fallback end to end, and the colocated server behind the same API."""

from __future__ import annotations

import pytest

from baton.v1 import generation_pb2 as gen
from baton.v1 import generation_pb2_grpc as gen_grpc
from services.engine import SamplingParams
from tests.e2e.helpers import greedy, joined, run, stats, until_served
from tests.e2e.topology import Topology, channel

PROMPTS = ["The three primary colours are", "Paged KV blocks move between workers. " * 5]


@pytest.fixture(scope="module")
def services(tmp_path_factory, model_path):
    topo = Topology(tmp_path_factory.mktemp("fallback"))
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


def test_a_restarted_prefill_worker_is_used_again(services, offline):
    """The prefill worker dies and comes back on its address with a new engine id: the
    router notices, the decode worker shakes hands again, and requests work again."""
    topo, prefill = services["topology"], services["prefill"]
    topo.kill(prefill)
    topo.worker("prefill", "--kv-transport", "grpc", port=int(prefill.rsplit(":", 1)[1]))
    ref = offline.generate([PROMPTS[0]], SamplingParams(max_tokens=24, temperature=0.0))[0]
    msgs = until_served(services["router"], gen.GenerateRequest(text=PROMPTS[0],
                                                                sampling=greedy(24)))
    assert joined(msgs) == (ref.token_ids, ref.text)
