"""The size of one request, bounded before any per-item work (services/common/limits.py):
the router's limits over HTTP bodies (router/openai/body.py), gRPC wire bytes
(router/wire.py: what its walk cannot skip is refused too) and parsed requests
(router/intake.py), each refusal naming its field, bodies parsed on threads of their own;
and the engine's own ceilings, which a caller that reaches a worker directly meets."""

from __future__ import annotations

import asyncio
import json
import random
import threading

import grpc
import pytest

from baton.router import wire
from baton.router.intake import Intake
from baton.router.openai import app as app_module
from baton.router.openai import body as body_module
from baton.router.openai.body import load_json, parse_body
from baton.router.openai.protocol import ChatRequest, CompletionRequest
from baton.services.common import constraint_limits
from baton.services.common.limits import Limits, OverLimit
from baton.services.common.sampling_params import SamplingParams
from baton.services.rpc.errors import InvalidArgument
from baton.services.rpc.server import status_of
from baton.v1 import generation_pb2 as gen
from tests.unit.test_openai_errors import call

SMALL = Limits(max_prompts=3, max_n=2, max_messages=3, max_prompt_chars=10,
               max_prompt_token_ids=5, max_stop=2, max_stop_chars=4, max_stop_token_ids=2,
               max_cache_salt_chars=4, max_request_id_chars=64, max_user_chars=4)
LONG_ID = "r" * 65
CHAT = [{"role": "user", "content": "hi"}]


def test_limits_are_validated_naming_the_value():
    with pytest.raises(ValueError, match="max_stop must be an integer >= 1, got 0"):
        Limits(max_stop=0)
    with pytest.raises(ValueError, match="max_stop_chars must be at most 512"):
        Limits(max_stop_chars=10_000)  # the engine would refuse what the router let in
    with pytest.raises(ValueError, match="max_request_id_chars must be at least 64"):
        Limits(max_request_id_chars=10)  # the router's own OpenAI ids would not fit


@pytest.mark.parametrize("kind, body, field", [
    (CompletionRequest, {"prompt": ["a"] * 4}, "prompt"),
    (CompletionRequest, {"prompt": "a" * 11}, "prompt"),
    (CompletionRequest, {"prompt": [1] * 6}, "prompt"),
    (CompletionRequest, {"prompt": [[1, 2, 3], [4, 5, 6]]}, "prompt"),
    (CompletionRequest, {"prompt": "a", "n": 3}, "n"),
    (CompletionRequest, {"prompt": "a", "n": "3"}, "n"),  # pydantic reads it as 3
    (ChatRequest, {"messages": CHAT * 4}, "messages"),
    (ChatRequest, {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "a" * 11}]}]}, "messages"),
    (ChatRequest, {"messages": CHAT, "stop": ["a", "b", "c"]}, "stop"),
    (ChatRequest, {"messages": CHAT, "stop": "abcde"}, "stop"),
    (ChatRequest, {"messages": CHAT, "stop_token_ids": [1, 2, 3]}, "stop_token_ids"),
    (ChatRequest, {"messages": CHAT, "cache_salt": "abcde"}, "cache_salt"),
    (ChatRequest, {"messages": CHAT, "user": "abcde"}, "user"),
])
@pytest.mark.parametrize("counting", [False, True])
def test_an_http_body_over_a_limit_is_refused_naming_the_field(kind, body, field, counting,
                                                               monkeypatch):
    if counting:  # the parse that counts as it goes, which big bodies take
        monkeypatch.setattr(body_module, "CHEAP", 0)
    raw = json.dumps({"model": "m", **body}).encode()
    with pytest.raises(OverLimit) as e:
        parse_body(raw, kind, SMALL)
    assert str(e.value).startswith(f"{field}: ") and "--max-" in str(e.value), str(e.value)


def test_at_the_limits_a_body_passes():
    body = {"model": "m", "prompt": ["ab", "cd", "ef"], "n": 2, "stop": ["abcd", "x"],
            "stop_token_ids": [1, 2], "cache_salt": "salt", "user": "me"}
    parsed = parse_body(json.dumps(body).encode(), CompletionRequest, SMALL)
    assert parsed.prompt_count() * parsed.n == 6
    chat = {"model": "m", "messages": CHAT * 3}
    assert len(parse_body(json.dumps(chat).encode(), ChatRequest, SMALL).messages) == 3


