"""vLLM's GenerateRequest in baton.v1's terms (router/vllm_request.py): unset and zero
values read as vLLM's servicer reads them, truncation keeps the prompt's last tokens, a
seeded request's choices get seeds of their own."""

from __future__ import annotations

import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as vllm

from baton.router.vllm_request import choices, logprobs
from baton.services.rpc.errors import InvalidArgument
from baton.v1 import generation_pb2 as gen

IDS = list(range(10, 30))


def one(**sampling) -> gen.GenerateRequest:
    req = vllm.GenerateRequest(request_id="r", tokenized=vllm.TokenizedInput(input_ids=IDS),
                               sampling_params=vllm.SamplingParams(**sampling))
    (out,) = choices(req, max_model_len=100, max_n=8)
    return out


def test_unset_and_zero_values_are_vllms_off_values():
    s = one().sampling
    assert (s.temperature, s.top_p, s.top_k, s.repetition_penalty) == (1.0, 1.0, -1, 1.0)
    assert s.max_tokens == 100  # to the end of the context, as vLLM
    assert not s.HasField("logprobs") and not s.HasField("seed")
    s = one(temperature=0, top_k=5, top_p=0.5, max_tokens=7, min_tokens=2, seed=3,
            logprobs=0, regex="a+").sampling
    assert (s.temperature, s.top_k, s.top_p, s.max_tokens, s.min_tokens, s.seed,
            s.logprobs, s.structured_output.regex) == (0, 5, 0.5, 7, 2, 3, 0, "a+")


def test_truncation_keeps_the_last_tokens():
    assert list(one(truncate_prompt_tokens=5).token_ids.ids) == IDS[-5:]
    assert list(one(truncate_prompt_tokens=-1).token_ids.ids) == IDS
    with pytest.raises(InvalidArgument, match="truncate_prompt_tokens"):
        one(truncate_prompt_tokens=-2)


def test_a_seeded_requests_choices_differ_and_repeat():
    req = vllm.GenerateRequest(request_id="r", tokenized=vllm.TokenizedInput(input_ids=IDS),
                               sampling_params=vllm.SamplingParams(n=3, seed=7))
    out = choices(req, max_model_len=100, max_n=8)
    assert [r.sampling.seed for r in out] == [7, 8, 9]
    assert [r.request_id for r in out] == ["r-0", "r-1", "r-2"]


def test_top_logprobs_are_the_first_distinct_tokens_sampled_first():
    entry = gen.TokenLogprobs(entries=[gen.Logprob(token_id=5, logprob=-0.1),
                                       gen.Logprob(token_id=5, logprob=-0.1),
                                       gen.Logprob(token_id=9, logprob=-2.0)])
    out = logprobs([entry], 2)
    assert (list(out.token_ids), list(out.top_logprobs[0].token_ids)) == ([5], [5, 9])
    assert not logprobs([entry], 0).top_logprobs and logprobs([entry], None) is None


def test_values_past_baton_v1s_int32_are_refused_naming_their_field():
    with pytest.raises(InvalidArgument, match="sampling_params.max_tokens"):
        one(max_tokens=2**31)
    with pytest.raises(InvalidArgument, match="sampling_params.stop_token_ids"):
        one(stop_token_ids=[2**32 - 1])
    req = vllm.GenerateRequest(tokenized=vllm.TokenizedInput(input_ids=[2**31]))
    with pytest.raises(InvalidArgument, match="tokenized.input_ids"):
        choices(req, max_model_len=100, max_n=8)
