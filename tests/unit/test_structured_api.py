"""Structured output and the speculative-decoding counters on the wire, without a model:
the proto <-> engine conversion, every OpenAI/vLLM form of a constraint and its refusals,
the router's own check, the "constraint" finish reason as each API shows it, the
client's keyword, and the workers' stats and metrics."""

from __future__ import annotations

import asyncio
import json
import re
from types import SimpleNamespace

import grpc
import pytest
from prometheus_client import generate_latest

from baton.router.intake import Intake
from baton.router.openai.protocol import ChatRequest, CompletionRequest
from baton.router.openai.render import Choice, Renderer, param_of
from baton.services.common.finish import FinishReason
from baton.services.common.sampling_params import SamplingParams, StructuredOutput
from baton.services.rpc.convert import (
    FINISH,
    FINISH_NAME,
    finish_reason_of,
    sampling_message,
    sampling_params,
)
from baton.services.rpc.errors import InvalidArgument
from baton.services.rpc.server import Lifecycle
from baton.v1 import generation_pb2 as gen
from baton.worker.v1 import worker_pb2 as wk
from baton_client import generate_request
from baton_client.results import chunk_of, finish_name
from tests.unit.test_openai_errors import call

MESSAGES = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"},
                                           "age": {"type": "integer"}},
          "required": ["name"]}
GBNF = 'root ::= "yes" | "no"'


# ---- convert: the wire message <-> the engine's StructuredOutput -------------------------

@pytest.mark.parametrize("engine, wire", [
    (StructuredOutput("json", '{"type": "string"}'),
     gen.StructuredOutput(json_schema='{"type": "string"}')),
    (StructuredOutput("json_object"), gen.StructuredOutput(json_object=True)),
    (StructuredOutput("regex", r"\d{3}-\d{4}"), gen.StructuredOutput(regex=r"\d{3}-\d{4}")),
    (StructuredOutput("grammar", GBNF), gen.StructuredOutput(grammar=GBNF)),
    (StructuredOutput("choice", choices=("red", "green")),
     gen.StructuredOutput(choice=gen.Choices(choices=["red", "green"]))),
])
def test_every_kind_round_trips_through_the_wire(engine, wire):
    msg = sampling_message(max_tokens=5, structured=engine)
    assert msg.structured_output == wire
    received = gen.SamplingParams.FromString(msg.SerializeToString())
    assert sampling_params(received) == SamplingParams(max_tokens=5, structured=engine)


def test_no_constraint_is_no_field_and_none():
    assert not sampling_message(max_tokens=3, structured=None).HasField("structured_output")
    assert sampling_params(gen.SamplingParams(max_tokens=3)).structured is None


@pytest.mark.parametrize("wire, words", [
    (gen.StructuredOutput(), "no constraint"),
    (gen.StructuredOutput(json_object=False), "json_object"),
    (gen.StructuredOutput(json_schema="not json"), "not valid JSON"),
    (gen.StructuredOutput(json_schema="[1, 2]"), "object"),
    (gen.StructuredOutput(regex=""), "regex"),
    (gen.StructuredOutput(choice=gen.Choices()), "choice"),
    (gen.StructuredOutput(choice=gen.Choices(choices=["a", ""])), "choice"),
])
def test_a_malformed_wire_constraint_is_a_value_error(wire, words):
    with pytest.raises(ValueError, match=words):
        sampling_params(gen.SamplingParams(structured_output=wire))


def test_the_constraint_finish_reason_round_trips():
    assert gen.FinishReason.Name(4) == "FINISH_REASON_CONSTRAINT"  # the proto's number
    assert FINISH["constraint"] == 4 and FINISH_NAME[4] == "constraint"
    delta = gen.TokenDelta(finish_reason=FINISH["constraint"])
    back = gen.TokenDelta.FromString(delta.SerializeToString())
    assert FINISH_NAME[back.finish_reason] == "constraint"
    assert len(set(FINISH.values())) == len(FINISH)  # no two names share a number


def test_every_finish_reason_has_one_wire_number_and_the_client_names_it_alike():
    assert set(FINISH_NAME) == set(gen.FinishReason.values())  # every number is named
    for reason in FinishReason:
        back = gen.TokenDelta.FromString(
            gen.TokenDelta(finish_reason=FINISH[reason]).SerializeToString())
        assert finish_reason_of(back.finish_reason) is reason
        assert finish_name(back.finish_reason) == reason.value
    assert finish_reason_of(gen.FINISH_REASON_UNSPECIFIED) is None
    assert finish_reason_of(99) is FinishReason.ABORT  # a newer peer's reason ends it
    assert finish_name(gen.FINISH_REASON_UNSPECIFIED) is None


