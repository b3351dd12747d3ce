"""JsonStream: the compact form of a JSON value written as it arrives equals json.dumps of
the parsed value (the reference), however the text is cut; what it has written never
changes; text that is not JSON is refused where it goes wrong."""

from __future__ import annotations

import json

import pytest

from baton.services.common.json_stream import JsonError, JsonStream, compact
from tests.unit.stream_splits import splits

SAMPLES = [
    '{"location": "San Francisco, CA", "unit": "celsius"}',
    '{ "to" : [ "a@example.com" , "b@example.com" ] , "cc" : [ ] , "meta" : { } }',
    '{"text": "Line 1\\nLine \\"2\\"\\t\\u00e9 \\ud83d\\ude00 \\/ \\\\ end", "emoji": "😀 Zoë"}',
    '{"n": [0, -0, 12, -3.50, 1e3, 2E-2, 1.0, 123456789012345678901234567890]}',
    '{"flags": [true, false, null], "nested": {"a": {"b": {"c": [[], [{}]]}}}}',
    '{"raw control": "tab\there, newline\nthere"}',  # raw control characters: json strict=False
    '[1, "two", {"three": 3}]',
    '"just a string"',
]


def _reference(text: str) -> str:
    return json.dumps(json.loads(text, strict=False), ensure_ascii=False,
                      separators=(",", ":"))


@pytest.mark.parametrize("text", SAMPLES)
def test_compact_equals_json_dumps_of_the_parsed_value(text):
    assert compact(text) == _reference(text)


@pytest.mark.parametrize("text", SAMPLES)
def test_any_cut_gives_the_same_text_and_written_text_never_changes(text):
    want = _reference(text)
    for pieces in splits(text, chunkings=4):
        stream, end = JsonStream(), None
        for k, piece in enumerate(pieces):
            before = stream.out
            end = stream.feed(piece)
            assert stream.out.startswith(before)
            assert want.startswith(stream.out)
            if end is not None:
                assert k == len(pieces) - 1 and end == len(piece)
        assert stream.done and stream.out == want


def test_the_end_of_the_value_is_reported_and_what_follows_is_not_read():
    stream = JsonStream()
    assert stream.feed('{"a": 1}\n</tool_call>') == len('{"a": 1}')
    assert stream.out == '{"a":1}'
    number = JsonStream()
    assert number.feed("42") is None and number.out == ""  # may go on: 421
    assert number.feed(",") == 0 and number.out == "42"


@pytest.mark.parametrize("text", [
    '{"a": NaN}', '{"a": Infinity}', '{"a": 1e999}', '{"a": 01}', '{"a": 1.}', '{"a": +1}',
    '{"a": tru}', '{"a": 1,}', '{"a" 1}', '{"a": 1 "b": 2}', "{'a': 1}", '{"a": "\\x"}',
    '{"a": "\\ud83d"}', '{"a": "\\ude00"}', '{"a": 1, "a": 2}', '[1, 2}', '{"a": [1]]',
    '{"a": 1} trailing',
])
def test_text_that_is_not_json_is_refused(text):
    with pytest.raises(JsonError):
        compact(text)


def test_the_position_of_the_fault_is_given():
    with pytest.raises(JsonError) as e:
        JsonStream().feed('{"a": 1, "b": ]')
    assert e.value.pos == len('{"a": 1, "b": ')
