"""The size of one request, bounded before any per-item work (services/serving/limits.py):
the router's limits over HTTP bodies (router/openai/body.py), gRPC wire bytes
(router/wire.py) and parsed requests (router/intake.py), each refusal naming its field;
and the engine's own ceilings, which a caller that reaches a worker directly meets."""

from __future__ import annotations

import asyncio
import json
import random

import grpc
import pytest

from baton.v1 import generation_pb2 as gen
from router import wire
from router.intake import Intake
from router.openai import body as body_module
from router.openai.body import load_json, parse_body
from router.openai.protocol import ChatRequest, CompletionRequest
from services.serving.errors import InvalidArgument
from services.serving.limits import Limits
from services.serving.sampling_params import SamplingParams

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
    with pytest.raises(InvalidArgument) as e:
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
    with pytest.raises(InvalidArgument, match="^messages: more than the limit of 3"):
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
    with pytest.raises(InvalidArgument) as e:
        wire.check_generate(SMALL)(_raw(**request_kw))
    assert str(e.value).startswith(f"{field}: ") and "the limit of" in str(e.value), str(
        e.value)


def test_wire_counts_add_up_over_repeated_fields_and_legal_requests_pass():
    one = _raw(chat=gen.ChatMessages(messages=[gen.ChatMessage(role="user")] * 2))
    wire.check_generate(SMALL)(one)  # 2 messages: within 3
    with pytest.raises(InvalidArgument, match="chat.messages"):
        wire.check_generate(SMALL)(one + one)  # protobuf merges the two: 4 messages
    tokenize = gen.TokenizeRequest(chat=gen.ChatMessages(
        messages=[gen.ChatMessage(role="user")] * 4)).SerializeToString()
    with pytest.raises(InvalidArgument, match="chat.messages"):
        wire.check_tokenize(SMALL)(tokenize)
    full = _raw(request_id="r" * 64, cache_salt="salt", token_ids=gen.TokenIds(ids=[1, 2]),
                sampling=gen.SamplingParams(stop=["a", "b"], stop_token_ids=[3, 4],
                                            max_tokens=7))
    wire.check_generate(SMALL)(full)
    wire.check_generate(SMALL)(_raw(text="é" * 10, request_id="🎉" * 64))  # bytes, not chars
    tokenize_text = gen.TokenizeRequest(text="a" * 11).SerializeToString()
    with pytest.raises(InvalidArgument, match="^text: "):
        wire.check_tokenize(SMALL)(tokenize_text)
    wire.check_generate(SMALL)(b"\xff\xff")  # malformed: protobuf refuses it, not the walk


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
        with pytest.raises(InvalidArgument) as e:
            asyncio.run(intake.job(gen.GenerateRequest(**kw),
                                   gen.ModelInfo(max_model_len=64, vocab_size=100)))
    finally:
        intake.close()
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert str(e.value).startswith(f"{field}: "), str(e.value)


@pytest.mark.parametrize("kw, says", [
    ({"stop": ("x" * 200,) * 20_000}, "stop may hold at most 128 strings"),
    ({"stop": ("x" * 5000,)}, "stop strings may hold at most 512 characters"),
    ({"stop_token_ids": (1,) * 5000}, "stop_token_ids may hold at most 1024 ids"),
])
def test_the_engine_ceilings_hold_for_any_caller(kw, says):
    with pytest.raises(ValueError, match=says):
        SamplingParams(**kw)