# ---- the OpenAI layer: every form, on every choice of both endpoints --------------------

def _wire(body: dict) -> list[gen.GenerateRequest]:
    """The chat and the completions requests (2 prompts x n=2) of the same extra fields."""
    chat = ChatRequest(model="m", messages=MESSAGES, n=2, **body).requests(2048)
    completion = CompletionRequest(model="m", prompt=["a", "b"], n=2, **body).requests(2048)
    assert len(chat) == 2 and len(completion) == 4
    return chat + completion


def _as_dict(so: gen.StructuredOutput) -> dict:
    """Which constraint, and its value (a JSON schema parsed, so key order and spacing do
    not matter)."""
    which = so.WhichOneof("constraint")
    value = getattr(so, which)
    if which == "json_schema":
        value = json.loads(value)
    elif which == "choice":
        value = list(value.choices)
    return {which: value}


@pytest.mark.parametrize("body, want", [
    ({"response_format": {"type": "json_object"}}, {"json_object": True}),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}},
     {"json_schema": SCHEMA}),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
     {"json_schema": SCHEMA}),
    ({"guided_json": SCHEMA}, {"json_schema": SCHEMA}),
    ({"guided_json": json.dumps(SCHEMA)}, {"json_schema": SCHEMA}),
    ({"guided_regex": r"[0-9]{3}"}, {"regex": r"[0-9]{3}"}),
    ({"guided_choice": ["yes", "no"]}, {"choice": ["yes", "no"]}),
    ({"guided_grammar": GBNF}, {"grammar": GBNF}),
    ({"structured_outputs": {"json": SCHEMA}}, {"json_schema": SCHEMA}),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, {"json_schema": SCHEMA}),
    ({"structured_outputs": {"regex": "a+b"}}, {"regex": "a+b"}),
    ({"structured_outputs": {"choice": ["x", "y", "z"]}}, {"choice": ["x", "y", "z"]}),
    ({"structured_outputs": {"grammar": GBNF}}, {"grammar": GBNF}),
    ({"structured_outputs": {"json_object": True}}, {"json_object": True}),
    ({"structured_outputs": {"regex": "a", "json_object": False, "disable_fallback": True}},
     {"regex": "a"}),
    # "text" is no constraint, so it goes with one
    ({"response_format": {"type": "text"}, "guided_regex": "a"}, {"regex": "a"}),
])
def test_every_openai_form_constrains_every_choice(body, want):
    reqs = _wire(body)
    assert [_as_dict(r.sampling.structured_output) for r in reqs] == [want] * len(reqs)
    # and what the router then checks accepts it
    for r in reqs:
        assert sampling_params(r.sampling).structured is not None


@pytest.mark.parametrize("body", [{}, {"response_format": {"type": "text"}},
                                  {"response_format": None, "guided_json": None}])
def test_no_constraint_leaves_the_field_unset(body):
    assert not any(r.sampling.HasField("structured_output") for r in _wire(body))


def test_the_constraint_goes_with_the_other_sampling_fields():
    [r] = ChatRequest(model="m", messages=MESSAGES, temperature=0.25, seed=3, max_tokens=9,
                      guided_choice=["A", "B"]).requests(2048)
    assert (r.sampling.max_tokens, r.sampling.temperature, r.sampling.seed) == (9, 0.25, 3)
    assert list(r.sampling.structured_output.choice.choices) == ["A", "B"]