def _random_value(rng: random.Random, depth: int = 0):
    pick = rng.randrange(7 if depth < 4 else 4)
    if pick == 0:
        return rng.choice(["", "a\"b", "é🎉", "x" * rng.randrange(50), "{[,]}"])
    if pick == 1:
        return rng.randrange(-10**6, 10**6)
    if pick == 2:
        return rng.choice([1.5, -2e-3, True, False, None])
    if pick == 3:
        return rng.random()
    if pick == 4:
        return [_random_value(rng, depth + 1) for _ in range(rng.randrange(5))]
    return {f"k{i}": _random_value(rng, depth + 1) for i in range(rng.randrange(5))}


def test_the_counting_parse_reads_json_as_json_does(monkeypatch):
    monkeypatch.setattr(body_module, "CHEAP", 0)  # every body takes the counting path
    rng = random.Random(0)
    for _ in range(200):
        value = {"v": _random_value(rng)}
        raw = json.dumps(value).encode()
        assert load_json(raw, Limits()) == json.loads(raw)


def test_the_counting_parse_stops_at_the_message_limit(monkeypatch):
    monkeypatch.setattr(body_module, "CHEAP", 0)
    calls = []
    original = body_module._CountingDecoder._object
    monkeypatch.setattr(body_module._CountingDecoder, "_object",
                        lambda self, pairs: calls.append(1) or original(self, pairs))
    raw = json.dumps({"model": "m", "messages": CHAT * 10_000}).encode()
    with pytest.raises(OverLimit, match="^messages: more than the limit of 3"):
        load_json(raw, SMALL)
    assert len(calls) <= 4  # it stopped at the limit, not at the end of the body


def _raw(**kw) -> bytes:
    return gen.GenerateRequest(**kw).SerializeToString()


@pytest.mark.parametrize("request_kw, field", [
    ({"chat": gen.ChatMessages(messages=[gen.ChatMessage(role="user")] * 4)},
     "chat.messages"),
    ({"token_ids": gen.TokenIds(ids=[300] * 6)}, "token_ids"),
    ({"text": "a", "sampling": gen.SamplingParams(stop=["a"] * 3)}, "sampling.stop"),
    ({"text": "a", "sampling": gen.SamplingParams(stop_token_ids=[1, 2, 300])},
     "sampling.stop_token_ids"),
    ({"text": "é" * 11}, "text"),
    ({"text": "a", "cache_salt": "saltier"}, "cache_salt"),
    ({"text": "a", "request_id": "🎉" * 65}, "request_id"),
])
def test_generate_wire_bytes_over_a_limit_are_refused_before_parsing(request_kw, field):
    with pytest.raises(OverLimit) as e:
        wire.check_generate(SMALL)(_raw(**request_kw))
    assert str(e.value).startswith(f"{field}: ") and "the limit of" in str(e.value), str(
        e.value)


def test_wire_counts_add_up_over_repeated_fields_and_legal_requests_pass():
    one = _raw(chat=gen.ChatMessages(messages=[gen.ChatMessage(role="user")] * 2))
    wire.check_generate(SMALL)(one)  # 2 messages: within 3
    with pytest.raises(OverLimit, match="chat.messages"):
        wire.check_generate(SMALL)(one + one)  # protobuf merges the two: 4 messages
    tokenize = gen.TokenizeRequest(chat=gen.ChatMessages(
        messages=[gen.ChatMessage(role="user")] * 4)).SerializeToString()
    with pytest.raises(OverLimit, match="chat.messages"):
        wire.check_tokenize(SMALL)(tokenize)
    full = _raw(request_id="r" * 64, cache_salt="salt", token_ids=gen.TokenIds(ids=[1, 2]),
                sampling=gen.SamplingParams(stop=["a", "b"], stop_token_ids=[3, 4],
                                            max_tokens=7))
    wire.check_generate(SMALL)(full)
    wire.check_generate(SMALL)(_raw(text="é" * 10, request_id="🎉" * 64))  # bytes, not chars
    tokenize_text = gen.TokenizeRequest(text="a" * 11).SerializeToString()
    with pytest.raises(OverLimit, match="^text: "):
        wire.check_tokenize(SMALL)(tokenize_text)


