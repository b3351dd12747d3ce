"""Structured output and speculative decoding through the services: the same constrained
greedy tokens offline, colocated and disaggregated (the decode worker rebuilding the
matcher from the prefill worker's first token, and drafting); JSON that validates; bad
constraints refused with INVALID_ARGUMENT (HTTP 400) and nothing queued; acceptance in
the metrics. The services are the session's, on the default model (`smollm`, in
tests/e2e/conftest.py): a random tiny model never repeats its prompt, so its drafts would
never be accepted."""

from __future__ import annotations

import json

import grpc
import httpx
import jsonschema
import pytest

from baton.services.common.sampling_params import StructuredOutput
from baton.services.engine import SamplingParams
from baton.v1 import generation_pb2 as gen
from tests.e2e.helpers import all_free_within, joined, metric_value, run, until_served

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "pets": {"type": "array", "maxItems": 2, "items": {"enum": ["cat", "dog", "fish"]}}},
    "required": ["name", "age", "pets"]}
CASES = [  # (constraint message, the engine's StructuredOutput, chat prompt)
    (gen.StructuredOutput(json_schema=json.dumps(SCHEMA)),
     StructuredOutput("json", json.dumps(SCHEMA)), "Describe a person and their pets."),
    (gen.StructuredOutput(regex=r"[A-Z][a-z]{2,8} (is|was) [a-z]{3,10}"),
     StructuredOutput("regex", r"[A-Z][a-z]{2,8} (is|was) [a-z]{3,10}"), "Say something."),
    (gen.StructuredOutput(choice=gen.Choices(choices=["red", "green", "blue"])),
     StructuredOutput("choice", choices=("red", "green", "blue")), "Pick a colour."),
]
# Text the answer repeats, so that the decode worker's drafts are accepted.
REPEAT = ("Repeat this exactly: the paged blocks move from the prefill worker to the decode "
          "worker, and the decode worker streams the tokens back to the router.")


def chat(text: str, sampling: gen.SamplingParams) -> gen.GenerateRequest:
    return gen.GenerateRequest(
        chat=gen.ChatMessages(messages=[gen.ChatMessage(role="user", content=text)]),
        sampling=sampling)


def test_same_constrained_tokens_offline_colocated_and_disaggregated(smollm, smollm_offline):
    for msg, so, text in CASES:
        prompt = smollm_offline.engine.apply_chat_template([{"role": "user", "content": text}])
        ref = smollm_offline.generate([prompt], SamplingParams(
            temperature=0, max_tokens=96, structured=so))[0]
        assert ref.finish_reason == "stop"
        sampling = gen.SamplingParams(max_tokens=96, temperature=0, structured_output=msg)
        for where in ("colocated", "router"):
            msgs = until_served(smollm[where], chat(text, sampling))
            assert joined(msgs) == (ref.token_ids, ref.text), where
            assert msgs[-1].delta.finish_reason == gen.FINISH_REASON_STOP
        if so.kind == "json":
            jsonschema.validate(json.loads(ref.text), SCHEMA)
    assert all_free_within([smollm["prefill"], smollm["decode"]], 5.0)


def test_the_decode_worker_speculates_with_the_same_output(smollm, smollm_offline):
    prompt = smollm_offline.engine.apply_chat_template([{"role": "user", "content": REPEAT}])
    ref = smollm_offline.generate([prompt], SamplingParams(temperature=0, max_tokens=48,
                                                           ignore_eos=True))[0]
    metrics = smollm["topology"].metrics[smollm["decode"]]
    before = httpx.get(f"http://{metrics}/metrics", timeout=10).text
    msgs = until_served(smollm["router"], chat(REPEAT, gen.SamplingParams(
        max_tokens=48, temperature=0, ignore_eos=True)))
    assert joined(msgs) == (ref.token_ids, ref.text)
    after = httpx.get(f"http://{metrics}/metrics", timeout=10).text
    accepted = (metric_value(after, "baton:spec_decode_num_accepted_tokens_total")
                - metric_value(before, "baton:spec_decode_num_accepted_tokens_total"))
    drafted = (metric_value(after, "baton:spec_decode_num_draft_tokens_total")
               - metric_value(before, "baton:spec_decode_num_draft_tokens_total"))
    assert 0 < accepted <= drafted


@pytest.mark.parametrize("msg", [gen.StructuredOutput(regex="((("),
                                 gen.StructuredOutput(grammar="root ::= "),
                                 gen.StructuredOutput(json_schema='{"type": "bogus"}')])
def test_a_constraint_that_cannot_compile_is_invalid_argument(smollm, msg):
    for where in ("colocated", "router"):
        with pytest.raises(grpc.RpcError) as e:
            run(smollm[where], chat("hi", gen.SamplingParams(structured_output=msg)))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "cannot compile" in e.value.details()
    assert all_free_within([smollm["prefill"], smollm["decode"]], 5.0)


def test_openai_response_format_and_its_errors(smollm):
    http = "http://" + smollm["topology"].http[smollm["router"]]
    model = httpx.get(http + "/v1/models", timeout=10).json()["data"][0]["id"]
    body = {"model": model, "max_tokens": 96, "temperature": 0,
            "messages": [{"role": "user", "content": "Describe a person and their pets."}],
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "person", "schema": SCHEMA}}}
    r = httpx.post(http + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()["choices"][0]["message"]["content"]), SCHEMA)
    bad = {**body, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "bogus"}}}}
    r = httpx.post(http + "/v1/chat/completions", json=bad, timeout=60)
    assert r.status_code == 400 and "cannot compile" in r.json()["error"]["message"]
    r = httpx.post(http + "/v1/completions", json={
        "model": model, "prompt": "The colour of the sky is", "max_tokens": 8,
        "temperature": 0, "guided_choice": ["blue", "grey"]}, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("blue", "grey")
