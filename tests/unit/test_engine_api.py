"""The engine's public API on the real default model (fp32, CPU): input validation, stop
conditions, streaming deltas, abort, seeds, scheduling policy, logprobs, preemption, chat.

References are the model's own greedy output (run without the feature under test), HF
transformers' logits, and the tokenizer's own chat template; never the engine's code.
"""

from __future__ import annotations

import random

import pytest
import torch

from services.engine import LLM, SamplingParams

EOS = 2
STORY = "Once upon a time, in a land far away, there lived a"
N_REF = 32


def _greedy(max_tokens: int = N_REF, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


def _assert_idle(llm: LLM) -> None:
    assert not llm.engine.has_unfinished_requests()
    llm.engine.pool.check_all_free()


def _run_steps(engine, max_steps: int = 10_000):
    """Step the engine; return ({id: [outputs in order]}, [ids in finish order])."""
    per_req: dict[str, list] = {}
    finished: list[str] = []
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            per_req.setdefault(out.request_id, []).append(out)
            if out.finished:
                assert out.request_id not in finished, "a request finished twice"
                finished.append(out.request_id)
    else:
        raise AssertionError("engine did not drain")
    return per_req, finished


@pytest.fixture(scope="module")
def small(make_llm):
    """max_model_len 40, priority scheduling, and a KV budget of only 14 blocks (13 usable,
    208 tokens): too few for 6 requests of up to 40 tokens (3 blocks each)."""
    return make_llm(dtype="float32", max_model_len=40, max_num_seqs=8,
                    max_num_batched_tokens=128, scheduling_policy="priority",
                    kv_cache_gib=0.01)


@pytest.fixture(scope="module")
def ref(llm):
    """Greedy reference continuation of STORY, EOS ignored."""
    out = llm.generate(STORY, _greedy(ignore_eos=True))[0]
    assert len(out.token_ids) == N_REF and out.finish_reason == "length"
    assert len(out.text) > 60, "reference too short to cut stop strings from"
    return out


@pytest.fixture(autouse=True)
def _start_clean(llm, small):
    """If an earlier test failed mid-way (and was reported by the conftest invariant),
    abort what it left behind so the shared engines start this test empty."""
    for x in (llm, small):
        for rid in list(x.engine.scheduler.requests):
            x.engine.abort_request(rid)
    yield


# ---- bad input -----------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, names", [
    ({"max_tokens": 0}, ["max_tokens", "0"]),
    ({"max_tokens": -3}, ["max_tokens", "-3"]),
    ({"temperature": -0.5}, ["temperature", "-0.5"]),
    ({"top_p": 0}, ["top_p", "0"]),
    ({"top_p": 1.5}, ["top_p", "1.5"]),
    ({"top_k": -2}, ["top_k", "-2"]),
    ({"top_k": 0}, ["top_k", "0"]),
    ({"min_p": 1.5}, ["min_p", "1.5"]),
    ({"logprobs": 21}, ["logprobs", "21"]),
    ({"stop": [""]}, ["stop"]),
    ({"stop_token_ids": [-1]}, ["stop_token_ids", "-1"]),
])
def test_bad_sampling_params_raise_naming_the_value(kwargs, names):
    with pytest.raises(ValueError) as exc:
        SamplingParams(**kwargs)
    for name in names:
        assert name in str(exc.value)


def test_bad_prompts_raise_and_queue_nothing(llm, small):
    engine = llm.engine
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("", _greedy(4))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([], _greedy(4))
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], _greedy(4))
    vocab = engine.model_config.vocab_size
    with pytest.raises(ValueError, match=str(vocab)):
        engine.add_request([1, 2, vocab], _greedy(4))
    with pytest.raises(ValueError, match="-5"):
        engine.add_request([1, -5], _greedy(4))
    with pytest.raises(ValueError):
        engine.add_request("hello", {"max_tokens": 4})  # not SamplingParams
    _assert_idle(llm)

    assert small.engine.max_model_len == 40
    with pytest.raises(ValueError) as exc:
        small.engine.add_request(list(range(100, 141)), _greedy(4))  # 41 tokens
    assert "41" in str(exc.value) and "40" in str(exc.value)
    with pytest.raises(ValueError, match="41"):
        small.generate([list(range(100, 141))], _greedy(4))
    _assert_idle(small)