@pytest.mark.parametrize("request_kw, field", [
    ({"request_id": LONG_ID}, "request_id"),
    ({"cache_salt": "abcde"}, "cache_salt"),
    ({"sampling": gen.SamplingParams(stop=["abcde"])}, "sampling.stop"),
    ({"text": "a" * 11, "token_ids": None}, "text"),
])
def test_the_intake_refuses_parsed_fields_over_their_limits(request_kw, field):
    kw = {"token_ids": gen.TokenIds(ids=[1, 2]), **request_kw}
    if kw["token_ids"] is None:
        del kw["token_ids"]
    intake = Intake(tokenizer=None, limits=SMALL)
    try:
        with pytest.raises(OverLimit) as e:
            asyncio.run(intake.job(gen.GenerateRequest(**kw),
                                   gen.ModelInfo(max_model_len=64, vocab_size=100)))
    finally:
        intake.close()
    assert status_of(e.value)[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert str(e.value).startswith(f"{field}: "), str(e.value)


@pytest.mark.parametrize("kw, says", [
    ({"stop": ("x" * 200,) * 20_000}, "stop may hold at most 128 strings"),
    ({"stop": ("x" * 5000,)}, "stop strings may hold at most 512 characters"),
    ({"stop_token_ids": (1,) * 5000}, "stop_token_ids may hold at most 1024 ids"),
])
def test_the_engine_ceilings_hold_for_any_caller(kw, says):
    with pytest.raises(ValueError, match=says):
        SamplingParams(**kw)


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    return bytes(out + bytes([n]))


def _group(number: int) -> bytes:
    """An empty group of field `number` (start and end tags), which protobuf keeps as an
    unknown field."""
    return _varint(number << 3 | 3) + _varint(number << 3 | 4)


def _len_field(number: int, value: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(value)) + value


FOUR_MESSAGES = gen.ChatMessages(messages=[gen.ChatMessage(role="user")] * 4
                                 ).SerializeToString()


@pytest.mark.parametrize("check, raw", [
    (wire.check_generate, _group(100) + _raw(chat=gen.ChatMessages.FromString(FOUR_MESSAGES))),
    (wire.check_generate, _len_field(wire.CHAT, _group(7) + FOUR_MESSAGES)),
    (wire.check_generate, _len_field(wire.SAMPLING, _group(99) + bytes([0x52, 1]) * 3)),
    (wire.check_tokenize, _group(100) + _len_field(wire.TOKENIZE_CHAT, FOUR_MESSAGES)),
    (wire.check_generate, bytes([0x7E, 0])),  # wire type 6
    (wire.check_generate, bytes([0x7F, 0])),  # wire type 7
    (wire.check_generate, bytes([0x00, 0x00])),  # field number 0
    (wire.check_generate, b"\xff\xff"),  # a varint past the end
    (wire.check_generate, _len_field(wire.TOKEN_IDS, b"")[:1] + bytes([5, 8])),  # length
], ids=["group first", "group in chat", "group in sampling", "tokenize group",
        "wire type 6", "wire type 7", "field 0", "short varint", "long length"])
def test_what_the_walk_cannot_skip_is_refused_not_passed_on(check, raw):
    with pytest.raises(InvalidArgument, match="^request: "):
        check(SMALL)(raw)


def test_protobuf_takes_a_group_in_front_of_the_messages_the_walk_does_not():
    raw = _group(100) + _raw(chat=gen.ChatMessages.FromString(FOUR_MESSAGES))
    assert len(gen.GenerateRequest.FromString(raw).chat.messages) == 4  # over the limit
    with pytest.raises(InvalidArgument, match="^request: wire type 3 "):
        wire.check_generate(SMALL)(raw)


def test_fields_without_a_limit_of_their_own_are_bounded_in_all():
    unknown = _varint(1000 << 3) + b"\x01"  # a varint field protobuf keeps as unknown
    check = wire.check_generate(Limits())
    assert wire.OTHER_FIELDS == 4096  # docs/configuration.md's Limits table
    check(_raw(text="a") + unknown * (wire.OTHER_FIELDS - 1))
    with pytest.raises(InvalidArgument, match="^request: more protobuf fields"):
        check(_raw(text="a") + unknown * wire.OTHER_FIELDS)


def _unpacked_ids(ids: list[int]) -> bytes:
    inner = b"".join(bytes([wire.IDS << 3]) + _varint(i) for i in ids)
    return _len_field(wire.TOKEN_IDS, inner)


@pytest.mark.parametrize("packed", [True, False])
def test_token_ids_are_counted_one_id_each_packed_or_not(packed):
    limits = Limits(max_prompt_token_ids=100)
    for n in (99, 100, 101):
        ids = [300] * n  # two bytes each
        raw = _raw(token_ids=gen.TokenIds(ids=ids)) if packed else _unpacked_ids(ids)
        assert list(gen.GenerateRequest.FromString(raw).token_ids.ids) == ids
        if n <= 100:
            wire.check_generate(limits)(raw)
        else:
            with pytest.raises(OverLimit, match="^token_ids: more than the limit of 100"):
                wire.check_generate(limits)(raw)


def _constraint(**kw) -> bytes:
    return _raw(text="a", sampling=gen.SamplingParams(
        structured_output=gen.StructuredOutput(**kw)))


def test_a_constraint_is_bounded_on_the_wire_by_the_engines_fixed_bounds():
    most, chars = constraint_limits.MAX_CHOICES, constraint_limits.MAX_CONSTRAINT_CHARS
    check = wire.check_generate(Limits())
    check(_constraint(choice=gen.Choices(choices=["a"] * most)))
    with pytest.raises(OverLimit, match=f"^sampling.structured_output.choice: more than "
                                        f"the limit of {most} choices"):
        check(_constraint(choice=gen.Choices(choices=["a"] * (most + 1))))
    check(_constraint(choice=gen.Choices(choices=["é" * (chars // 2)] * 2)))  # characters
    with pytest.raises(OverLimit, match="^sampling.structured_output.choice: .* characters"):
        check(_constraint(choice=gen.Choices(choices=["é" * (chars // 2)] * 2 + ["a"])))
    for name in ("regex", "grammar", "json_schema"):
        check(_constraint(**{name: "é" * chars}))
        with pytest.raises(OverLimit, match=f"^sampling.structured_output.{name}: "):
            check(_constraint(**{name: "a" * (chars + 1)}))


@pytest.mark.parametrize("key, field", [("\\u0070rompt", "prompt"), ("\\u0073top", "stop"),
                                        ("m\\u0065ssages", "messages")])
def test_escaped_keys_are_counted_as_the_body_parses(key, field, monkeypatch):
    monkeypatch.setattr(body_module, "CHEAP", 0)
    items = ", ".join(['"a"'] * 10_000)
    raw = f'{{"model": "m", "{key}": [{items}]}}'.encode()
    with pytest.raises(OverLimit, match=f"^{field}: more than the limit"):
        load_json(raw, SMALL)


@pytest.mark.parametrize("body, field", [
    ({"guided_choice": ["a"] * (constraint_limits.MAX_CHOICES + 1)}, "guided_choice"),
    ({"structured_outputs": {"choice": ["a"] * (constraint_limits.MAX_CHOICES + 1)}},
     "structured_outputs.choice"),
])
@pytest.mark.parametrize("counting", [False, True])
def test_a_constraints_choices_are_counted_before_the_model(body, field, counting,
                                                            monkeypatch):
    if counting:
        monkeypatch.setattr(body_module, "CHEAP", 0)
    raw = json.dumps({"model": "m", "prompt": "a", **body}).encode()
    with pytest.raises(OverLimit, match=f"^{field}: .*the limit of 1024 choices"):
        parse_body(raw, CompletionRequest, Limits())


def test_a_schema_with_more_values_than_its_size_bound_stops_the_counting_parse(
        monkeypatch):
    monkeypatch.setattr(body_module, "CHEAP", 0)
    schema = {"enum": list(range(constraint_limits.MAX_CONSTRAINT_CHARS + 1))}
    raw = json.dumps({"model": "m", "response_format": {
        "type": "json_schema", "json_schema": {"schema": schema}}}).encode()
    with pytest.raises(OverLimit, match="^response_format: more JSON values"):
        load_json(raw, Limits())
    fine = {"model": "m", "guided_json": {"enum": list(range(1000))}}
    assert load_json(json.dumps(fine).encode(), Limits()) == fine


def test_a_body_holds_at_most_its_budget_of_objects_and_arrays(monkeypatch):
    monkeypatch.setattr(body_module, "CHEAP", 0)
    containers, values = body_module.budgets(Limits())
    assert (containers, values) == (12_544, 1_149_184)  # docs/configuration.md's Limits table

    def body(n: int) -> bytes:  # the body, "x" and n empty arrays
        return json.dumps({"model": "m", "x": [[]] * n}).encode()

    load_json(body(containers - 2), Limits())
    with pytest.raises(InvalidArgument, match="^body: more JSON objects and arrays"):
        load_json(body(containers - 1), Limits())


def test_a_limit_is_a_value_error_that_names_its_field_over_http():
    with pytest.raises(ValueError) as e:
        SMALL.check("max_stop", 3, "stop")
    assert status_of(e.value)[0] == grpc.StatusCode.INVALID_ARGUMENT
    error = app_module.api_error(e.value)
    assert error.status == 400 and error.body["error"]["param"] == "stop"


def test_bodies_are_parsed_on_parse_threads_never_the_tokenizers(monkeypatch):
    threads = []
    monkeypatch.setattr(app_module, "parse_body", lambda *a: (
        threads.append(threading.current_thread().name), parse_body(*a))[1])
    reply = call("POST", "/v1/completions",
                 json={"model": "m", "prompt": ["a"] * (Limits().max_prompts + 1)})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "prompt"
    assert len(threads) == 1 and threads[0].startswith("parse"), threads