@pytest.mark.parametrize("body, field, words", [
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex",
     "only one"),
    ({"guided_json": SCHEMA, "structured_outputs": {"regex": "a"}}, "structured_outputs",
     "only one"),
    ({"guided_choice": ["a"], "guided_grammar": GBNF}, "guided_grammar", "only one"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs",
     "exactly one"),
    ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", "schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": "{}"}}},
     "response_format", "schema"),
    ({"response_format": {"type": "xml"}}, "response_format", "xml"),
    ({"response_format": {"type": "structural_tag"}}, "response_format", "structural_tag"),
    ({"response_format": "json"}, "response_format", "type"),
    ({"guided_choice": "yes"}, "guided_choice", "list"),
    ({"guided_choice": []}, "guided_choice", "list"),
    ({"guided_choice": ["a", 1]}, "guided_choice", "list"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_json": "[1, 2]"}, "guided_json", "object"),
    ({"guided_json": 7}, "guided_json", "schema"),
    ({"guided_regex": ""}, "guided_regex", "non-empty"),
    ({"guided_grammar": ["root ::= x"]}, "guided_grammar", "string"),
    ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs", "boolean"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs",
     "whitespace_pattern"),
    ({"structured_outputs": {"regex": "a", "colour": "red"}}, "structured_outputs", "colour"),
    ({"structured_outputs": ["regex"]}, "structured_outputs", "object"),
    ({"guided_whitespace_pattern": " ", "guided_json": SCHEMA}, "guided_whitespace_pattern",
     "not supported"),
])
def test_a_bad_constraint_is_refused_naming_its_field(body, field, words):
    for chat, make in ((True, lambda: ChatRequest(model="m", messages=MESSAGES, **body)),
                       (False, lambda: CompletionRequest(model="m", prompt="p", **body))):
        with pytest.raises(InvalidArgument, match=re.escape(words)) as e:
            make().requests(2048)
        assert param_of(str(e.value), chat) == field, str(e.value)


def test_a_bad_nested_value_names_the_nested_key():
    with pytest.raises(InvalidArgument) as e:
        ChatRequest(model="m", messages=MESSAGES,
                    structured_outputs={"json": "{oops"}).requests(2048)
    assert param_of(str(e.value), True) == "structured_outputs.json"


@pytest.mark.parametrize("body, field", [({"functions": [{"name": "f"}]}, "functions")])
def test_functions_are_refused(body, field):
    with pytest.raises(InvalidArgument, match=field):
        ChatRequest(model="m", messages=MESSAGES, guided_regex="a", **body).requests(2048)


def test_logit_bias_goes_with_a_constraint():
    (req,) = ChatRequest(model="m", messages=MESSAGES, guided_regex="a",
                         logit_bias={"1": 1.0}).requests(2048)
    assert dict(req.sampling.logit_bias) == {1: 1.0}
    assert sampling_params(req.sampling).structured == StructuredOutput("regex", "a")


def test_over_http_a_bad_constraint_is_a_400_naming_the_field():
    chat = call("POST", "/v1/chat/completions", json={
        "model": "m", "messages": MESSAGES,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}})
    completion = call("POST", "/v1/completions", json={
        "model": "m", "prompt": "p", "guided_choice": "yes"})
    assert chat.status_code == 400 and completion.status_code == 400
    assert chat.json()["error"]["param"] == "response_format"
    assert chat.json()["error"]["type"] == "invalid_request_error"
    assert completion.json()["error"]["param"] == "guided_choice"


# ---- the "constraint" finish reason as OpenAI clients and the Python client see it -------

def _reply(finish: int, stop_string: str | None = None) -> gen.GenerateResponse:
    delta = gen.TokenDelta(token_ids=[5], text="{}", finish_reason=finish)
    if stop_string is not None:
        delta.stop_string = stop_string
    return gen.GenerateResponse(request_id="r", delta=delta,
                                usage=gen.Usage(prompt_tokens=3, completion_tokens=1))


@pytest.mark.parametrize("chat", [True, False])
def test_openai_shows_constraint_as_stop_with_stop_reason(chat):
    renderer = Renderer(chat, "m", lambda t: f"<{t}>")
    ended, stopped = Choice(0), Choice(1)
    ended.add(_reply(gen.FINISH_REASON_CONSTRAINT))
    stopped.add(_reply(gen.FINISH_REASON_STOP, stop_string="END"))
    body = json.loads(renderer.whole_json([ended, stopped], 1, 0))
    got = [(c["finish_reason"], c["stop_reason"]) for c in body["choices"]]
    assert got == [("stop", "constraint"), ("stop", "END")]
    chunk = renderer.chunk(0, _reply(gen.FINISH_REASON_CONSTRAINT), True, 0, False)
    assert chunk["choices"][0]["finish_reason"] == "stop"
    assert "stop_reason" not in chunk["choices"][0]  # a chunk has no such field
    going = renderer.chunk(0, _reply(gen.FINISH_REASON_UNSPECIFIED), False, 0, False)
    assert going["choices"][0]["finish_reason"] is None


def test_the_python_client_names_the_constraint_finish():
    assert chunk_of(_reply(gen.FINISH_REASON_CONSTRAINT)).finish_reason == "constraint"
    assert chunk_of(_reply(gen.FINISH_REASON_STOP, "x")).finish_reason == "stop"


