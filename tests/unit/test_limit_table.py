"""Every row of the limits' TABLE (services/common/limits.py) is enforced on every path it
names: one over its bound is refused naming its field, on the gRPC wire bytes
(router/wire.py), once parsed (router/intake.py), in an OpenAI body (router/openai/body.py)
and by the engine (its ceiling); at its bound it passes. A row added to the table without
the enforcement its paths need fails here."""

from __future__ import annotations

import asyncio
import functools
import json

import pytest
from google.protobuf.descriptor import FieldDescriptor

from baton.router import wire
from baton.router.intake import Intake
from baton.router.openai import body as body_module
from baton.router.openai.body import parse_body
from baton.router.openai.protocol import ChatRequest, CompletionRequest
from baton.services.common.limits import CHARS, ITEMS, TABLE, Limits, OverLimit
from baton.services.common.tokenizer import Tokenizer
from baton.v1 import generation_pb2 as gen

# Every router bound at 64 (the least max_request_id_chars may be): small requests.
SMALL = Limits(**{row.name: 64 for row in TABLE if row.flag})
CHAT = [{"role": "user", "content": "hi"}]
INFO = gen.ModelInfo(max_model_len=1 << 20, vocab_size=1 << 16)
ROWS = [pytest.param(row, id=row.name) for row in TABLE]


def _descriptor(path: str) -> FieldDescriptor:
    message, *parts = gen.GenerateRequest.DESCRIPTOR, *path.split(".")
    for part in parts[:-1]:
        message = message.fields_by_name[part].message_type
    return message.fields_by_name[parts[-1]]


def _value(row, n: int, fd: FieldDescriptor | None, body: bool = False):
    """A value of `row`'s field that counts `n` as the row counts."""
    if fd is not None and fd.message_type is not None and fd.message_type.GetOptions().map_entry:
        return {(str(i) if body else i): 1.0 for i in range(n)}
    repeated = fd is not None and fd.is_repeated
    ints = fd is not None and fd.cpp_type == FieldDescriptor.CPPTYPE_INT32
    if row.count == ITEMS:
        return [1] * n if ints else ["w"] * n
    assert row.count == CHARS, row
    return ["x" * n] if repeated else "x" * n


def _request(row, n: int) -> gen.GenerateRequest:
    """A request (a prompt of token ids, unless the row bounds its text) whose field at
    `row.wire` counts `n`."""
    request = gen.GenerateRequest(token_ids=gen.TokenIds(ids=[1, 2]))
    *parents, last = row.wire.split(".")
    message = functools.reduce(getattr, parents, request)
    value = _value(row, n, _descriptor(row.wire))
    if isinstance(value, dict):
        getattr(message, last).update(value)
    elif isinstance(value, list):
        getattr(message, last).extend(value)
    else:
        setattr(message, last, value)
    return request


def _refused(error: BaseException, field: str, bound: int) -> None:
    text = str(error)
    assert isinstance(error, OverLimit) and text.startswith(f"{field}: "), text
    assert f"the limit of {bound} " in text, text


@pytest.mark.parametrize("row", [r for r in ROWS if r.values[0].wire])
def test_each_row_with_a_wire_path_is_counted_on_the_bytes_and_once_parsed(row, tok):
    bound = SMALL.bound(row.name)
    check = wire.check_generate(SMALL)
    check(_request(row, bound).SerializeToString())
    with pytest.raises(ValueError) as e:
        check(_request(row, bound + 1).SerializeToString())
    _refused(e.value, row.wire, bound)
    intake = Intake(Tokenizer(tok), limits=SMALL)
    try:
        asyncio.run(intake.job(_request(row, bound), INFO))
        with pytest.raises(ValueError) as e:
            asyncio.run(intake.job(_request(row, bound + 1), INFO))
    finally:
        intake.close()
    _refused(e.value, row.wire, bound)


@pytest.mark.parametrize("counting", [False, True])
@pytest.mark.parametrize("row", [r for r in ROWS if r.values[0].body])
def test_each_row_with_a_body_key_is_counted_in_a_body(row, counting, monkeypatch):
    if counting:  # the parse that counts as it goes, not C's json
        monkeypatch.setattr(body_module, "CHEAP", 0)
    bound = SMALL.bound(row.name)
    fd = _descriptor(row.wire) if row.wire else None

    def body(n: int) -> bytes:
        return json.dumps({"model": "m", "messages": CHAT,
                           row.body: _value(row, n, fd, body=True)}).encode()

    parse_body(body(bound), ChatRequest, SMALL)
    with pytest.raises(ValueError) as e:
        parse_body(body(bound + 1), ChatRequest, SMALL)
    _refused(e.value, row.body, bound)


# The rows counted by code of their own (a prompt's shapes, a chat's messages, the answer's
# size): what one over the bound looks like, and the field it is refused naming.
OWN_CODE = {
    "max_prompts": lambda n: (CompletionRequest, {"prompt": ["a"] * n}, "prompt"),
    "max_n": lambda n: (CompletionRequest, {"prompt": "a", "n": n}, "n"),
    "max_messages": lambda n: (ChatRequest, {"messages": [{"role": "user"}] * n},
                               "messages"),
    "max_prompt_chars": lambda n: (CompletionRequest, {"prompt": "a" * n}, "prompt"),
    "max_prompt_token_ids": lambda n: (CompletionRequest, {"prompt": [1] * n}, "prompt"),
    "max_answer_tokens": lambda n: (CompletionRequest, {"prompt": "a", "max_tokens": n},
                                    "max_tokens"),
}


def test_every_row_has_a_path_that_enforces_it():
    for row in TABLE:
        assert row.wire or row.body or row.name in OWN_CODE, (
            f"{row.name}: neither a wire path nor a body key, nor counted by code of its own")


@pytest.mark.parametrize("name", sorted(OWN_CODE))
def test_each_row_counted_by_code_of_its_own_is_refused_naming_its_field(name):
    bound = SMALL.bound(name)
    for n in (bound, bound + 1):
        kind, fields, field = OWN_CODE[name](n)
        raw = json.dumps({"model": "m", **fields}).encode()
        try:
            request = parse_body(raw, kind, SMALL)
            if name == "max_answer_tokens":  # reckoned once the requests are made
                request.check_answer(request.requests(1 << 20), SMALL)
        except OverLimit as e:
            assert n == bound + 1, e
            _refused(e, field, bound)
        else:
            assert n == bound, f"{name}: one over its bound passed"
