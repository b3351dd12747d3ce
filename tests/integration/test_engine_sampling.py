"""The engine's public API, continued: seeds, scheduling policy, logprobs, preemption,
chat. On the tiny serving model (fp32, CPU): what is checked is the engine's sampling and
logprob path, so HF transformers runs the same weights; only the chat answer needs the
real default model.

References are HF transformers' logits, the model's own greedy output without the feature
under test, and the tokenizer's own chat template; never the engine's code.
"""

from __future__ import annotations

import random

import pytest
import torch

from baton.services.engine import SamplingParams
from tests.integration.engine_helpers import STORY, assert_idle, greedy, run_steps


@pytest.fixture(scope="module")
def llm(make_llm, tiny_model):
    return make_llm(model=str(tiny_model), dtype="float32", max_num_batched_tokens=128,
                    max_num_seqs=16)



# ---- seeds ---------------------------------------------------------------------------


def test_seeded_sampling_is_reproducible_in_any_batch(llm):
    prompt = "Write a short poem about the sea."

    def seeded(seed):
        return SamplingParams(temperature=1.0, seed=seed, max_tokens=16, ignore_eos=True)

    alone = llm.generate(prompt, seeded(123))[0].token_ids
    assert len(alone) == 16

    batch = llm.generate(
        ["Tell me a joke.", prompt, STORY, prompt, "Hello", prompt, prompt],
        [SamplingParams(temperature=1.0, seed=7, max_tokens=10, ignore_eos=True),
         seeded(123),
         SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True),  # unseeded
         seeded(123),
         SamplingParams(temperature=0.7, top_k=40, max_tokens=5, ignore_eos=True),
         seeded(124),
         seeded(9999)])
    assert batch[1].token_ids == alone
    assert batch[3].token_ids == alone
    others = [batch[5].token_ids, batch[6].token_ids]
    assert all(o != alone for o in others)
    assert others[0] != others[1]


# ---- scheduling policy ---------------------------------------------------------------


def test_priority_policy_runs_the_most_urgent_first(small, monkeypatch):
    engine = small.engine
    assert engine.scheduler.priority_policy
    monkeypatch.setattr(engine.scheduler, "max_num_seqs", 1)
    params = greedy(3, ignore_eos=True)
    low = engine.add_request("Hello there", params, priority=10)
    high = engine.add_request("Good morning", params, priority=0)
    high2 = engine.add_request("Good evening", params, priority=0)
    _, finished = run_steps(engine)
    assert finished == [high, high2, low]


def test_fcfs_runs_the_first_arrival_first(llm, monkeypatch):
    engine = llm.engine
    assert not engine.scheduler.priority_policy
    monkeypatch.setattr(engine.scheduler, "max_num_seqs", 1)
    params = greedy(3, ignore_eos=True)
    first = engine.add_request("Hello there", params, priority=10)
    second = engine.add_request("Good morning", params, priority=0)
    _, finished = run_steps(engine)
    assert finished == [first, second]


# ---- logprobs ------------------------------------------------------------------------


def test_logprobs_match_hf(llm, hf_tiny):
    prompt = llm.tokenizer.encode("The capital of France is")
    outs = llm.generate([prompt, prompt, prompt],
                        [greedy(6, logprobs=3, ignore_eos=True),
                         greedy(6, logprobs=0, ignore_eos=True),
                         greedy(6, ignore_eos=True)])
    out, out0, plain = outs
    assert out.token_ids == out0.token_ids == plain.token_ids
    assert plain.logprobs is None
    assert len(out.logprobs) == len(out0.logprobs) == 6

    ids = torch.tensor([prompt + out.token_ids])
    with torch.no_grad():
        logits = hf_tiny(ids).logits[0].float()
    ref = torch.log_softmax(logits, dim=-1)
    for j, tok in enumerate(out.token_ids):
        row = ref[len(prompt) + j - 1]  # the position that predicts output token j
        lp = out.logprobs[j]
        assert tok in lp
        assert lp[tok] == max(lp.values())  # greedy: the sampled token is the best
        top_v, top_i = row.topk(3)
        assert set(lp) == set(top_i.tolist())
        for t, v in lp.items():
            assert v == pytest.approx(row[t].item(), abs=1e-3)
        assert lp[tok] == pytest.approx(top_v[0].item(), abs=1e-3)
        assert list(out0.logprobs[j]) == [tok]
        assert out0.logprobs[j][tok] == pytest.approx(row[tok].item(), abs=1e-3)