def test_generate_with_one_bad_prompt_queues_nothing(llm, small):
    for prompts in (["The capital of France is", ""], [[], "The capital of France is"]):
        with pytest.raises(ValueError):
            llm.generate(prompts, _greedy(4))
        _assert_idle(llm)
    with pytest.raises(ValueError):
        small.generate([list(range(100, 110)), list(range(100, 150))], _greedy(4))
    _assert_idle(small)
    with pytest.raises(ValueError, match="1 sampling params for 2 prompts"):
        llm.generate(["Hello", "Hi"], [_greedy(2)])
    _assert_idle(llm)
    # The engine is still usable afterwards.
    out = llm.generate("The capital of France is", _greedy(3, ignore_eos=True))[0]
    assert len(out.token_ids) == 3


def test_duplicate_request_id_raises_and_keeps_the_first(llm, ref):
    engine = llm.engine
    engine.add_request(STORY, _greedy(8, ignore_eos=True), request_id="dup")
    with pytest.raises(ValueError, match="dup"):
        engine.add_request("something else", _greedy(2), request_id="dup")
    per_req, finished = _run_steps(engine)
    assert finished == ["dup"]
    assert per_req["dup"][-1].token_ids == ref.token_ids[:8]


def test_unknown_model_path_raises():
    with pytest.raises(ValueError, match="/no/such/path"):
        LLM(model="/no/such/path", dtype="float32", kv_cache_gib=0.01)


# ---- stop conditions -----------------------------------------------------------------


def test_stop_token_id_ends_at_that_token(llm, ref):
    toks = ref.token_ids
    k = next(i for i in range(8, N_REF) if toks[i] not in toks[:i])
    out = llm.generate(STORY, _greedy(stop_token_ids=[toks[k]], ignore_eos=True))[0]
    assert out.token_ids == toks[: k + 1]
    assert out.finish_reason == "stop"
    assert out.stop_reason == toks[k]
    assert ref.text.startswith(out.text)


def test_stop_string_cuts_the_text_before_it(llm, ref):
    text = ref.text
    i = len(text) // 2
    s = text[i : i + 6]
    assert s.strip(), "pick a stop string with some content"
    cut = text.index(s)
    tok = llm.tokenizer
    # The request must end at the first token whose text completes the stop string.
    k = next(j for j in range(1, N_REF + 1) if s in tok.decode(ref.token_ids[:j]))

    out = llm.generate(STORY, _greedy(stop=[s], ignore_eos=True))[0]
    assert out.text == text[:cut]
    assert out.finish_reason == "stop" and out.stop_reason == s
    assert out.token_ids == ref.token_ids[:k]

    kept = llm.generate(STORY, _greedy(stop=[s], ignore_eos=True,
                                       include_stop_str_in_output=True))[0]
    assert kept.text == text[: cut + len(s)]
    assert kept.finish_reason == "stop" and kept.stop_reason == s
    assert kept.token_ids == ref.token_ids[:k]

    # Completed on the last token max_tokens allows: still a stop-string stop (as vLLM).
    last = llm.generate(STORY, _greedy(k, stop=[s], ignore_eos=True))[0]
    assert last.token_ids == ref.token_ids[:k] and last.text == text[:cut]
    assert last.finish_reason == "stop" and last.stop_reason == s


def test_earliest_of_several_stop_strings_wins(llm, ref):
    text = ref.text
    early, late = text[20:25], text[50:56]
    assert text.index(early) < text.index(late)
    out = llm.generate(STORY, _greedy(stop=[late, early], ignore_eos=True))[0]
    assert out.text == text[: text.index(early)]
    assert out.stop_reason == early


def test_max_tokens_gives_length(llm, ref):
    for n in (1, 5):
        out = llm.generate(STORY, _greedy(n, ignore_eos=True))[0]
        assert out.finish_reason == "length" and out.stop_reason is None
        assert out.token_ids == ref.token_ids[:n]
        assert ref.text.startswith(out.text)


