"""The engine's public API: input validation, stop conditions, streaming deltas, abort.
On the tiny serving model (fp32, CPU): what is checked is the engine's bookkeeping; only
the EOS test needs the real default model, one that ends its answers.

References are the model's own greedy output (run without the feature under test) and the
tokenizer; never the engine's code.
"""

from __future__ import annotations

import random

import pytest

from baton.services.engine import LLM, SamplingParams
from tests.integration.engine_helpers import EOS, N_REF, STORY, assert_idle, greedy, run_steps

pytestmark = pytest.mark.usefixtures("start_clean")


@pytest.fixture(scope="module")
def llm(make_llm, tiny_model):
    return make_llm(model=str(tiny_model), dtype="float32", max_num_batched_tokens=128,
                    max_num_seqs=16)


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
        engine.add_request("", greedy(4))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([], greedy(4))
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], greedy(4))
    vocab = engine.model_config.vocab_size
    with pytest.raises(ValueError, match=str(vocab)):
        engine.add_request([1, 2, vocab], greedy(4))
    with pytest.raises(ValueError, match="-5"):
        engine.add_request([1, -5], greedy(4))
    with pytest.raises(ValueError):
        engine.add_request("hello", {"max_tokens": 4})  # not SamplingParams
    assert_idle(llm)

    assert small.engine.max_model_len == 40
    with pytest.raises(ValueError) as exc:
        small.engine.add_request(list(range(100, 141)), greedy(4))  # 41 tokens
    assert "41" in str(exc.value) and "40" in str(exc.value)
    with pytest.raises(ValueError, match="41"):
        small.generate([list(range(100, 141))], greedy(4))
    assert_idle(small)


def test_a_giant_salt_or_request_id_is_refused_by_the_engine_itself(llm):
    """A caller that reaches a worker directly meets the engine's own ceilings: an 8 MiB
    salt would be hashed into every block on the engine thread."""
    engine = llm.engine
    with pytest.raises(ValueError, match="cache_salt may hold at most 4096 characters"):
        engine.add_request([1, 2, 3], greedy(4), cache_salt="s" * (8 << 20))
    with pytest.raises(ValueError, match="request_id may hold at most 1024 characters"):
        engine.add_request([1, 2, 3], greedy(4), request_id="r" * 2000)
    assert_idle(llm)


def test_generate_with_one_bad_prompt_queues_nothing(llm, small):
    for prompts in (["The capital of France is", ""], [[], "The capital of France is"]):
        with pytest.raises(ValueError):
            llm.generate(prompts, greedy(4))
        assert_idle(llm)
    with pytest.raises(ValueError):
        small.generate([list(range(100, 110)), list(range(100, 150))], greedy(4))
    assert_idle(small)
    with pytest.raises(ValueError, match="1 sampling params for 2 prompts"):
        llm.generate(["Hello", "Hi"], [greedy(2)])
    assert_idle(llm)
    # The engine is still usable afterwards.
    out = llm.generate("The capital of France is", greedy(3, ignore_eos=True))[0]
    assert len(out.token_ids) == 3


def test_duplicate_request_id_raises_and_keeps_the_first(llm, ref):
    engine = llm.engine
    engine.add_request(STORY, greedy(8, ignore_eos=True), request_id="dup")
    with pytest.raises(ValueError, match="dup"):
        engine.add_request("something else", greedy(2), request_id="dup")
    per_req, finished = run_steps(engine)
    assert finished == ["dup"]
    assert per_req["dup"][-1].token_ids == ref.token_ids[:8]


def test_unknown_model_path_raises():
    with pytest.raises(ValueError, match="/no/such/path"):
        LLM(model="/no/such/path", dtype="float32", kv_cache_gib=0.01)


# ---- stop conditions -----------------------------------------------------------------


def test_stop_token_id_ends_at_that_token(llm, ref):
    toks = ref.token_ids
    k = next(i for i in range(8, N_REF) if toks[i] not in toks[:i])
    out = llm.generate(STORY, greedy(stop_token_ids=[toks[k]], ignore_eos=True))[0]
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

    out = llm.generate(STORY, greedy(stop=[s], ignore_eos=True))[0]
    assert out.text == text[:cut]
    assert out.finish_reason == "stop" and out.stop_reason == s
    assert out.token_ids == ref.token_ids[:k]

    kept = llm.generate(STORY, greedy(stop=[s], ignore_eos=True,
                                       include_stop_str_in_output=True))[0]
    assert kept.text == text[: cut + len(s)]
    assert kept.finish_reason == "stop" and kept.stop_reason == s
    assert kept.token_ids == ref.token_ids[:k]

    # Completed on the last token max_tokens allows: still a stop-string stop (as vLLM).
    last = llm.generate(STORY, greedy(k, stop=[s], ignore_eos=True))[0]
    assert last.token_ids == ref.token_ids[:k] and last.text == text[:cut]
    assert last.finish_reason == "stop" and last.stop_reason == s