def test_logprobs_of_sampled_tokens_are_raw_model_logprobs(llm, hf_tiny):
    # At a high temperature some sampled tokens are not the model's best; the dict still
    # holds the sampled token plus exactly the top 1, and the values are the raw model's
    # (before temperature), as in vLLM.
    prompt = llm.tokenizer.encode(STORY)
    out = llm.generate([prompt], SamplingParams(temperature=1.5, seed=5, max_tokens=12,
                                                logprobs=1, ignore_eos=True))[0]
    assert len(out.logprobs) == 12
    with torch.no_grad():
        logits = hf_tiny(torch.tensor([prompt + out.token_ids])).logits[0].float()
    ref = torch.log_softmax(logits, dim=-1)
    off_top = 0
    for j, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        row = ref[len(prompt) + j - 1]
        best = int(row.argmax())
        assert set(lp) == {tok, best}
        for t, v in lp.items():
            assert v == pytest.approx(row[t].item(), abs=1e-3)
        off_top += tok != best
    assert off_top > 0, "pick a seed/temperature that samples off the top token"


# ---- preemption ----------------------------------------------------------------------


def test_preemption_keeps_outputs_correct(small, llm):
    engine = small.engine
    assert engine.pool.num_blocks < 20
    rng = random.Random(0)
    prompts = [[rng.randint(100, 40000) for _ in range(rng.randint(18, 30))]
               for _ in range(6)]
    # Run each to max_model_len (40); the ample engine has a larger one, so cap it there.
    params = [greedy(40 - len(p), ignore_eos=True) for p in prompts[:5]] + [
        SamplingParams(temperature=1.0, seed=42, max_tokens=40 - len(prompts[5]),
                       ignore_eos=True)]

    before = llm.engine.scheduler.num_preemptions
    want = [o.token_ids for o in llm.generate(prompts, params)]
    assert llm.engine.scheduler.num_preemptions == before, "the ample engine preempted"

    preempted_before = engine.scheduler.num_preemptions
    rids = [engine.add_request(p, sp, priority=i % 3)
            for i, (p, sp) in enumerate(zip(prompts, params, strict=True))]
    per_req, _ = run_steps(engine)
    assert engine.scheduler.num_preemptions > preempted_before, "the budget was meant to force it"
    got = [per_req[r][-1] for r in rids]
    assert sum(o.num_preemptions for o in got) > 0
    for i, (o, w) in enumerate(zip(got, want, strict=True)):
        assert o.finish_reason == "length"
        assert len(o.prompt_token_ids) + len(o.token_ids) == 40
        assert o.token_ids == w, f"prompt {i} diverged after preemption"
    assert_idle(small)


# ---- chat ----------------------------------------------------------------------------


def test_chat_template_and_answer(llm, make_llm):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    tok = llm.tokenizer
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    want = tok.encode(text, add_special_tokens=False)
    ids = llm.engine.apply_chat_template(messages)
    assert ids == want
    decoded = tok.decode(ids)
    assert decoded.endswith("<|im_start|>assistant\n")
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>" in decoded

    # The answer is the real model's: the template is the one it was trained on.
    real = make_llm(dtype="float32", max_num_batched_tokens=128, kv_cache_gib=0.05)
    out = real.chat(messages, greedy(24))
    assert out.prompt_token_ids == want
    assert "Paris" in out.text
