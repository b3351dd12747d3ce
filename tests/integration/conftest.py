"""Fixtures of the engine API tests (test_engine_*.py, test_sampling_fields.py)."""

from __future__ import annotations

import pytest

from tests.integration.engine_helpers import N_REF, STORY, greedy, kv_gib


@pytest.fixture(scope="module")
def small(make_llm, tiny_model):
    """The tiny serving model, max_model_len 40, priority scheduling, and a KV budget of
    only 14 blocks (13 usable, 208 tokens): too few for 6 requests of up to 40 tokens (3
    blocks each). The modules that use it compare it with an `llm` of the same model."""
    return make_llm(model=str(tiny_model), dtype="float32", max_model_len=40, max_num_seqs=8,
                    max_num_batched_tokens=128, scheduling_policy="priority",
                    kv_cache_gib=kv_gib(tiny_model, 13))


@pytest.fixture(scope="module")
def hf_tiny(tiny_model):
    """HF transformers' own Llama over the tiny model's weights, in fp32 (the reference)."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def ref(llm):
    """Greedy reference continuation of STORY, EOS ignored."""
    out = llm.generate(STORY, greedy(ignore_eos=True))[0]
    assert len(out.token_ids) == N_REF and out.finish_reason == "length"
    assert len(out.text) > 60, "reference too short to cut stop strings from"
    return out


@pytest.fixture
def start_clean(llm, small):
    """If an earlier test failed mid-way (and was reported by the conftest invariant),
    abort what it left behind so the shared engines start this test empty."""
    for x in (llm, small):
        for rid in list(x.engine.scheduler.requests):
            x.engine.abort_request(rid)
    yield