def test_earliest_of_several_stop_strings_wins(llm, ref):
    text = ref.text
    early, late = text[20:25], text[50:56]
    assert text.index(early) < text.index(late)
    out = llm.generate(STORY, greedy(stop=[late, early], ignore_eos=True))[0]
    assert out.text == text[: text.index(early)]
    assert out.stop_reason == early


def test_max_tokens_gives_length(llm, ref):
    for n in (1, 5):
        out = llm.generate(STORY, greedy(n, ignore_eos=True))[0]
        assert out.finish_reason == "length" and out.stop_reason is None
        assert out.token_ids == ref.token_ids[:n]
        assert ref.text.startswith(out.text)


@pytest.mark.slow
def test_eos_stops_unless_ignored(make_llm):
    llm = make_llm(dtype="float32", max_num_batched_tokens=128, kv_cache_gib=0.05)
    ids = llm.engine.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])
    out = llm.generate([ids], greedy(40))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids[-1] == EOS and EOS not in out.token_ids[:-1]
    assert out.stop_reason is None  # EOS is not a user stop condition
    assert "4" in out.text and "<|im_end|>" not in out.text
    n = len(out.token_ids)
    assert n < 40

    on = llm.generate([ids], greedy(n + 6, ignore_eos=True))[0]
    assert on.finish_reason == "length"
    assert len(on.token_ids) == n + 6
    assert on.token_ids[:n] == out.token_ids

    # EOS named as a stop token id stops even with ignore_eos, with EOS as the reason.
    named = llm.generate([ids], greedy(n + 6, ignore_eos=True, stop_token_ids=[EOS]))[0]
    assert named.token_ids == out.token_ids
    assert named.finish_reason == "stop" and named.stop_reason == EOS


def test_max_model_len_caps_the_output(small):
    rng = random.Random(1)
    prompt = [rng.randint(100, 40000) for _ in range(30)]
    out = small.generate([prompt], greedy(100, ignore_eos=True))[0]
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
        "plain": engine.add_request(STORY, greedy(ignore_eos=True)),
        "stop": engine.add_request(STORY, greedy(stop=[stop], ignore_eos=True)),
        "miss": engine.add_request(STORY, greedy(stop=[near_miss], ignore_eos=True)),
        "chat": engine.add_request(
            engine.apply_chat_template([{"role": "user", "content": "Say hello in French."}]),
            greedy(20)),
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


def test_a_resumed_stream_neither_loses_nor_repeats_text(llm):
    """A migration (a decode worker died mid-stream): another engine's resume_request
    replays the tokens already streamed, then decodes on. Cut anywhere, a character split
    over tokens included (its first bytes streamed, its text held back), what was sent
    before the cut and what is sent after add up to the text of all the tokens."""
    engine, tok = llm.engine, llm.tokenizer
    prompt = tok.encode(STORY)
    before = tok.encode(" Party 🎉 in 世界, naïve")
    # What the stream had sent at each cut: the text of its tokens up to the last one
    # that ends a character (a token ending mid-character is held back whole).
    whole = [tok.decode(before[:k]) for k in range(len(before) + 1)]
    sent = [next(whole[j] for j in range(k, -1, -1) if not whole[j].endswith("\ufffd"))
            for k in range(len(before) + 1)]
    assert sent != whole, "no cut falls inside a character: this test would prove nothing"
    rids = {k: engine.resume_request(prompt, before[:k], greedy(k + 3, ignore_eos=True))
            for k in range(1, len(before) + 1)}
    outs, _ = run_steps(engine)
    for k, rid in rids.items():
        after = [t for o in outs[rid] for t in o.new_token_ids]
        text = sent[k] + "".join(o.new_text for o in outs[rid])
        assert text == tok.decode(before[:k] + after) == outs[rid][-1].text, (k, text)


# ---- abort ---------------------------------------------------------------------------

PROMPTS3 = [STORY, "List three colours of the rainbow:", "def fibonacci(n):\n    "]


def test_abort_mid_decode_leaves_the_others_unchanged(llm):
    engine = llm.engine
    params = greedy(12, ignore_eos=True)
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

    per_req, finished = run_steps(engine)
    assert rids[1] not in per_req, "an aborted request produced more output"
    assert sorted(finished) == sorted([rids[0], rids[2]])
    assert per_req[rids[0]][-1].token_ids == want[0]
    assert per_req[rids[2]][-1].token_ids == want[2]
    assert per_req[rids[0]][-1].finish_reason == "length"


def test_abort_before_it_ran(llm):
    engine = llm.engine
    rid = engine.add_request(STORY, greedy(4))
    out = engine.abort_request(rid)
    assert out.finish_reason == "abort" and out.token_ids == [] and out.text == ""
    assert engine.step() == []
    assert_idle(llm)
