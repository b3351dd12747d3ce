"""min_tokens, logit_bias and bad_words through the engine: colocated, prefilled then
decoded, with speculative decoding and under a structured constraint. On the tiny serving
model in fp32, against HF transformers' own greedy `generate` with the same bias (a
LogitsProcessor), its `min_new_tokens` and its `bad_words_ids`; stop strings against the
reference's own text."""

from __future__ import annotations

import re

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from baton.services.common.sampling_params import StructuredOutput
from baton.services.engine.config import SpecConfig
from baton.services.engine.sampler import bad_words_ids
from tests.integration.engine_helpers import EOS, STORY, greedy, run_steps


@pytest.fixture(scope="module")
def llm(make_llm, tiny_model):
    return make_llm(model=str(tiny_model), dtype="float32", max_num_batched_tokens=128,
                    max_num_seqs=16)



@pytest.fixture(scope="module")
def prompt(llm):
    return llm.tokenizer.encode(STORY)


@pytest.fixture(scope="module")
def ref(llm, prompt):
    """The greedy continuation, EOS ignored."""
    return llm.generate(prompt, greedy(16, ignore_eos=True))[0].token_ids


class Bias(LogitsProcessor):
    def __init__(self, bias: dict[int, float]):
        self.bias = bias

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        for t, b in self.bias.items():
            scores[:, t] += b
        return scores