# ---- the router's own check (intake), over gRPC terms ------------------------------------

def _job(structured: gen.StructuredOutput):
    intake = Intake(tokenizer=None)  # token ids need no tokenizer
    request = gen.GenerateRequest(token_ids=gen.TokenIds(ids=[1, 2, 3]),
                                  sampling=gen.SamplingParams(structured_output=structured))
    try:
        return asyncio.run(intake.job(request, gen.ModelInfo(max_model_len=64,
                                                             vocab_size=100)))
    finally:
        intake.close()


@pytest.mark.parametrize("structured, words", [
    (gen.StructuredOutput(json_schema="not json"), "not valid JSON"),
    (gen.StructuredOutput(choice=gen.Choices()), "choice"),
    (gen.StructuredOutput(grammar=""), "grammar"),
    (gen.StructuredOutput(), "no constraint"),
])
def test_the_router_refuses_a_bad_constraint_as_invalid_argument(structured, words):
    with pytest.raises(InvalidArgument) as e:
        _job(structured)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert str(e.value).startswith("sampling: ") and words in str(e.value), str(e.value)


def test_the_router_passes_a_good_constraint_on_unchanged():
    structured = gen.StructuredOutput(regex="[a-z]+")
    job = _job(structured)
    assert job.request.sampling.structured_output == structured


# ---- the Python client's keyword ------------------------------------------------------

@pytest.mark.parametrize("given, want", [
    ({"json_schema": json.dumps(SCHEMA)}, {"json_schema": SCHEMA}),
    ({"json_schema": SCHEMA}, {"json_schema": SCHEMA}),  # a dict: sent as its JSON text
    ({"json_object": True}, {"json_object": True}),
    ({"regex": "a|b"}, {"regex": "a|b"}),
    ({"grammar": GBNF}, {"grammar": GBNF}),
    ({"choice": ("one", "two")}, {"choice": ["one", "two"]}),
    (gen.StructuredOutput(regex="z+"), {"regex": "z+"}),
])
def test_the_client_sends_structured_output(given, want):
    msg = generate_request("hi", max_tokens=4, structured_output=given)
    assert _as_dict(msg.sampling.structured_output) == want
    assert msg.sampling.max_tokens == 4
    assert not generate_request("hi").sampling.HasField("structured_output")




# ---- the workers: speculative-decoding counters in GetStats and the metrics -------------

SPEC = dict(num_spec_drafts=3, num_spec_draft_tokens=12, num_spec_accepted_tokens=7)


def test_the_spec_decode_counters_are_exported_under_vllms_names():
    from baton.services.engine.outputs import EngineStats
    from baton.services.worker.metrics import WorkerMetrics

    stats = EngineStats(num_blocks=10, num_free_blocks=10, **SPEC)
    registry = WorkerMetrics(lambda: stats, "m", 1).registry
    kinds = {family.name: family.type for family in registry.collect()}
    text = generate_latest(registry).decode()
    for name, value in (("baton:spec_decode_num_drafts", 3),
                        ("baton:spec_decode_num_draft_tokens", 12),
                        ("baton:spec_decode_num_accepted_tokens", 7)):
        assert kinds.get(name) == "counter", name
        assert f'{name}_total{{model_name="m"}} {float(value)}' in text.splitlines(), name


def test_get_stats_carries_the_spec_decode_counters():
    from baton.kernels import kv_layout
    from baton.kv_transfer.base import KVLayout
    from baton.services.engine.outputs import EngineStats, ModelInfo
    from baton.services.worker.worker_service import WorkerServicer

    engine = SimpleNamespace(
        rank_kv_caches=[[SimpleNamespace(shape=kv_layout.shape(8, 1, 16, 8))]],
        kv_layout=KVLayout("m", "float32", 16, 2, 1, 8),
        model_info=ModelInfo("m", "LlamaForCausalLM", 64, 100, (2,), 16, "float32"))
    stats = EngineStats(num_blocks=8, num_free_blocks=8, num_generation_tokens=20, **SPEC)
    servicer = WorkerServicer(SimpleNamespace(engine=engine, stats=stats,
                                              stalled_since=lambda: None), "e1", "decode",
                              Lifecycle())
    reply = asyncio.run(servicer.GetStats(wk.GetStatsRequest(), None))
    assert (reply.num_spec_drafts, reply.num_spec_draft_tokens,
            reply.num_spec_accepted_tokens) == (3, 12, 7)
    assert reply.num_generation_tokens == 20 and reply.engine_id == "e1"
