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
]


def _prompts(tokenizer) -> list[list[int]]:
    rng = random.Random(0)
    prompts = [tokenizer.encode(t) for t in TEXTS]
    # A question whose reply ends (EOS) within the tokens asked for.
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+2?"}],
                                         add_generation_prompt=True, tokenize=False)
    prompts.append(tokenizer.encode(chat))
    # Random tokens (real text gets dull fast; random ids stress positions): around the
    # 16-token block, one past the 96-token step, one of 500 (31 full blocks and a part).
    for length in [8, 15, 16, 17, 100, 500]:
        prompts.append([rng.randint(100, tokenizer.vocab_size - 1) for _ in range(length)])
    return prompts


def _hf_choices(model, prompt: list[int], out: list[int]) -> list[int]:
    """HF's greedy token at each position of `out`, after the prompt and out's tokens
    before it: one forward pass over both (what HF's generate computes one token at a
    time, 16 passes of 30 layers). So `out` is HF's greedy output, token for token,
    exactly when this returns `out`; else it returns HF's choice where `out` left it."""
    ids = torch.tensor([prompt + out[:-1]])
    with torch.no_grad():
        logits = model(ids, logits_to_keep=len(out)).logits
    return logits[0].argmax(-1).tolist()


@pytest.mark.slow
def test_greedy_matches_hf_with_chunks_and_preemption(make_llm, hf_model):
    # 43 blocks of 16 tokens: the 500-token prompt takes 33 of them, the 9 requests need
    # about 60 together (16 tokens more each).
    llm = make_llm(dtype="float32", max_num_batched_tokens=96, max_num_seqs=18,
                   kv_cache_gib=0.03)
    engine = llm.engine
    prompts = _prompts(llm.tokenizer)
    assert max(map(len, prompts)) == 500 and min(map(len, prompts)) <= 8
    params = SamplingParams(max_tokens=16, temperature=0)
    outs = llm.generate(prompts, params)
    assert engine.scheduler.num_preemptions > 0, "the KV budget was meant to force preemption"
    assert engine.scheduler.num_partial_prefills > 0, "prompts were meant to run in chunks"
    assert any(o.finish_reason == "stop" for o in outs), "the chat reply was meant to end"
    for prompt, out in zip(prompts, outs, strict=True):
        want = _hf_choices(hf_model, prompt, out.token_ids)
        assert out.token_ids == want, f"prompt of {len(prompt)} tokens diverged"
        # HF's generate stops at its EOS (2) and only there: ours ends where it does.
        assert 2 not in want[:-1]
        assert out.finish_reason == ("stop" if want[-1] == 2 else "length")