def hf_greedy(hf, prompt, n, bias=None, stops=(EOS,), **kw) -> list[int]:
    """transformers' greedy tokens (the stop token included, as the engine keeps it)."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                          logits_processor=LogitsProcessorList([Bias(bias or {})]),
                          eos_token_id=list(stops), pad_token_id=0, **kw)
    return out[0, len(prompt):].tolist()


def test_logit_bias_steers_greedy_exactly_as_in_transformers(llm, hf_tiny, prompt, ref):
    with torch.no_grad():
        top = hf_tiny(torch.tensor([prompt])).logits[0, -1].topk(4).indices.tolist()
    bias = {top[0]: -100.0, top[1]: -1.5, top[3]: 2.0, ref[5]: 6.0, ref[9]: -30.0}
    got = llm.generate(prompt, greedy(12, logit_bias=bias))[0].token_ids
    assert got == hf_greedy(hf_tiny, prompt, 12, bias)
    assert got != ref[:12] and top[0] not in got


@pytest.mark.parametrize("min_tokens", [0, 5, 10])
@pytest.mark.parametrize("stop_id", [EOS, "ref[1]"])
def test_min_tokens_holds_off_eos_and_stop_ids(llm, hf_tiny, prompt, ref, min_tokens,
                                               stop_id):
    stop_id = ref[1] if stop_id == "ref[1]" else stop_id
    params = greedy(10, min_tokens=min_tokens, logit_bias={stop_id: 100.0},
                    stop_token_ids=[stop_id])
    out = llm.generate(prompt, params)[0]
    want = hf_greedy(hf_tiny, prompt, 10, {stop_id: 100.0}, stops=(EOS, stop_id),
                     min_new_tokens=min_tokens)
    assert out.token_ids == want
    if min_tokens < 10:  # the stop comes at once after min_tokens tokens
        assert len(want) == min_tokens + 1 and want[-1] == stop_id
        assert out.finish_reason == "stop"
    else:  # min_tokens == max_tokens: never
        assert stop_id not in want and out.finish_reason == "length"


def _expected_stop(tok, ids: list[int], stop: str, min_tokens: int):
    """(tokens, text) where `stop` first ends in the text of a token past min_tokens."""
    for k in range(min_tokens, len(ids)):
        before, text = tok.decode(ids[:k]), tok.decode(ids[:k + 1])
        at = text.find(stop, max(0, len(before) - len(stop) + 1))
        if at >= 0:
            return ids[:k + 1], text[:at]
    return ids, tok.decode(ids)


def test_min_tokens_holds_off_stop_strings(llm, prompt, ref):
    tok = llm.tokenizer
    t0, t1 = tok.decode(ref[:1]), tok.decode(ref[:2])
    across = t1[len(t0) - 2:len(t0) + 2]  # ends in token 1's text, starts in token 0's
    text = tok.decode(ref)
    again = next(text[i:i + 2] for i in range(len(t0)) if text.count(text[i:i + 2]) > 1)
    cases = [(across, 0), (across, 1), (across, 2), (again, 0), (again, 3)]
    outs = llm.generate([prompt] * len(cases), [greedy(16, ignore_eos=True, stop=[s],
                                                       min_tokens=m) for s, m in cases])
    for (stop, m), out in zip(cases, outs, strict=True):
        ids, want = _expected_stop(tok, ref, stop, m)
        assert (out.token_ids, out.text) == (ids, want), (stop, m)
    assert len(outs[2].token_ids) > 2 and len(outs[4].token_ids) > 3  # passed over


def test_decode_after_prefill_counts_the_first_token(llm, hf_tiny, prompt):
    """The prefill role samples the first token; the decode role (resume_request, as a
    decode worker continues it) counts it toward min_tokens."""
    engine = llm.engine
    params = greedy(10, min_tokens=5, logit_bias={EOS: 100.0})
    want = hf_greedy(hf_tiny, prompt, 10, {EOS: 100.0}, min_new_tokens=5)
    rid = engine.add_request(prompt, params, kv_hold=True)
    outs, _ = run_steps(engine)
    first = outs[rid][-1].new_token_ids
    assert first == want[:1] and engine.release_lease(rid)
    rid = engine.resume_request(prompt, first, params)
    outs, _ = run_steps(engine)
    assert first + [t for o in outs[rid] for t in o.new_token_ids] == want
    assert len(want) == 6 and want[-1] == EOS


def test_bad_words_are_never_produced_as_in_transformers(llm, hf_tiny, prompt, ref):
    tok = llm.tokenizer
    one, two = tok.decode(ref[:1]), tok.decode(ref[3:5])  # a token, and two
    seqs = bad_words_ids(tok, (one, two))
    assert tuple(ref[:1]) in seqs and tuple(ref[3:5]) in seqs
    assert all(len(s) == 1 or s[0] != prompt[-1] for s in seqs)  # HF reads the prompt too
    out = llm.generate(prompt, greedy(16, ignore_eos=True, bad_words=[one, two]))[0]
    want = hf_greedy(hf_tiny, prompt, 16, stops=(), bad_words_ids=[list(s) for s in seqs])
    assert out.token_ids == want and out.token_ids != ref
    for s in seqs:
        assert all(tuple(want[i:i + len(s)]) != s for i in range(len(want)))


def test_speculative_decoding_keeps_min_tokens_bias_and_bad_words(make_llm, tiny_model,
                                                                   llm, ref):
    spec = make_llm(model=str(tiny_model), dtype="float32", max_num_batched_tokens=128,
                    speculative=SpecConfig(method="ngram", num_speculative_tokens=4,
                                           ngram_min=1, ngram_max=3))
    # The reference continuation repeated: the proposer drafts from it.
    prompt = llm.tokenizer.encode(STORY) + ref * 3
    tok = llm.tokenizer
    params = [greedy(12, min_tokens=6, logit_bias={EOS: 100.0}),
              greedy(12, logit_bias={ref[2]: -100.0, ref[6]: 5.0}, ignore_eos=True),
              greedy(12, bad_words=[tok.decode(ref[4:6])], ignore_eos=True)]
    want = [o.token_ids for o in llm.generate([prompt] * 3, params)]
    got = [o.token_ids for o in spec.generate([prompt] * 3, params)]
    assert got == want
    assert len(want[0]) == 7 and want[0][-1] == EOS
    assert spec.engine.stats().num_spec_drafts > 0


def test_min_tokens_under_a_constraint(llm, prompt):
    """The constraint's tokens go on until min_tokens; where it allows only EOS, the ban
    gives way and the constraint ends the output."""
    ab = StructuredOutput("regex", "[ab]+")
    outs = llm.generate([prompt] * 3, [
        greedy(10, structured=ab, logit_bias={EOS: 100.0}),
        greedy(10, structured=ab, logit_bias={EOS: 100.0}, min_tokens=4),
        greedy(10, structured=StructuredOutput("regex", "a"), min_tokens=4)])
    assert [len(o.token_ids) for o in outs[:2]] == [2, 5]
    for o in outs:
        assert o.token_ids[-1] == EOS and o.finish_reason == "stop"
        assert re.fullmatch("[ab]+", o.text)
    assert outs[2].text == "a"


def test_logit_bias_outside_the_vocabulary_is_refused(llm, prompt):
    vocab = llm.engine.model_info.vocab_size
    with pytest.raises(ValueError, match="logit_bias token id"):
        llm.generate(prompt, greedy(4, logit_bias={vocab: 1.0}))