def test_eos_stops_unless_ignored(llm):
    ids = llm.engine.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])
    out = llm.generate([ids], _greedy(40))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids[-1] == EOS and EOS not in out.token_ids[:-1]
    assert out.stop_reason is None  # EOS is not a user stop condition
    assert "4" in out.text and "<|im_end|>" not in out.text
    n = len(out.token_ids)
    assert n < 40

    on = llm.generate([ids], _greedy(n + 6, ignore_eos=True))[0]
    assert on.finish_reason == "length"
    assert len(on.token_ids) == n + 6
    assert on.token_ids[:n] == out.token_ids

    # EOS named as a stop token id stops even with ignore_eos, with EOS as the reason.
    named = llm.generate([ids], _greedy(n + 6, ignore_eos=True, stop_token_ids=[EOS]))[0]
    assert named.token_ids == out.token_ids
    assert named.finish_reason == "stop" and named.stop_reason == EOS


def test_max_model_len_caps_the_output(small):
    rng = random.Random(1)
    prompt = [rng.randint(100, 40000) for _ in range(30)]
    out = small.generate([prompt], _greedy(100, ignore_eos=True))[0]
    assert out.finish_reason == "length"
    assert len(out.token_ids) == 10
    assert len(out.prompt_token_ids) + len(out.token_ids) == 40


# ---- streaming -----------------------------------------------------------------------


