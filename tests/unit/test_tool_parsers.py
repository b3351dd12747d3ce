"""Tool-call parsers on tool-call text as the models write it (Qwen2.5/Qwen3 and Hermes 2
Pro for hermes, Llama 3.1/3.2 for llama3_json, Mistral 7B v0.3/Nemo and Small 3.2 for
mistral, Qwen3-Coder for qwen3_coder): the whole text gives the exact content and the
calls' arguments as the expected objects, in compact JSON; streamed in every cut it gives
the same content, and argument fragments that join to the same arguments. Text that is not
a call, or a malformed call, stays content."""

from __future__ import annotations

import json
import re

import pytest

from baton.services.common.tool_parsers import TOOL_PARSERS, ToolCall, tool_call_id
from tests.unit.stream_splits import splits
from tests.unit.tool_parser_samples import MALFORMED, SAMPLES, TOOLS, TRUNCATED


def stream(name: str, pieces: list[str], tools=TOOLS) -> tuple[str, list[tuple[str, str]]]:
    """Content and (name, arguments) per call from feeding `pieces`, checking the deltas'
    shape on the way: ids and names on a call's first delta only, indices in order."""
    parser = TOOL_PARSERS[name](tools)
    content, calls = [], []
    for piece in [*pieces, None]:
        text, deltas = parser.feed(piece) if piece is not None else parser.finish()
        content.append(text)
        for d in deltas:
            if d.index == len(calls):
                assert re.fullmatch(r"call_[A-Za-z0-9]{24}", d.id) and d.name
                calls.append([d.name, d.arguments])
            else:
                assert d.index == len(calls) - 1 and d.id is None and d.name is None
                assert d.arguments  # no empty fragments after the first
                calls[-1][1] += d.arguments
    return "".join(content), [tuple(c) for c in calls]


def _compact(obj) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


SAMPLE_IDS = [f"{s[0]}-{i}" for i, s in enumerate(SAMPLES)]


@pytest.mark.parametrize("name,text,content,calls", SAMPLES, ids=SAMPLE_IDS)
def test_whole_text_gives_the_content_and_the_calls(name, text, content, calls):
    got_content, got = TOOL_PARSERS[name](TOOLS).parse(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    assert [c.arguments for c in got] == [_compact(args) for _, args in calls]
    assert all(isinstance(c, ToolCall) and re.fullmatch(r"call_[A-Za-z0-9]{24}", c.id)
               for c in got)
    assert len({c.id for c in got}) == len(got)


@pytest.mark.parametrize("name,text,content,calls", SAMPLES, ids=SAMPLE_IDS)
def test_every_cut_streams_the_same_content_and_arguments(name, text, content, calls):
    want = [(n, _compact(args)) for n, args in calls]
    for pieces in splits(text):
        assert stream(name, pieces) == (content, want), pieces


@pytest.mark.parametrize("name,text", MALFORMED, ids=[f"{m[0]}-{i}"
                                                      for i, m in enumerate(MALFORMED)])
def test_text_that_is_not_a_well_formed_call_stays_content(name, text):
    assert TOOL_PARSERS[name](TOOLS).parse(text) == (text, [])
    for pieces in splits(text, chunkings=4):
        assert stream(name, pieces) == (text, []), pieces


def test_arguments_stream_while_the_call_arrives():
    # Each fragment goes out as soon as it cannot change: a string character by character,
    # a number once the character after it shows it has ended.
    parser = TOOL_PARSERS["hermes"](TOOLS)
    seen = []
    head = '<tool_call>\n{"name": "get_current_weather", "arguments": {"location": "Par'
    for piece in (head, 'is", "days": 1', "2", ", ", '"unit": "celsius"}}\n</tool_call>'):
        seen.append(parser.feed(piece))
    assert all(content == "" for content, _ in seen)
    assert seen[0][1][0].name == "get_current_weather"
    assert [[d.arguments for d in ds] for _, ds in seen] == [
        ['{"location":"Par'], ['is","days":'], [], ["12,"], ['"unit":"celsius"}']]
    assert parser.finish() == ("", [])


def test_qwen3_coder_string_values_stream_before_their_end_tag():
    parser = TOOL_PARSERS["qwen3_coder"](TOOLS)
    _, first = parser.feed("<tool_call>\n<function=write_file>\n<parameter=path>\nsrc/a")
    _, more = parser.feed(".py\n</param")
    _, end = parser.feed("eter>\n</function>\n</tool_call>")
    assert [d.arguments for d in first] == ['{"path":"src/a']
    assert [d.arguments for d in more] == [".py"]  # the newline may be the template's
    assert [d.arguments for d in end] == ['"}']


def test_the_template_whitespace_around_calls_is_not_content():
    text = 'Sure.\n\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n\n'
    assert TOOL_PARSERS["hermes"](TOOLS).parse(text)[0] == "Sure."
    # ... but text without calls is returned exactly as written, whitespace and all.
    plain = "  Two spaces, then a newline.\n\n"
    assert TOOL_PARSERS["hermes"](TOOLS).parse(plain) == (plain, [])


def test_without_tools_any_name_is_a_call_with_tools_only_theirs():
    text = '<tool_call>\n{"name": "lookup", "arguments": {"q": 1}}\n</tool_call>'
    content, calls = TOOL_PARSERS["hermes"]([]).parse(text)
    assert content == "" and [(c.name, c.arguments) for c in calls] == [("lookup", '{"q":1}')]
    assert TOOL_PARSERS["hermes"](TOOLS).parse(text) == (text, [])


@pytest.mark.parametrize("name,text,prefix", TRUNCATED, ids=[t[0] for t in TRUNCATED])
def test_a_call_cut_off_by_the_token_limit(name, text, prefix):
    # Whole, it is content; streamed, the call was sent as far as it had come, and the
    # stream ends without an error.
    assert TOOL_PARSERS[name](TOOLS).parse(text) == (text, [])
    for pieces in splits(text, chunkings=3):
        content, calls = stream(name, pieces)
        if calls:
            assert content == "" and len(calls) == 1 and prefix.startswith(calls[0][1])
        else:
            assert content == text  # cut before the call could be known


def test_a_sent_call_that_turns_malformed_stops_and_its_region_is_dropped():
    text = ('<tool_call>\n{"name": "get_current_weather", "arguments": {"location": "Paris"}'
            '\n</tool_call>\nDone.')  # the envelope's closing brace is missing
    assert TOOL_PARSERS["hermes"](TOOLS).parse(text) == (text, [])
    for pieces in splits(text, chunkings=3):
        assert stream("hermes", pieces) == (
            "Done.", [("get_current_weather", '{"location":"Paris"}')])


def test_parse_leaves_a_streaming_parser_alone():
    parser = TOOL_PARSERS["hermes"](TOOLS)
    assert parser.feed("Hi <tool") == ("Hi", [])
    parser.parse('<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    assert parser.feed("s>") == (" <tools>", [])


def test_registry_and_ids():
    assert {"hermes", "llama3_json", "mistral", "qwen3_coder"} <= set(TOOL_PARSERS)
    ids = {tool_call_id() for _ in range(100)}
    assert len(ids) == 100 and all(re.fullmatch(r"call_[A-Za-z0-9]{24}", i) for i in ids)
