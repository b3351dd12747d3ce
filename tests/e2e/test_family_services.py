"""A family other than Llama through the services: a tiny Gemma 3 (sliding windows, q/k
norms, sandwich norms, two RoPE tables) served from a hub id (an offline HF cache) by a
disaggregated topology over NIXL, and from its directory by `baton serve --role
colocated`. Greedy tokens equal transformers', with chunked prefill and prefix-cache hits
on both paths, and GetModelInfo names the family and the served name."""

from __future__ import annotations

import json
import urllib.request

import pytest
import torch

from baton.v1 import generation_pb2 as gen
from baton.v1 import generation_pb2_grpc as gen_grpc
from tests.e2e.helpers import (
    all_free_within,
    colocated_http,
    greedy,
    joined,
    metric_value,
    run,
    scrape,
    stats,
    until_served,
)
from tests.e2e.topology import Topology, channel
from tests.tiny_models import build, hf_greedy, put_in_hub_cache

REPO = "baton-test/tiny-gemma3"
FLAGS = ("--max-num-batched-tokens", "32")  # prompts run in chunks


@pytest.fixture(scope="module")
def gemma(tmp_path_factory, model_path):
    from baton.services.common.tokenizer import load_tokenizer

    root = tmp_path_factory.mktemp("gemma3")
    hf = build("gemma3", root / "tiny-gemma3", load_tokenizer(model_path))
    put_in_hub_cache(root / "tiny-gemma3", root / "hub", REPO)
    topo = Topology(root, model_path)  # every service names its model
    env = {"HF_HUB_CACHE": str(root / "hub"), "HF_HUB_OFFLINE": "1"}
    try:
        prefill = topo.worker("prefill", "--model", REPO, *FLAGS, "--served-model-name",
                              "tiny", "--kv-transport", "nixl", env=env, wait=False)
        decode = topo.worker("decode", "--model", REPO, *FLAGS, "--served-model-name", "tiny",
                             "--kv-transport", "nixl", env=env, wait=False)
        colocated = topo.worker("colocated", "--model", str(root / "tiny-gemma3"), *FLAGS,
                                wait=False)
        topo.wait()
        router = topo.start("router", "--model", REPO, "--prefill", prefill, "--decode",
                            decode, env=env)
        yield {"hf": hf, "router": router, "prefill": prefill, "decode": decode,
               "colocated": colocated, "topology": topo}
    finally:
        topo.stop()


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(100, 40000, (48,), generator=g).tolist()
    rest = [torch.randint(100, 40000, (n,), generator=g).tolist() for n in (7, 20, 60)]
    return [rest[0], shared + rest[1], shared + rest[2], shared + rest[2]]


def _cache_hits(gemma, entry: str) -> float:
    """Prompt tokens the serving engine found cached (colocated: from its /metrics)."""
    if entry == "router":
        return stats(gemma["decode"]).prefix_cache_hits
    return metric_value(scrape(colocated_http(gemma["topology"], gemma["colocated"])),
                        "baton:prefix_cache_hits_total")


@pytest.mark.parametrize("entry", ["router", "colocated"])
def test_greedy_tokens_equal_transformers_through_the_services(gemma, entry):
    hits = _cache_hits(gemma, entry)
    for prompt in _prompts():
        req = gen.GenerateRequest(token_ids=gen.TokenIds(ids=prompt),
                                  sampling=greedy(10, ignore_eos=True))
        msgs = until_served(gemma[entry], req)
        assert joined(msgs)[0] == hf_greedy(gemma["hf"], prompt, 10), (
            f"{entry}: the prompt of {len(prompt)} tokens diverged from transformers")
    # The last prompt repeats the third: its blocks were cached.
    assert _cache_hits(gemma, entry) > hits
    workers = ([gemma["prefill"], gemma["decode"]] if entry == "router"
               else [colocated_http(gemma["topology"], gemma["colocated"])])
    assert all_free_within(workers, 5.0)


def test_model_info_names_the_family_and_the_served_name(gemma):
    with channel(gemma["router"]) as ch:
        info = gen_grpc.GenerationStub(ch).GetModelInfo(gen.GetModelInfoRequest()).info
    assert (info.family, info.architecture) == ("gemma3", "Gemma3ForCausalLM")
    assert (info.model, info.served_model_name) == (REPO, "tiny")
    with channel(gemma["colocated"]) as ch:
        info = gen_grpc.GenerationStub(ch).GetModelInfo(gen.GetModelInfoRequest()).info
    assert (info.family, info.model, info.served_model_name) == (
        "gemma3", "tiny-gemma3", "tiny-gemma3")
    http = gemma["topology"].http[gemma["router"]]
    with urllib.request.urlopen(f"http://{http}/v1/models", timeout=10) as r:
        assert [m["id"] for m in json.load(r)["data"]] == ["tiny"]
    assert run(gemma["router"], gen.GenerateRequest(text="hi", sampling=greedy(2)))