def test_streamed_deltas_add_up_and_never_show_a_stop_string(llm, ref):
    engine = llm.engine
    text = ref.text
    stop = text[len(text) // 2 : len(text) // 2 + 8]
    # A stop string whose start appears in the output but which never completes: the
    # held-back text must still come out by the end.
    i = len(text) // 3
    near_miss = text[i : i + 4] + "\x00"
    ids = {
        "plain": engine.add_request(STORY, _greedy(ignore_eos=True)),
        "stop": engine.add_request(STORY, _greedy(stop=[stop], ignore_eos=True)),
        "miss": engine.add_request(STORY, _greedy(stop=[near_miss], ignore_eos=True)),
        "chat": engine.add_request(
            engine.apply_chat_template([{"role": "user", "content": "Say hello in French."}]),
            _greedy(20)),
    }
    streamed = {rid: "" for rid in ids.values()}
    streamed_ids = {rid: [] for rid in ids.values()}
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id not in finals, "output after the request finished"
            streamed[out.request_id] += out.new_text
            streamed_ids[out.request_id] += out.new_token_ids
            assert streamed_ids[out.request_id] == out.token_ids
            # What has been streamed so far is always what the text so far begins with.
            assert out.text.startswith(streamed[out.request_id])
            if out.request_id == ids["stop"]:
                assert stop not in streamed[out.request_id]
                assert text[: text.index(stop)].startswith(streamed[out.request_id])
            if out.finished:
                finals[out.request_id] = out
    assert set(finals) == set(ids.values())
    for rid, out in finals.items():
        assert streamed[rid] == out.text
        assert streamed_ids[rid] == out.token_ids
    assert finals[ids["plain"]].text == text
    assert finals[ids["miss"]].text == text
    assert finals[ids["miss"]].finish_reason == "length"
    assert finals[ids["stop"]].text == text[: text.index(stop)]
    assert finals[ids["stop"]].finish_reason == "stop"


# ---- abort ---------------------------------------------------------------------------

PROMPTS3 = [STORY, "List three colours of the rainbow:", "def fibonacci(n):\n    "]


def test_abort_mid_decode_leaves_the_others_unchanged(llm):
    engine = llm.engine
    params = _greedy(12, ignore_eos=True)
    want = [o.token_ids for o in llm.generate(PROMPTS3, params)]

    rids = [engine.add_request(p, params) for p in PROMPTS3]
    seen: dict[str, list] = {r: [] for r in rids}
    for _ in range(4):
        for out in engine.step():
            seen[out.request_id].append(out)
    assert all(len(seen[r]) >= 2 for r in rids), "every request should be decoding by now"
    assert not any(o.finished for r in rids for o in seen[r])

    aborted = engine.abort_request(rids[1])
    assert aborted is not None
    assert aborted.finish_reason == "abort" and aborted.finished
    assert aborted.stop_reason is None
    n = len(aborted.token_ids)
    assert 2 <= n < 12
    assert aborted.token_ids == want[1][:n]
    assert aborted.token_ids == seen[rids[1]][-1].token_ids
    assert engine.abort_request(rids[1]) is None  # once only
    assert engine.abort_request("no-such-request") is None

    per_req, finished = _run_steps(engine)
    assert rids[1] not in per_req, "an aborted request produced more output"
    assert sorted(finished) == sorted([rids[0], rids[2]])
    assert per_req[rids[0]][-1].token_ids == want[0]
    assert per_req[rids[2]][-1].token_ids == want[2]
    assert per_req[rids[0]][-1].finish_reason == "length"


def test_abort_before_it_ran(llm):
    engine = llm.engine
    rid = engine.add_request(STORY, _greedy(4))
    out = engine.abort_request(rid)
    assert out.finish_reason == "abort" and out.token_ids == [] and out.text == ""
    assert engine.step() == []
    _assert_idle(llm)


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
    params = _greedy(3, ignore_eos=True)
    low = engine.add_request("Hello there", params, priority=10)
    high = engine.add_request("Good morning", params, priority=0)
    high2 = engine.add_request("Good evening", params, priority=0)
    _, finished = _run_steps(engine)
    assert finished == [high, high2, low]


def test_fcfs_runs_the_first_arrival_first(llm, monkeypatch):
    engine = llm.engine
    assert not engine.scheduler.priority_policy
    monkeypatch.setattr(engine.scheduler, "max_num_seqs", 1)
    params = _greedy(3, ignore_eos=True)
    first = engine.add_request("Hello there", params, priority=10)
    second = engine.add_request("Good morning", params, priority=0)
    _, finished = _run_steps(engine)
    assert finished == [first, second]


# ---- logprobs ------------------------------------------------------------------------


def test_logprobs_match_hf(llm, hf_model):
    prompt = llm.tokenizer.encode("The capital of France is")
    outs = llm.generate([prompt, prompt, prompt],
                        [_greedy(6, logprobs=3, ignore_eos=True),
                         _greedy(6, logprobs=0, ignore_eos=True),
                         _greedy(6, ignore_eos=True)])
    out, out0, plain = outs
    assert out.token_ids == out0.token_ids == plain.token_ids
    assert plain.logprobs is None
    assert len(out.logprobs) == len(out0.logprobs) == 6

    ids = torch.tensor([prompt + out.token_ids])
    with torch.no_grad():
        logits = hf_model(ids).logits[0].float()
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


def test_logprobs_of_sampled_tokens_are_raw_model_logprobs(llm, hf_model):
    # At a high temperature some sampled tokens are not the model's best; the dict still
    # holds the sampled token plus exactly the top 1, and the values are the raw model's
    # (before temperature), as in vLLM.
    prompt = llm.tokenizer.encode(STORY)
    out = llm.generate([prompt], SamplingParams(temperature=1.5, seed=5, max_tokens=12,
                                                logprobs=1, ignore_eos=True))[0]
    assert len(out.logprobs) == 12
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt + out.token_ids])).logits[0].float()
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
    params = [_greedy(40 - len(p), ignore_eos=True) for p in prompts[:5]] + [
        SamplingParams(temperature=1.0, seed=42, max_tokens=40 - len(prompts[5]),
                       ignore_eos=True)]

    before = llm.engine.scheduler.num_preemptions
    want = [o.token_ids for o in llm.generate(prompts, params)]
    assert llm.engine.scheduler.num_preemptions == before, "the ample engine preempted"

    preempted_before = engine.scheduler.num_preemptions
    rids = [engine.add_request(p, sp, priority=i % 3)
            for i, (p, sp) in enumerate(zip(prompts, params, strict=True))]
    per_req, _ = _run_steps(engine)
    assert engine.scheduler.num_preemptions > preempted_before, "the budget was meant to force it"
    got = [per_req[r][-1] for r in rids]
    assert sum(o.num_preemptions for o in got) > 0
    for i, (o, w) in enumerate(zip(got, want, strict=True)):
        assert o.finish_reason == "length"
        assert len(o.prompt_token_ids) + len(o.token_ids) == 40
        assert o.token_ids == w, f"prompt {i} diverged after preemption"
    _assert_idle(small)


# ---- chat ----------------------------------------------------------------------------


def test_chat_template_and_answer(llm):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    tok = llm.tokenizer
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    want = tok.encode(text, add_special_tokens=False)
    ids = llm.engine.apply_chat_template(messages)
    assert ids == want
    decoded = tok.decode(ids)
    assert decoded.endswith("<|im_start|>assistant\n")
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>" in decoded

    out = llm.chat(messages, _greedy(24))
    assert out.prompt_token_ids == want
    assert "Paris" in out.text
