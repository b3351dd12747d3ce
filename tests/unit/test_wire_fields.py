"""Every list a caller sends is counted before anything is built of it, and no error
quotes a caller's value whole: each repeated or map field of the router's requests
counted on the wire against a bound of its own (router/wire.py), found from the protos
themselves so a new field cannot slip past; the engine's types count a wire message's
lists before copying them; `shown` cuts what an error quotes; and every string a chat
template may render counts against --max-prompt-chars (gRPC and HTTP)."""

from __future__ import annotations

import json

import pytest

from baton.router import wire
from baton.router.chat import check_chat
from baton.router.config import RouterConfig
from baton.router.openai.body import parse_body
from baton.router.openai.protocol import ChatRequest
from baton.router.server import build
from baton.services.common.errors import shown
from baton.services.common.limits import OverLimit
from baton.services.common.sampling_params import SamplingParams
from baton.services.rpc.convert import sampling_params
from baton.services.rpc.errors import InvalidArgument
from baton.services.rpc.server import Lifecycle, method_name
from baton.v1 import generation_pb2 as gen
from tests.unit.test_limits import SMALL, _len_field

# More items than any field's bound under SMALL (the fixed ones included: 2048 tool
# calls), and than the walk lets go uncounted: a list not counted on its own is refused
# as "request: more protobuf fields", which names no field.
ITEMS = wire.OTHER_FIELDS + 1
F = gen.ChatMessage.DESCRIPTOR.fields[0]  # for the type constants
WIDTH = {F.TYPE_FLOAT: 4, F.TYPE_FIXED32: 4, F.TYPE_SFIXED32: 4, F.TYPE_DOUBLE: 8,
         F.TYPE_FIXED64: 8, F.TYPE_SFIXED64: 8}  # a packed item's bytes; else a varint


def _repeated(message, path=()):
    """The path (field descriptors, from `message` down) of every repeated or map field
    that a request of type `message` may hold."""
    for f in message.fields:
        here = (*path, f)
        if f.is_repeated:
            yield here
        inner = f.message_type
        if inner is not None and not inner.GetOptions().map_entry and inner not in (
                p.message_type for p in path):
            yield from _repeated(inner, here)


def _many(path, n: int) -> bytes:
    """A request with `n` items in the field at `path`, each as small as it goes: empty
    messages (map entries too), one-character strings, or one packed list of ints."""
    *outer, last = path
    if last.message_type is not None:
        raw = _len_field(last.number, b"") * n
    elif last.type in (last.TYPE_STRING, last.TYPE_BYTES):
        raw = _len_field(last.number, b"a") * n
    else:
        raw = _len_field(last.number, b"\x01" * n * WIDTH.get(last.type, 1))
    for f in reversed(outer):
        raw = _len_field(f.number, raw)
    return raw


def test_every_repeated_field_of_a_request_is_counted_on_the_wire(tok):
    """For each method of the router's public service: every list its request may hold,
    sent long, is refused by the method's raw check naming that list (or the list that
    holds it), before protobuf parses anything."""
    lifecycle = Lifecycle()
    router = build(RouterConfig(model=str(tok), limits=SMALL), lifecycle)
    router.intake.close()
    checked = []
    for method in gen.DESCRIPTOR.services_by_name["Generation"].methods:
        paths = list(_repeated(method.input_type))
        if not paths:
            continue
        check = lifecycle.request_checks.get(method_name(gen, "Generation", method.name))
        assert check is not None, f"{method.name}: its lists are not counted on the wire"
        for path in paths:
            name = ".".join(f.name for f in path)
            with pytest.raises(ValueError) as e:
                check(_many(path, ITEMS))
            field = str(e.value).split(": ")[0]
            assert field != "request" and f"{name}.".startswith(f"{field}."), (name, e.value)
            checked.append(f"{method.name} {name}")
    assert "Generate sampling.structured_output.start_after_token_ids" in checked
    assert len(checked) == 13, checked  # 10 of Generate, 3 of Tokenize


def test_a_packed_start_marker_is_refused_for_the_price_of_its_bound():
    """60M one-byte ids in one packed field: counted no further than past the bound."""
    structured = _len_field(gen.StructuredOutput.DESCRIPTOR.fields_by_name[
        "start_after_token_ids"].number, b"\x05" * 60_000_000)
    raw = gen.GenerateRequest(text="hi").SerializeToString() + _len_field(
        wire.SAMPLING, _len_field(wire.STRUCTURED, structured))
    with pytest.raises(OverLimit, match="^sampling.structured_output.start_after_token_ids: "
                       "more than the limit of 16 token ids"):
        wire.check_generate(SMALL)(raw)


