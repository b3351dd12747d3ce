"""LLMEngine.prompt_logprobs (teacher forcing through the paged KV cache) against HF
transformers on a tiny model, chunked and whole; and tools/bench/perplexity.py's
options, which reach the engine only when given."""

from __future__ import annotations

import math

import pytest
import torch

from baton.tools.bench.perplexity import (
    TEXT,
    baseline_kwargs,
    engine_kwargs,
    parse_args,
    perplexity,
)


@pytest.fixture(scope="module")
def scored(make_llm, tiny_model):
    """(engine, the text's token ids, HF's log p of each token after the first)."""
    from transformers import AutoModelForCausalLM

    llm = make_llm(model=str(tiny_model), dtype="float32", max_num_batched_tokens=4096,
                   kv_cache_gib=0.05)
    ids = llm.tokenizer.encode(TEXT.read_text(encoding="utf-8"), add_special_tokens=False)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32,
                                              attn_implementation="eager").eval()
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0, :-1].float()
    want = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    return llm, ids, want


# Whole (one step), steps of 256, and of 333 (not a multiple of the 16-token block).
@pytest.mark.parametrize("chunk", [None, 256, 333])
def test_logprobs_equal_transformers_and_every_block_is_freed(scored, chunk):
    llm, ids, want = scored
    engine = llm.engine
    assert 2000 <= len(ids) <= 4096, f"the shipped text is {len(ids)} tokens"
    free = engine.pool.num_free_blocks
    got = engine.prompt_logprobs(ids, chunk_tokens=chunk or len(ids))
    assert got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
    assert math.isclose(perplexity(got), perplexity(want), rel_tol=1e-5)
    assert engine.pool.num_free_blocks == free
    engine.pool.check_all_free()
    assert not engine.pool.cached, "scoring must not publish blocks to the prefix cache"


def test_one_token_steps_take_the_decode_path_and_agree(scored):
    llm, ids, want = scored
    got = llm.engine.prompt_logprobs(ids[:40], chunk_tokens=1)
    torch.testing.assert_close(got, want[:39], atol=2e-4, rtol=1e-4)


def test_scoring_refuses_what_it_cannot_run(scored):
    llm, ids, _ = scored
    engine = llm.engine
    with pytest.raises(ValueError, match="2 to max_model_len"):
        engine.prompt_logprobs(ids[:1])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.prompt_logprobs([1, engine.model_config.vocab_size])
    with pytest.raises(ValueError, match="chunk_tokens"):
        engine.prompt_logprobs(ids[:10], chunk_tokens=-1)
    engine.pool.check_all_free()


def test_perplexity_is_exp_of_the_mean_negative_logprob():
    lp = [math.log(0.5), math.log(0.25)]
    assert math.isclose(perplexity(lp), math.exp((math.log(2) + math.log(4)) / 2))
    assert math.isclose(perplexity(torch.tensor([0.0, 0.0])), 1.0)
    with pytest.raises(ValueError):
        perplexity([])


def test_quantization_and_kv_dtype_reach_the_engine_only_when_given():
    plain = engine_kwargs(parse_args([]))
    assert "quantization" not in plain and "kv_cache_dtype" not in plain
    assert plain["dtype"] == "bfloat16" and "model" not in plain
    args = parse_args(["--quantization", "gguf", "--kv-cache-dtype", "fp8_e4m3",
                       "--dtype", "float32", "--model", "m.gguf", "--baseline"])
    kw = engine_kwargs(args)
    assert (kw["quantization"], kw["kv_cache_dtype"], kw["dtype"], kw["model"]) == \
        ("gguf", "fp8_e4m3", "float32", "m.gguf")
    # The baseline is the same model in bf16, nothing else changed.
    base = baseline_kwargs(args)
    assert base == {"dtype": "bfloat16", "kv_cache_gib": args.kv_cache_gib, "model": "m.gguf"}


def test_a_chunk_below_one_is_refused():
    with pytest.raises(SystemExit):
        parse_args(["--chunk", "0"])


def test_an_fp8_cache_shows_in_the_scores(make_llm, tiny_model, scored):
    """Attention reads its context back from the cache: stored in fp8, it moves the
    scores of the chunks that read it (the perplexity a little)."""
    _, ids, want = scored
    llm = make_llm(model=str(tiny_model), dtype="float32", kv_cache_dtype="fp8_e4m3",
                   kv_cache_gib=0.05)
    got = llm.engine.prompt_logprobs(ids[:600], chunk_tokens=256)
    later = (got[256:] - want[256:599]).abs()
    assert later.max() > 1e-3, "the second chunk read nothing from the fp8 cache"
    assert abs(perplexity(got) / perplexity(want[:599]) - 1) < 0.05
    llm.engine.pool.check_all_free()
