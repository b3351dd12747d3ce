"""Greedy output equals HF transformers token for token, on the default model in fp32,
under chunked prefill and preemption."""

from __future__ import annotations

import random

import pytest
import torch

from baton.services.engine import SamplingParams

TEXTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a land far away, there lived a",
    "List three colours of the rainbow:",
]


def _prompts(tokenizer) -> list[list[int]]:
    rng = random.Random(0)
    prompts = [tokenizer.encode(t) for t in TEXTS]
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Name a planet."}],
                                         add_generation_prompt=True, tokenize=False)
    prompts.append(tokenizer.encode(chat))
    # Random tokens, 8 to 500 long (real text gets dull fast; random ids stress positions).
    for length in [8, 9, 15, 16, 17, 33, 64, 100, 160, 250, 333, 420, 500]:
        prompts.append([rng.randint(100, tokenizer.vocab_size - 1) for _ in range(length)])
    return prompts


def _hf_greedy(model, prompt: list[int], max_new: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                             do_sample=False, eos_token_id=2, pad_token_id=2)
    return out[0, len(prompt):].tolist()


@pytest.mark.slow
def test_greedy_matches_hf_with_chunks_and_preemption(make_llm, hf_model):
    # ~100 blocks of 16 tokens: far less than the 18 requests need together.
    llm = make_llm(dtype="float32", max_num_batched_tokens=96, max_num_seqs=18,
                   kv_cache_gib=0.07)
    engine = llm.engine
    prompts = _prompts(llm.tokenizer)
    assert len(prompts) >= 16 and max(map(len, prompts)) == 500 and min(map(len, prompts)) <= 8
    params = SamplingParams(max_tokens=24, temperature=0)
    outs = llm.generate(prompts, params)
    assert engine.scheduler.num_preemptions > 0, "the KV budget was meant to force preemption"
    assert engine.scheduler.num_partial_prefills > 0, "prompts were meant to run in chunks"
    for prompt, out in zip(prompts, outs, strict=False):
        want = _hf_greedy(hf_model, prompt, 24)
        assert out.token_ids == want, f"prompt of {len(prompt)} tokens diverged"
        assert out.finish_reason == ("stop" if want[-1] == 2 else "length")