def test_the_engine_counts_a_wire_messages_lists_before_it_copies_them():
    """What a worker (no wire check) or the router after its parse builds of a message:
    a list over its bound is refused by its length, and the error quotes none of it."""
    so = gen.StructuredOutput(regex="a", start_after_token_ids=range(100_000))
    with pytest.raises(ValueError, match=r"start_after: at most 16 token ids, got 100000$"):
        sampling_params(gen.SamplingParams(structured_output=so))
    with pytest.raises(ValueError, match="^stop_token_ids may hold at most 1024 ids; got "):
        sampling_params(gen.SamplingParams(stop_token_ids=range(100_000)))


@pytest.mark.parametrize("kw", [
    {"stop_token_ids": [-1] * 1000}, {"bad_words": [" " * 512] * 128},
    {"stop": ["", *["x" * 512] * 127]}, {"max_tokens": "x" * 100_000},
    {"logit_bias": [("x" * 100_000, 1.0)]}, {"seed": "x" * 100_000}])
def test_an_error_quotes_only_the_start_of_a_callers_value(kw):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kw)
    assert len(str(e.value)) < 300, str(e.value)[:300]


def test_shown_cuts_a_value_to_its_start_and_says_its_size():
    assert shown("abc") == "'abc'" and shown((1, 2)) == "(1, 2)" and shown((1,)) == "(1,)"
    assert shown({1: 2.0}) == "{1: 2.0}" and shown(None) == "None"
    text = shown("a" * 3_000_000)
    assert text.startswith("'aaaa") and text.endswith("... (3000000 characters)")
    ids = shown((5,) * 1_000_000)
    assert ids.startswith("(5, 5, ") and ids.endswith(", ...) (1000000 items)")
    assert shown(range(10**12)).endswith("(1000000000000 items)")  # never iterated whole
    assert shown(10**5000) == "<an integer of 16610 bits>"  # repr() would refuse it
    for value in ("a" * 10**6, ["x" * 10**6] * 3, {i: "y" * 500 for i in range(1000)}):
        assert len(shown(value)) < 200


CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
# Each string of a message that a template may render, as gRPC and as an HTTP body holds
# it, 11 characters long (SMALL's --max-prompt-chars is 10).
LONG = "x" * 11
MESSAGE_STRINGS = [
    ({"role": "tool", "tool_call_id": LONG}, gen.ChatMessage(role="tool", tool_call_id=LONG)),
    ({"role": "user", "name": LONG}, gen.ChatMessage(role="user", name=LONG)),
    ({"role": "assistant", "reasoning_content": LONG},
     gen.ChatMessage(role="assistant", reasoning_content=LONG)),
    ({"role": "user", "content": [{"type": "text", "text": LONG}]},
     gen.ChatMessage(role="user", content=LONG)),
    ({"role": "assistant", "tool_calls": [{**CALL, "id": LONG}]},
     gen.ChatMessage(role="assistant", tool_calls=[gen.ToolCall(id=LONG)])),
    ({"role": "assistant", "tool_calls": [{**CALL, "function": {"name": LONG,
                                                                "arguments": "{}"}}]},
     gen.ChatMessage(role="assistant", tool_calls=[gen.ToolCall(name=LONG)])),
    ({"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "f",
                                                                "arguments": LONG}}]},
     gen.ChatMessage(role="assistant", tool_calls=[gen.ToolCall(arguments=LONG)])),
]


@pytest.mark.parametrize("body, message", MESSAGE_STRINGS,
                         ids=["tool_call_id", "name", "reasoning_content", "content part",
                              "call id", "call name", "call arguments"])
def test_every_string_a_template_renders_counts_against_the_prompt_chars(body, message):
    with pytest.raises(OverLimit, match=r"^chat.messages: 11, over .*--max-prompt-chars"):
        check_chat(gen.ChatMessages(messages=[message]), 10**6, SMALL)
    raw = json.dumps({"model": "m", "messages": [body]}).encode()
    with pytest.raises(OverLimit, match=r"^messages: 1\d, over .*--max-prompt-chars"):
        parse_body(raw, ChatRequest, SMALL)


def test_a_tool_call_id_counts_against_what_the_model_can_hold():
    """The per-token bound (64 characters a token of max_model_len) counts it too."""
    chat = gen.ChatMessages(messages=[gen.ChatMessage(role="tool", tool_call_id="x" * 65)])
    with pytest.raises(InvalidArgument, match="^chat.messages: 65 characters of content "
                       "cannot fit in 1 tokens"):
        check_chat(chat, 64, SMALL.__class__(max_prompt_chars=100))
